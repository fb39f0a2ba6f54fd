"""What a run does next (services/owner/rules/decisions.py and
services/owner/rules/departure_rules.py): pure, no etcd, no gRPC, no event loop.
Each test gives the shell's decisions a state and a command and checks the
effect it gets back and what the state became."""

from __future__ import annotations

import collections

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import Reason
from baton_runtime.owner.agents.api import ModelReply, RequestedCall
from baton_runtime.owner.agents.fixture import build_agent
from baton_runtime.owner.rules import decisions, departure_rules
from baton_runtime.owner.rules.decisions import (
    AnswerAuthorization,
    AnswerInputs,
    Commit,
    Finalize,
    NextStep,
    Rejected,
    RunTurn,
    Summarize,
)
from baton_runtime.owner.rules.held import RunIdentity
from baton_runtime.owner.rules.step_rules import StepProgress
from baton_runtime.owner.rules.turns import SessionState
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


def send(seq: int, text: str = "hi", caller: str = "u1", **fields: object) -> s.InboxEntry:
    return entry(seq, caller, send=s.SendCommand(text=text, **fields))


def kinds(events: list[s.Event]) -> list[str]:
    return [K.Name(e.kind).removeprefix("EVENT_KIND_") for e in events]


def none() -> collections.deque[s.InboxEntry]:
    return collections.deque()


def paused_on(st: SessionState, *calls: RequestedCall) -> list[s.Event]:
    """A turn whose first step asked for `calls` (approvals, sign-ins, questions)."""
    events = st.start_turn(send(0, "go"), none())
    reply = ModelReply(tool_calls=list(calls))
    st.apply_step(StepProgress(reply=reply, calls=st.tool_calls(reply)), events)
    return events


def asked(st: SessionState, question: str) -> None:
    st.start_turn(send(0, "go"), none())
    st.apply_step(StepProgress(reply=ModelReply(question=question)), [])


def answer(seq: int, *responses: s.InputResponse, text: str = "") -> s.InboxEntry:
    return send(seq, text, input_responses=list(responses))


# -- commands between turns --------------------------------------------------------


def test_a_message_starts_a_turn_with_the_same_principals_messages_behind_it() -> None:
    st = state()
    pending = collections.deque([send(1, "and"), send(2, "other", caller="u2")])
    effect = decisions.decide(st, send(0, "hi"), pending)
    assert isinstance(effect, RunTurn)
    assert kinds(effect.events) == ["TURN_STARTED", "MESSAGE_RECEIVED", "MESSAGE_RECEIVED"]
    assert [e.seq for e in pending] == [2] and st.turn_open


def test_an_empty_message_and_an_unknown_kind_are_rejected_and_consumed() -> None:
    st = state()
    empty = decisions.decide(st, send(0, "   "), none())
    assert isinstance(empty, Rejected) and empty.event.error.reason == Reason.EMPTY_MESSAGE
    unknown = decisions.decide(st, entry(1), none())
    assert isinstance(unknown, Rejected) and unknown.event.error.reason == Reason.UNKNOWN_COMMAND
    assert st.snapshot.inbox_next_seq == 2 and not st.turn_open


def test_cancel_settles_an_open_turn_or_is_rejected() -> None:
    st = state()
    nothing = decisions.decide(st, entry(0, cancel=s.CancelCommand()), none())
    assert isinstance(nothing, Rejected)
    assert nothing.event.error.reason == Reason.NOTHING_TO_CANCEL
    asked(st, "which?")
    effect = decisions.decide(st, entry(1, cancel=s.CancelCommand()), none())
    assert isinstance(effect, Commit)
    assert kinds(effect.events) == ["TURN_CANCELLED", "SESSION_WAITING"]
    assert not st.turn_open and st.snapshot.inbox_next_seq == 2


def test_reset_and_an_own_timeout_finalize_a_predecessors_timeout_is_dropped() -> None:
    st = state()
    reset = decisions.decide(st, entry(0, reset=s.ResetCommand()), none())
    assert isinstance(reset, Finalize) and reset.error is None
    own = entry(1, timeout=s.TimeoutCommand(armed_by_owner_run_id="run_1"))
    timeout = decisions.decide(st, own, none())
    assert isinstance(timeout, Finalize) and timeout.error is not None
    assert timeout.error.reason == Reason.TIMEOUT
    stale = entry(2, timeout=s.TimeoutCommand(armed_by_owner_run_id="run_0"))
    dropped = decisions.decide(st, stale, none())
    assert isinstance(dropped, Commit) and dropped.events == []
    assert st.snapshot.inbox_next_seq == 3


