"""A session's status: the one place that says where a session stands
(docs/design.md §14), for introspection now and for metrics and logs later.

Pure: it reads `SessionFacts`, plain values gathered from what hooks (owner
record, inbox head) and anchor (snapshot, latest event) store, and does no
I/O. The gRPC edge maps the result onto its proto enum.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(enum.Enum):
    """Where a session stands. The value is the name the CLI and logs use."""

    IDLE = "idle"
    RUNNING = "running"
    WAITING_FOR_INPUT = "waiting_for_input"
    WAITING_FOR_AUTHORIZATION = "waiting_for_authorization"
    PARKED = "parked"
    STALLED = "stalled"
    HANDING_OFF = "handing_off"
    FINALIZED = "finalized"


@dataclass(frozen=True)
class SessionFacts:
    """What the status is computed from.

    `committed` is False while the session has no snapshot yet (a child
    session before its first commit). `stalled_by_run` is the owner run that
    reported the latest event when that event is `session.stalled` (else
    ""): a stall counts only while that run still owns the session (a
    takeover or a restart runs it again with a fresh budget)."""

    committed: bool
    finalized: bool
    owner_run_id: str
    owner_deployment_id: str
    snapshot_deployment_id: str
    parked: bool
    inbox_depth: int
    turn_open: bool
    pending_inputs: int
    pending_authorizations: int
    children_running: int
    children_waiting: int
    stalled_by_run: str = ""
    stalled_reason: str = ""
    stalled_message: str = ""


@dataclass(frozen=True)
class StatusView:
    """A status and, for `stalled`, why."""

    status: Status
    reason: str = ""
    message: str = ""


def session_status(facts: SessionFacts) -> StatusView:
    """The status, first match wins:

    1. finalized — the snapshot says so (the stream is closed);
    2. handing_off — the owner record names another deployment than the
       last snapshot's: a transfer moved the session and the successor has
       not committed yet;
    3. stalled — the latest event is session.stalled by the current run;
    4. waiting_for_authorization — the open turn waits for sign-ins;
    5. waiting_for_input — the open turn waits for human input, or a child
       surfaced a wait;
    6. running — a turn is open, a child works for the session, or accepted
       commands are not consumed yet (also a parked session whose bell rang);
    7. parked — idle and unloaded;
    8. idle.
    """
    if facts.finalized:
        return StatusView(Status.FINALIZED)
    if facts.committed and facts.owner_deployment_id != facts.snapshot_deployment_id:
        return StatusView(Status.HANDING_OFF)
    if facts.stalled_by_run and facts.stalled_by_run == facts.owner_run_id:
        return StatusView(Status.STALLED, facts.stalled_reason, facts.stalled_message)
    if facts.pending_authorizations:
        return StatusView(Status.WAITING_FOR_AUTHORIZATION)
    if facts.pending_inputs or facts.children_waiting:
        return StatusView(Status.WAITING_FOR_INPUT)
    if facts.turn_open or facts.children_running or facts.inbox_depth > 0:
        return StatusView(Status.RUNNING)
    if facts.parked:
        return StatusView(Status.PARKED)
    return StatusView(Status.IDLE)
