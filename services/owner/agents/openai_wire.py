"""The chat-completions wire format of the OpenAI adapter (openai_model.py):
the request body built from a session's history and tools, the reply read
back into a `ModelReply`, and the errors a call ends in, whose messages are
safe to publish. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.agents.api import ModelRejected, ModelReply, RequestedCall, Tool

log = structlog.get_logger("baton.owner.openai_model")

BODY_EXCERPT_CHARS = 500


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


def request_body(
    model: str, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
) -> dict[str, Any]:
    """The chat-completions request: the instructions as the system message,
    the history, the tools as functions."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(_message(m) for m in history)
    body: dict[str, Any] = {"model": model, "messages": messages}
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


def read_reply(data: Any) -> ModelReply:
    """A chat-completions answer as a `ModelReply` (its cost is the
    adapter's: 0 here); ModelError with a safe summary when it is malformed."""
    if not isinstance(data, Mapping):
        raise ModelError("model reply is not a JSON object", body=excerpt(json.dumps(data)))
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise ModelError("model reply has no choices", body=excerpt(json.dumps(data)))
    message = choices[0].get("message")
    if not isinstance(message, Mapping):
        raise ModelError("model reply choice has no message", body=excerpt(json.dumps(data)))
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
    )


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
        raise ModelError("model returned a malformed tool call", body=excerpt(json.dumps(raw)))
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
                body=f"{exc}: {excerpt(arguments)}",
            ) from exc
    else:
        parsed = arguments
    if not isinstance(parsed, dict):
        raise ModelError(
            f"model returned arguments for tool {_tool_name(name)} that are not a JSON object",
            body=excerpt(json.dumps(parsed)),
        )
    return RequestedCall(name, parsed)


def _tool_name(name: str) -> str:
    """A tool name as the public summary may quote it (the model chose it)."""
    return repr(name[:64])


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def excerpt(text: str) -> str:
    text = text.strip()
    if len(text) <= BODY_EXCERPT_CHARS:
        return text
    return text[:BODY_EXCERPT_CHARS] + "…"


# -- agent factory -----------------------------------------------------------
