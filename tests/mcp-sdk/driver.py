"""The official MCP Python SDK (PyPI `mcp`) as a real client of the gateway.

    python driver.py URL [initialize|discover]

connects with the SDK's Streamable HTTP client and ClientSession to URL (an MCP route
through Envoy and the filter), runs the scenarios of tests/tests/mcp_sdk.rs and prints
one JSON line per step (the lifecycle is protocol 2025-11-25's `initialize`, or 2026-07-28's
`server/discover`, after which every request carries `Mcp-Method`, and a tools/call `Mcp-Name`):

    {"sdk", "step", "ok", "error", "isError", "status", "structuredContent", "meta", "content", ...}

`ok` is false when the SDK raised (then `error` is the exception's type and text).
Output-schema validation is the SDK's default: ClientSession validates every non-error
tools/call result against the tool's `outputSchema` once it has listed the tools
(`list_tools`, and it lists them itself on a call of a tool it has not seen). The step
`validation_armed` proves it is on in this session. Nothing here judges the answers:
the Rust test does.
"""

import contextlib
import importlib.metadata
import json
import sys
import traceback

import anyio
import mcp.types as types
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

REPLY_META = "agent-idempotency/reply"
ALICE = "user-alice"
BOB = "user-bob"
SDK = f"mcp {importlib.metadata.version('mcp')}"


def emit(step, **fields):
    line = {"sdk": "python", "step": step}
    line.update(fields)
    print(json.dumps(line, sort_keys=True), flush=True)


def describe(result):
    """The wire view of a CallToolResult the SDK accepted."""
    wire = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    meta = wire.get("_meta")
    structured = wire.get("structuredContent")
    envelope = meta.get(REPLY_META) if isinstance(meta, dict) else None
    status = None
    if isinstance(envelope, dict):
        status = envelope.get("status")
    elif isinstance(structured, dict):
        status = structured.get("status")
    return {
        "ok": True,
        "error": None,
        "isError": bool(wire.get("isError", False)),
        "status": status,
        "structuredContent": structured,
        "meta": meta,
        "content": wire.get("content", []),
    }


def failure(e):
    code = f" (code {e.code})" if isinstance(getattr(e, "code", None), int) else ""
    return {
        "ok": False,
        "error": f"{type(e).__name__}{code}: {e}",
        "isError": None,
        "status": None,
        "structuredContent": None,
        "meta": None,
        "content": None,
    }


LIFECYCLE = "initialize"


class Agent:
    """One ClientSession over one Streamable HTTP transport, with its own headers."""

    def __init__(self, url, headers):
        self.url = url
        self.headers = headers

    async def start(self):
        """The lifecycle, then tools/list (which arms the output validation)."""
        if LIFECYCLE == "discover":
            await self.session.discover()
        else:
            await self.session.initialize()
        await self.session.list_tools()

    async def __aenter__(self):
        self._stack = contextlib.AsyncExitStack()
        await self._stack.__aenter__()
        http = await self._stack.enter_async_context(create_mcp_http_client(headers=self.headers))
        read, write = await self._stack.enter_async_context(streamable_http_client(self.url, http_client=http))
        self.session = await self._stack.enter_async_context(ClientSession(read, write))
        return self

    async def __aexit__(self, *exc):
        return await self._stack.__aexit__(*exc)

    async def call(self, tool, arguments):
        try:
            return describe(await self.session.call_tool(tool, arguments))
        except Exception as e:  # noqa: BLE001 - every SDK exception is a finding
            return failure(e)


def transfer(amount, memo, fingerprint=None):
    args = {"amount": amount, "currency": "EUR", "payee_id": "payee-42", "memo": memo}
    if fingerprint is not None:
        args["fingerprint"] = fingerprint
    return args


def fingerprint_of(answer):
    sc = answer.get("structuredContent")
    return sc.get("fingerprint") if isinstance(sc, dict) else None


def garble(fp):
    """The same length, one character in the middle changed: a signature that cannot verify."""
    i = len(fp) // 2
    return fp[:i] + ("A" if fp[i] != "A" else "B") + fp[i + 1 :]


async def quote(agent, step, amount, memo):
    answer = await agent.call("quote_transfer", transfer(amount, memo))
    fp = fingerprint_of(answer)
    emit(step, fingerprint=fp, **answer)
    return fp


