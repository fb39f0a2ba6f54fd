"""The rules of a commit, without etcd: what a step's commit may hold, and
what a refused commit's transaction saw means.

`encode_commit` checks and encodes a commit once, before anything is
written; `refused_commit` reads the values a failed commit transaction
read back and says whether it was our own applied commit (a retry) or
which refusal it is. services/anchor/journal.py does the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.history import check_entry
from baton_runtime.common import ids, limits
from baton_runtime.common.errors import Aborted, FailedPrecondition, InvalidArgument, Reason
from baton_runtime.common.etcd.txn import Fence

TERMINAL_KINDS = frozenset({s.EVENT_KIND_SESSION_COMPLETED, s.EVENT_KIND_SESSION_FAILED})


@dataclass(frozen=True)
class EncodedCommit:
    """One step's durable effect, validated and encoded once."""

    fence: Fence
    events: Sequence[s.Event]
    encoded_events: Sequence[bytes]
    history: Sequence[bytes]
    snapshot: s.SessionSnapshot
    snapshot_bytes: bytes
    close: bool
    # Snapshot, events and history entries, encoded (at most MAX_COMMIT_BYTES).
    size: int

    @property
    def first_seq(self) -> int:
        """Where the commit continues the stream (for a snapshot-only commit:
        the snapshot names the stream head exactly)."""
        return self.events[0].seq if self.events else self.snapshot.next_event_seq


def encode_commit(
    fence: s.Fence,
    events: Sequence[s.Event],
    snapshot: s.SessionSnapshot,
    close: bool,
    history: Sequence[s.ChatMessage] = (),
) -> EncodedCommit:
    """Everything checkable without etcd: ids, seqs, sizes, terminal rules.
    Nothing is written unless all of it holds."""
    _check_header(fence, events, snapshot, history)
    snapshot_bytes = snapshot.SerializeToString()
    if len(snapshot_bytes) > limits.MAX_SNAPSHOT_BYTES:
        raise InvalidArgument(
            Reason.SNAPSHOT_TOO_LARGE,
            f"snapshot is {len(snapshot_bytes)} bytes; the limit is {limits.MAX_SNAPSHOT_BYTES}",
        )
    head = snapshot.history_log.next_index
    encoded_history = [m.SerializeToString() for m in history]
    for offset, raw in enumerate(encoded_history):
        check_entry(len(raw), head - len(history) + offset)
    encoded_events = [e.SerializeToString() for e in events]
    for event, raw in zip(events, encoded_events, strict=True):
        if len(raw) > limits.MAX_EVENT_BYTES:
            raise InvalidArgument(
                Reason.EVENT_TOO_LARGE,
                f"event {event.seq} is {len(raw)} bytes; the limit is {limits.MAX_EVENT_BYTES}",
            )
    total = len(snapshot_bytes) + sum(map(len, encoded_events)) + sum(map(len, encoded_history))
    if total > limits.MAX_COMMIT_BYTES:
        raise InvalidArgument(
            Reason.COMMIT_TOO_LARGE,
            f"commit is {total} bytes; the limit is {limits.MAX_COMMIT_BYTES}",
        )
    _check_sequence(fence.session_id, events, snapshot, close)
    return EncodedCommit(
        Fence.of(fence),
        events,
        encoded_events,
        encoded_history,
        snapshot,
        snapshot_bytes,
        close,
        total,
    )


def _check_header(
    fence: s.Fence,
    events: Sequence[s.Event],
    snapshot: s.SessionSnapshot,
    history: Sequence[s.ChatMessage],
) -> None:
    """The fence, the counts and the snapshot's session and history head."""
    ids.validate_session_id(fence.session_id)
    if not fence.owner_run_id or fence.epoch < 1:
        raise InvalidArgument(Reason.INVALID_FIELD, "fence needs owner_run_id and epoch >= 1")
    if len(events) > limits.MAX_EVENTS_PER_COMMIT:
        raise InvalidArgument(
            Reason.COMMIT_TOO_LARGE,
            f"{len(events)} events; at most {limits.MAX_EVENTS_PER_COMMIT}",
        )
    if len(history) > limits.MAX_HISTORY_PER_COMMIT:
        raise InvalidArgument(
            Reason.COMMIT_TOO_LARGE,
            f"{len(history)} history entries; at most {limits.MAX_HISTORY_PER_COMMIT}",
        )
    if snapshot.session_id != fence.session_id:
        raise InvalidArgument(Reason.INVALID_FIELD, "snapshot.session_id differs from the fence")
    if len(history) > snapshot.history_log.next_index:
        raise InvalidArgument(
            Reason.INVALID_FIELD, "history entries must end at snapshot.history_log.next_index"
        )


