"""The session journal on etcd: fenced commits, snapshots, stream reads."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from baton.session.v1 import session_pb2 as s
from services.common import ids
from services.common.errors import (
    Aborted,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    NotFound,
    Reason,
)
from services.common.etcd import (
    Store,
    cmp_absent,
    cmp_mod,
    cmp_present,
    cmp_value,
    op_get,
    op_put,
    single_value,
    watch_then_read,
)
from services.common.keys import Keys, fence_value, prefix_end, seq_of

MAX_SNAPSHOT_BYTES = 1024 * 1024
MAX_COMMIT_BYTES = 1400 * 1024
MAX_EVENTS_PER_COMMIT = 100
_BATCH_BYTES = 512 * 1024

TERMINAL_KINDS = frozenset({s.EVENT_KIND_SESSION_COMPLETED, s.EVENT_KIND_SESSION_FAILED})


def validate_commit(
    fence: s.Fence, events: Sequence[s.Event], snapshot: s.SessionSnapshot, close: bool
) -> None:
    """Everything checkable without etcd: ids, seqs, sizes, terminal rules."""
    ids.validate_session_id(fence.session_id)
    if not fence.owner_run_id or fence.epoch < 1:
        raise InvalidArgument(Reason.INVALID_FIELD, "fence needs owner_run_id and epoch >= 1")
    if len(events) > MAX_EVENTS_PER_COMMIT:
        raise InvalidArgument(
            Reason.COMMIT_TOO_LARGE, f"{len(events)} events; at most {MAX_EVENTS_PER_COMMIT}"
        )
    if snapshot.session_id != fence.session_id:
        raise InvalidArgument(Reason.INVALID_FIELD, "snapshot.session_id differs from the fence")
    snapshot_size = snapshot.ByteSize()
    if snapshot_size > MAX_SNAPSHOT_BYTES:
        raise InvalidArgument(
            Reason.SNAPSHOT_TOO_LARGE,
            f"snapshot is {snapshot_size} bytes; the limit is {MAX_SNAPSHOT_BYTES}",
        )
    total = snapshot_size + sum(e.ByteSize() for e in events)
    if total > MAX_COMMIT_BYTES:
        raise InvalidArgument(
            Reason.COMMIT_TOO_LARGE, f"commit is {total} bytes; the limit is {MAX_COMMIT_BYTES}"
        )
    for offset, event in enumerate(events):
        if event.session_id != fence.session_id:
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


class Journal:
    """Domain operations of the anchor service over one etcd store."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._keys = keys

    async def commit(
        self,
        fence: s.Fence,
        events: Sequence[s.Event],
        snapshot: s.SessionSnapshot,
        close: bool,
        expected_snapshot_revision: int | None = None,
    ) -> tuple[int, bool]:
        """One fenced txn: events + snapshot (+ the closed marker).

        Returns (revision, replayed). With `expected_snapshot_revision` the txn
        also compares the snapshot's mod revision, so no delayed or reordered
        commit can roll the snapshot back. A retry of an applied commit (the
        stored snapshot and first event are byte-identical) writes nothing and
        reports replayed."""
        validate_commit(fence, events, snapshot, close)
        k = self._keys
        sid = fence.session_id
        encoded = [e.SerializeToString() for e in events]
        snapshot_bytes = snapshot.SerializeToString()
        compare = [
            cmp_value(k.fence(sid), fence_value(fence.epoch, fence.owner_run_id)),
            cmp_absent(k.closed(sid)),
        ]
        if expected_snapshot_revision is not None:
            compare.append(
                cmp_absent(k.snapshot(sid))
                if expected_snapshot_revision == 0
                else cmp_mod(k.snapshot(sid), expected_snapshot_revision)
            )
        success = [op_put(k.snapshot(sid), snapshot_bytes)]
        # The stream continues gaplessly at `first` (for a snapshot-only commit:
        # the snapshot names the stream head exactly).
        first = events[0].seq if events else snapshot.next_event_seq
        compare.append(cmp_absent(k.event(sid, first)))
        if first > 0:
            compare.append(cmp_present(k.event(sid, first - 1)))
        if events:
            success += [
                op_put(k.event(sid, e.seq), raw) for e, raw in zip(events, encoded, strict=True)
            ]
        if close:
            success.append(op_put(k.closed(sid), str(events[-1].seq).encode()))
        if events:  # last: readers batch a commit's events up to this marker
            success.append(op_put(k.commit_marker(sid), str(events[-1].seq).encode()))
        failure = [op_get(k.fence(sid)), op_get(k.closed(sid)), op_get(k.snapshot(sid))]
        if events:
            failure.append(op_get(k.event(sid, events[0].seq)))
        response = await self._store.txn(compare, success, failure)
        if response.succeeded:
            return response.header.revision, False
        current_fence = single_value(response.responses[0])
        if current_fence != fence_value(fence.epoch, fence.owner_run_id):
            if current_fence is None:
                raise NotFound(Reason.SESSION_NOT_FOUND, f"session {sid} not found")
            raise Fenced(
                f"owner run {fence.owner_run_id} epoch {fence.epoch} no longer owns session {sid}",
                session_id=sid,
            )
        stored = response.responses[2].response_range.kvs
        same_snapshot = bool(stored) and stored[0].value == snapshot_bytes
        same_first = not events or single_value(response.responses[3]) == encoded[0]
        if same_snapshot and same_first:
            return stored[0].mod_revision, True  # our own applied commit: a retry
        if single_value(response.responses[1]) is not None:
            raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {sid} stream is closed")
        current_revision = stored[0].mod_revision if stored else 0
        if (
            expected_snapshot_revision is not None
            and current_revision != expected_snapshot_revision
        ):
            raise Aborted(
                Reason.STALE_SNAPSHOT,
                f"the snapshot is at revision {current_revision}, "
                f"not {expected_snapshot_revision}: a newer commit exists",
            )
        raise Aborted(
            Reason.SEQ_CONFLICT,
            f"events must continue the stream gaplessly at seq {events[0].seq if events else 0}",
        )

    async def snapshot(self, session_id: str) -> tuple[s.SessionSnapshot, int]:
        ids.validate_session_id(session_id)
        response = await self._store.txn([], [op_get(self._keys.snapshot(session_id))], [])
        kvs = response.responses[0].response_range.kvs
        if not kvs:
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} has no snapshot")
        # The snapshot key's own revision: what the next commit must compare.
        return s.SessionSnapshot.FromString(kvs[0].value), kvs[0].mod_revision

    async def read(
        self, session_id: str, start_seq: int, follow: bool
    ) -> AsyncIterator[list[s.Event]]:
        """Events from `start_seq` in order, in batches (a replayed range, then
        one batch per commit); with `follow`, live until the terminal event."""
        ids.validate_session_id(session_id)
        k = self._keys
        prefix = k.events_prefix(session_id)
        # A follower's watch opens before the read (see `watch_then_read`).
        watching = (
            watch_then_read(self._store.client, k.stream_prefix(session_id))
            if follow
            else contextlib.nullcontext()
        )
        async with watching as follower:
            response = await self._store.txn(
                [],
                [
                    op_get(k.event(session_id, start_seq), prefix_end(prefix)),
                    op_get(k.snapshot(session_id), keys_only=True),
                    op_get(k.closed(session_id)),
                ],
                [],
            )
            kvs = response.responses[0].response_range.kvs
            if not kvs and not response.responses[1].response_range.kvs:
                raise NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} not found")
            closed = single_value(response.responses[2])
            if closed is not None and start_seq > int(closed):
                return  # the cursor is past the terminal event: the stream is over
            next_seq = start_seq
            batch: list[s.Event] = []
            size = 0
            for kv in kvs:
                event = s.Event.FromString(kv.value)
                batch.append(event)
                size += len(kv.value)
                next_seq = event.seq + 1
                if event.kind in TERMINAL_KINDS:
                    yield batch
                    return
                if size >= _BATCH_BYTES:
                    yield batch
                    batch, size = [], 0
            if batch:
                yield batch
            if not follow or closed is not None:
                return
            # Watch the events and the commit marker (written last by every commit
            # with events), so each commit reaches the reader as one batch.
            marker = k.commit_marker(session_id)
            batch = []
            assert follower is not None
            async for change in follower.events(response.header.revision + 1):
                key = change.kv.key
                if key == marker:
                    if batch:
                        yield batch
                        if batch[-1].kind in TERMINAL_KINDS:
                            return
                        batch = []
                    continue
                if not change.kv.value or seq_of(key) < next_seq:
                    continue
                event = s.Event.FromString(change.kv.value)
                batch.append(event)
                next_seq = event.seq + 1
