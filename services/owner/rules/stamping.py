"""Stamping a commit (docs/design.md §4): what a step's events and snapshot
become as the commit that carries them. The events are numbered on from the
stream's position, and an event no rule gave a time (the host's
session.started, stalled, resumed) gets the commit's; the snapshot moves
past them and is stamped with the deployment that commits it and the trace
of its last turn. Pure: no I/O; run/commit.py sends what this stamps.
(Sealing is the object store's word: a full segment sealed into an object.)
"""

from __future__ import annotations

from collections.abc import Sequence

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.rules.held import timestamp


def stamp(
    snapshot: s.SessionSnapshot,
    events: Sequence[s.Event],
    *,
    deployment_id: str,
    now: float,
    trace_id: str = "",
    consumed_from: int | None = None,
) -> int | None:
    """Stamp `events` and `snapshot` (both changed in place) as one commit
    made at `now` by `deployment_id`; `trace_id`: the trace the commit is
    part of ("" keeps the last one). Returns the inbox position the commit
    deletes consumed entries from: `consumed_from` (the last committed
    snapshot's; None: every entry below this one's), never past the
    snapshot's own position (a snapshot rolled back to a refused commit's
    may be behind it)."""
    first = snapshot.next_event_seq
    for offset, event in enumerate(events):
        event.seq = first + offset
        if not event.HasField("time"):
            event.time.CopyFrom(timestamp(now))
    snapshot.next_event_seq = first + len(events)
    snapshot.deployment_id = deployment_id
    if trace_id:
        snapshot.last_trace_id = trace_id
    if consumed_from is None:
        return None
    return min(consumed_from, snapshot.inbox_next_seq)
