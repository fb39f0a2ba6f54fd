"""The pure turn rules (services/owner/rules/turns.py, services/owner/rules/context.py):
no etcd, no gRPC, no event loop. What a command means, what a step does to
the snapshot and the context, when a budget is spent, what a refused commit
leaves behind."""

from __future__ import annotations

import collections

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits
from baton_runtime.owner.agents.api import ModelReply, RequestedCall
from baton_runtime.owner.agents.fixture import build_agent
from baton_runtime.owner.rules.admission import Admission
from baton_runtime.owner.rules.held import RunIdentity
from baton_runtime.owner.rules.step_rules import Outcome, StepProgress
from baton_runtime.owner.rules.turns import SessionState, safe_error
from baton_runtime.owner.run.snapshots import initial_snapshot

K = s.EventKind
SID = "ses_" + "a" * 26
IDENTITY = RunIdentity(s.Fence(session_id=SID, owner_run_id="run_1", epoch=1), "dep-a", "i1")


def state(token_budget: int = 0) -> SessionState:
    snapshot = initial_snapshot(SID, "slack", "dep-a", [], token_budget=token_budget)
    return SessionState(IDENTITY, snapshot, build_agent("dep-a"))


def entry(seq: int, caller: str = "u1", **command: object) -> s.InboxEntry:
    delivery = s.DeliveryMetadata(delivery_id=f"d{seq}", channel="slack", caller=caller)
    return s.InboxEntry(seq=seq, command=s.Command(delivery=delivery, **command))


def send(seq: int, text: str = "hi", caller: str = "u1", queue: bool = False) -> s.InboxEntry:
    policy = s.TURN_POLICY_QUEUE if queue else s.TURN_POLICY_STEER
    return entry(seq, caller, send=s.SendCommand(text=text, turn_policy=policy))


def kinds(events: list[s.Event]) -> list[str]:
    return [K.Name(e.kind).removeprefix("EVENT_KIND_") for e in events]


def test_classify() -> None:
    st = state()
    own = entry(1, timeout=s.TimeoutCommand(armed_by_owner_run_id="run_1"))
    other = entry(2, timeout=s.TimeoutCommand(armed_by_owner_run_id="run_0"))
    assert st.classify(send(0)) is Admission.ADMIT
    assert st.classify(send(0, queue=True)) is Admission.BLOCK
    assert st.classify(send(0, text="  ")) is Admission.REJECT
    assert st.classify(entry(0, cancel=s.CancelCommand())) is Admission.CANCEL
    assert st.classify(entry(0, reset=s.ResetCommand())) is Admission.FINALIZE
    assert st.classify(own) is Admission.FINALIZE
    assert st.classify(other) is Admission.DROP
    assert st.classify(entry(0)) is Admission.REJECT  # a kind this build does not know
    assert st.classify(entry(0, clear=s.ClearCommand())) is Admission.BLOCK
    stale = entry(0, authorization_callback=s.AuthorizationCallbackCommand(attempt_id="a_9"))
    assert st.classify(stale) is Admission.DROP


def test_a_turn_merges_the_same_principals_messages_up_to_the_cap() -> None:
    st = state()
    many = limits.MAX_ADMITTED_PER_BOUNDARY + 5
    pending = collections.deque(send(i) for i in range(1, many))
    pending.append(send(many, caller="u2"))
    events = st.start_turn(send(0), pending)
    assert kinds(events)[:2] == ["TURN_STARTED", "MESSAGE_RECEIVED"]
    assert len(events) == 1 + limits.MAX_ADMITTED_PER_BOUNDARY
    assert list(st.snapshot.open_turn.inbox_seqs) == list(range(limits.MAX_ADMITTED_PER_BOUNDARY))
    assert st.snapshot.inbox_next_seq == limits.MAX_ADMITTED_PER_BOUNDARY
    assert len(pending) == many + 1 - limits.MAX_ADMITTED_PER_BOUNDARY
    assert st.context.log.next_index == limits.MAX_ADMITTED_PER_BOUNDARY


def test_a_boundary_admits_steers_and_stops_at_a_cancel() -> None:
    st = state()
    st.start_turn(send(0), collections.deque())
    pending = collections.deque([send(1, caller="u2"), entry(2, cancel=s.CancelCommand()), send(3)])
    events: list[s.Event] = []
    admission, stop = st.admit_pending(pending, events)
    assert admission is Admission.CANCEL and stop is not None and stop.seq == 2
    assert kinds(events) == ["MESSAGE_RECEIVED"]
    assert [e.seq for e in pending] == [3]
    assert st.snapshot.inbox_next_seq == 3
    queued = collections.deque([send(4, queue=True), send(5)])
    assert st.admit_pending(queued, events) == (Admission.BLOCK, None)
    assert len(queued) == 2


def test_a_push_aborts_the_step_only_when_everything_ahead_can_join() -> None:
    st = state()
    cancel = entry(9, cancel=s.CancelCommand())
    assert st.aborts_step(cancel, [send(1), send(2, text="")])
    assert not st.aborts_step(cancel, [send(1, queue=True)])
    assert not st.aborts_step(send(3), [])


