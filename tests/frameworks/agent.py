"""Real agent frameworks from PyPI, driven by scripted models (no LLM), as agents through the gateway.

    python agent.py FRAMEWORK URL

FRAMEWORK is one of the configurations in FRAMEWORKS below (pydantic-ai, with its default and with
`tool_error_behavior='failed'`; the OpenAI Agents SDK, with `use_structured_content` off and on; LangGraph's
prebuilt agent over langchain-mcp-adapters, run from .venv-langchain: the adapters need the MCP SDK 1.x). Each
call of a tool is one agent run: the scripted model asks for the call, then is shown the tool's answer
as the framework hands it to a model, and ends the run. One JSON line per step:

    {"framework", "step", "ran", "seen", "error"}

`seen` is exactly what the framework put in front of the model for that call (text); `ran` is false
when the framework ended the agent's run with an exception instead (then `error` names it). The Rust
test (tests/tests/frameworks.rs) judges the lines: nothing here decides what is right.
"""

import json
import sys
import traceback

import anyio

ALICE = "user-alice"
BOB = "user-bob"


def emit(framework, step, **fields):
    line = {"framework": framework, "step": step}
    line.update(fields)
    print(json.dumps(line, sort_keys=True), flush=True)


# --- pydantic-ai ------------------------------------------------------------------------------


class PydanticAi:
    """pydantic-ai's Agent with its MCPToolset built from the URL, as its docs show: FastMCP picks the
    transport from the URL itself (Streamable HTTP, unless the path ends in /sse: the legacy HTTP+SSE
    transport, which is why the SSE-framed endpoint is /mcp/stream), and a FunctionModel that plays
    the model."""

    def __init__(self, url, headers, error_behavior):
        from pydantic_ai.mcp import MCPToolset

        kwargs = {} if error_behavior is None else {"tool_error_behavior": error_behavior}
        self.toolset = MCPToolset(url, headers=headers, **kwargs)

    async def __aenter__(self):
        await self.toolset.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self.toolset.__aexit__(*exc)

    async def call(self, tool, arguments, times=1):
        """One agent run in which the model calls `tool` with `arguments` `times` times in a row (as a
        model told "call this tool again" does), each call after it has seen the previous answer."""
        from pydantic_ai import Agent
        from pydantic_ai.messages import ModelResponse, RetryPromptPart, TextPart, ToolCallPart, ToolReturnPart
        from pydantic_ai.models.function import FunctionModel

        seen = []

        def model(messages, info):
            for part in messages[-1].parts:
                if isinstance(part, ToolReturnPart):
                    seen.append(part.model_response_str())
                elif isinstance(part, RetryPromptPart):
                    seen.append(part.model_response())
            if len(seen) < times and (seen or len(messages) == 1):
                return ModelResponse(parts=[ToolCallPart(tool_name=tool, args=arguments)])
            return ModelResponse(parts=[TextPart(content="noted")])

        agent = Agent(FunctionModel(model), toolsets=[self.toolset])
        try:
            await agent.run(f"call {tool}")
            return {"ran": True, "seen": "\n".join(seen), "error": None}
        except Exception as e:  # noqa: BLE001 - a framework ending the run is the finding
            return {"ran": False, "seen": "\n".join(seen), "error": f"{type(e).__name__}: {e}"}


# --- OpenAI Agents SDK -----------------------------------------------------------------------