def test_clear_and_compact_end_a_waiting_turn_first() -> None:
    st = state()
    asked(st, "which?")
    compact = decisions.decide(st, entry(1, compact=s.CompactCommand()), none())
    assert isinstance(compact, Summarize) and compact.entry is not None
    assert kinds(compact.events) == ["TURN_CANCELLED"] and not st.turn_open
    clear = decisions.decide(st, entry(2, clear=s.ClearCommand()), none())
    assert isinstance(clear, Commit) and kinds(clear.events) == ["CONTEXT_CLEARED"]
    assert st.snapshot.inbox_next_seq == 3


def test_a_message_while_the_turn_waits_abandons_the_waits_and_goes_on() -> None:
    st = state()
    paused_on(st, RequestedCall("transfer", {"amount": "5"}))
    effect = decisions.decide(st, send(1, "never mind"), none())
    assert isinstance(effect, RunTurn)
    assert kinds(effect.events) == ["TOOL_CALL_RESULT", "MESSAGE_RECEIVED"]
    assert not st.still_waiting() and st.turn_open


def test_a_report_from_an_unknown_child_is_rejected() -> None:
    st = state()
    report = s.TaskResultCommand(
        task_delivery_id="task:x:1",
        parent_session_id=SID,
        child_session_id="ses_" + "c" * 26,
        work=1,
        status=s.TASK_STATUS_COMPLETED,
    )
    effect = decisions.decide(st, entry(0, task_result=report), none())
    assert isinstance(effect, Rejected) and st.snapshot.inbox_next_seq == 1


# -- input responses: two phases ---------------------------------------------------


def test_input_responses_without_a_pending_request_are_rejected() -> None:
    st = state()
    effect = decisions.decide(st, answer(0, s.InputResponse(request_id="input_1")), none())
    assert isinstance(effect, Rejected)
    assert effect.event.error.reason == Reason.INPUT_NOT_PENDING


def test_an_approval_names_the_call_to_run_and_its_result_is_folded_in() -> None:
    st = state()
    paused_on(st, RequestedCall("transfer", {"amount": "5"}))
    response = s.InputResponse(request_id="input_1", approved=True)
    plan = decisions.decide(st, answer(1, response, text="yes"), none())
    assert isinstance(plan, AnswerInputs)
    assert [c.name for c in plan.to_run] == ["transfer"]
    assert kinds(plan.events) == ["MESSAGE_RECEIVED"]
    assert st.snapshot.open_turn.pending_inputs  # nothing applied before the results
    result = s.ToolResult(tool_call_id=plan.to_run[0].id, name="transfer", output="moved 5")
    effect = decisions.apply_input_answers(st, plan, [result])
    assert isinstance(effect, RunTurn)
    assert kinds(effect.events) == ["MESSAGE_RECEIVED", "TOOL_CALL_RESULT"]
    assert effect.events[-1].tool_result.output == "moved 5"
    assert not st.snapshot.open_turn.pending_inputs


def test_a_denied_approval_runs_nothing() -> None:
    st = state()
    paused_on(st, RequestedCall("transfer", {"amount": "5"}))
    plan = decisions.decide(st, answer(1, s.InputResponse(request_id="input_1")), none())
    assert isinstance(plan, AnswerInputs) and plan.to_run == []
    effect = decisions.apply_input_answers(st, plan, [])
    assert isinstance(effect, RunTurn)
    assert effect.events[-1].tool_result.output == "the user denied this call"
    assert effect.events[-1].tool_result.is_error


