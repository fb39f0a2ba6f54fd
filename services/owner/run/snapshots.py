"""A new session's first snapshot, and the snapshot format this build
writes (a checkpoint in another format is refused by checkpoint.py unless
this build reads it). Pure: no I/O; the host commits it with session.started.
"""

from __future__ import annotations

import time

from baton_runtime._proto.baton.session.v1 import session_pb2 as s

SNAPSHOT_FORMAT = 2  # 2: the model history is appended as entries of its own


def initial_snapshot(
    session_id: str,
    channel: str,
    deployment_id: str,
    hooks: list[str],
    *,
    timeout_seconds: int = 0,
    token_budget: int = 0,
    cost_budget_micros: int = 0,
    parent: s.ParentLink | None = None,
    now: float | None = None,
) -> s.SessionSnapshot:
    """Active, with the claimed tokens and the limits asked for; a child's
    parent link (its work and outbox empty) and the parent's limits; a
    lifetime deadline from `now` when the session has a timeout."""
    snapshot = s.SessionSnapshot(
        format_version=SNAPSHOT_FORMAT,
        session_id=session_id,
        channel=channel,
        deployment_id=deployment_id,
        hooks=hooks,
        status=s.SESSION_STATUS_ACTIVE,
        limits=s.Limits(token_budget=token_budget, cost_budget_micros=cost_budget_micros),
    )
    if parent is not None and parent.parent_session_id:
        snapshot.parent.CopyFrom(parent)
        snapshot.parent.work = 0
        del snapshot.parent.outbox[:]
        snapshot.limits.MergeFrom(parent.limits)
    if timeout_seconds:
        # The deadline is committed with session.started: it survives restarts.
        snapshot.timeout.duration_seconds = timeout_seconds
        started = time.time() if now is None else now
        snapshot.timeout.deadline.FromSeconds(int(started) + timeout_seconds)
    return snapshot


def lifetime_deadline(snapshot: s.SessionSnapshot) -> int:
    """The session's lifetime deadline (unix seconds), 0 without a timeout."""
    timeout = snapshot.timeout
    return timeout.deadline.seconds if timeout.duration_seconds else 0
