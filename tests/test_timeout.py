"""The session timeout is stamped with the arming owner run: a timeout command
stamped by any other run (a predecessor's timer) is ignored."""

from __future__ import annotations

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from tests.stack import Stack


async def test_a_predecessors_timeout_is_ignored(stack: Stack) -> None:
    session_id = await stack.create(timeout_seconds=3600)
    hooks = stack.hooks_client()
    try:
        stale = s.Command(
            delivery=s.DeliveryMetadata(delivery_id="timeout-run_predecessor"),
            timeout=s.TimeoutCommand(armed_by_owner_run_id="run_predecessor"),
        )
        receipt = await hooks.append(ids.inbox_token(session_id), stale)
        assert receipt.seq == 0
    finally:
        await hooks.close()
    reply = await stack.send(session_id, "still here")
    assert reply.receipt.seq == 1
    events = await stack.events(session_id, until=1)
    kinds = [e.kind for e in events]
    assert s.EVENT_KIND_SESSION_COMPLETED not in kinds
    answers = [e.text for e in events if e.kind == s.EVENT_KIND_MESSAGE_COMPLETED]
    assert answers == ["echo: still here"]
    received = [e.inbox_seq for e in events if e.kind == s.EVENT_KIND_MESSAGE_RECEIVED]
    assert received == [1]  # seq 0 (the stale timeout) was consumed without effect