def test_answers_are_applied_in_the_order_given() -> None:
    st = state()
    paused_on(
        st,
        RequestedCall("transfer", {"amount": "1"}),
        RequestedCall("transfer", {"amount": "2"}),
    )
    responses = [
        s.InputResponse(request_id="input_2", approved=True),
        s.InputResponse(request_id="input_1", approved=True),
        s.InputResponse(request_id="input_2", approved=False),  # a repeat: the first counts
        s.InputResponse(request_id="input_9"),
    ]
    plan = decisions.decide(st, answer(1, *responses), none())
    assert isinstance(plan, AnswerInputs)
    assert [c.id for c in plan.to_run] == ["call_2", "call_1"]
    assert kinds(plan.events) == ["COMMAND_REJECTED"]
    assert plan.events[0].error.reason == Reason.UNKNOWN_INPUT_REQUEST
    results = [s.ToolResult(tool_call_id=c.id, name=c.name, output=c.id) for c in plan.to_run]
    effect = decisions.apply_input_answers(st, plan, results)
    outputs = [
        e.tool_result.output for e in effect.events if e.kind == K.EVENT_KIND_TOOL_CALL_RESULT
    ]
    assert outputs == ["call_2", "call_1"]


def test_a_partial_answer_commits_and_says_the_session_still_waits() -> None:
    st = state()
    paused_on(
        st,
        RequestedCall("transfer", {"amount": "1"}),
        RequestedCall("transfer", {"amount": "2"}),
    )
    plan = decisions.decide(st, answer(1, s.InputResponse(request_id="input_1")), none())
    assert isinstance(plan, AnswerInputs)
    effect = decisions.apply_input_answers(st, plan, [])
    assert isinstance(effect, Commit)
    assert kinds(effect.events) == ["TOOL_CALL_RESULT", "SESSION_WAITING"]
    assert [r.request_id for r in st.snapshot.open_turn.pending_inputs] == ["input_2"]


def test_a_question_answer_reaches_the_context() -> None:
    st = state()
    asked(st, "which colour?")
    response = s.InputResponse(request_id="input_1", text="blue")
    plan = decisions.decide(st, answer(1, response), none())
    assert isinstance(plan, AnswerInputs) and plan.to_run == []
    assert isinstance(decisions.apply_input_answers(st, plan, []), RunTurn)
    assert st.context.messages[-1].content == "blue"


def test_the_session_limit_is_extended_or_kept() -> None:
    st = state(token_budget=10)
    st.start_turn(send(0, "go"), none())
    st.snapshot.usage.input_tokens = 10
    st.ask_to_extend_budget([])
    yes = decisions.decide(
        st, answer(1, s.InputResponse(request_id="input_1", approved=True)), none()
    )
    assert isinstance(yes, AnswerInputs)
    assert isinstance(decisions.apply_input_answers(st, yes, []), RunTurn)
    assert not st.budget_spent()
    st.snapshot.usage.input_tokens = 100
    st.ask_to_extend_budget([])
    no = decisions.decide(st, answer(2, s.InputResponse(request_id="input_2")), none())
    assert isinstance(no, AnswerInputs)
    kept = decisions.apply_input_answers(st, no, [])
    assert isinstance(kept, Commit)
    assert kinds(kept.events) == ["TURN_FAILED", "SESSION_WAITING"]
    assert kept.events[0].error.reason == Reason.LIMIT_EXCEEDED and not st.turn_open


# -- sign-in callbacks: two phases ---------------------------------------------------


def callback(seq: int, attempt: str, granted: bool = True) -> s.InboxEntry:
    command = s.AuthorizationCallbackCommand(attempt_id=attempt, granted=granted)
    return entry(seq, authorization_callback=command)


def test_sign_in_runs_the_call_once_every_attempt_reported() -> None:
    st = state()
    paused_on(st, RequestedCall("calendar", {}))
    first = decisions.decide(st, callback(1, "attempt_1"), none())
    assert isinstance(first, Commit) and first.events == [] and not first.note
    wait = st.snapshot.open_turn.pending_authorizations[0]
    assert list(wait.reported_attempt_ids) == ["attempt_1"]
    plan = decisions.decide(st, callback(2, "attempt_2"), none())
    assert isinstance(plan, AnswerAuthorization)
    assert plan.to_run is not None and plan.to_run.name == "calendar"
    assert kinds(plan.events) == ["AUTHORIZATION_COMPLETED"]
    result = s.ToolResult(tool_call_id=plan.to_run.id, name="calendar", output="free")
    effect = decisions.apply_authorization(st, plan, result)
    assert isinstance(effect, RunTurn)
    assert kinds(effect.events) == ["AUTHORIZATION_COMPLETED", "TOOL_CALL_RESULT"]
    assert not st.snapshot.open_turn.pending_authorizations


