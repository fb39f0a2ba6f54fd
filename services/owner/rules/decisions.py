"""What a run does next, decided without I/O (docs/design.md §4).

The shell (`SessionRun`, session.py) takes a command from the inbox, asks
`decide` what it means and performs the effect it gets back: a commit, the
open turn's steps, a finalization, a compaction, or tool calls to run for
answered waits. The turn loop asks `before_step` and `after_step` whether
the turn goes on or ends, and how. The state changes are the turn rules'
(`SessionState`, turns.py); this module only chooses among them, so every
choice the run makes is unit-tested without etcd, gRPC or a model.

Answers that run tools are two-phase: `decide` returns the tool calls to
run (`AnswerInputs`, `AnswerAuthorization`); once the shell has their
results, `apply_input_answers` / `apply_authorization` fold them in, in
order, and say what comes next. Nothing else touches the state in between.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import Reason
from baton_runtime.owner.rules.admission import Admission
from baton_runtime.owner.rules.handles import ReportMeaning
from baton_runtime.owner.rules.step_rules import Outcome, StepProgress
from baton_runtime.owner.rules.turns import SessionState
from baton_runtime.owner.rules.waits import error_result

Pending = collections.deque[s.InboxEntry]


# -- effects: what the shell performs ------------------------------------------------


@dataclass
class Commit:
    """Commit `events`; the command's effect is complete. `note`: a line the
    shell logs (what was dropped, and why)."""

    events: list[s.Event]
    note: str = ""


@dataclass
class Rejected:
    """The command is consumed with a command.rejected event; commit it."""

    entry: s.InboxEntry
    event: s.Event


@dataclass
class RunTurn:
    """Go on with the open turn's steps, `events` first."""

    events: list[s.Event]


@dataclass
class Finalize:
    """End the session (reset, an own timeout)."""

    events: list[s.Event]
    entry: s.InboxEntry
    error: s.ErrorDetail | None = None


@dataclass
class Summarize:
    """Replace the context with the model's summary of it; `entry` is the
    compact command, None when the owner compacts on its own."""

    events: list[s.Event]
    entry: s.InboxEntry | None


@dataclass
class AnswerInputs:
    """Input responses: run `to_run` (approved tool calls, in order), then
    `apply_input_answers` with their results."""

    entry: s.InboxEntry
    events: list[s.Event]
    to_run: list[s.ToolCall] = field(default_factory=list)


@dataclass
class AnswerAuthorization:
    """Every expected sign-in attempt reported: run the call (None: sign-in
    was refused), then `apply_authorization` with its result."""

    entry: s.InboxEntry
    events: list[s.Event]
    tool_call: s.ToolCall
    to_run: s.ToolCall | None


Effect = Commit | Rejected | RunTurn | Finalize | Summarize | AnswerInputs | AnswerAuthorization


class NextStep(enum.Enum):
    """The turn goes on after a step."""

    NOW = "now"  # a pushed command aborted the step: the boundary finds it
    AFTER_COMMIT = "after_commit"  # commit the step, then the next one


# -- commands --------------------------------------------------------------------