async def main(url):
    headers = {"x-agent-subject": ALICE}
    async with Agent(url, headers) as alice:
        try:
            if LIFECYCLE == "discover":
                found = await alice.session.discover()
                version, server = alice.session._negotiated_version, found.model_dump(mode="json").get("serverInfo")
            else:
                init = await alice.session.initialize()
                version, server = init.protocol_version, init.server_info.name
            emit("initialize", ok=True, error=None, lifecycle=LIFECYCLE, protocolVersion=version, server=server,
                 sdk_version=SDK)
        except Exception as e:  # noqa: BLE001
            emit("initialize", **failure(e))
            return
        try:
            listed = await alice.session.list_tools()
            tools = {t.name: t.output_schema is not None for t in listed.tools}
            schemas = {t.name: t.output_schema for t in listed.tools}
            emit("list_tools", ok=True, error=None, tools=tools, schemas=schemas)
        except Exception as e:  # noqa: BLE001
            emit("list_tools", **failure(e))
            return

        # Validation is on in this session: the SDK's own check, with the schema it listed,
        # refuses a non-error result whose structuredContent is not a transfer record.
        probe = types.CallToolResult(
            content=[types.TextContent(type="text", text="probe")],
            structured_content={"status": "already_completed"},
            is_error=False,
        )
        try:
            await alice.session.validate_tool_result("execute_transfer", probe)
            emit("validation_armed", ok=False, error="the SDK accepted a structuredContent its schema forbids")
        except RuntimeError as e:
            emit("validation_armed", ok=True, error=f"{type(e).__name__}: {e}")

        # The agent flow: quote, execute, a retry with a drifted memo, the status tool.
        fp = await quote(alice, "quote", "12.50", "rent")
        if fp is None:
            return
        emit("execute", **await alice.call("execute_transfer", transfer(12.5, "rent, ASAP", fp)))
        emit("replay", **await alice.call("execute_transfer", transfer("12.50", "please rent ASAP", fp)))
        emit("status_done", **await alice.call("get_transfer_status", {"fingerprint": fp}))

        # Refusals: nothing executes.
        emit("params_changed", **await alice.call("execute_transfer", transfer("4000.00", "rent", fp)))
        emit("fingerprint_missing", **await alice.call("execute_transfer", transfer("12.50", "rent")))
        emit("fingerprint_invalid", **await alice.call("execute_transfer", transfer("12.50", "rent", garble(fp))))
        async with Agent(url, {"x-agent-subject": BOB}) as bob:
            await bob.start()
            emit("forbidden", **await bob.call("execute_transfer", transfer("12.50", "rent", fp)))

        # A duplicate while the first call is still executing (the demo holds it 4 s).
        fp2 = await quote(alice, "quote_slow", "20.00", "slow")
        async with Agent(url, {**headers, "x-demo-delay-ms": "4000"}) as slow:
            await slow.start()
            first = {}

            async def run_first():
                first.update(await slow.call("execute_transfer", transfer("20.00", "slow", fp2)))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run_first)
                # Wait until the gateway holds the operation (its status tool says so), then duplicate.
                polled = None
                for _ in range(60):
                    await anyio.sleep(0.1)
                    polled = await alice.call("get_transfer_status", {"fingerprint": fp2})
                    if polled["status"] == "in_progress":
                        break
                    if not polled["ok"]:
                        await anyio.sleep(1.0)  # the SDK refused the report: give the first call time to land
                        break
                emit("status_in_flight", **polled)
                emit("in_progress", **await alice.call("execute_transfer", transfer("20.00", "slow again", fp2)))
            emit("execute_slow", **first)

        # The upstream answers the MCP POST with HTTP 503 (demo: x-demo-fail): released, then a retry runs once.
        fp3 = await quote(alice, "quote_503", "30.00", "flaky")
        async with Agent(url, {**headers, "x-demo-fail": "503"}) as flaky:
            await flaky.start()
            emit("not_executed", **await flaky.call("execute_transfer", transfer("30.00", "flaky", fp3)))
        emit("execute_after_503", **await alice.call("execute_transfer", transfer("30.00", "flaky", fp3)))

        # The upstream's own refusal (over the demo's limit) makes a FAILED operation; a retry is already_failed.
        fp5 = await quote(alice, "quote_over_limit", "20000.00", "too much")
        emit("execute_over_limit", **await alice.call("execute_transfer", transfer("20000.00", "too much", fp5)))
        emit("replay_failed", **await alice.call("execute_transfer", transfer("20000.00", "too much", fp5)))
        emit("status_failed", **await alice.call("get_transfer_status", {"fingerprint": fp5}))

        # A server that leaves its outputSchema (demo: x-demo-off-schema): the SDK's validation acts through the
        # gateway, and a FAILED operation recorded from such an answer replays without its structuredContent.
        async with Agent(url, {**headers, "x-demo-off-schema": "1"}) as careless:
            await careless.start()
            emit("off_schema_quote", **await careless.call("quote_transfer", transfer("50.00", "careless")))
            fp6 = await quote(alice, "quote_off_schema", "30000.00", "careless")
            emit("execute_off_schema", **await careless.call("execute_transfer", transfer("30000.00", "careless", fp6)))
        emit("replay_failed_off_schema", **await alice.call("execute_transfer", transfer("30000.00", "careless", fp6)))

        # The status tool on a fingerprint never used.
        fp4 = await quote(alice, "quote_unused", "40.00", "unused")
        emit("status_not_yet", **await alice.call("get_transfer_status", {"fingerprint": fp4}))

        # The route's approval rule (amount 7777.77): approval_required, then the status tool says it waits.
        fp7 = await quote(alice, "quote_approval", "7777.77", "needs a person")
        emit("execute_approval", **await alice.call("execute_transfer", transfer("7777.77", "needs a person", fp7)))
        emit("status_approval", **await alice.call("get_transfer_status", {"fingerprint": fp7}))
    emit("done", ok=True, error=None)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["initialize"], ["discover"]):
        sys.exit("usage: driver.py URL [initialize|discover]")
    LIFECYCLE = (sys.argv[2:] or ["initialize"])[0]
    try:
        anyio.run(main, sys.argv[1])
    except BaseException as e:  # noqa: BLE001 - the driver's own failure is a line too
        emit("driver", ok=False, error="".join(traceback.format_exception(e)))
        sys.exit(1)
