"""Live items in the client SDK (docs/design.md "Live items", docs/sdk.md
"Streaming an answer"): `LiveView` assembles a step's text and drops it
when the step commits or a newer run voids it; a follower asked for live
items passes them among the events, asks again for them when it resumes,
and never yields a step's items after that step's commit. The last test
streams an answer from the fixture agent through a real stack.

The follower's side alone runs through grpcio-testing (the harness of
tests/test_sdk_errors.py); the real stack checks the whole path."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import baton_client
import grpc
from baton_client import Event, LiveBatch, LiveView
from baton_client._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_client._proto.baton.session.v1 import session_pb2 as s

from tests.stack import Stack
from tests.test_sdk import sdk
from tests.test_sdk_errors import Harness, events

L = baton_client.LiveKind


def step(base_seq: int = 5, *, epoch: int = 1, attempt: int = 1, run: str = "run-1") -> s.LiveStep:
    return s.LiveStep(
        session_id="ses_x",
        base_seq=base_seq,
        turn_id="turn-1",
        step=1,
        owner_run_id=run,
        epoch=epoch,
        attempt=attempt,
    )


def texts(run: s.LiveStep, first: int, *parts: str) -> LiveBatch:
    """Text items of `run` from offset `first`."""
    items = [
        s.LiveItem(offset=first + i, kind=L.LIVE_KIND_TEXT, text=part)
        for i, part in enumerate(parts)
    ]
    return LiveBatch(step=run, items=items)


def started(run: s.LiveStep) -> LiveBatch:
    return LiveBatch(
        step=run,
        items=[
            s.LiveItem(offset=0, kind=L.LIVE_KIND_TURN_STARTED, text="hello"),
            s.LiveItem(offset=1, kind=L.LIVE_KIND_STEP_STARTED),
        ],
    )


def event(seq: int) -> Event:
    return Event(session_id="ses_x", seq=seq, kind=s.EVENT_KIND_MESSAGE_COMPLETED)


# -- LiveView -----------------------------------------------------------------------


def test_a_view_assembles_the_text_and_the_commit_supersedes_it() -> None:
    view = LiveView(next_seq=5)
    run = step(5)
    view.update(started(run))
    assert view.current is not None and view.text == ""
    assert view.current.turn_text == "hello"
    view.update(texts(run, 2, "The ", "answer"))
    view.update(texts(run, 4, " is 42."))
    assert view.text == "The answer is 42." and view.current.complete
    update = view.update(event(4))  # below the step's base_seq: not its commit
    assert update.superseded == [] and view.text == "The answer is 42."
    update = view.update(event(5))
    assert [d.text for d in update.superseded] == ["The answer is 42."]
    assert view.current is None and view.text == "" and view.next_seq == 6
    # A late batch of the committed step is stale: ignored.
    assert view.update(texts(run, 5, "late")).draft is None and view.drafts == []


def test_a_view_skips_replayed_items_and_counts_what_was_dropped() -> None:
    view = LiveView()
    run = step(0)
    view.update(texts(run, 0, "a", "b"))
    view.update(texts(run, 0, "a", "b", "c"))  # a reconnect replays the buffered items
    assert view.text == "abc" and view.current is not None and view.current.complete
    marker = s.LiveItem(offset=3, kind=L.LIVE_KIND_DROPPED, dropped=4)
    view.update(LiveBatch(step=run, items=[marker]))
    view.update(texts(run, 7, "h"))
    view.update(texts(run, 10, "k"))  # offsets 8 and 9 missing, unannounced
    draft = view.current
    assert draft is not None
    assert (draft.text, draft.dropped, draft.complete) == ("abchk", 6, False)


def test_a_successor_run_or_a_new_attempt_voids_the_earlier_items() -> None:
    view = LiveView()
    first = step(5, epoch=1)
    view.update(texts(first, 0, "half an ans"))
    successor = step(5, epoch=2, run="run-2")  # the owner was killed mid-step
    update = view.update(texts(successor, 0, "A whole "))
    assert [d.text for d in update.voided] == ["half an ans"]
    assert view.text == "A whole " and len(view.drafts) == 1
    # The killed run's last batch, arriving late, is void too.
    assert view.update(texts(first, 1, "wer")).draft is None
    assert view.text == "A whole "
    # The same run starting the step again (a higher attempt).
    again = step(5, epoch=2, run="run-2", attempt=2)
    update = view.update(texts(again, 0, "Again"))
    assert [d.text for d in update.voided] == ["A whole "] and view.text == "Again"
    # A run of a lower epoch at a later base_seq is not voided by a higher one
    # that started earlier (it cannot happen, but the rule is by base_seq).
    assert not baton_client.live.voids(step(5, epoch=3), step(4, epoch=1))


def test_a_view_keeps_tool_calls_and_progress() -> None:
    view = LiveView()
    run = step(0)
    items = [
        s.LiveItem(offset=0, kind=L.LIVE_KIND_TOOL_CALL, tool_call_index=0, text='{"a"'),
        s.LiveItem(
            offset=1,
            kind=L.LIVE_KIND_TOOL_CALL,
            tool_call_index=0,
            tool_call_id="call-1",
            tool_name="calculator",
            text=': "6*7"}',
        ),
        s.LiveItem(offset=2, kind=L.LIVE_KIND_TOOL_PROGRESS, tool_call_id="call-1", text="1/3"),
        s.LiveItem(offset=3, kind=L.LIVE_KIND_TOOL_PROGRESS, tool_call_id="call-1", text="2/3"),
    ]
    view.update(LiveBatch(step=run, items=items))
    draft = view.current
    assert draft is not None and draft.text == ""
    call = draft.tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call-1", "calculator", '{"a": "6*7"}')
    assert draft.progress == {"call-1": "2/3"}


# -- the follower (grpcio-testing) ----------------------------------------------------


def live(batch: LiveBatch) -> pb.StreamEventsResponse:
    return pb.StreamEventsResponse(live=batch)


class Taken:
    """What a follower yielded, read in the harness's thread, so the test
    can wait until the client took what was sent (grpc_testing ends a call
    at once, not after the responses before the end were read)."""

    def __init__(self, harness: Harness, follower: Any) -> None:
        self.items: list[Any] = []
        self._changed = threading.Condition()
        self._follower = follower
        self.future = harness.run(self._read)

    def _read(self) -> list[Any]:
        for item in self._follower:
            with self._changed:
                self.items.append(item)
                self._changed.notify_all()
        return self.items

    def wait_for(self, count: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.items) >= count, timeout=10), self.items


def test_a_live_follower_asks_again_on_resume_and_drops_committed_steps() -> None:
    harness = Harness()
    try:
        follower = harness.client.follow("ses_x", start_seq=4, live=True)
        taken = Taken(harness, follower)
        _, request, rpc = harness.take_stream()
        assert (request.start_seq, request.follow, request.live) == (4, True, True)
        run = step(5)
        rpc.send_response(events(4))
        rpc.send_response(live(texts(run, 0, "par")))
        taken.wait_for(2)
        rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "connection reset")
        _, request, rpc = harness.take_stream()
        assert (request.start_seq, request.live) == (5, True)
        rpc.send_response(live(texts(run, 0, "par", "tial")))  # the buffer again
        rpc.send_response(events(5, 6))
        rpc.send_response(live(texts(run, 2, "late")))  # below the cursor now: not yielded
        rpc.send_response(events(7, last=True))
        taken.wait_for(6)
        rpc.terminate((), grpc.StatusCode.OK, "")
        got = taken.future.result(timeout=10)
        shown = [("event", x.seq) if isinstance(x, Event) else ("live", len(x.items)) for x in got]
        assert shown == [
            ("event", 4),
            ("live", 1),
            ("live", 2),
            ("event", 5),
            ("event", 6),
            ("event", 7),
        ]
        view = LiveView()
        texts_seen = []
        for item in got:
            view.update(item)
            texts_seen.append(view.text)
        assert texts_seen == ["", "par", "partial", "", "", ""]
    finally:
        harness.close()


def test_a_follower_that_did_not_ask_for_live_items_does_not_ask() -> None:
    harness = Harness()
    try:
        taken = Taken(harness, harness.client.follow("ses_x"))
        _, request, rpc = harness.take_stream()
        assert request.live is False
        rpc.send_response(events(0, last=True))
        taken.wait_for(1)
        rpc.terminate((), grpc.StatusCode.OK, "")
        assert [e.seq for e in taken.future.result(timeout=10)] == [0]
    finally:
        harness.close()


# -- a real stack ---------------------------------------------------------------------


async def test_an_answer_streams_through_the_async_client(stack: Stack) -> None:
    """The fixture model writes its answer as 60 deltas over 1.5 s: the
    follower sees the text grow (each view a prefix of the next) before the
    commit, the commit supersedes the draft, and the committed answer is
    the text it grew into."""
    answer = "".join(f"{i}," for i in range(60))
    async with sdk(stack) as client:
        sid = (await client.create_session()).session_id
        view = LiveView()
        grown: list[str] = []
        committed: list[Event] = []
        superseded: list[str] = []
        follower = client.follow(sid, live=True)
        await client.send(sid, "stream 60 1500")
        async with asyncio.timeout(60):
            async for item in follower:
                update = view.update(item)
                superseded += [d.text for d in update.superseded]
                if isinstance(item, Event):
                    committed.append(item)
                    if item.kind == s.EVENT_KIND_SESSION_WAITING:
                        break
                elif view.text and (not grown or grown[-1] != view.text):
                    grown.append(view.text)
        await follower.aclose()
    [message] = [e for e in committed if e.kind == s.EVENT_KIND_MESSAGE_COMPLETED]
    assert message.text == answer
    assert len(grown) >= 2, grown  # it grew while the step ran
    assert all(b.startswith(a) for a, b in zip(grown, grown[1:], strict=False)), grown
    # Grown to the answer, or nearly: the last batch may race the commit,
    # which then stands for it.
    assert answer.startswith(grown[-1]) and len(grown[-1]) > len(answer) // 2, grown[-1]
    [last] = [t for t in superseded if t]
    assert answer.startswith(last) and view.drafts == []
