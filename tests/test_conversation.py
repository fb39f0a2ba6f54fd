"""One conversation end to end through ingress, with a tool call."""

from __future__ import annotations

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from tests.stack import Stack

K = s.EventKind


def kinds(events: list[s.Event]) -> list[str]:
    return [K.Name(e.kind).removeprefix("EVENT_KIND_") for e in events]


async def test_conversation_with_tool_call(stack: Stack) -> None:
    session_id = await stack.create()
    first = await stack.send(session_id, "hello")
    second = await stack.send(session_id, "calc 6*7")
    assert (first.receipt.seq, second.receipt.seq) == (0, 1)
    assert first.accepted_deployment_id == stack.deployment_id

    events = await stack.events(session_id, until=2)
    assert [e.seq for e in events] == list(range(len(events)))
    assert kinds(events) == [
        "SESSION_STARTED",
        "TURN_STARTED",
        "MESSAGE_RECEIVED",
        "STEP_STARTED",
        "MESSAGE_COMPLETED",
        "STEP_COMPLETED",
        "TURN_COMPLETED",
        "SESSION_WAITING",
        "TURN_STARTED",
        "MESSAGE_RECEIVED",
        "STEP_STARTED",
        "TOOL_CALL_REQUESTED",
        "TOOL_CALL_RESULT",
        "STEP_COMPLETED",
        "STEP_STARTED",
        "MESSAGE_COMPLETED",
        "STEP_COMPLETED",
        "TURN_COMPLETED",
        "SESSION_WAITING",
    ]
    answers = [e.text for e in events if e.kind == s.EVENT_KIND_MESSAGE_COMPLETED]
    assert answers == ["echo: hello", "The result is 42."]
    tool_result = next(e for e in events if e.kind == s.EVENT_KIND_TOOL_CALL_RESULT)
    assert tool_result.tool_result.output == "42"
    assert {e.deployment_id for e in events} == {stack.deployment_id}
    received = [e for e in events if e.kind == s.EVENT_KIND_MESSAGE_RECEIVED]
    assert [e.inbox_seq for e in received] == [0, 1]
    assert [e.delivery_id for e in received] == [first.delivery_id, second.delivery_id]

    # Resuming from a cursor gives exactly the rest.
    cursor = 8
    rest = await stack.events(session_id, start_seq=cursor, follow=False)
    assert [e.SerializeToString() for e in rest] == [e.SerializeToString() for e in events[cursor:]]
