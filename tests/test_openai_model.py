"""OpenAIChatModel against a real local HTTP/1.1 server speaking chat completions."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.agents import fixture_tools
from baton_runtime.owner.agents.api import (
    ModelRejected,
    ModelReply,
    RequestedCall,
    TextDelta,
    ToolCallDelta,
    ToolContext,
    dumps_arguments,
    load_agent,
)
from baton_runtime.owner.agents.openai_model import (
    OpenAIChatModel,
    OpenAIStreamingChatModel,
    build_agent,
)
from baton_runtime.owner.agents.openai_wire import ModelError, ModelTimeout

# -- a tiny scripted chat-completions server ---------------------------------

HANG = "hang"  # accept the request, never answer
DROP = "drop"  # close the connection without answering


@dataclass
class Reply:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float


class ChatServer:
    """Serves scripted replies in order (the last one repeats) and records every request."""

    def __init__(self) -> None:
        self.script: list[Reply | str] = []
        self.requests: list[Received] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def base_url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}/v1"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    def bodies(self) -> list[Any]:
        return [r.body for r in self.requests]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                method, path, _ = request_line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                body = json.loads(raw) if raw else None
                self.requests.append(Received(method, path, headers, body, time.monotonic()))
                index = min(len(self.requests), len(self.script)) - 1
                action = self.script[index]
                if action == HANG:
                    await asyncio.Event().wait()
                if action == DROP:
                    return
                assert isinstance(action, Reply)
                payload = action.body if isinstance(action.body, bytes) else json.dumps(action.body)
                data = payload if isinstance(payload, bytes) else payload.encode()
                head = [f"HTTP/1.1 {action.status} X", f"Content-Length: {len(data)}"]
                head.append(f"Content-Type: {action.content_type}")
                head += [f"{k}: {v}" for k, v in action.headers.items()]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self._handlers.discard(task)
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[ChatServer]:
    running = ChatServer()
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


def completion(
    content: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture
async def models() -> AsyncIterator[list[OpenAIChatModel]]:
    made: list[OpenAIChatModel] = []
    try:
        yield made
    finally:
        for model in made:
            await model.aclose()


@pytest.fixture
def make_model(server: ChatServer, models: list[OpenAIChatModel]) -> Any:
    def make(**kwargs: Any) -> OpenAIChatModel:
        options: dict[str, Any] = {"timeout": 5.0, "backoff_base": 0.01}
        options.update(kwargs)
        model = OpenAIChatModel(server.base_url, "test-model", **options)
        models.append(model)
        return model

    return make


USER_HELLO = [s.ChatMessage(role=s.ROLE_USER, content="hello")]

# -- tests -------------------------------------------------------------------


async def test_plain_answer_with_usage(server: ChatServer, make_model: Any) -> None:
    server.script = [Reply(body=completion("Hi there.", prompt_tokens=12, completion_tokens=3))]
    model = make_model()

    reply = await model.complete("Be brief.", USER_HELLO, ())

    assert reply == ModelReply(text="Hi there.", input_tokens=12, output_tokens=3, cost_micros=0)
    [request] = server.requests
    assert (request.method, request.path) == ("POST", "/v1/chat/completions")
    assert request.headers["content-type"] == "application/json"
    assert "authorization" not in request.headers
    assert request.body == {
        "model": "test-model",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
        ],
    }  # no "tools" key when there are no tools


async def test_tool_call_round_trip(server: ChatServer, make_model: Any) -> None:
    server.script = [
        Reply(
            body=completion(
                None,
                [tool_call("srv_1", "calculator", '{"expression": "6*7"}')],
                prompt_tokens=20,
                completion_tokens=5,
            )
        ),
        Reply(body=completion("The result is 42.", prompt_tokens=30, completion_tokens=6)),
    ]
    model = make_model()
    tools = fixture_tools.TOOLS
    history = [
        s.ChatMessage(role=s.ROLE_SYSTEM, content="Extra context."),
        s.ChatMessage(role=s.ROLE_USER, content="what is 6*7?"),
    ]

    first = await model.complete("Use tools.", history, tools)
    assert first.text == ""
    assert list(first.tool_calls) == [RequestedCall("calculator", {"expression": "6*7"})]
    assert (first.input_tokens, first.output_tokens) == (20, 5)

    # What the session does with it: ids of its own, the tool's output as a tool message.
    call = s.ToolCall(
        id="call_1", name="calculator", arguments_json=dumps_arguments({"expression": "6*7"})
    )
    context = ToolContext(session_id="ses", deployment_id="dep", owner_run_id="run")
    calculator = next(t for t in fixture_tools.TOOLS if t.name == "calculator")
    output = await calculator.run({"expression": "6*7"}, context)
    history.append(s.ChatMessage(role=s.ROLE_ASSISTANT, tool_calls=[call]))
    history.append(s.ChatMessage(role=s.ROLE_TOOL, content=output, tool_call_id="call_1"))

    second = await model.complete("Use tools.", history, tools)
    assert second.text == "The result is 42."
    assert list(second.tool_calls) == []

    first_body, second_body = server.bodies()
    assert first_body["tools"] == [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]
    assert second_body["tools"] == first_body["tools"]
    assert second_body["messages"] == [
        {"role": "system", "content": "Use tools."},
        {"role": "system", "content": "Extra context."},
        {"role": "user", "content": "what is 6*7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression":"6*7"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]


async def test_several_tool_calls_and_text(server: ChatServer, make_model: Any) -> None:
    server.script = [
        Reply(
            body=completion(
                "Let me check.",
                [tool_call("a", "deployment", ""), tool_call("b", "echo", '{"text": "x"}')],
            )
        )
    ]
    reply = await make_model().complete("", USER_HELLO, fixture_tools.TOOLS)
    assert reply.text == "Let me check."
    assert list(reply.tool_calls) == [
        RequestedCall("deployment", {}),
        RequestedCall("echo", {"text": "x"}),
    ]
    # No instructions: no system message.
    assert server.bodies()[0]["messages"] == [{"role": "user", "content": "hello"}]


async def test_invalid_tool_arguments_is_a_clear_error(server: ChatServer, make_model: Any) -> None:
    server.script = [Reply(body=completion(None, [tool_call("a", "echo", '{"text": ')]))]
    with pytest.raises(ModelError, match="invalid JSON arguments for tool 'echo'"):
        await make_model().complete("", USER_HELLO, fixture_tools.TOOLS)
    server.requests.clear()
    server.script = [Reply(body=completion(None, [tool_call("a", "echo", "[1, 2]")]))]
    with pytest.raises(ModelError, match="not a JSON object"):
        await make_model().complete("", USER_HELLO, fixture_tools.TOOLS)
    assert len(server.requests) == 1  # a bad reply is not retried


async def test_malformed_reply_is_a_clear_error(server: ChatServer, make_model: Any) -> None:
    server.script = [Reply(body={"choices": []})]
    with pytest.raises(ModelError, match="no choices"):
        await make_model().complete("", USER_HELLO, ())
    server.requests.clear()
    server.script = [Reply(body=b"<html>not json</html>")]
    with pytest.raises(ModelError, match="invalid JSON") as caught:
        await make_model().complete("", USER_HELLO, ())
    assert caught.value.status == 200


async def test_429_then_success_honours_retry_after(server: ChatServer, make_model: Any) -> None:
    server.script = [
        Reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "1"}),
        Reply(body=completion("ok", prompt_tokens=1, completion_tokens=1)),
    ]
    model = make_model(backoff_base=0.001)

    reply = await model.complete("", USER_HELLO, ())

    assert reply.text == "ok"
    first, second = server.requests
    assert second.at - first.at >= 0.95  # waited Retry-After, not the 1 ms backoff
    assert first.body == second.body


async def test_retry_after_is_capped(server: ChatServer, make_model: Any) -> None:
    server.script = [
        Reply(503, {"error": "busy"}, {"Retry-After": "3600"}),
        Reply(body=completion("ok")),
    ]
    model = make_model(max_backoff=0.05)
    started = time.monotonic()
    assert (await model.complete("", USER_HELLO, ())).text == "ok"
    assert time.monotonic() - started < 5  # not an hour
    assert len(server.requests) == 2


async def test_500_exhausts_retries(server: ChatServer, make_model: Any) -> None:
    server.script = [Reply(500, {"error": {"message": "internal kaboom"}})]
    model = make_model(max_retries=2, backoff_base=0.05)
    started = time.monotonic()

    with pytest.raises(ModelError) as caught:
        await model.complete("", USER_HELLO, ())

    assert len(server.requests) == 3  # max_retries + 1
    assert time.monotonic() - started >= 0.05 + 0.1  # exponential backoff between attempts
    error = caught.value
    assert (error.status, error.attempts) == (500, 3)
    assert "HTTP 500" in str(error) and "internal kaboom" in error.body
    # The message is what a session publishes: no upstream text, no URL.
    assert "kaboom" not in str(error) and server.base_url not in str(error)
    assert not isinstance(error, ModelTimeout)
    assert not isinstance(error, ModelRejected)


async def test_400_is_not_retried(server: ChatServer, make_model: Any) -> None:
    server.script = [Reply(400, {"error": {"message": "unknown parameter: foo"}})]
    model = make_model(max_retries=3)

    with pytest.raises(ModelError) as caught:
        await model.complete("", USER_HELLO, ())

    assert len(server.requests) == 1
    assert caught.value.status == 400
    assert "HTTP 400" in str(caught.value)
    assert "unknown parameter: foo" in caught.value.body
    # Deterministic: the owner fails the turn with MODEL_REJECTED, no retry.
    assert isinstance(caught.value, ModelRejected)


async def test_long_error_body_is_excerpted(server: ChatServer, make_model: Any) -> None:
    server.script = [Reply(401, {"error": "x" * 5000})]
    with pytest.raises(ModelError) as caught:
        await make_model().complete("", USER_HELLO, ())
    assert caught.value.status == 401
    assert len(caught.value.body) < 700 and "x" * 10 not in str(caught.value)


async def test_hanging_server_times_out_after_retries(server: ChatServer, make_model: Any) -> None:
    server.script = [HANG]
    model = make_model(timeout=0.2, max_retries=1, backoff_base=0.01)
    started = time.monotonic()

    with pytest.raises(ModelTimeout, match="timed out") as caught:
        await model.complete("", USER_HELLO, ())

    elapsed = time.monotonic() - started
    assert len(server.requests) == 2
    assert caught.value.attempts == 2
    assert 0.4 <= elapsed < 5.0  # two 0.2 s timeouts, not the 5 s default


async def test_dropped_connection_is_retried(server: ChatServer, make_model: Any) -> None:
    server.script = [DROP, Reply(body=completion("recovered"))]
    reply = await make_model().complete("", USER_HELLO, ())
    assert reply.text == "recovered"
    assert len(server.requests) == 2


async def test_connection_refused_exhausts_retries(models: list[OpenAIChatModel]) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    model = OpenAIChatModel(f"http://127.0.0.1:{port}", "m", max_retries=2, backoff_base=0.01)
    models.append(model)
    with pytest.raises(ModelError, match="failed after 3 attempts: ConnectError") as caught:
        await model.complete("", USER_HELLO, ())
    assert caught.value.status is None
    assert f"127.0.0.1:{port}" not in str(caught.value)
    assert f"127.0.0.1:{port}" in caught.value.detail


async def test_authorization_header_sent_with_api_key(server: ChatServer, make_model: Any) -> None:
    server.script = [Reply(body=completion("ok"))]
    model = make_model(api_key="sk-test-123")
    await model.complete("", USER_HELLO, ())
    assert server.requests[0].headers["authorization"] == "Bearer sk-test-123"
    assert "sk-test-123" not in repr(model)


async def test_cost_computed_from_prices(server: ChatServer, make_model: Any) -> None:
    server.script = [Reply(body=completion("ok", prompt_tokens=1500, completion_tokens=250))]
    model = make_model(price_input_micros_per_1k=2000, price_output_micros_per_1k=8000)
    reply = await model.complete("", USER_HELLO, ())
    # 1500 * 2000 / 1000 + 250 * 8000 / 1000 = 3000 + 2000
    assert (reply.input_tokens, reply.output_tokens, reply.cost_micros) == (1500, 250, 5000)
    assert model.cost_micros(1, 1) == 10  # (2000 + 8000) / 1000
    assert model.cost_micros(0, 0) == 0


async def test_injected_client_is_left_open(server: ChatServer) -> None:
    import openai

    server.script = [Reply(body=completion("ok"))]
    async with openai.AsyncOpenAI(base_url=server.base_url + "/", api_key="k") as client:
        model = OpenAIChatModel(server.base_url + "/", "m", client=client)
        assert (await model.complete("", USER_HELLO, ())).text == "ok"
        await model.aclose()
        assert not client.is_closed()
    assert server.requests[0].path == "/v1/chat/completions"  # trailing slash tolerated


async def test_no_api_key_sends_no_authorization(server: ChatServer, make_model: Any) -> None:
    server.script = [Reply(body=completion("ok"))]
    await make_model().complete("", USER_HELLO, ())
    assert "authorization" not in server.requests[0].headers


async def test_the_clients_own_retries_are_off(server: ChatServer, make_model: Any) -> None:
    """Every attempt is this adapter's: the official client never retries
    underneath it (its retries would multiply Baton's)."""
    server.script = [Reply(503, {"error": "busy"})]
    with pytest.raises(ModelError):
        await make_model(max_retries=1).complete("", USER_HELLO, ())
    assert len(server.requests) == 2
    assert [r.headers.get("x-stainless-retry-count") for r in server.requests] == ["0", "0"]


# -- the agent factory -------------------------------------------------------


def test_build_agent_requires_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_OPENAI_BASE_URL", raising=False)
    monkeypatch.setenv("BATON_OPENAI_MODEL", "m")
    with pytest.raises(RuntimeError, match="BATON_OPENAI_BASE_URL is required"):
        build_agent("dep-1")


def test_build_agent_requires_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_OPENAI_BASE_URL", "http://127.0.0.1:1/v1")
    monkeypatch.delenv("BATON_OPENAI_MODEL", raising=False)
    with pytest.raises(RuntimeError, match="BATON_OPENAI_MODEL is required"):
        build_agent("dep-1")


async def test_build_agent_via_spec(server: ChatServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_OPENAI_BASE_URL", server.base_url)
    monkeypatch.setenv("BATON_OPENAI_MODEL", "env-model")
    monkeypatch.setenv("BATON_OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("BATON_OPENAI_PRICE_INPUT_MICROS_PER_1K", "1000")
    server.script = [Reply(body=completion("hi", prompt_tokens=7, completion_tokens=2))]

    agent = load_agent("baton_runtime.owner.agents.openai_model:build_agent", "dep-1")

    assert agent.deployment_id == "dep-1"
    assert agent.tools == fixture_tools.TOOLS
    assert isinstance(agent.model, OpenAIChatModel)
    try:
        reply = await agent.model.complete(agent.instructions, USER_HELLO, agent.tools)
    finally:
        await agent.model.aclose()
    assert reply.cost_micros == 7
    [request] = server.requests
    assert request.headers["authorization"] == "Bearer sk-env"
    assert request.body["model"] == "env-model"
    assert request.body["messages"][0] == {"role": "system", "content": agent.instructions}
    sent = [t["function"]["name"] for t in request.body["tools"]]
    assert sent == [t.name for t in fixture_tools.TOOLS]
    assert {"calculator", "deployment", "echo"} <= set(sent)


async def test_a_failed_model_call_publishes_a_safe_summary(
    server: ChatServer, monkeypatch: pytest.MonkeyPatch, etcd_endpoint: str
) -> None:
    """docs/design.md §12: public events carry safe summaries of upstream failures.
    A session on the OpenAI agent whose endpoint fails: the stream's
    turn.failed names the HTTP status, not the endpoint or what it said."""
    from tests.stack import start_stack, stop_stack

    secret = "upstream-secret-detail-7f3a"
    server.script = [Reply(500, {"error": {"message": secret}})]
    monkeypatch.setenv("BATON_OPENAI_BASE_URL", server.base_url)
    monkeypatch.setenv("BATON_OPENAI_MODEL", "m")
    stack = await start_stack(
        etcd_endpoint, "dep-oai", agent="baton_runtime.owner.agents.openai_model:build_agent"
    )
    try:
        session_id = await stack.create()
        await stack.send(session_id, "hello")
        events = await stack.events(session_id, until=1)
    finally:
        await stop_stack(stack)
    [failed] = [e for e in events if e.kind == s.EVENT_KIND_TURN_FAILED]
    assert failed.error.reason == "MODEL_ERROR"
    assert "HTTP 500" in failed.error.message
    public = b"".join(e.SerializeToString() for e in events)
    assert secret.encode() not in public
    assert server.base_url.encode() not in public
    assert b"127.0.0.1" not in public


def test_waits_between_attempts_follow_the_configured_backoff() -> None:
    """Pure: the wait before each retry doubles from `backoff_base` up to
    `max_backoff`; a Retry-After replaces it, capped; a zero base retries
    at once; a cap below the base caps the first wait too."""
    model = OpenAIChatModel("http://127.0.0.1:1", "m", backoff_base=0.5, max_backoff=3.0)
    assert [model._delay(n, None) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert model._delay(1, 10.0) == 3.0 and model._delay(2, 0.25) == 0.25
    assert OpenAIChatModel("http://127.0.0.1:1", "m", backoff_base=0.0)._delay(3, None) == 0.0
    low_cap = OpenAIChatModel("http://127.0.0.1:1", "m", backoff_base=2.0, max_backoff=0.5)
    assert [low_cap._delay(n, None) for n in (1, 2)] == [0.5, 0.5]


# -- streaming (issue 35: live items) ---------------------------------------------------


def sse(chunks: list[dict[str, Any]]) -> Reply:
    """A streamed completion: server-sent events of `chunks`, then [DONE]."""
    body = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
    return Reply(body=body, content_type="text/event-stream")


def chunk(delta: dict[str, Any], usage: dict[str, int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "test-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}] if delta else [],
    }
    if usage is not None:
        out["usage"] = usage
    return out


@pytest.fixture
def make_streaming_model(server: ChatServer, models: list[OpenAIChatModel]) -> Any:
    def make(**kwargs: Any) -> OpenAIStreamingChatModel:
        options: dict[str, Any] = {"timeout": 5.0, "backoff_base": 0.01}
        options.update(kwargs)
        model = OpenAIStreamingChatModel(server.base_url, "test-model", **options)
        models.append(model)
        return model

    return make


async def test_streamed_text_arrives_as_deltas_and_ends_in_the_reply(
    server: ChatServer, make_streaming_model: Any
) -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    server.script = [
        sse(
            [
                chunk({"role": "assistant", "content": ""}),
                chunk({"content": "Hi"}),
                chunk({"content": " there"}),
                chunk({"content": "."}),
                chunk({}, usage),
            ]
        )
    ]
    model = make_streaming_model(price_input_micros_per_1k=1000)
    items = [item async for item in model.stream("be brief", USER_HELLO, [])]
    assert items[:-1] == [TextDelta("Hi"), TextDelta(" there"), TextDelta(".")]
    reply = items[-1]
    assert isinstance(reply, ModelReply)
    assert reply.text == "Hi there." and not reply.tool_calls
    assert (reply.input_tokens, reply.output_tokens, reply.cost_micros) == (12, 3, 12)
    [request] = server.requests
    assert request.body["stream"] is True
    assert request.body["stream_options"] == {"include_usage": True}


async def test_streamed_tool_call_arguments_arrive_as_they_form(
    server: ChatServer, make_streaming_model: Any
) -> None:
    def call_part(index: int, **fields: Any) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, **fields}]}

    server.script = [
        sse(
            [
                chunk(call_part(0, id="c1", type="function", function={"name": "calculator"})),
                chunk(call_part(0, function={"arguments": '{"expression"'})),
                chunk(call_part(0, function={"arguments": ': "6*7"}'})),
                chunk({}, {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}),
            ]
        )
    ]
    model = make_streaming_model()
    items = [item async for item in model.stream("", USER_HELLO, fixture_tools.TOOLS)]
    assert items[:-1] == [
        ToolCallDelta(0, "calculator", ""),
        ToolCallDelta(0, "", '{"expression"'),
        ToolCallDelta(0, "", ': "6*7"}'),
    ]
    reply = items[-1]
    assert isinstance(reply, ModelReply)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("calculator", {"expression": "6*7"})
    ]


async def test_a_stream_refused_before_it_starts_is_retried_as_a_call(
    server: ChatServer, make_streaming_model: Any
) -> None:
    server.script = [
        Reply(503, {"error": {"message": "busy"}}),
        sse(
            [
                chunk({"content": "ok"}),
                chunk({}, {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}),
            ]
        ),
    ]
    model = make_streaming_model()
    items = [item async for item in model.stream("", USER_HELLO, [])]
    assert items[0] == TextDelta("ok")
    assert isinstance(items[-1], ModelReply) and items[-1].text == "ok"
    assert len(server.requests) == 2


def test_build_agent_streams_unless_told_not_to(
    server: ChatServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_OPENAI_BASE_URL", server.base_url)
    monkeypatch.setenv("BATON_OPENAI_MODEL", "m")
    assert isinstance(build_agent("dep-1").model, OpenAIStreamingChatModel)
    monkeypatch.setenv("BATON_OPENAI_STREAM", "0")
    model = build_agent("dep-1").model
    assert isinstance(model, OpenAIChatModel) and not hasattr(model, "stream")


async def test_a_stream_that_breaks_midway_is_a_safe_model_error(
    server: ChatServer, make_streaming_model: Any
) -> None:
    """After the first chunk nothing is retried: the step fails, saying only
    what failed (no endpoint, no upstream text)."""
    body = f"data: {json.dumps(chunk({'content': 'half'}))}\n\ndata: {{not json secret-9\n\n"
    server.script = [Reply(body=body.encode(), content_type="text/event-stream")]
    model = make_streaming_model()
    got: list[Any] = []
    with pytest.raises(ModelError) as failed:
        async for item in model.stream("", USER_HELLO, []):
            got.append(item)
    assert got == [TextDelta("half")]
    assert str(failed.value).startswith("model stream failed")
    assert "secret-9" not in str(failed.value) and server.base_url not in str(failed.value)
    assert len(server.requests) == 1
