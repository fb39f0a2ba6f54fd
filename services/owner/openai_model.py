"""A model adapter for an OpenAI-compatible chat-completions endpoint.

`OpenAIChatModel` implements `services.owner.agent.ModelAdapter` by sending the
session history to `{base_url}/chat/completions` with the official `openai`
client (its 3.x line, on httpx2). Every request has a timeout; 429, 5xx,
connection errors and timeouts are retried here with exponential backoff (a
`Retry-After` header is honoured, capped), and the client's own retries are
off (`max_retries=0`) so that the two never stack; any other failure raises
`ModelError` at once. The reply is read from the raw response, so that a
reply the client's types would refuse still gets this module's safe,
specific summary.

An owner selects it with `BATON_AGENT=services.owner.openai_model:build_agent`
and configures it from the environment (see `build_agent`).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import openai
import structlog

from baton.session.v1 import session_pb2 as s
from services.common import tracing
from services.owner.agent import Agent, ModelRejected, ModelReply, RequestedCall, Tool
from services.owner.fixture import TOOLS

log = structlog.get_logger("baton.owner.openai_model")

BODY_EXCERPT_CHARS = 500

ENV_BASE_URL = "BATON_OPENAI_BASE_URL"
ENV_MODEL = "BATON_OPENAI_MODEL"
ENV_API_KEY = "BATON_OPENAI_API_KEY"
ENV_TIMEOUT = "BATON_OPENAI_TIMEOUT"
ENV_PRICE_INPUT = "BATON_OPENAI_PRICE_INPUT_MICROS_PER_1K"
ENV_PRICE_OUTPUT = "BATON_OPENAI_PRICE_OUTPUT_MICROS_PER_1K"

DEFAULT_INSTRUCTIONS = (
    "You are a helpful assistant running on Baton. Use the provided tools when they help, "
    "and answer plainly once you have what you need."
)


class ModelError(Exception):
    """A model call that failed: an HTTP error, a transport failure, or a bad reply.

    Its message is a safe summary (what failed, an HTTP status, how many
    attempts): the session publishes it in `turn.failed`. The endpoint URL,
    transport error text and anything the upstream returned stay out of it;
    they are logged where the error is raised (`detail`) and kept here for
    the caller: `status` is the HTTP status when the server answered (None
    otherwise), `body` an excerpt of its answer, `attempts` how many requests
    were made.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        body: str = "",
        attempts: int = 1,
        detail: str = "",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.attempts = attempts
        self.detail = detail
        if detail or body:
            log.warning("model call failed", error=message, detail=detail, body=body)


class ModelTimeout(ModelError):
    """Every attempt timed out."""


