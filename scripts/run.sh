#!/usr/bin/env bash
# `make run`: demo + idemd + Envoy in the foreground, and a walkthrough to copy from; Ctrl-C stops all three.
# `scripts/run.sh --walkthrough` (after `make build`) runs every step of the walkthrough itself, prints what
# each answered, and stops the three.
# Embedded default: idemd on SQLite under ./data, no Redis. Set IDEM_REDIS_URL
# and/or IDEM_DATABASE_URL to use real stores (docs/configuration.md). IDEM_HOST=native runs the
# native dynamic module (envoy/native.yaml) instead of the .wasm.
set -euo pipefail
mode=show
case "${1:-}" in
  --walkthrough) mode=run ;;
  "") ;;
  *) echo "usage: $0 [--walkthrough]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
mkdir -p data

# idemd answers only callers with its token; the filter reads the same one from Envoy's
# environment (plugin config "sidecar_token": {"secret_env": "IDEM_SIDECAR_TOKEN"}).
export IDEM_SIDECAR_TOKEN="${IDEM_SIDECAR_TOKEN:-dev-$(head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
export IDEM_AUTH_TOKENS="$IDEM_SIDECAR_TOKEN"

pids=()
stop() { trap - INT TERM EXIT; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; echo; echo "stopped."; }
trap stop INT TERM EXIT

# The three processes log to the terminal; with --walkthrough to data/walkthrough.log, so the answers stand out.
if [ "$mode" = run ]; then exec 3>data/walkthrough.log; else exec 3>&1; fi

target/debug/demo --listen 127.0.0.1:8080 --db sqlite://./data/demo.db >&3 2>&3 & pids+=($!)
# The reconciler asks the demo's status-by-key endpoint about operations whose executor went silent.
target/debug/idemd serve --listen 127.0.0.1:9090 \
  --status-endpoint 'payments.transfer=http://127.0.0.1:8080/v1/transfers/by-key/{key}' \
  --status-reading 'payments.transfer=pointer=/status;done=executed;failed=failed;done_status=201' >&3 2>&3 & pids+=($!)
if [ "${IDEM_HOST:-wasm}" = native ]; then
  ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/release .venv/bin/envoy -c envoy/native.yaml --disable-hot-restart \
    --log-level warn --component-log-level dynamic_modules:info >&3 2>&3 & pids+=($!)
else
  .venv/bin/envoy -c envoy/envoy.yaml --disable-hot-restart --log-level warn --component-log-level wasm:info >&3 2>&3 & pids+=($!)
fi

for url in http://127.0.0.1:8080/healthz http://127.0.0.1:9090/healthz http://127.0.0.1:9901/ready; do
  for _ in $(seq 1 200); do curl -fs -o /dev/null "$url" && break; sleep 0.1; done
  curl -fs -o /dev/null "$url" || { echo "not ready: $url"; exit 1; }
done

cat <<'WALK'

  Agent idempotency is up: agents -> Envoy 127.0.0.1:10000 -> demo 127.0.0.1:8080
                            Envoy's filter -> idemd 127.0.0.1:9090 (SQLite in ./data)
WALK

# One step of the walkthrough: what it shows, then the command. With --walkthrough the command runs here too
# (in this shell, so FP and MFP carry over) and its answer is printed under it.
step() {
  printf '\n  %s\n' "$1"
  sed 's/^/       /' <<<"$2"
  if [ "$mode" = run ]; then
    local out
    out=$(mktemp)
    eval "$2" >"$out" 2>&1 || true
    sed 's/^/       > /' "$out"
    rm -f "$out"
  fi
}

step "1. Preview a transfer; the gateway adds a signed fingerprint to the answer (and the Agent-Fingerprint header):" \
'curl -s localhost:10000/v1/transfers/preview -H '"'"'x-agent-subject: alice'"'"' \
     -d '"'"'{"amount":"100.00","currency":"EUR","payee_id":"p-1","memo":"rent"}'"'"'; echo'
step "   Keep the fingerprint for the next steps:" \
'FP=$(curl -s -D - -o /dev/null localhost:10000/v1/transfers/preview -H '"'"'x-agent-subject: alice'"'"' \
     -d '"'"'{"amount":"100.00","currency":"EUR","payee_id":"p-1","memo":"rent"}'"'"' | sed -n '"'"'s/^agent-fingerprint: //Ip'"'"' | tr -d '"'"'\r'"'"')'
