"""Which tools/call result shapes the official SDKs accept, for a tool with an outputSchema.

    .venv/bin/python tests/mcp-sdk/probe_shapes.py

A tool for whoever changes the gateway's MCP answers, not part of `make test` (the e2e test is
tests/tests/mcp_sdk.rs). It serves, on 127.0.0.1, a minimal stateless Streamable HTTP MCP server
whose one tool is the demo's `execute_transfer` (its outputSchema copied from demo/src/mcp.rs) and
whose tools/call answers one of the SHAPES below, picked by the argument `shape`. Then the Python
SDK (ClientSession, with protocol 2025-11-25's initialize and with 2026-07-28's server/discover) and
the TypeScript SDK (Client, via node; 1.x speaks 2025-11-25) each list the tools (arming their
output validation) and call every shape; it prints one line per shape and SDK: accepted, or the
SDK's error, for each listed outputSchema in SCHEMAS (the record's own, strict, strict as the gateway
rewrites it); `probe_shapes.py strict` runs one. Edit SHAPES to try a candidate answer.
"""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

HERE = Path(__file__).resolve().parent

RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "transfer_id": {"type": "string"},
        "status": {"type": "string", "enum": ["executed"]},
        "amount": {"type": ["string", "number"]},
        "currency": {"type": "string"},
        "payee_id": {"type": "string"},
        "memo": {"type": ["string", "null"]},
        "idempotency_key": {"type": "string"},
        "executed_at": {"type": "integer"},
    },
    "required": ["transfer_id", "status", "amount", "currency", "payee_id", "idempotency_key", "executed_at"],
}
# The record's schema as a strict server writes it, and as the gateway lists it for a guarded confirm
# tool (an optional `agent_idempotency` property for its reply on a replay). A client whose cached
# listing was not rewritten (it listed elsewhere, or before the gateway) still holds the strict one.
STRICT_SCHEMA = {**RECORD_SCHEMA, "additionalProperties": False}
ENVELOPE_PROPERTY = {"type": "object", "description": "the gateway's reply"}
SCHEMAS = {
    "open": RECORD_SCHEMA,
    "strict": STRICT_SCHEMA,
    "strict, rewritten": {
        **STRICT_SCHEMA,
        "properties": {**STRICT_SCHEMA["properties"], "agent_idempotency": ENVELOPE_PROPERTY},
    },
}
RECORD = {
    "transfer_id": "t_1",
    "status": "executed",
    "amount": "12.50",
    "currency": "EUR",
    "payee_id": "payee-42",
    "memo": "rent",
    "idempotency_key": "k",
    "executed_at": 1,
}
ENVELOPE = {
    "status": "in_progress",
    "meaning": "m",
    "instruction": "i",
    "retryable": False,
    "trace_id": "t",
}
TEXT = [{"type": "text", "text": "meaning instruction"}, {"type": "text", "text": json.dumps(ENVELOPE)}]
META = {"agent-idempotency/reply": ENVELOPE}

SHAPES = {
    "refusal: isError, no structuredContent, _meta envelope": {"content": TEXT, "isError": True, "_meta": META},
    "refusal: isError, structuredContent null": {"content": TEXT, "isError": True, "structuredContent": None},
    "refusal: isError, envelope as structuredContent (today)": {
        "content": TEXT,
        "isError": True,
        "structuredContent": ENVELOPE,
    },
    "refusal: isError, empty structuredContent {}": {"content": TEXT, "isError": True, "structuredContent": {}},
    "replay: record + extra text block + _meta envelope": {
        "content": [{"type": "text", "text": json.dumps(RECORD)}, TEXT[0]],
        "isError": False,
        "structuredContent": RECORD,
        "_meta": {"agent-idempotency/reply": {**ENVELOPE, "status": "already_completed", "result": {"x": 1}}},
    },
    "replay: record + an extra property": {
        "content": TEXT[:1],
        "isError": False,
        "structuredContent": {**RECORD, "gateway": "extra"},
    },
    "replay: record + the envelope as property agent_idempotency": {
        "resultType": "complete",
        "content": [{"type": "text", "text": json.dumps(RECORD)}, TEXT[0]],
        "isError": False,
        "structuredContent": {**RECORD, "agent_idempotency": {**ENVELOPE, "status": "already_completed"}},
        "_meta": {"agent-idempotency/reply": {**ENVELOPE, "status": "already_completed"}},
    },
    "replay: envelope as structuredContent (today)": {
        "content": TEXT[:1],
        "isError": False,
        "structuredContent": {**ENVELOPE, "status": "already_completed"},
    },
    "result: no isError, no structuredContent": {"content": TEXT},
    # 2026-07-28 requires `resultType` in every result (the Python SDK refuses a result without it once it
    # negotiated that version with server/discover); is it harmless at 2025-11-25, where this probe runs?
    "refusal with resultType complete (2026-07-28's field)": {
        "resultType": "complete",
        "content": TEXT,
        "isError": True,
        "_meta": META,
    },
    "replay with resultType complete": {
        "resultType": "complete",
        "content": TEXT[:1],
        "isError": False,
        "structuredContent": RECORD,
        "_meta": META,
    },
    "HTTP 400 + JSON-RPC error -32020 (header/body disagreement)": {
        "http_error": 400,
        "error": {"code": -32020, "message": "Mcp-Method says tools/list, the body says tools/call"},
    },
    "result: _meta with a key without a prefix": {
        "content": TEXT[:1],
        "isError": False,
        "structuredContent": RECORD,
        "_meta": {"reply": ENVELOPE},
    },
}


