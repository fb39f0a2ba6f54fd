"""Wait rules (docs/design.md §4), as functions over `SessionState`
(held.py): human input and sign-in pause the turn (the session waits);
responses and callbacks resume it (the two-phase answers are decisions.py's);
a steer message while a turn waits abandons the waits (a queued one waits
for the turn to end: admission.py); a spent budget asks the user (input
kind SESSION_LIMIT): approving extends it. A turn also waits, not for the
user, for the children its calls wait for. Pure: no I/O.
"""

from __future__ import annotations

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.rules import reports
from baton_runtime.owner.rules.held import SessionState


def auth_wait(state: SessionState, attempt_id: str) -> s.AuthorizationWait | None:
    if not state.turn_open:
        return None
    for wait in state.snapshot.open_turn.pending_authorizations:
        if attempt_id in wait.expected_attempt_ids and attempt_id not in wait.reported_attempt_ids:
            return wait
    return None


def request_input(
    state: SessionState,
    events: list[s.Event],
    kind: s.InputKind.ValueType,
    prompt: str,
    *,
    step: int = 0,
    tool_call: s.ToolCall | None = None,
) -> None:
    request = s.InputRequest(
        request_id=state.next_id("input"), kind=kind, prompt=prompt, tool_call=tool_call
    )
    state.snapshot.open_turn.pending_inputs.append(request)
    events.append(state.event(s.EVENT_KIND_INPUT_REQUESTED, step=step, input_request=request))
    reports.report_wait(state, request=request)


def ask_to_extend_budget(state: SessionState, events: list[s.Event]) -> None:
    request_input(
        state, events, s.INPUT_KIND_SESSION_LIMIT, "The session budget is spent. Extend it?"
    )
    events.append(state.event(s.EVENT_KIND_SESSION_WAITING))


def require_authorization(
    state: SessionState, events: list[s.Event], call: s.ToolCall, attempts: int, step: int
) -> None:
    wait = s.AuthorizationWait(tool_call=call)
    for _ in range(attempts):
        attempt = state.next_id("attempt")
        wait.expected_attempt_ids.append(attempt)
        events.append(
            state.event(
                s.EVENT_KIND_AUTHORIZATION_REQUIRED,
                step=step,
                tool_call=call,
                attempt_id=attempt,
            )
        )
        reports.report_wait(state, attempt_id=attempt)
    state.snapshot.open_turn.pending_authorizations.append(wait)


def abandon_waits(state: SessionState) -> list[s.Event]:
    """A steer message while the turn waits: pending waits are closed
    (approvals and sign-ins as not done) and the turn goes on."""
    events: list[s.Event] = []
    turn = state.snapshot.open_turn
    for request in turn.pending_inputs:
        if request.kind == s.INPUT_KIND_APPROVAL:
            message = "not approved: the user sent a new message"
            state.record_result(error_result(request.tool_call, message), events)
    for wait in turn.pending_authorizations:
        message = "sign-in abandoned: the user sent a new message"
        state.record_result(error_result(wait.tool_call, message), events)
    del turn.pending_inputs[:]
    del turn.pending_authorizations[:]
    return events


def extend_budget(state: SessionState) -> None:
    """The user approved a SESSION_LIMIT request."""
    snap = state.snapshot
    used = snap.usage.input_tokens + snap.usage.output_tokens
    snap.limits.token_budget = used + max(snap.limits.token_budget, 1)
    if snap.limits.cost_budget_micros:
        snap.limits.cost_budget_micros = snap.usage.cost_micros + snap.limits.cost_budget_micros


def close_auth_wait(state: SessionState, call: s.ToolCall) -> None:
    turn = state.snapshot.open_turn
    remaining = [w for w in turn.pending_authorizations if w.tool_call.id != call.id]
    del turn.pending_authorizations[:]
    turn.pending_authorizations.extend(remaining)


def waiting_for_user(state: SessionState) -> bool:
    turn = state.snapshot.open_turn
    return bool(turn.pending_inputs or turn.pending_authorizations)


def still_waiting(state: SessionState) -> bool:
    """The open turn waits: for the user, or for children's results."""
    return waiting_for_user(state) or bool(state.handles.awaited(state.turn_id))


def error_result(call: s.ToolCall, output: str) -> s.ToolResult:
    """A tool call's error result (it did not run, or it failed)."""
    return s.ToolResult(tool_call_id=call.id, name=call.name, output=output, is_error=True)