def test_a_refused_sign_in_runs_nothing_and_a_stale_attempt_is_dropped() -> None:
    st = state()
    paused_on(st, RequestedCall("calendar", {}))
    decisions.decide(st, callback(1, "attempt_1", granted=False), none())
    plan = decisions.decide(st, callback(2, "attempt_2"), none())
    assert isinstance(plan, AnswerAuthorization) and plan.to_run is None
    assert plan.events[0].error.reason == Reason.DENIED
    effect = decisions.apply_authorization(st, plan, None)
    assert effect.events[-1].tool_result.output == "sign-in was refused"  # type: ignore[union-attr]
    stale = decisions.decide(st, callback(3, "attempt_1"), none())
    assert isinstance(stale, Commit) and stale.note and st.snapshot.inbox_next_seq == 4


# -- a queued message while the turn waits (issue 32) ------------------------------------


def queued(seq: int, text: str = "later") -> s.InboxEntry:
    return send(seq, text, turn_policy=s.TURN_POLICY_QUEUE)


def position(st: SessionState) -> tuple[int, list[int]]:
    """The inbox position and what was consumed ahead of it."""
    return st.snapshot.inbox_next_seq, list(st.snapshot.inbox_consumed_ahead)


def finish(st: SessionState, pending: decisions.Pending) -> list[str]:
    """The open turn's next step gives the final answer (`pending` stays)."""
    events: list[s.Event] = []
    assert decisions.before_step(st, pending, events) is None
    ended = decisions.after_step(st, StepProgress(reply=ModelReply(text="done")), pending, events)
    assert isinstance(ended, Commit), "the turn did not end at its final answer"
    return kinds(ended.events)


def starts_its_turn(st: SessionState, pending: decisions.Pending, seq: int) -> None:
    """Once the turn has ended, the queued message `seq` is taken next and
    starts a turn of its own."""
    taken = st.take(pending)
    assert taken is not None and taken.seq == seq
    effect = decisions.decide(st, taken, pending)
    assert isinstance(effect, RunTurn)
    assert kinds(effect.events) == ["TURN_STARTED", "MESSAGE_RECEIVED"]
    assert effect.events[1].inbox_seq == seq and st.turn_id == "turn_2"


def test_a_queued_message_waits_for_the_answer_then_starts_its_own_turn() -> None:
    st = state()
    paused_on(st, RequestedCall("transfer", {"amount": "5"}))
    approve = answer(2, s.InputResponse(request_id="input_1", approved=True))
    pending = collections.deque([queued(1), approve])
    taken = st.take(pending)
    assert taken is approve, "the queued message was taken while the turn waits"
    plan = decisions.decide(st, taken, pending)
    assert isinstance(plan, AnswerInputs) and [c.name for c in plan.to_run] == ["transfer"]
    result = s.ToolResult(tool_call_id=plan.to_run[0].id, name="transfer", output="moved 5")
    effect = decisions.apply_input_answers(st, plan, [result])
    assert isinstance(effect, RunTurn) and kinds(effect.events) == ["TOOL_CALL_RESULT"]
    assert not effect.events[0].tool_result.is_error
    assert position(st) == (1, [2]), "consumed past the queued message, which is not"
    assert finish(st, pending)[-2:] == ["TURN_COMPLETED", "SESSION_WAITING"]
    starts_its_turn(st, pending, 1)
    assert position(st) == (3, [])


def test_a_queued_message_waits_for_a_cancel_of_the_waiting_turn() -> None:
    st = state()
    paused_on(st, RequestedCall("transfer", {"amount": "5"}))
    pending = collections.deque([queued(1), entry(2, cancel=s.CancelCommand())])
    taken = st.take(pending)
    assert taken is not None and taken.seq == 2
    effect = decisions.decide(st, taken, pending)
    assert isinstance(effect, Commit)
    assert kinds(effect.events) == ["TURN_CANCELLED", "SESSION_WAITING"]
    starts_its_turn(st, pending, 1)
    assert position(st) == (3, [])


