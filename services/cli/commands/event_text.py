"""How a session event reads on a terminal: one line per event (seq, kind,
and what it carries), as `baton demo` and `baton sessions events` print it."""

from __future__ import annotations

import json

from baton_runtime._proto.baton.session.v1 import session_pb2 as s


def kind_name(kind: s.EventKind.ValueType) -> str:
    """EVENT_KIND_TOOL_CALL_REQUESTED -> "tool_call.requested"."""
    try:
        name = s.EventKind.Name(kind).removeprefix("EVENT_KIND_").lower()
    except ValueError:
        return f"kind.{kind}"
    if kind == s.EVENT_KIND_SESSION_HANDED_OFF:
        return "session.handed_off"
    subject, _, verb = name.rpartition("_")
    return f"{subject}.{verb}" if subject else verb


_INPUT_KINDS = {
    s.INPUT_KIND_QUESTION: "question",
    s.INPUT_KIND_APPROVAL: "approval",
    s.INPUT_KIND_SESSION_LIMIT: "limit",
}


def _input_request(request: s.InputRequest) -> list[str]:
    """What a person answers (`baton sessions answer SESSION REQUEST`): the
    request's kind and id, its prompt, and the call an approval is for."""
    details = [f"{_INPUT_KINDS.get(request.kind, 'input')} {request.request_id}"]
    if request.prompt:
        details.append(json.dumps(request.prompt, ensure_ascii=False))
    if request.HasField("tool_call"):
        call = request.tool_call
        details.append(f"for {call.name}({call.arguments_json})")
    return details


def format_event(event: s.Event) -> str:
    """One readable line: seq, kind, and what the event carries."""
    details: list[str] = []
    if event.HasField("input_request"):
        details += _input_request(event.input_request)
    if event.attempt_id:
        details.append(f"attempt {event.attempt_id}")
    if event.HasField("tool_call") and not event.HasField("input_request"):
        call = event.tool_call
        details.append(f"{call.name}({call.arguments_json})")
    if event.HasField("tool_result"):
        result = event.tool_result
        marker = " (error)" if result.is_error else ""
        details.append(f"{result.name} -> {result.output}{marker}")
    if event.child_session_id:
        details.append(f"{event.task.name or 'child'} {event.child_session_id}")
    if event.kind == s.EVENT_KIND_SESSION_HANDED_OFF:
        details.append(f"from {event.text or '?'} to {event.deployment_id or '?'}")
    elif event.text:
        details.append(json.dumps(event.text, ensure_ascii=False))
    if event.HasField("usage"):
        usage = event.usage
        details.append(f"tokens in={usage.input_tokens} out={usage.output_tokens}")
    if event.HasField("error"):
        details.append(f"error {event.error.reason}: {event.error.message}")
    if event.kind == s.EVENT_KIND_SESSION_STARTED and event.deployment_id:
        details.append(f"deployment={event.deployment_id}")
    return f"#{event.seq:<3} {kind_name(event.kind):<22} {' '.join(details)}".rstrip()