class OpenAiAgents:
    """The OpenAI Agents SDK's Agent and Runner with MCPServerStreamableHttp and a scripted Model."""

    def __init__(self, url, headers, structured):
        from agents.mcp import MCPServerStreamableHttp

        self.server = MCPServerStreamableHttp(
            params={"url": url, "headers": headers, "timeout": 30},
            use_structured_content=structured,
            cache_tools_list=True,
        )

    async def __aenter__(self):
        await self.server.connect()
        return self

    async def __aexit__(self, *exc):
        await self.server.cleanup()

    async def call(self, tool, arguments, times=1):
        """As PydanticAi.call."""
        from agents import Agent, RunConfig, Runner
        from agents.items import ModelResponse
        from agents.models.interface import Model
        from agents.usage import Usage
        from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

        seen = []

        class Scripted(Model):
            async def get_response(self, system_instructions, input, *args, **kwargs):
                outputs = [i for i in (input if isinstance(input, list) else [])
                           if isinstance(i, dict) and i.get("type") == "function_call_output"]
                if outputs:
                    out = outputs[-1]["output"]
                    seen.append(out if isinstance(out, str) else json.dumps(out))
                if len(outputs) < times:
                    call = ResponseFunctionToolCall(type="function_call", call_id=f"c{len(outputs)}", name=tool,
                                                    arguments=json.dumps(arguments))
                    return ModelResponse(output=[call], usage=Usage(), response_id=None)
                text = ResponseOutputText(type="output_text", text="noted", annotations=[])
                msg = ResponseOutputMessage(type="message", id="m1", role="assistant", status="completed",
                                            content=[text])
                return ModelResponse(output=[msg], usage=Usage(), response_id=None)

            def stream_response(self, *args, **kwargs):
                raise NotImplementedError("the scripted model does not stream")

        agent = Agent(name="payments", model=Scripted(), mcp_servers=[self.server])
        try:
            await Runner.run(agent, f"call {tool}", run_config=RunConfig(tracing_disabled=True))
            return {"ran": True, "seen": "\n".join(seen), "error": None}
        except Exception as e:  # noqa: BLE001
            return {"ran": False, "seen": "\n".join(seen), "error": f"{type(e).__name__}: {e}"}


# --- LangGraph over langchain-mcp-adapters ------------------------------------------------------


class LangGraph:
    """LangGraph's prebuilt ReAct agent (`create_react_agent`, its ToolNode with its default error
    handling) over the tools langchain-mcp-adapters' MultiServerMCPClient loads, as their docs show
    (Streamable HTTP; the adapter opens a session per call), and a scripted chat model. The model
    reads a ToolMessage's content: the result's content blocks (text, an embedded text resource as
    its text); `structuredContent` goes to the message's artifact, which no model is shown."""

    def __init__(self, url, headers):
        from langchain_mcp_adapters.client import MultiServerMCPClient

        self.client = MultiServerMCPClient({"demo": {"url": url, "transport": "streamable_http", "headers": headers}})
        self.tools = None

    async def __aenter__(self):
        self.tools = await self.client.get_tools()
        return self

    async def __aexit__(self, *exc):
        return None

    async def call(self, tool, arguments, times=1):
        """As PydanticAi.call."""
        from langchain_core.language_models.chat_models import BaseChatModel
        from langchain_core.messages import AIMessage, ToolMessage
        from langchain_core.outputs import ChatGeneration, ChatResult
        from langgraph.prebuilt import create_react_agent

        seen = []

        def shown(content):
            if isinstance(content, str):
                return content
            return "\n".join(b.get("text", json.dumps(b)) if isinstance(b, dict) else str(b) for b in content)

        class Scripted(BaseChatModel):
            @property
            def _llm_type(self):
                return "scripted"

            def bind_tools(self, tools, **kwargs):
                return self

            def _generate(self, messages, stop=None, run_manager=None, **kwargs):
                outputs = [m for m in messages if isinstance(m, ToolMessage)]
                if outputs:
                    seen.append(shown(outputs[-1].content))
                if len(outputs) < times:
                    call = {"name": tool, "args": arguments, "id": f"c{len(outputs)}", "type": "tool_call"}
                    message = AIMessage(content="", tool_calls=[call])
                else:
                    message = AIMessage(content="noted")
                return ChatResult(generations=[ChatGeneration(message=message)])

        agent = create_react_agent(Scripted(), self.tools)
        try:
            await agent.ainvoke({"messages": [("user", f"call {tool}")]})
            return {"ran": True, "seen": "\n".join(seen), "error": None}
        except Exception as e:  # noqa: BLE001
            return {"ran": False, "seen": "\n".join(seen), "error": f"{type(e).__name__}: {e}"}


FRAMEWORKS = {
    "pydantic-ai": lambda url, h: PydanticAi(url, h, None),
    "pydantic-ai-failed": lambda url, h: PydanticAi(url, h, "failed"),
    "openai-agents": lambda url, h: OpenAiAgents(url, h, False),
    "openai-agents-structured": lambda url, h: OpenAiAgents(url, h, True),
    "langgraph": LangGraph,
}


def transfer(amount, memo, fingerprint=None):
    args = {"amount": amount, "currency": "EUR", "payee_id": "payee-42", "memo": memo}
    if fingerprint is not None:
        args["fingerprint"] = fingerprint
    return args


