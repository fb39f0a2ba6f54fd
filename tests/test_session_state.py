"""One session state, composed (services/owner/rules/held.py), and the stamping of
a commit (services/owner/rules/stamping.py): pure, no etcd, no gRPC, no event
loop."""

from __future__ import annotations

import collections
import time

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import Reason
from baton_runtime.owner.agents.api import ModelReply, RequestedCall
from baton_runtime.owner.agents.fixture import build_agent
from baton_runtime.owner.rules import decisions, steps, turns
from baton_runtime.owner.rules.decisions import AnswerInputs, Commit, Finalize, NextStep, RunTurn
from baton_runtime.owner.rules.held import (
    LastCommit,
    RunIdentity,
    SessionState,
    make_event,
    timestamp,
)
from baton_runtime.owner.rules.stamping import stamp
from baton_runtime.owner.rules.steps import StepProgress
from baton_runtime.owner.run.snapshots import initial_snapshot

K = s.EventKind
SID = "ses_" + "a" * 26
IDENTITY = RunIdentity(s.Fence(session_id=SID, owner_run_id="run_1", epoch=1), "dep-a", "i1")


def held(now: float = 100.0) -> SessionState:
    snapshot = initial_snapshot(SID, "slack", "dep-a", [])
    return SessionState.hold(IDENTITY, snapshot, build_agent("dep-a"), now=now)


def send(seq: int, text: str = "hi", **fields: object) -> s.InboxEntry:
    delivery = s.DeliveryMetadata(delivery_id=f"d{seq}", channel="slack", caller="u1")
    command = s.Command(delivery=delivery, send=s.SendCommand(text=text, **fields))  # type: ignore[arg-type]
    return s.InboxEntry(seq=seq, command=command)


def times(events: list[s.Event]) -> list[float]:
    return [e.time.ToNanoseconds() / 1e9 for e in events]


# -- one state, composed ------------------------------------------------------------


def test_a_state_is_held_from_its_snapshot_and_its_parts_write_that_snapshot() -> None:
    snapshot = initial_snapshot(SID, "slack", "dep-a", [])
    snapshot.open_turn.turn_id = "turn_2"
    snapshot.next_event_seq, snapshot.inbox_next_seq = 9, 3
    snapshot.inbox_consumed_ahead.append(5)
    snapshot.parent.outbox.add(task_delivery_id="task:c:1")
    context = [s.ChatMessage(role=s.ROLE_USER, content="before")]
    st = SessionState.hold(IDENTITY, snapshot, build_agent("dep-a"), context, now=5.0)
    # What the last commit left is the snapshot's (a successor starts there).
    assert st.last_commit == LastCommit("turn_2", 9, {"task:c:1"})
    assert st.turn_id == "turn_2" and st.now == 5.0
    assert st.context.messages == context and not st.context.appended
    # The parts share the one snapshot: what they change is what commits.
    st.inbox.consume(send(3))
    assert (snapshot.inbox_next_seq, list(snapshot.inbox_consumed_ahead)) == (4, [5])
    assert st.inbox.consumed(5) and not st.inbox.consumed(4)
    st.context.remember(s.ChatMessage(role=s.ROLE_USER, content="x"))
    assert snapshot.history_log.next_index == 1
    st.handles.start("ses_" + "c" * 26, s.TASK_KIND_SUBAGENT, "helper", "dep-a", "turn_2", "")
    assert [h.child_session_id for h in snapshot.handles] == ["ses_" + "c" * 26]
    assert st.next_id("input") == "input_1" and snapshot.id_count == 1
    # A commit moves what the last commit left.
    snapshot.next_event_seq = 12
    snapshot.ClearField("open_turn")
    st.mark_committed()
    assert st.last_commit == LastCommit("", 12, {"task:c:1"})
    assert not st.context.appended


# -- time is an input -----------------------------------------------------------------