def test_a_queued_message_waits_for_the_sign_in() -> None:
    st = state()
    paused_on(st, RequestedCall("calendar", {}))
    first = callback(2, "attempt_1")
    pending = collections.deque([queued(1), first, callback(3, "attempt_2")])
    assert st.take(pending) is first
    assert decisions.decide(st, first, pending) == Commit([])
    taken = st.take(pending)
    assert taken is not None and taken.seq == 3
    plan = decisions.decide(st, taken, pending)
    assert isinstance(plan, AnswerAuthorization) and plan.to_run is not None
    result = s.ToolResult(tool_call_id=plan.to_run.id, name="calendar", output="free")
    effect = decisions.apply_authorization(st, plan, result)
    assert isinstance(effect, RunTurn)
    assert kinds(effect.events) == ["AUTHORIZATION_COMPLETED", "TOOL_CALL_RESULT"]
    assert position(st) == (1, [2, 3])
    finish(st, pending)
    starts_its_turn(st, pending, 1)
    assert position(st) == (4, [])


def test_a_steer_while_the_sign_in_waits_abandons_it_and_goes_on() -> None:
    st = state()
    paused_on(st, RequestedCall("calendar", {}))
    pending = collections.deque([send(1, "never mind")])
    taken = st.take(pending)
    assert taken is not None and taken.seq == 1
    effect = decisions.decide(st, taken, pending)
    assert isinstance(effect, RunTurn)
    assert kinds(effect.events) == ["TOOL_CALL_RESULT", "MESSAGE_RECEIVED"]
    assert effect.events[0].tool_result.output.startswith("sign-in abandoned")
    assert not st.still_waiting() and position(st) == (2, [])


# -- the turn loop -------------------------------------------------------------------


def test_before_a_step_a_pending_cancel_or_reset_ends_the_turn() -> None:
    st = state()
    st.start_turn(send(0, "go"), none())
    events: list[s.Event] = []
    pending = collections.deque([send(1, "more"), entry(2, cancel=s.CancelCommand())])
    ends = decisions.before_step(st, pending, events)
    assert isinstance(ends, Commit)
    assert kinds(ends.events) == ["MESSAGE_RECEIVED", "TURN_CANCELLED", "SESSION_WAITING"]
    st.start_turn(send(3, "go"), none())
    reset = decisions.before_step(st, collections.deque([entry(4, reset=s.ResetCommand())]), [])
    assert isinstance(reset, Finalize) and reset.error is None and reset.entry.seq == 4


def test_before_a_step_the_step_limit_and_the_budget_end_or_pause_the_turn() -> None:
    st = state(token_budget=10)
    st.start_turn(send(0, "go"), none())
    assert decisions.before_step(st, none(), []) is None
    st.snapshot.usage.input_tokens = 10
    spent = decisions.before_step(st, none(), [])
    assert isinstance(spent, Commit) and "INPUT_REQUESTED" in kinds(spent.events)
    st = state()
    st.start_turn(send(0, "go"), none())
    st.snapshot.open_turn.steps = st.max_steps()
    limit = decisions.before_step(st, none(), [])
    assert isinstance(limit, Commit) and limit.events[0].error.reason == Reason.MAX_STEPS


def test_after_a_step_the_turn_goes_on_or_ends() -> None:
    st = state()
    st.start_turn(send(0, "go"), none())
    assert decisions.after_step(st, StepProgress(aborted=True), none(), []) is NextStep.NOW
    reply = ModelReply(tool_calls=[RequestedCall("echo", {"text": "x"})])
    progress = StepProgress(reply=reply, calls=st.tool_calls(reply))
    progress.results[0] = s.ToolResult(tool_call_id="call_1", name="echo", output="x")
    assert decisions.after_step(st, progress, none(), []) is NextStep.AFTER_COMMIT
    final = StepProgress(reply=ModelReply(text="done"))
    steer = collections.deque([send(1, "and")])
    assert decisions.after_step(st, final, steer, []) is NextStep.AFTER_COMMIT
    ended = decisions.after_step(st, StepProgress(reply=ModelReply(text="done")), none(), [])
    assert isinstance(ended, Commit)
    assert kinds(ended.events)[-2:] == ["TURN_COMPLETED", "SESSION_WAITING"]
    st.start_turn(send(2, "go"), none())
    failed = decisions.after_step(st, StepProgress(error="boom"), none(), [])
    assert isinstance(failed, Commit) and failed.events[0].error.message == "boom"
    st.start_turn(send(3, "go"), none())
    question = decisions.after_step(st, StepProgress(reply=ModelReply(question="?")), none(), [])
    assert isinstance(question, Commit) and kinds(question.events)[-1] == "SESSION_WAITING"