# What a 2026-07-28 listing carries besides its tools (as rmcp's server answers).
MODERN_LIST_FIELDS = {"2026-07-28": {"resultType": "complete", "ttlMs": 0, "cacheScope": "private"}}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        message = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        if "id" not in message:
            self.send_response(202)
            self.end_headers()
            return
        method, params = message.get("method"), message.get("params") or {}
        if method == "initialize":
            result = {
                "protocolVersion": params.get("protocolVersion"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "probe", "version": "0"},
            }
        elif method == "server/discover":
            result = {
                "resultType": "complete",
                "supportedVersions": ["2025-11-25", "2026-07-28"],
                "capabilities": {"tools": {}},
                "ttlMs": 0,
                "cacheScope": "private",
                "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "probe", "version": "0"}},
            }
        elif method == "tools/list":
            result = {
                **MODERN_LIST_FIELDS.get(self.headers.get("mcp-protocol-version"), {}),
                "tools": [
                    {
                        "name": "execute_transfer",
                        "inputSchema": {"type": "object", "properties": {"shape": {"type": "string"}}},
                        "outputSchema": SCHEMAS[self.path.rsplit("/", 1)[-1].replace("_", " ")],
                    }
                ]
            }
        elif method == "tools/call":
            result = SHAPES[params["arguments"]["shape"]]
        else:
            result = {}
        answer = {"jsonrpc": "2.0", "id": message["id"], "result": result}
        status = 200
        if isinstance(result, dict) and "http_error" in result:
            # Not a result: the HTTP status and JSON-RPC error the gateway answers a header/body disagreement with.
            status, answer = result["http_error"], {"jsonrpc": "2.0", "id": message["id"], "error": result["error"]}
        body = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


NODE = """
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
const [url, ...shapes] = process.argv.slice(1);
const client = new Client({ name: 'probe', version: '0' });
await client.connect(new StreamableHTTPClientTransport(new URL(url)));
await client.listTools();
for (const shape of shapes) {
  try {
    await client.callTool({ name: 'execute_transfer', arguments: { shape } });
    console.log(JSON.stringify({ shape, verdict: 'accepted' }));
  } catch (e) {
    const said = `${e.name} (code ${e.code}): ${e.message}`.replace(/\s+/g, ' ');
    console.log(JSON.stringify({ shape, verdict: said }));
  }
}
await client.close();
"""


async def python_verdicts(url, lifecycle):
    verdicts = {}
    async with streamable_http_client(url) as (read, write), ClientSession(read, write) as session:
        if lifecycle == "discover":
            await session.discover()
        else:
            await session.initialize()
        await session.list_tools()
        for shape in SHAPES:
            try:
                await session.call_tool("execute_transfer", {"shape": shape})
                verdicts[shape] = "accepted"
            except Exception as e:  # noqa: BLE001
                code = f" (code {e.code})" if hasattr(e, "code") else ""
                verdicts[shape] = f"{type(e).__name__}{code}: {str(e).splitlines()[0]}"
    return verdicts


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    only = sys.argv[1:] or list(SCHEMAS)
    for schema in only:
        url = f"http://127.0.0.1:{server.server_address[1]}/mcp/{schema.replace(' ', '_')}"
        py = anyio.run(python_verdicts, url, "initialize")
        py_modern = anyio.run(python_verdicts, url, "discover")
        out = subprocess.run(
            ["node", "--input-type=module", "-e", NODE, url, *SHAPES],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            sys.exit(f"node failed: {out.stderr}")
        node = {v["shape"]: v["verdict"] for v in map(json.loads, out.stdout.splitlines())}
        print(f"=== the listed outputSchema: {schema}")
        for shape in SHAPES:
            print(f"{shape}\n    python 2025-11-25 (initialize): {py[shape]}")
            print(f"    python 2026-07-28 (discover):   {py_modern[shape]}")
            print(f"    node   2025-11-25 (initialize): {node[shape]}")
    server.shutdown()


if __name__ == "__main__":
    main()
