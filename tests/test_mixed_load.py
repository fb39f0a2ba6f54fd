"""Concurrent senders with steering and cancels mixed in: every accepted
command is consumed exactly once, in inbox order, and the stream stays gapless."""

from __future__ import annotations

import asyncio

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from tests.stack import SLACK, Stack

SENDERS = 4
PER_SENDER = 6


async def test_concurrent_steering_and_cancels_consume_every_command_once(stack: Stack) -> None:
    session_id = await stack.create()
    kinds: dict[int, str] = {}

    async def sender(n: int) -> None:
        for i in range(PER_SENDER):
            if i % 3 == 2:
                response = await stack.ingress_stub.SendControl(
                    ingress_pb.SendControlRequest(
                        session_id=session_id, kind=ingress_pb.CONTROL_KIND_CANCEL
                    ),
                    metadata=SLACK,
                    timeout=10,
                )
                kinds[response.receipt.seq] = "cancel"
            else:
                text = "wait 30" if i % 3 == 0 else f"s{n}-m{i}"
                reply = await stack.send(session_id, text, caller=f"user{n}")
                kinds[reply.receipt.seq] = "send"

    await asyncio.gather(*(sender(n) for n in range(SENDERS)))
    total = SENDERS * PER_SENDER
    assert sorted(kinds) == list(range(total))
    # A final marker message; once it is answered everything before was consumed.
    last = await stack.send(session_id, "final marker")
    assert last.receipt.seq == total

    async def settled() -> list[s.Event]:
        while True:
            events = await stack.events(session_id, follow=False)
            if any(e.text == "echo: final marker" for e in events) and (
                events[-1].kind == s.EVENT_KIND_SESSION_WAITING
            ):
                return events
            await asyncio.sleep(0.05)

    events = await asyncio.wait_for(settled(), 60)
    assert [e.seq for e in events] == list(range(len(events)))
    # Each send is admitted exactly once; each cancel is consumed exactly once,
    # either cancelling a turn or rejected as having nothing to cancel.
    admitted = [e.inbox_seq for e in events if e.kind == s.EVENT_KIND_MESSAGE_RECEIVED]
    cancels = [
        e.inbox_seq
        for e in events
        if e.kind == s.EVENT_KIND_TURN_CANCELLED
        or (e.kind == s.EVENT_KIND_COMMAND_REJECTED and e.error.reason == "NOTHING_TO_CANCEL")
    ]
    sends = sorted(seq for seq, kind in kinds.items() if kind == "send") + [total]
    assert admitted == sends, "sends not admitted exactly once in inbox order"
    assert sorted(cancels) == sorted(seq for seq, kind in kinds.items() if kind == "cancel")
    assert len(set(cancels)) == len(cancels)
    # Consumption order is inbox order across both kinds.
    consumed = [
        e.inbox_seq
        for e in events
        if e.kind == s.EVENT_KIND_MESSAGE_RECEIVED
        or e.inbox_seq in set(cancels)
        and (e.kind in (s.EVENT_KIND_TURN_CANCELLED, s.EVENT_KIND_COMMAND_REJECTED))
    ]
    assert consumed == sorted(consumed)
    # No tool call or step is committed twice, and every turn settles once.
    started = [e.turn_id for e in events if e.kind == s.EVENT_KIND_TURN_STARTED]
    settled_turns = [
        e.turn_id
        for e in events
        if e.kind
        in (s.EVENT_KIND_TURN_COMPLETED, s.EVENT_KIND_TURN_CANCELLED, s.EVENT_KIND_TURN_FAILED)
    ]
    assert len(started) == len(set(started))
    assert sorted(settled_turns) == sorted(started)