def decide(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    """What `entry`, taken from the inbox between turns or while the turn
    waits (which entry is taken is `SessionState.take`'s), means.
    `pending` (the entries read and not taken) may lend a new turn the same
    principal's messages right behind it."""
    kind = entry.command.WhichOneof("kind")
    rule = _BY_KIND.get(kind or "", _unknown)
    return rule(state, entry, pending)


def reject(
    state: SessionState, entry: s.InboxEntry, reason: str = "", message: str = ""
) -> Rejected:
    state.consume(entry)
    return Rejected(entry, state.rejection(entry, reason, message))


def go_on(state: SessionState, events: list[s.Event], *, announce_wait: bool = False) -> Effect:
    """The one "still waiting? commit : go on" decision: an open turn that
    still waits (for the user, or for children's results) commits what
    happened; otherwise its steps go on. `announce_wait`: a turn that waits
    for the user says so again (session.waiting)."""
    if state.still_waiting():
        if announce_wait and state.waiting_for_user():
            events.append(state.event(s.EVENT_KIND_SESSION_WAITING))
        return Commit(events)
    return RunTurn(events)


def _send(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    send = entry.command.send
    if send.input_responses:
        return answer_inputs(state, entry)
    if not send.text.strip() or state.refuses_message(entry):
        return reject(state, entry)
    if state.turn_open:
        # The turn waits, and this is a steer: a queued message is not taken
        # while the turn waits (`next_to_take`), it waits for the turn to end.
        events = state.abandon_waits()
        state.admit_message(entry, events)
        # Waiting for children: the model sees it with their results.
        return go_on(state, events)
    return RunTurn(state.start_turn(entry, pending))


def _cancel(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    if not state.turn_open:
        return reject(state, entry, Reason.NOTHING_TO_CANCEL, "no turn is running")
    state.consume(entry)
    events: list[s.Event] = []
    state.close_turn(events, s.EVENT_KIND_TURN_CANCELLED, entry=entry)
    return Commit(events)


def _reset(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    return Finalize([], entry)


def _timeout(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    if state.classify(entry) is Admission.FINALIZE:
        return Finalize([], entry, s.ErrorDetail(reason=Reason.TIMEOUT))
    state.consume(entry)  # a predecessor's timer: ignored
    return Commit([])


def _clear(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    return Commit(state.clear(entry))


def _compact(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    events = state.cancel_waiting_turn(entry)
    state.consume(entry)
    return Summarize(events, entry)


def _task_result(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    """A child's report, between steps (see handles.py for what it means)."""
    reading = state.read_report(entry)
    if reading.meaning is ReportMeaning.REJECT:
        return reject(state, entry, reading.reason, reading.message)
    if reading.meaning is ReportMeaning.ADMIT and not state.turn_open:
        return RunTurn(state.start_turn(entry, pending))
    events: list[s.Event] = []
    meaning = state.apply_report(entry, events)
    if meaning in (ReportMeaning.AWAITED, ReportMeaning.ADMIT) and state.turn_open:
        return go_on(state, events)
    return Commit(events)


def _unknown(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    return reject(state, entry)


# -- human input and sign-in: two phases --------------------------------------------


def answer_inputs(state: SessionState, entry: s.InboxEntry) -> Effect:
    """Phase one of input responses: consume the send, say what it said,
    reject unknown request ids, and name the approved tool calls to run."""
    turn = state.snapshot.open_turn
    if not state.turn_open or not turn.pending_inputs:
        return reject(state, entry, Reason.INPUT_NOT_PENDING, "no input request is pending")
    send = entry.command.send
    requests = {r.request_id: r for r in turn.pending_inputs}
    unknown = [r.request_id for r in send.input_responses if r.request_id not in requests]
    state.consume(entry)
    events: list[s.Event] = []
    if send.text.strip():
        turn.inbox_seqs.append(entry.seq)
        events.append(state.event(s.EVENT_KIND_MESSAGE_RECEIVED, entry, text=send.text))
    if unknown:
        message = f"no pending input request {', '.join(unknown)}"
        events.append(state.rejection(entry, Reason.UNKNOWN_INPUT_REQUEST, message))
    plan = AnswerInputs(entry, events)
    for request, response in _answered(requests, send.input_responses):
        if request.kind == s.INPUT_KIND_APPROVAL and response.approved:
            plan.to_run.append(request.tool_call)
    return plan


def apply_input_answers(
    state: SessionState, plan: AnswerInputs, results: Sequence[s.ToolResult]
) -> Effect:
    """Phase two: fold the answers in, in the order given (`results` are
    those of `plan.to_run`, in its order), and say what comes next."""
    if len(results) != len(plan.to_run):
        raise ValueError("one result per tool call to run")
    turn = state.snapshot.open_turn
    requests = {r.request_id: r for r in turn.pending_inputs}
    ran = iter(results)
    events = plan.events
    kept_limit = False
    for request, response in _answered(requests, plan.entry.command.send.input_responses):
        del requests[request.request_id]
        if request.kind == s.INPUT_KIND_QUESTION:
            state.context.remember(s.ChatMessage(role=s.ROLE_USER, content=response.text))
        elif request.kind == s.INPUT_KIND_APPROVAL:
            call = request.tool_call
            denied = error_result(call, "the user denied this call")
            state.record_result(next(ran) if response.approved else denied, events)
        elif response.approved:
            state.extend_budget()
        else:
            kept_limit = True
    del turn.pending_inputs[:]
    turn.pending_inputs.extend(requests.values())
    if kept_limit:
        error = s.ErrorDetail(reason=Reason.LIMIT_EXCEEDED, message="the user kept the limit")
        state.close_turn(events, s.EVENT_KIND_TURN_FAILED, error=error)
        return Commit(events)
    return go_on(state, events, announce_wait=True)


def _answered(
    requests: dict[str, s.InputRequest], responses: Sequence[s.InputResponse]
) -> list[tuple[s.InputRequest, s.InputResponse]]:
    """The responses that answer a pending request, each request once (the
    first response for it), in the order given."""
    seen: set[str] = set()
    answered = []
    for response in responses:
        request = requests.get(response.request_id)
        if request is None or response.request_id in seen:
            continue
        seen.add(response.request_id)
        answered.append((request, response))
    return answered


def _authorization_callback(state: SessionState, entry: s.InboxEntry, pending: Pending) -> Effect:
    """Phase one of a sign-in callback: record the attempt on its wait; once
    every expected attempt reported, say whether the call runs."""
    callback = entry.command.authorization_callback
    wait = state.auth_wait(callback.attempt_id)
    state.consume(entry)
    if wait is None:
        return Commit([], note="stale sign-in attempt dropped")
    wait.reported_attempt_ids.append(callback.attempt_id)
    wait.denied = wait.denied or not callback.granted
    if len(wait.reported_attempt_ids) < len(wait.expected_attempt_ids):
        return Commit([])
    call = wait.tool_call
    completed = state.event(
        s.EVENT_KIND_AUTHORIZATION_COMPLETED,
        entry,
        tool_call=call,
        attempt_id=callback.attempt_id,
        error=s.ErrorDetail(reason=Reason.DENIED) if wait.denied else None,
    )
    return AnswerAuthorization(entry, [completed], call, None if wait.denied else call)


def apply_authorization(
    state: SessionState, plan: AnswerAuthorization, result: s.ToolResult | None
) -> Effect:
    """Phase two: the call's result (None when it did not run: refused)."""
    call = plan.tool_call
    if result is None:
        result = error_result(call, "sign-in was refused")
    state.record_result(result, plan.events)
    state.close_auth_wait(call)
    return go_on(state, plan.events)


# -- the turn loop ---------------------------------------------------------------------


def recovery(state: SessionState) -> bool:
    """A run starting with an open turn that waits for nothing continues it:
    the step in flight at the predecessor's crash runs again."""
    return state.turn_open and not state.still_waiting()


def before_step(state: SessionState, pending: Pending, events: list[s.Event]) -> Effect | None:
    """At a model-call boundary: admit what may join the turn; None when the
    next step runs, else how the turn ends."""
    admission, stop = state.admit_pending(pending, events)
    if admission is Admission.CANCEL:
        state.close_turn(events, s.EVENT_KIND_TURN_CANCELLED, entry=stop)
        return Commit(events)
    if admission is Admission.FINALIZE:
        assert stop is not None
        is_timeout = stop.command.WhichOneof("kind") == "timeout"
        return Finalize(events, stop, s.ErrorDetail(reason=Reason.TIMEOUT) if is_timeout else None)
    max_steps = state.max_steps()
    if state.steps_taken() >= max_steps:
        error = s.ErrorDetail(
            reason=Reason.MAX_STEPS, message=f"the turn reached {max_steps} steps"
        )
        state.close_turn(events, s.EVENT_KIND_TURN_FAILED, error=error)
        return Commit(events)
    if state.budget_spent():
        state.ask_to_extend_budget(events)
        return Commit(events)
    return None


def after_step(
    state: SessionState, progress: StepProgress, pending: Pending, events: list[s.Event]
) -> Effect | NextStep:
    """Fold a step in: the turn goes on (NextStep) or ends (the effect)."""
    outcome = state.apply_step(progress, events)
    if outcome is Outcome.ABORTED:
        return NextStep.NOW
    if outcome is Outcome.FAILED:
        error = s.ErrorDetail(reason=progress.reason, message=progress.error)
        state.close_turn(events, s.EVENT_KIND_TURN_FAILED, error=error)
        return Commit(events)
    if outcome in (Outcome.PAUSED, Outcome.AWAITING):
        if state.waiting_for_user():
            events.append(state.event(s.EVENT_KIND_SESSION_WAITING))
        return Commit(events)
    if outcome is Outcome.FINAL and not state.steer_pending(pending):
        state.close_turn(events, s.EVENT_KIND_TURN_COMPLETED)
        return Commit(events)
    return NextStep.AFTER_COMMIT


def compaction_due(state: SessionState) -> bool:
    """At a turn boundary: what the model sees outgrew the agent's context
    budget (docs/design.md §4)."""
    agent = state.agent
    return not state.turn_open and state.context.over(
        agent.context_budget_bytes, agent.context_budget_entries
    )


_Rule = Callable[[SessionState, s.InboxEntry, Pending], Effect]
_BY_KIND: dict[str, _Rule] = {
    "send": _send,
    "cancel": _cancel,
    "reset": _reset,
    "timeout": _timeout,
    "clear": _clear,
    "compact": _compact,
    "authorization_callback": _authorization_callback,
    "task_result": _task_result,
}