class ModelRequestRejected(ModelError, ModelRejected):
    """The endpoint refused the request itself (HTTP 4xx other than 429):
    retrying the same request cannot help, so the turn fails at once."""


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
        messages: list[dict[str, Any]] = []
        if instructions:
            messages.append({"role": "system", "content": instructions})
        messages.extend(_message(m) for m in history)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters,
                    },
                }
                for t in tools
            ]
        return body

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
        headers: dict[str, Any] = {} if self._api_key else {"Authorization": openai.Omit()}
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            retry_after: float | None = None
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    **payload, extra_headers=headers, timeout=self.timeout
                )
            except openai.APITimeoutError as exc:
                if attempt == attempts:
                    raise ModelTimeout(
                        f"model request timed out after {self.timeout}s "
                        f"({attempts} attempt{'s' if attempts != 1 else ''})",
                        attempts=attempt,
                        detail=f"POST {self.url}",
                    ) from exc
                reason = "timeout"
            except openai.APIConnectionError as exc:
                failure = type(exc.__cause__ or exc).__name__
                if attempt == attempts:
                    raise ModelError(
                        f"model request failed after {attempts} "
                        f"attempt{'s' if attempts != 1 else ''}: {failure}",
                        attempts=attempt,
                        detail=f"POST {self.url}: {failure}: {exc.__cause__ or exc}",
                    ) from exc
                reason = f"transport error ({failure})"
            except openai.APIStatusError as exc:
                status = exc.status_code
                retryable = status == 429 or status >= 500
                if not retryable or attempt == attempts:
                    tried = f" after {attempt} attempts" if attempt > 1 else ""
                    error = ModelError if retryable else ModelRequestRejected
                    raise error(
                        f"model endpoint returned HTTP {status}{tried}",
                        status=status,
                        body=_excerpt(exc.response.text),
                        attempts=attempt,
                        detail=f"POST {self.url}",
                    ) from exc
                reason = f"HTTP {status}"
                retry_after = _retry_after(exc.response.headers)
            else:
                try:
                    return json.loads(raw.http_response.text)
                except ValueError as exc:
                    raise ModelError(
                        f"model endpoint returned invalid JSON (HTTP {raw.status_code})",
                        status=raw.status_code,
                        body=_excerpt(raw.http_response.text),
                        attempts=attempt,
                    ) from exc
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

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """Backoff before attempt `attempt + 1`: Retry-After if given, else exponential."""
        if retry_after is not None:
            return min(retry_after, self.max_backoff)
        backoff: float = self.backoff_base * 2.0 ** (attempt - 1)
        return min(backoff, self.max_backoff)

    # -- reply --------------------------------------------------------------

    def parse_reply(self, data: Any) -> ModelReply:
        if not isinstance(data, Mapping):
            raise ModelError("model reply is not a JSON object", body=_excerpt(json.dumps(data)))
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            raise ModelError("model reply has no choices", body=_excerpt(json.dumps(data)))
        message = choices[0].get("message")
        if not isinstance(message, Mapping):
            raise ModelError("model reply choice has no message", body=_excerpt(json.dumps(data)))
        content = message.get("content")
        text = content if isinstance(content, str) else ""
        calls = [_requested_call(raw) for raw in message.get("tool_calls") or ()]
        usage = data.get("usage")
        usage = usage if isinstance(usage, Mapping) else {}
        input_tokens = _int(usage.get("prompt_tokens"))
        output_tokens = _int(usage.get("completion_tokens"))
        return ModelReply(
            text=text,
            tool_calls=tuple(calls),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cost_micros=self.cost_micros(input_tokens, output_tokens),
        )

    def cost_micros(self, input_tokens: int, output_tokens: int) -> int:
        """Cost in micro-units, rounded half up to a whole micro."""
        total = (
            input_tokens * self.price_input_micros_per_1k
            + output_tokens * self.price_output_micros_per_1k
        )
        return (total + 500) // 1000


_ROLES = {
    s.ROLE_USER: "user",
    s.ROLE_ASSISTANT: "assistant",
    s.ROLE_TOOL: "tool",
    s.ROLE_SYSTEM: "system",
}


def _message(m: s.ChatMessage) -> dict[str, Any]:
    role = _ROLES.get(m.role)
    if role is None:
        raise ValueError(f"chat message has unsupported role {m.role}")
    if role == "tool":
        return {"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content}
    if role == "assistant" and m.tool_calls:
        return {
            "role": "assistant",
            "content": m.content or None,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_json or "{}"},
                }
                for c in m.tool_calls
            ],
        }
    return {"role": role, "content": m.content}


def _requested_call(raw: Any) -> RequestedCall:
    function = raw.get("function") if isinstance(raw, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ModelError("model returned a malformed tool call", body=_excerpt(json.dumps(raw)))
    name = function["name"]
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        parsed: Any = {}
    elif isinstance(arguments, Mapping):
        parsed = dict(arguments)
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError as exc:
            raise ModelError(
                f"model returned invalid JSON arguments for tool {_tool_name(name)}",
                body=f"{exc}: {_excerpt(arguments)}",
            ) from exc
    else:
        parsed = arguments
    if not isinstance(parsed, dict):
        raise ModelError(
            f"model returned arguments for tool {_tool_name(name)} that are not a JSON object",
            body=_excerpt(json.dumps(parsed)),
        )
    return RequestedCall(name, parsed)


def _tool_name(name: str) -> str:
    """A tool name as the public summary may quote it (the model chose it)."""
    return repr(name[:64])


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


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _excerpt(text: str) -> str:
    text = text.strip()
    if len(text) <= BODY_EXCERPT_CHARS:
        return text
    return text[:BODY_EXCERPT_CHARS] + "…"


# -- agent factory -----------------------------------------------------------


def _required_env(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise RuntimeError(
            f"{name} is required for services.owner.openai_model:build_agent "
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
    BATON_OPENAI_PRICE_INPUT_MICROS_PER_1K / _OUTPUT_ (optional).
    """
    model = OpenAIChatModel(
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
