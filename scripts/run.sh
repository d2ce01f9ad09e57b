#!/usr/bin/env bash
# `make run`: demo + idemd + Envoy in the foreground; Ctrl-C stops all three.
# Embedded default: idemd on SQLite under ./data, no Redis. Set IDEM_REDIS_URL
# and/or IDEM_DATABASE_URL to use real stores (see README). IDEM_HOST=native runs the
# native dynamic module (envoy/native.yaml) instead of the .wasm.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p data

# idemd answers only callers with its token; the filter reads the same one from Envoy's
# environment (plugin config "sidecar_token": {"secret_env": "IDEM_SIDECAR_TOKEN"}).
export IDEM_SIDECAR_TOKEN="${IDEM_SIDECAR_TOKEN:-dev-$(head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
export IDEM_AUTH_TOKENS="$IDEM_SIDECAR_TOKEN"

pids=()
stop() { trap - INT TERM EXIT; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; echo; echo "stopped."; }
trap stop INT TERM EXIT

target/debug/demo --listen 127.0.0.1:8080 --db sqlite://./data/demo.db & pids+=($!)
# The reconciler asks the demo's status-by-key endpoint about operations whose executor went silent.
target/debug/idemd serve --listen 127.0.0.1:9090 \
  --status-endpoint 'payments.transfer=http://127.0.0.1:8080/v1/transfers/by-key/{key}' \
  --status-reading 'payments.transfer=pointer=/status;done=executed;failed=failed;done_status=201' & pids+=($!)
if [ "${IDEM_HOST:-wasm}" = native ]; then
  ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/release .venv/bin/envoy -c envoy/native.yaml --disable-hot-restart \
    --log-level warn --component-log-level dynamic_modules:info & pids+=($!)
else
  .venv/bin/envoy -c envoy/envoy.yaml --disable-hot-restart --log-level warn --component-log-level wasm:info & pids+=($!)
fi

for url in http://127.0.0.1:8080/healthz http://127.0.0.1:9090/healthz http://127.0.0.1:9901/ready; do
  for _ in $(seq 1 200); do curl -fs -o /dev/null "$url" && break; sleep 0.1; done
  curl -fs -o /dev/null "$url" || { echo "not ready: $url"; exit 1; }
done

cat <<'WALK'

  Agent idempotency is up: agents -> Envoy 127.0.0.1:10000 -> demo 127.0.0.1:8080
                            Envoy's filter -> idemd 127.0.0.1:9090 (SQLite in ./data)

  1. Preview a transfer; the gateway adds a signed fingerprint to the answer:
       curl -si localhost:10000/v1/transfers/preview -H 'x-agent-subject: alice' \
            -d '{"amount":"100.00","currency":"EUR","payee_id":"p-1","memo":"rent"}'
     and keep the fingerprint (also in the Agent-Fingerprint header) for the next steps:
       FP=$(curl -s -D - -o /dev/null localhost:10000/v1/transfers/preview -H 'x-agent-subject: alice' \
            -d '{"amount":"100.00","currency":"EUR","payee_id":"p-1","memo":"rent"}' | sed -n 's/^agent-fingerprint: //Ip' | tr -d '\r')

  2. Confirm it (the memo may drift; amount, currency and payee may not):
       curl -si localhost:10000/v1/transfers -H 'x-agent-subject: alice' -H "agent-fingerprint: $FP" \
            -d '{"amount":100,"currency":"EUR","payee_id":"p-1","memo":"rent, ASAP"}'

  3. Retry exactly the same call: you get the first result back, marked already_completed:
       (repeat step 2)

  4. Ask for the status, as an agent would after losing its context:
       curl -s "localhost:10000/v1/transfers/status?fingerprint=$FP" -H 'x-agent-subject: alice'

  5. Try a changed amount (422 params_changed) or another subject (403 forbidden).
     How many times did the transfer really run?   curl -s localhost:8080/v1/executions
     Filter stats:                                  curl -s localhost:9901/stats | grep custom.idem

  6. Operators see every operation and its audit trail (the key is the Idempotency-Key from step 2):
       target/debug/idemd ops list --state done          (also: in_flight, needs_review, failed)
       target/debug/idemd ops show <key>

  Ctrl-C stops everything.
WALK
wait -n "${pids[@]}"
echo "a process exited; stopping the rest"