def test_recovery_continues_an_open_turn_that_waits_for_nothing() -> None:
    st = state()
    assert not decisions.recovery(st)
    st.start_turn(send(0, "go"), none())
    assert decisions.recovery(st)
    st.apply_step(StepProgress(reply=ModelReply(question="?")), [])
    assert not decisions.recovery(st)


def test_compaction_is_due_between_turns_over_the_budget() -> None:
    st = state()
    assert not decisions.compaction_due(st)
    for _ in range(st.agent.context_budget_entries + 1):
        st.context.remember(s.ChatMessage(role=s.ROLE_USER, content="x"))
    assert decisions.compaction_due(st)
    st.start_turn(send(0, "go"), none())
    assert not decisions.compaction_due(st)


# -- departures -------------------------------------------------------------------------


def accepted_by(seq: int, deployment: str, text: str = "hi") -> s.InboxEntry:
    delivery = s.DeliveryMetadata(delivery_id=f"d{seq}", accepted_deployment_id=deployment)
    return s.InboxEntry(
        seq=seq, command=s.Command(delivery=delivery, send=s.SendCommand(text=text))
    )


def test_only_a_message_accepted_by_another_deployment_triggers_a_handoff() -> None:
    st = state()
    assert departure_rules.is_trigger(st, accepted_by(0, "dep-b"), revision_known=True)
    assert not departure_rules.is_trigger(st, accepted_by(0, "dep-b"), revision_known=False)
    assert not departure_rules.is_trigger(st, accepted_by(0, "dep-a"), revision_known=True)
    assert not departure_rules.is_trigger(st, accepted_by(0, ""), revision_known=True)
    assert not departure_rules.is_trigger(st, accepted_by(0, "dep-b", " "), revision_known=True)
    cancel = entry(0, cancel=s.CancelCommand())
    cancel.command.delivery.accepted_deployment_id = "dep-b"
    assert not departure_rules.is_trigger(st, cancel, revision_known=True)
    st.start_turn(send(1), none())
    assert not departure_rules.is_trigger(st, accepted_by(2, "dep-b"), revision_known=True)


def test_a_drain_attempt_is_due_only_while_the_session_is_idle() -> None:
    st = state()
    due = departure_rules.drain_wait
    assert due(st, draining=False, pending=0, due_at=0.0, now=5.0) is None
    assert due(st, draining=True, pending=0, due_at=0.0, now=5.0) == 0.0
    assert due(st, draining=True, pending=0, due_at=7.0, now=5.0) == 2.0
    assert due(st, draining=True, pending=1, due_at=0.0, now=5.0) is None
    st.start_turn(send(0), none())
    assert due(st, draining=True, pending=0, due_at=0.0, now=5.0) is None


def test_an_idle_run_parks_only_with_nothing_left_to_do() -> None:
    may_park = departure_rules.may_park
    assert may_park(park_after=1.0, pending=0, reports_pending=False)
    assert not may_park(park_after=None, pending=0, reports_pending=False)
    assert not may_park(park_after=1.0, pending=1, reports_pending=False)
    assert not may_park(park_after=1.0, pending=0, reports_pending=True)


def test_a_session_says_why_it_cannot_move_yet() -> None:
    st = state()
    assert departure_rules.busy_with(st) == ""
    st.snapshot.handles.add(child_session_id="child-1", state=s.HANDLE_STATE_RUNNING)
    assert "child session" in departure_rules.busy_with(st)
    st.start_turn(send(0), none())
    assert "turn is open" in departure_rules.busy_with(st)


def test_every_effect_has_its_one_apply_in_the_shell() -> None:
    """The shell's dispatch is one `_apply_<kind>` per effect the decisions
    can return (session.py), and nothing else is named so."""
    import re
    import typing

    from baton_runtime.owner.run.session import SessionRun

    def snake(name: str) -> str:
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()

    effects = {f"_apply_{snake(kind.__name__)}" for kind in typing.get_args(decisions.Effect)}
    assert len(effects) == 7
    applies = {name for name in vars(SessionRun) if name.startswith("_apply_")}
    assert applies == effects