def fingerprint_in(seen):
    """The fingerprint as a model reads it: a JSON field or the gateway's line, whichever it was shown."""
    import re

    found = re.search(r'"fingerprint":\s*"([^"]+)"', seen) or re.search(r"fingerprint: (\S+)", seen)
    return found.group(1) if found else None


async def main(name, url):
    make = FRAMEWORKS[name]

    def step(s, answer):
        emit(name, s, **answer)
        return answer

    async with make(url, {"x-agent-subject": ALICE}) as alice:
        async def quote(s, amount, memo):
            return fingerprint_in(step(s, await alice.call("quote_transfer", transfer(amount, memo)))["seen"])

        fp = await quote("quote", "12.50", "rent")
        if fp is None:
            return
        step("execute", await alice.call("execute_transfer", transfer(12.5, "rent", fp)))
        # Re-planning: the same fingerprint, drifted free text.
        step("replan", await alice.call("execute_transfer", transfer("12.50", "rent, as planned", fp)))
        # Context loss: a fresh agent (new session) with only the fingerprint it wrote down.
        async with make(url, {"x-agent-subject": ALICE}) as again:
            step("context_loss", await again.call("execute_transfer", transfer("12.50", "rent", fp)))
        step("tamper", await alice.call("execute_transfer", transfer("4000.00", "rent", fp)))

        # A duplicate while the first call still executes (the demo holds it 4 s).
        fp2 = await quote("quote_slow", "20.00", "slow")
        async with make(url, {"x-agent-subject": ALICE, "x-demo-delay-ms": "4000"}) as slow:
            first = {}

            async def run_first():
                first.update(await slow.call("execute_transfer", transfer("20.00", "slow", fp2)))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run_first)
                await anyio.sleep(1.5)
                step("in_progress", await alice.call("execute_transfer", transfer("20.00", "slow", fp2)))
            step("execute_slow", first)

        # The upstream answers 503 twice (nothing ran): not_executed twice in a row, then it runs once.
        fp3 = await quote("quote_503", "30.00", "flaky")
        # In one run, as the model is told: "call this tool again with exactly the same arguments".
        async with make(url, {"x-agent-subject": ALICE, "x-demo-fail": "503"}) as flaky:
            step("not_executed_twice", await flaky.call("execute_transfer", transfer("30.00", "flaky", fp3), times=2))
        step("execute_after_503", await alice.call("execute_transfer", transfer("30.00", "flaky", fp3)))

        # The server's own failure (over the demo's limit), then its replay.
        fp5 = await quote("quote_over_limit", "20000.00", "too much")
        step("server_failure", await alice.call("execute_transfer", transfer("20000.00", "too much", fp5)))
        step("failure_replay", await alice.call("execute_transfer", transfer("20000.00", "too much", fp5)))
        # The same two in one run: the server's failure, then (a model retrying anyway) its replay.
        fp6 = await quote("quote_over_limit_again", "25000.00", "too much again")
        step("failure_then_replay", await alice.call("execute_transfer", transfer("25000.00", "too much again", fp6),
                                                    times=2))

        # A quote that lapses (the demo's quote lives 2 s): the confirm after it is refused, nothing runs.
        async with make(url, {"x-agent-subject": ALICE, "x-demo-quote-ttl-s": "2"}) as brief:
            fp7 = fingerprint_in(step("quote_brief", await brief.call("quote_transfer", transfer("9.00", "brief")))["seen"])
        await anyio.sleep(3.5)
        step("expired", await alice.call("execute_transfer", transfer("9.00", "brief", fp7)))

        # Another subject presents Alice's fingerprint.
        async with make(url, {"x-agent-subject": BOB}) as bob:
            step("forbidden", await bob.call("execute_transfer", transfer("12.50", "rent", fp)))
    emit(name, "done", ran=True, seen="", error=None)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in FRAMEWORKS:
        sys.exit(f"usage: agent.py {{{'|'.join(FRAMEWORKS)}}} URL")
    try:
        anyio.run(main, sys.argv[1], sys.argv[2])
    except BaseException as e:  # noqa: BLE001
        emit(sys.argv[1], "driver", ran=False, seen="", error="".join(traceback.format_exception(e)))
        sys.exit(1)
