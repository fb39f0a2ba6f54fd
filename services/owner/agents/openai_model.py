"""A model adapter for an OpenAI-compatible chat-completions endpoint.

`OpenAIChatModel` implements `baton_runtime.owner.agents.api.ModelAdapter` by sending the
session history to `{base_url}/chat/completions` with the official `openai`
client (its 3.x line, on httpx2). Every request has a timeout; 429, 5xx,
connection errors and timeouts are retried here with exponential backoff (a
`Retry-After` header is honoured, capped), and the client's own retries are
off (`max_retries=0`) so that the two never stack; any other failure raises
`ModelError` at once. The reply is read from the raw response, so that a
reply the client's types would refuse still gets a safe, specific summary
(the wire format and the errors are in openai_wire.py).

An owner selects it with `BATON_AGENT=baton_runtime.owner.agents.openai_model:build_agent`
and configures it from the environment (see `build_agent`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import openai
import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import retry
from baton_runtime.common.observability import tracing
from baton_runtime.owner.agents import openai_wire as wire
from baton_runtime.owner.agents.api import (
    Agent,
    ModelDelta,
    ModelReply,
    TextDelta,
    Tool,
    ToolCallDelta,
)
from baton_runtime.owner.agents.fixture_tools import TOOLS
from baton_runtime.owner.agents.openai_wire import ModelError, ModelRequestRejected, ModelTimeout

log = structlog.get_logger("baton.owner.openai_model")
_T = TypeVar("_T")

ENV_BASE_URL = "BATON_OPENAI_BASE_URL"
ENV_MODEL = "BATON_OPENAI_MODEL"
ENV_API_KEY = "BATON_OPENAI_API_KEY"
ENV_TIMEOUT = "BATON_OPENAI_TIMEOUT"
ENV_PRICE_INPUT = "BATON_OPENAI_PRICE_INPUT_MICROS_PER_1K"
ENV_PRICE_OUTPUT = "BATON_OPENAI_PRICE_OUTPUT_MICROS_PER_1K"
ENV_STREAM = "BATON_OPENAI_STREAM"

DEFAULT_INSTRUCTIONS = (
    "You are a helpful assistant running on Baton. Use the provided tools when they help, "
    "and answer plainly once you have what you need."
)


def _retry_policy(backoff_base: float, max_backoff: float) -> retry.RetryPolicy | None:
    """The waits between attempts, as a policy of common/retry.py built from
    this endpoint's settings (an authored agent's, so not a row of its
    table). No jitter: the waits are the configured ones. None: a zero base
    or cap, retry at once."""
    if backoff_base <= 0 or max_backoff <= 0:
        return None
    first = min(backoff_base, max_backoff)
    return retry.RetryPolicy("model", first=first, cap=max_backoff, jitter=0.0)


class OpenAIChatModel:
    """A `ModelAdapter` for an OpenAI-compatible `/chat/completions` endpoint."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 30.0,
        max_retries: int = 3,
        backoff_base: float = 0.5,
        price_input_micros_per_1k: int = 0,
        price_output_micros_per_1k: int = 0,
        client: openai.AsyncOpenAI | None = None,
        *,
        max_backoff: float = 30.0,
    ) -> None:
        if not base_url:
            raise ValueError("base_url is required")
        if not model:
            raise ValueError("model is required")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if backoff_base < 0 or max_backoff < 0:
            raise ValueError("backoff_base and max_backoff must be >= 0")
        if price_input_micros_per_1k < 0 or price_output_micros_per_1k < 0:
            raise ValueError("prices must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.model = model
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.max_backoff = max_backoff
        self._retry = _retry_policy(backoff_base, max_backoff)
        self.price_input_micros_per_1k = price_input_micros_per_1k
        self.price_output_micros_per_1k = price_output_micros_per_1k
        self._api_key = api_key
        # An injected client belongs to the caller; one made here is made lazily
        # (inside the running event loop) and closed by `aclose`.
        self._client = client
        self._owns_client = client is None

    def __repr__(self) -> str:  # never show the API key
        return f"OpenAIChatModel(url={self.url!r}, model={self.model!r})"

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def complete(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> ModelReply:
        payload = self.request_body(instructions, history, tools)
        data = await self._post(payload)
        reply = self.parse_reply(data)
        attributes: dict[str, str | int | bool] = {
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": self.model,
            "gen_ai.usage.input_tokens": reply.input_tokens,
            "gen_ai.usage.output_tokens": reply.output_tokens,
        }
        tracing.annotate(**attributes)  # on the owner's `chat` span, while tracing is on
        return reply

    # -- request ------------------------------------------------------------

    def request_body(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> dict[str, Any]:
        return wire.request_body(self.model, instructions, history, tools)

    def _open(self) -> openai.AsyncOpenAI:
        if self._client is None:
            self._client = openai.AsyncOpenAI(
                base_url=self.base_url,
                # A keyless endpoint: the client wants a key, and each request
                # then omits the Authorization header (`_post`).
                api_key=self._api_key or "unused",
                timeout=self.timeout,
                max_retries=0,  # retried here, with Baton's backoff and caps
            )
        return self._client

    async def _post(self, payload: dict[str, Any]) -> Any:
        client = self._open()
        raw, attempt = await self._with_retries(
            lambda headers: client.chat.completions.with_raw_response.create(
                **payload, extra_headers=headers, timeout=self.timeout
            )
        )
        try:
            return json.loads(raw.http_response.text)
        except ValueError as exc:
            raise ModelError(
                f"model endpoint returned invalid JSON (HTTP {raw.status_code})",
                status=raw.status_code,
                body=wire.excerpt(raw.http_response.text),
                attempts=attempt,
            ) from exc

    async def _with_retries(
        self, send: Callable[[dict[str, Any]], Awaitable[_T]]
    ) -> tuple[_T, int]:
        """`send(headers)`'s answer and the attempt that got it: a failure
        retried as `_retry_or_raise` says, with `_delay` between attempts."""
        headers: dict[str, Any] = {} if self._api_key else {"Authorization": openai.Omit()}
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return await send(headers), attempt
            except openai.APIError as exc:
                reason, retry_after = self._retry_or_raise(exc, attempt, attempts)
            delay = self._delay(attempt, retry_after)
            log.warning(
                "model request failed; retrying",
                url=self.url,
                reason=reason,
                attempt=attempt,
                delay=round(delay, 3),
            )
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _retry_or_raise(
        self, exc: openai.APIError, attempt: int, attempts: int
    ) -> tuple[str, float | None]:
        """A failed attempt: why, to retry (with the server's Retry-After,
        if any), or the error to raise (the last attempt, or a status that
        no retry changes). Anything but a timeout, a transport error or an
        HTTP status is raised as it is."""
        plural = "s" if attempts != 1 else ""
        # (A timeout is a connection error too: checked first.)
        if isinstance(exc, openai.APITimeoutError):
            if attempt == attempts:
                raise ModelTimeout(
                    f"model request timed out after {self.timeout}s ({attempts} attempt{plural})",
                    attempts=attempt,
                    detail=f"POST {self.url}",
                ) from exc
            return "timeout", None
        if isinstance(exc, openai.APIConnectionError):
            failure = type(exc.__cause__ or exc).__name__
            if attempt == attempts:
                raise ModelError(
                    f"model request failed after {attempts} attempt{plural}: {failure}",
                    attempts=attempt,
                    detail=f"POST {self.url}: {failure}: {exc.__cause__ or exc}",
                ) from exc
            return f"transport error ({failure})", None
        if not isinstance(exc, openai.APIStatusError):
            raise exc
        status = exc.status_code
        retryable = status == 429 or status >= 500
        if not retryable or attempt == attempts:
            tried = f" after {attempt} attempts" if attempt > 1 else ""
            error = ModelError if retryable else ModelRequestRejected
            raise error(
                f"model endpoint returned HTTP {status}{tried}",
                status=status,
                body=wire.excerpt(exc.response.text),
                attempts=attempt,
                detail=f"POST {self.url}",
            ) from exc
        return f"HTTP {status}", _retry_after(exc.response.headers)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """Backoff before attempt `attempt + 1`: Retry-After if given, else
        the model's retry policy (exponential, no wait past the cap)."""
        if retry_after is not None:
            return min(retry_after, self.max_backoff)
        if self._retry is None:
            return 0.0  # a zero base or cap: retry at once
        return self._retry.delay(attempt)

    # -- reply --------------------------------------------------------------

    def parse_reply(self, data: Any) -> ModelReply:
        reply = wire.read_reply(data)
        cost = self.cost_micros(reply.input_tokens, reply.output_tokens)
        return dataclasses.replace(reply, cost_micros=cost)

    def cost_micros(self, input_tokens: int, output_tokens: int) -> int:
        """Cost in micro-units, rounded half up to a whole micro."""
        total = (
            input_tokens * self.price_input_micros_per_1k
            + output_tokens * self.price_output_micros_per_1k
        )
        return (total + 500) // 1000


class OpenAIStreamingChatModel(OpenAIChatModel):
    """`OpenAIChatModel` that also streams (`StreamingModelAdapter`): the
    official client's streaming completions (`stream=True`, with usage in
    the last chunk), each text and tool-call delta yielded as it arrives,
    then the reply, assembled from the chunks and read as `complete` reads
    one. A failure before the first chunk is retried as `complete`'s; one
    after it raises `ModelError` (the step fails, as a failed call does)."""

    async def stream(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> AsyncIterator[ModelDelta | ModelReply]:
        payload = self.request_body(instructions, history, tools)
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
        client = self._open()
        chunks, _ = await self._with_retries(
            lambda headers: client.chat.completions.create(
                **payload, extra_headers=headers, timeout=self.timeout
            )
        )
        text: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] | None = None
        try:
            async for chunk in chunks:
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump()
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.content:
                        text.append(delta.content)
                        yield TextDelta(delta.content)
                    for part in delta.tool_calls or ():
                        call = calls.setdefault(part.index, _empty_call())
                        name = part.function.name if part.function else None
                        arguments = part.function.arguments if part.function else None
                        call["id"] = part.id or call["id"]
                        call["function"]["name"] += name or ""
                        call["function"]["arguments"] += arguments or ""
                        yield ToolCallDelta(part.index, name or "", arguments or "")
        except Exception as exc:  # noqa: BLE001 - the client's or the transport's: told safely
            raise ModelError(
                f"model stream failed: {type(exc).__name__}",
                detail=f"POST {self.url}: {exc}",
            ) from exc
        finally:
            await chunks.close()
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        data: dict[str, Any] = {"choices": [{"index": 0, "message": message}]}
        if usage is not None:
            data["usage"] = usage
        reply = self.parse_reply(data)
        attributes: dict[str, str | int | bool] = {
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": self.model,
            "gen_ai.usage.input_tokens": reply.input_tokens,
            "gen_ai.usage.output_tokens": reply.output_tokens,
        }
        tracing.annotate(**attributes)
        yield reply


def _empty_call() -> dict[str, Any]:
    return {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Retry-After as seconds (delta-seconds or an HTTP date), if present and sensible."""
    value = headers.get("retry-after")
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


def _required_env(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise RuntimeError(
            f"{name} is required for baton_runtime.owner.agents.openai_model:build_agent "
            f"(set {ENV_BASE_URL} to the endpoint, e.g. https://api.example.com/v1, "
            f"and {ENV_MODEL} to the model name)"
        )
    return value


def _number_env(name: str, default: float, kind: type[int] | type[float]) -> Any:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise RuntimeError(f"{name} must be a {kind.__name__}, got {raw!r}") from None
    if value < 0 or (kind is float and value == 0):
        raise RuntimeError(f"{name} must be positive, got {raw!r}")
    return value


def build_agent(deployment_id: str) -> Agent:
    """An agent backed by an OpenAI-compatible endpoint, with the fixture's tools.

    Environment: BATON_OPENAI_BASE_URL and BATON_OPENAI_MODEL (required),
    BATON_OPENAI_API_KEY, BATON_OPENAI_TIMEOUT (seconds), and
    BATON_OPENAI_PRICE_INPUT_MICROS_PER_1K / _OUTPUT_ (optional), and
    BATON_OPENAI_STREAM (default 1: streaming completions, whose deltas reach
    followers as live items; 0: one answer per call).
    """
    streams = os.environ.get(ENV_STREAM, "1").strip() not in ("0", "false", "no")
    kind = OpenAIStreamingChatModel if streams else OpenAIChatModel
    model = kind(
        base_url=_required_env(ENV_BASE_URL),
        model=_required_env(ENV_MODEL),
        api_key=os.environ.get(ENV_API_KEY, "").strip() or None,
        timeout=_number_env(ENV_TIMEOUT, 30.0, float),
        price_input_micros_per_1k=_number_env(ENV_PRICE_INPUT, 0, int),
        price_output_micros_per_1k=_number_env(ENV_PRICE_OUTPUT, 0, int),
    )
    return Agent(
        name="openai",
        deployment_id=deployment_id,
        instructions=DEFAULT_INSTRUCTIONS,
        model=model,
        tools=TOOLS,
    )