step "2. Confirm it (the memo may drift; amount, currency and payee may not):" \
'curl -si localhost:10000/v1/transfers -H '"'"'x-agent-subject: alice'"'"' -H "agent-fingerprint: $FP" \
     -d '"'"'{"amount":100,"currency":"EUR","payee_id":"p-1","memo":"rent, ASAP"}'"'"'; echo'
step "3. Retry exactly the same call: you get the first result back, marked already_completed:" \
'curl -s localhost:10000/v1/transfers -H '"'"'x-agent-subject: alice'"'"' -H "agent-fingerprint: $FP" \
     -d '"'"'{"amount":100,"currency":"EUR","payee_id":"p-1","memo":"rent, ASAP"}'"'"'; echo'
step "4. Ask for the status, as an agent would after losing its context:" \
'curl -s "localhost:10000/v1/transfers/status?fingerprint=$FP" -H '"'"'x-agent-subject: alice'"'"'; echo'
step "5. A path that is not a route is the gateway's 404, never the demo's (no path around the guard):" \
'curl -s localhost:10000/v1/transfers/ -H '"'"'x-agent-subject: alice'"'"' -d '"'"'{}'"'"'; echo'

step "6. The same through MCP (Streamable HTTP, the demo's MCP server at /mcp; /mcp/stream, /mcp/sse and
   /mcp/session are guarded alike). A helper that posts one JSON-RPC message as alice:" \
'mcp() { curl -s localhost:10000/mcp -H '"'"'x-agent-subject: alice'"'"' -H '"'"'content-type: application/json'"'"' \
         -H '"'"'accept: application/json, text/event-stream'"'"' -d "$1"; echo; }'
step "   initialize, and the tools the server lists (the gateway declares its optional agent_idempotency property
   in the confirm tool's outputSchema, where a replay carries its reply):" \
'mcp '"'"'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"curl","version":"1"}}}'"'"'
mcp '"'"'{"jsonrpc":"2.0","id":2,"method":"tools/list"}'"'"' | grep -o '"'"'"name":"[a-z_]*_transfer[a-z_]*"'"'"''
step "   quote_transfer (the preview tool): the fingerprint is in structuredContent and in a text block:" \
'Q=$(mcp '"'"'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"quote_transfer","arguments":{"amount":"25.00","currency":"EUR","payee_id":"p-2","memo":"books"}}}'"'"')
echo "$Q"; MFP=$(sed -n '"'"'s/.*"fingerprint":"\([^"]*\)".*/\1/p'"'"' <<<"$Q")'
step "   execute_transfer (the confirm tool) with that fingerprint as an argument: it runs once:" \
'mcp '"'"'{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"execute_transfer","arguments":{"amount":"25.00","currency":"EUR","payee_id":"p-2","memo":"books, today","fingerprint":"'"'"'"$MFP"'"'"'"}}}'"'"''
step "   The replay: the same call again is the first result, inside an already_completed envelope:" \
'mcp '"'"'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"execute_transfer","arguments":{"amount":"25.00","currency":"EUR","payee_id":"p-2","memo":"books, today","fingerprint":"'"'"'"$MFP"'"'"'"}}}'"'"''
step "   Without a fingerprint: a tool error the model can act on; nothing reaches the server's execute:" \
'mcp '"'"'{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"execute_transfer","arguments":{"amount":"25.00","currency":"EUR","payee_id":"p-2"}}}'"'"''

step "7. How many times did each transfer really run (one REST, one MCP)? Straight to the demo:" \
'curl -s localhost:8080/v1/executions; echo'
step "   Filter stats:" \
'curl -s localhost:9901/stats | grep -E '"'"'custom\.idem\.(minted|acquired|completed|replayed|rejected)'"'"' || true'

cat <<'WALK'

  8. Try a changed amount (422 params_changed) or another subject (403 forbidden).
     Operators see every operation and its audit trail (the key is the Idempotency-Key of step 2):
       target/debug/idemd ops list --state done          (also: in_flight, needs_review, failed)
       target/debug/idemd ops show <key>

WALK
if [ "$mode" = run ]; then
  exit 0
fi
echo "  Ctrl-C stops everything."
wait -n "${pids[@]}"
echo "a process exited; stopping the rest"