def _check_sequence(
    session_id: str, events: Sequence[s.Event], snapshot: s.SessionSnapshot, close: bool
) -> None:
    """Events of the fenced session, consecutive, the snapshot after the
    last; a terminal event only last, and only closing the stream."""
    for offset, event in enumerate(events):
        if event.session_id != session_id:
            raise InvalidArgument(Reason.INVALID_FIELD, "every event must name the fenced session")
        if event.seq != events[0].seq + offset:
            raise InvalidArgument(Reason.INVALID_FIELD, "event seqs must be consecutive")
        if event.kind in TERMINAL_KINDS and not (close and offset == len(events) - 1):
            raise InvalidArgument(
                Reason.INVALID_FIELD, "a terminal event must be last and close the stream"
            )
    if events and snapshot.next_event_seq != events[-1].seq + 1:
        raise InvalidArgument(
            Reason.INVALID_FIELD, "snapshot.next_event_seq must follow the last event"
        )
    if close and (not events or events[-1].kind not in TERMINAL_KINDS):
        raise InvalidArgument(Reason.INVALID_FIELD, "close_stream needs a terminal last event")


def check_consumed_from(consumed_from: int | None, snapshot: s.SessionSnapshot) -> None:
    """The replaced snapshot's inbox position cannot be beyond the new one's."""
    consumed = snapshot.inbox_next_seq
    if consumed_from is not None and consumed_from > consumed:
        raise InvalidArgument(
            Reason.INVALID_FIELD,
            f"consumed_inbox_from {consumed_from} is beyond the snapshot's "
            f"inbox_next_seq {consumed}",
        )


@dataclass(frozen=True)
class RefusedRead:
    """What a refused commit's transaction read back (the fence was checked
    first): the stored snapshot and its mod revision, the stored event at
    the commit's first seq, the closed marker, the stream's horizon and the
    seq below which its events are sealed into the object store."""

    snapshot: bytes | None
    snapshot_revision: int
    first_event: bytes | None
    closed: bool
    horizon: int
    sealed_below: int = 0


def refused_commit(
    commit: EncodedCommit, seen: RefusedRead, expected_snapshot_revision: int | None
) -> int:
    """The revision of our own applied commit when the refused txn was a
    retry of it (the stored snapshot and first event are byte-identical);
    otherwise raises the refusal: SESSION_FINALIZED, STALE_SNAPSHOT or
    SEQ_CONFLICT."""
    same_snapshot = seen.snapshot is not None and seen.snapshot == commit.snapshot_bytes
    same_first = (
        not commit.events
        or seen.first_event == commit.encoded_events[0]
        # (the applied commit's first event is already below the horizon,
        # or sealed: its key is gone from etcd)
        or (seen.first_event is None and commit.first_seq < max(seen.horizon, seen.sealed_below))
    )
    if same_snapshot and same_first:
        return seen.snapshot_revision
    sid = commit.fence.session_id
    if seen.closed:
        raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {sid} stream is closed")
    if (
        expected_snapshot_revision is not None
        and seen.snapshot_revision != expected_snapshot_revision
    ):
        raise Aborted(
            Reason.STALE_SNAPSHOT,
            f"the snapshot is at revision {seen.snapshot_revision}, "
            f"not {expected_snapshot_revision}: a newer commit exists",
        )
    raise Aborted(
        Reason.SEQ_CONFLICT,
        f"events must continue the stream gaplessly at seq {commit.first_seq}",
    )
