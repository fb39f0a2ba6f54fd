"""When a run may leave its owner (docs/design.md §6, issue 12), decided without
I/O: which delivery triggers a handoff, when a drain attempt is due, why
a session cannot move yet, when an idle session may park. `Departures`
(departures.py) makes the attempts.
"""

from __future__ import annotations

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.rules.held import SessionState


def idle_for_handoff(state: SessionState) -> bool:
    """Nothing of this session works on: no open turn, no running child
    (a running task, an active subagent turn or workflow tool, a child
    waiting on a human), and not a child session itself (a child stays
    on the deployment that owns it). Pending commands are the run's
    business (docs/design.md §6)."""
    return not (state.turn_open or state.handles.busy() or state.is_child)


def is_trigger(state: SessionState, entry: s.InboxEntry, *, revision_known: bool) -> bool:
    """Evaluated once, when the delivery arrives while the session is idle
    (no open turn: no step, pending input or sign-in; nothing pending) and
    before it is buffered or applied. Only a conversational send accepted
    by another deployment qualifies; everything else — input responses,
    results, cancel, reset, clear, compact — never does. Without the last
    commit's revision eligibility is unknown: no."""
    if not revision_known or not idle_for_handoff(state):
        return False  # unknown, or a child works for it (or it is a child)
    command = entry.command
    if command.WhichOneof("kind") != "send":
        return False
    send = command.send
    accepted = command.delivery.accepted_deployment_id
    return (
        bool(send.text.strip())
        and not send.input_responses
        and bool(accepted)
        and accepted != state.identity.deployment_id
        and state.snapshot.status == s.SESSION_STATUS_ACTIVE
    )


def drain_wait(
    state: SessionState, *, draining: bool, pending: int, due_at: float, now: float
) -> float | None:
    """Seconds until a drain attempt is due; None while none can be (no
    drain, or the session is not idle: an open turn, something pending, a
    child working for it: it moves when that is done)."""
    if (
        not draining
        or pending
        or state.turn_open
        or state.handles.busy()
        or state.snapshot.status != s.SESSION_STATUS_ACTIVE
    ):
        return None
    return max(0.0, due_at - now)


def busy_with(state: SessionState) -> str:
    """Why the session is not idle (it moves, by a drain or a handoff, when
    it is); "" when it is idle. A drain's report says it per session."""
    if state.turn_open:
        return "a turn is open; it moves when it settles"
    if state.handles.busy():
        return "a child session works for it; it moves after"
    return ""


def may_park(*, park_after: float | None, pending: int, reports_pending: bool) -> bool:
    """An idle run parks when parking is on and nothing is left to do here."""
    return park_after is not None and not pending and not reports_pending