# -- what the run takes next while the turn waits (issue 32) ------------------------


def waiting_for_approval() -> SessionState:
    st = state()
    events = st.start_turn(send(0, "transfer 5"), collections.deque())
    reply = ModelReply(tool_calls=[RequestedCall("transfer", {"amount": "5"})])
    assert st.apply_step(StepProgress(reply=reply, calls=st.tool_calls(reply)), events) is (
        Outcome.PAUSED
    )
    return st


def answer(seq: int, request_id: str = "input_1") -> s.InboxEntry:
    response = s.InputResponse(request_id=request_id, approved=True)
    return entry(seq, send=s.SendCommand(input_responses=[response]))


def test_while_the_turn_waits_a_queued_message_waits_with_the_messages_behind_it() -> None:
    between = state()
    assert between.next_to_take([send(1, queue=True), send(2)]) == 0, "between turns: in order"
    assert between.next_to_take([]) is None
    st = waiting_for_approval()
    cancel = entry(5, cancel=s.CancelCommand())
    reset = entry(5, reset=s.ResetCommand())
    assert st.next_to_take([send(1), send(2, queue=True)]) == 0  # a steer: abandons the wait
    assert st.next_to_take([send(1, queue=True)]) is None
    assert st.next_to_take([send(1, queue=True), send(2), answer(3)]) == 2
    assert st.next_to_take([send(1, queue=True), send(2, caller="u2"), cancel]) == 2
    assert st.next_to_take([send(1, queue=True), reset]) == 1
    assert st.next_to_take([send(1, queue=True), send(2, queue=True), send(3, text=" ")]) == 2
    assert st.next_to_take([send(1, queue=True), entry(2)]) == 1  # rejected: taken
    # Answers are taken first whatever their own policy says.
    queued_answer = answer(2)
    queued_answer.command.send.turn_policy = s.TURN_POLICY_QUEUE
    assert st.next_to_take([send(1, queue=True), queued_answer]) == 1


def test_what_is_taken_past_a_waiting_message_is_consumed_ahead_of_the_position() -> None:
    st = waiting_for_approval()
    later, also, stray, approve = (
        send(1, "later", queue=True),
        send(2, "also"),
        answer(3, "x"),
        answer(4),
    )
    pending = collections.deque([later, also, stray, approve])
    assert st.take(pending) is stray
    st.consume(stray)
    assert (st.snapshot.inbox_next_seq, list(st.snapshot.inbox_consumed_ahead)) == (1, [3])
    assert st.consumed(3) and not st.consumed(1) and not st.consumed(2)
    # A successor from the committed snapshot reads the inbox from 1: it
    # skips what was consumed ahead and sets the same messages aside.
    successor = SessionState(
        IDENTITY,
        s.SessionSnapshot.FromString(st.snapshot.SerializeToString()),
        build_agent("dep-a"),
    )
    assert successor.consumed(3) and not successor.consumed(1)
    assert successor.next_to_take([later, also, approve]) == 2

    assert st.take(pending) is approve
    st.consume(approve)
    assert list(st.snapshot.inbox_consumed_ahead) == [3, 4] and list(pending) == [later, also]
    events: list[s.Event] = []
    st.close_turn(events, K.EVENT_KIND_TURN_COMPLETED)
    # The turn ended: the queued message is next, and starts a turn with
    # the same principal's message behind it; the position moves over all.
    assert st.take(pending) is later
    assert kinds(st.start_turn(later, pending)) == [
        "TURN_STARTED",
        "MESSAGE_RECEIVED",
        "MESSAGE_RECEIVED",
    ]
    assert not pending
    assert (st.snapshot.inbox_next_seq, list(st.snapshot.inbox_consumed_ahead)) == (5, [])


def test_with_nothing_set_aside_the_position_moves_past_what_is_consumed() -> None:
    st = state()
    st.consume(send(3))
    assert (st.snapshot.inbox_next_seq, list(st.snapshot.inbox_consumed_ahead)) == (4, [])
    st.consume(send(1))  # below the position: consumed already
    assert st.snapshot.inbox_next_seq == 4