def test_every_event_carries_the_time_of_the_activation_that_made_it() -> None:
    st = held(now=100.0)
    started = decisions.decide(st, send(0, "calc 1+1"), collections.deque(), now=200.0)
    assert isinstance(started, RunTurn)
    assert times(started.events) == [200.0, 200.0] and st.now == 200.0
    events = started.events
    assert decisions.before_step(st, collections.deque(), events, now=210.0) is None
    reply = ModelReply(tool_calls=[RequestedCall("calculator", {"expression": "1+1"})])
    progress = StepProgress(reply=reply, calls=steps.tool_calls(st, reply))
    progress.results[0] = s.ToolResult(tool_call_id="call_1", name="calculator", output="2")
    after = decisions.after_step(st, progress, collections.deque(), events, now=250.5)
    assert after is NextStep.AFTER_COMMIT
    assert times(events) == [200.0, 200.0] + [250.5] * 4, "earlier events keep their time"
    final = StepProgress(reply=ModelReply(text="2"))
    ended = decisions.after_step(st, final, collections.deque(), [], now=260.0)
    assert isinstance(ended, Commit) and set(times(ended.events)) == {260.0}
    # The turn rules the shell calls itself take it too.
    refused = turns.refused(st, ended.events, False, s.ErrorDetail(reason="X"), now=270.0)
    assert set(times(refused)) == {270.0}
    reset = s.InboxEntry(seq=1, command=s.Command(reset=s.ResetCommand()))
    closing: list[s.Event] = []
    turns.finalize(st, closing, reset, None, now=280.0)
    assert times(closing) == [280.0]


def test_no_rule_reads_a_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn through the decisions, a refused commit and a finalization
    with every clock of the time module broken: the rules never ask one."""
    st = held()

    def no_clock() -> float:
        raise AssertionError("a rule read the clock")

    for name in ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter"):
        monkeypatch.setattr(time, name, no_clock)
    effect = decisions.decide(st, send(0, "transfer 5"), collections.deque(), now=1.0)
    assert isinstance(effect, RunTurn)
    assert decisions.before_step(st, collections.deque(), effect.events, now=2.0) is None
    reply = ModelReply(tool_calls=[RequestedCall("transfer", {"amount": "5"})])
    progress = StepProgress(reply=reply, calls=steps.tool_calls(st, reply))
    paused = decisions.after_step(st, progress, collections.deque(), effect.events, now=3.0)
    assert isinstance(paused, Commit)
    approve = send(1, "", input_responses=[s.InputResponse(request_id="input_1", approved=True)])
    plan = decisions.decide(st, approve, collections.deque(), now=4.0)
    assert isinstance(plan, AnswerInputs)
    result = s.ToolResult(tool_call_id=plan.to_run[0].id, name="transfer", output="moved")
    assert isinstance(decisions.apply_input_answers(st, plan, [result], now=5.0), RunTurn)
    error = s.ErrorDetail(reason=Reason.HISTORY_ENTRY_TOO_LARGE)
    turns.refused(st, plan.events, False, error, now=6.0)
    reset = decisions.decide(
        st,
        s.InboxEntry(seq=2, command=s.Command(reset=s.ResetCommand())),
        collections.deque(),
        now=7.0,
    )
    assert isinstance(reset, Finalize)
    turns.finalize(st, reset.events, reset.entry, reset.error, now=8.0)
    stamp(st.snapshot, reset.events, deployment_id="dep-a", now=9.0)
    assert st.snapshot.status == s.SESSION_STATUS_FINALIZED


# -- a commit's stamps---------------------------------------------------------------


def test_stamping_numbers_the_events_on_and_stamps_the_snapshot() -> None:
    snapshot = s.SessionSnapshot(
        session_id=SID, next_event_seq=7, deployment_id="dep-old", last_trace_id="t0"
    )
    stamped = make_event(IDENTITY, K.EVENT_KIND_TURN_STARTED)
    stamped.time.CopyFrom(timestamp(50.0))
    bare = s.Event(session_id=SID, kind=K.EVENT_KIND_SESSION_STARTED)
    stamp(snapshot, [stamped, bare], deployment_id="dep-a", now=100.25)
    assert (stamped.seq, bare.seq, snapshot.next_event_seq) == (7, 8, 9)
    assert stamped.time == timestamp(50.0), "a rule's time is kept"
    assert bare.time == timestamp(100.25), "an event without one gets the commit's"
    assert snapshot.deployment_id == "dep-a" and snapshot.last_trace_id == "t0"
    stamp(snapshot, [], deployment_id="dep-a", now=101.0, trace_id="t1")
    assert snapshot.next_event_seq == 9 and snapshot.last_trace_id == "t1"


def test_stamping_deletes_consumed_entries_no_further_than_the_snapshots_position() -> None:
    snapshot = s.SessionSnapshot(session_id=SID, inbox_next_seq=5)
    assert stamp(snapshot, [], deployment_id="dep-a", now=1.0) is None
    assert stamp(snapshot, [], deployment_id="dep-a", now=1.0, consumed_from=3) == 3
    # A snapshot rolled back to a refused commit's is behind what was consumed.
    assert stamp(snapshot, [], deployment_id="dep-a", now=1.0, consumed_from=9) == 5