def test_steps_fold_into_history_usage_and_events() -> None:
    st = state()
    events = st.start_turn(send(0, "calc 1+1"), collections.deque())
    reply = ModelReply(
        tool_calls=[RequestedCall("calculator", {"expression": "1+1"})], input_tokens=7
    )
    progress = StepProgress(reply=reply, calls=st.tool_calls(reply))
    assert [c.id for c in progress.calls] == ["call_1"]
    progress.results[0] = s.ToolResult(tool_call_id="call_1", name="calculator", output="2")
    assert st.apply_step(progress, events) is Outcome.CONTINUE
    answer = StepProgress(reply=ModelReply(text="The result is 2.", output_tokens=4))
    assert st.apply_step(answer, events) is Outcome.FINAL
    st.close_turn(events, K.EVENT_KIND_TURN_COMPLETED)
    assert kinds(events) == [
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
    assert [m.role for m in st.context.messages] == [
        s.ROLE_USER,
        s.ROLE_ASSISTANT,
        s.ROLE_TOOL,
        s.ROLE_ASSISTANT,
    ]
    assert len(st.context.appended) == 4 and st.context.log.next_index == 4
    assert st.snapshot.usage.input_tokens == 7 and st.snapshot.usage.output_tokens == 4
    assert st.snapshot.usage.model_calls == 2 and st.snapshot.tool_call_count == 1
    assert events[-2].usage.model_calls == 2  # the turn's usage
    assert not st.turn_open


def test_a_tool_that_needs_approval_pauses_the_turn() -> None:
    st = state()
    events = st.start_turn(send(0, "transfer 5"), collections.deque())
    reply = ModelReply(tool_calls=[RequestedCall("transfer", {"amount": "5"})])
    progress = StepProgress(reply=reply, calls=st.tool_calls(reply))
    assert not st.runs_now(progress.calls[0])
    assert st.apply_step(progress, events) is Outcome.PAUSED
    request = st.snapshot.open_turn.pending_inputs[0]
    assert request.kind == s.INPUT_KIND_APPROVAL and request.request_id == "input_1"
    assert st.still_waiting()
    abandoned = st.abandon_waits()
    assert kinds(abandoned) == ["TOOL_CALL_RESULT"] and abandoned[0].tool_result.is_error
    assert not st.still_waiting()


def test_an_aborted_step_records_cancelled_results() -> None:
    st = state()
    events = st.start_turn(send(0, "steps 3"), collections.deque())
    reply = ModelReply(tool_calls=[RequestedCall("echo", {"text": "x"})])
    progress = StepProgress(reply=reply, calls=st.tool_calls(reply), aborted=True)
    assert st.apply_step(progress, events) is Outcome.ABORTED
    assert events[-2].tool_result.output == "cancelled"
    assert StepProgress(aborted=True).reply is None
    assert st.apply_step(StepProgress(aborted=True), events) is Outcome.ABORTED
    assert st.apply_step(StepProgress(error="boom"), events) is Outcome.FAILED


def test_budgets() -> None:
    st = state(token_budget=10)
    assert not st.budget_spent()
    st.snapshot.usage.input_tokens = 10
    assert st.budget_spent()
    st.extend_budget()
    assert st.snapshot.limits.token_budget == 20 and not st.budget_spent()


def test_the_context_budget_and_its_reset() -> None:
    st = state()
    context = st.context
    for i in range(5):
        context.remember(s.ChatMessage(role=s.ROLE_USER, content="x" * 100 + str(i)))
    entries, size = context.size()
    assert entries == 5 and size == sum(m.ByteSize() for m in context.messages)
    assert context.over(size - 1, 0) and not context.over(size, 0)
    assert context.over(0, 4) and not context.over(0, 5) and not context.over(0, 0)
    context.mark_committed()
    assert context.retirable() is None
    events = st.clear(entry(5, clear=s.ClearCommand()))
    change = events[-1].context_change
    assert (change.before_entries, change.after_entries, change.after_bytes) == (5, 0, 0)
    assert context.log.context_start == 5 and context.size() == (0, 0)
    context.mark_committed()
    assert context.retirable() == (0, 5)
    context.retired(5)
    assert context.retirable() is None and context.log.retired_below == 5


def test_a_refused_commit_rolls_back_and_fails_the_turn() -> None:
    st = state()
    st.snapshot.next_event_seq = 3
    st.mark_committed()
    events = st.start_turn(send(0, "big 300"), collections.deque())
    reply = ModelReply(tool_calls=[RequestedCall("big", {"kib": 300})])
    progress = StepProgress(reply=reply, calls=st.tool_calls(reply))
    progress.results[0] = s.ToolResult(tool_call_id="call_1", name="big", output="x" * 307200)
    st.apply_step(progress, events)
    assert "over the limit" in st.context.oversized_entry()
    st.snapshot.next_event_seq = 3 + len(events)  # what commit_step assigned
    error = s.ErrorDetail(reason="HISTORY_ENTRY_TOO_LARGE", message="too big")
    replaced = st.refused(events, False, error)
    assert kinds(replaced) == ["TURN_STARTED", "TURN_FAILED", "SESSION_WAITING"]
    assert replaced[1].error == error and replaced[1].turn_id == "turn_1"
    assert st.snapshot.next_event_seq == 3
    assert st.context.log.next_index == 0 and not st.context.appended
    assert st.snapshot.inbox_next_seq == 1, "the poison command stays consumed"
    assert st.snapshot.usage.model_calls == 1, "the model call stays counted"
    assert not st.turn_open and not st.context.oversized_entry()


def test_a_failure_of_authored_code_is_published_as_its_type_and_a_bounded_prefix() -> None:
    upstream = "https://internal.example/v1?key=" + "s" * 5000
    said = safe_error(RuntimeError(upstream))
    assert said.startswith("RuntimeError: https://") and len(said) <= 320
    assert "s" * 400 not in said
