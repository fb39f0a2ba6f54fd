"""The session journal on etcd: fenced commits, loads, stream reads.

A commit is one fenced transaction holding a step's events, the history
entries the step appended (through `HistoryStore`) and the new snapshot,
which stays bounded: nothing in it grows with the session's age, so a
commit costs the same at turn 10 and at turn 10,000. The stream itself is
bounded by its retention horizon (services/anchor/horizon.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from baton.session.v1 import session_pb2 as s
from services.anchor.history import EtcdHistory, GuardFailed, HistoryStore, check_entry
from services.anchor.horizon import StreamHorizon, below_horizon, horizon_of, opened_pages
from services.common import ids, limits, metrics
from services.common.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
)
from services.common.etcd_ops import cmp_absent, cmp_mod, cmp_present
from services.common.etcd_store import Store
from services.common.etcd_watch import watch_then_read
from services.common.keys import Keys, prefix_end, seq_of
from services.common.txn import Fence, Txn

_BATCH_BYTES = 512 * 1024
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0

TERMINAL_KINDS = frozenset({s.EVENT_KIND_SESSION_COMPLETED, s.EVENT_KIND_SESSION_FAILED})


@dataclass(frozen=True)
class Commit:
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


def encode_commit(
    fence: s.Fence,
    events: Sequence[s.Event],
    snapshot: s.SessionSnapshot,
    close: bool,
    history: Sequence[s.ChatMessage] = (),
) -> Commit:
    """Everything checkable without etcd: ids, seqs, sizes, terminal rules.
    Nothing is written unless all of it holds."""
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
    head = snapshot.history_log.next_index
    if len(history) > head:
        raise InvalidArgument(
            Reason.INVALID_FIELD, "history entries must end at snapshot.history_log.next_index"
        )
    snapshot_bytes = snapshot.SerializeToString()
    if len(snapshot_bytes) > limits.MAX_SNAPSHOT_BYTES:
        raise InvalidArgument(
            Reason.SNAPSHOT_TOO_LARGE,
            f"snapshot is {len(snapshot_bytes)} bytes; the limit is {limits.MAX_SNAPSHOT_BYTES}",
        )
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
    return Commit(
        Fence.of(fence),
        events,
        encoded_events,
        encoded_history,
        snapshot,
        snapshot_bytes,
        close,
        total,
    )


@dataclass(frozen=True)
class LoadedSnapshot:
    """The first part of a load: the snapshot and its key's mod revision."""

    snapshot: s.SessionSnapshot
    revision: int


@dataclass(frozen=True)
class _Page:
    events: Sequence[bytes]
    more: bool
    exists: bool
    closed: int | None
    # The first seq kept (the retention horizon, services/anchor/horizon.py).
    horizon: int
    revision: int


class Journal:
    """Domain operations of the anchor service over one etcd store."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        history: HistoryStore | None = None,
        *,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        horizon: StreamHorizon | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self._history = history or EtcdHistory(store, keys)
        self._horizon = horizon
        self._retention_seconds = retention_seconds
        self._clock = clock

    @property
    def horizon(self) -> StreamHorizon | None:
        """What moves live streams' retention horizons (None: nothing does)."""
        return self._horizon

    async def commit(
        self,
        fence: s.Fence,
        events: Sequence[s.Event],
        snapshot: s.SessionSnapshot,
        close: bool,
        expected_snapshot_revision: int | None = None,
        history: Sequence[s.ChatMessage] = (),
        consumed_from: int | None = None,
    ) -> tuple[int, bool]:
        """One fenced txn: events + history entries + snapshot (+ the closed
        marker and the retention index entry), deleting the inbox entries
        the snapshot says are consumed, from `consumed_from` (the replaced
        snapshot's position; None: from the inbox's first key).

        Returns (revision, replayed). With `expected_snapshot_revision` the txn
        also compares the snapshot's mod revision, so no delayed or reordered
        commit can roll the snapshot back. A retry of an applied commit (the
        stored snapshot and first event are byte-identical) writes nothing and
        reports replayed."""
        commit = encode_commit(fence, events, snapshot, close, history)
        consumed = snapshot.inbox_next_seq
        if consumed_from is not None and consumed_from > consumed:
            raise InvalidArgument(
                Reason.INVALID_FIELD,
                f"consumed_inbox_from {consumed_from} is beyond the snapshot's "
                f"inbox_next_seq {consumed}",
            )
        k = self._keys
        sid = fence.session_id
        txn = Txn().require(commit.fence.compare(k), cmp_absent(k.closed(sid)))
        if expected_snapshot_revision is not None:
            txn.require(
                cmp_absent(k.snapshot(sid))
                if expected_snapshot_revision == 0
                else cmp_mod(k.snapshot(sid), expected_snapshot_revision)
            )
        # The stream continues gaplessly at `first` (for a snapshot-only commit:
        # the snapshot names the stream head exactly).
        first = events[0].seq if events else snapshot.next_event_seq
        txn.require(cmp_absent(k.event(sid, first)))
        if first > 0:
            txn.require(cmp_present(k.event(sid, first - 1)))
        txn.put(k.snapshot(sid), commit.snapshot_bytes)
        for event, raw in zip(events, commit.encoded_events, strict=True):
            txn.put(k.event(sid, event.seq), raw)
        # A page the commit opens is stamped with anchor's clock: it dates the
        # events before it for the stream's retention horizon.
        pages = opened_pages(first, len(events))
        for page in pages:
            txn.put(k.stream_page(sid, page), str(int(self._clock() * 1000)).encode())
        if commit.history:
            first_index = snapshot.history_log.next_index - len(commit.history)
            txn.success += await self._history.stage(sid, first_index, commit.history)
        deletes = self._delete_consumed(txn, sid, consumed_from, consumed)
        if close:
            txn.put(k.closed(sid), str(events[-1].seq).encode())
            expires_ms = int((self._clock() + self._retention_seconds) * 1000)
            txn.put(k.retention(expires_ms, sid), b"")
        if events:  # last: readers batch a commit's events up to this marker
            txn.put(k.commit_marker(sid), str(events[-1].seq).encode())
        txn.read_on_failure("fence", k.fence(sid))
        txn.read_on_failure("closed", k.closed(sid))
        txn.read_on_failure("snapshot", k.snapshot(sid))
        if events:
            txn.read_on_failure("first", k.event(sid, events[0].seq))
            txn.read_on_failure("horizon", k.horizon(sid))
        result = await txn.run(self._store)
        if result.succeeded:
            metrics.EVENTS_COMMITTED.inc(len(events))
            metrics.COMMIT_BYTES.observe(commit.size)
            if deletes:
                metrics.INBOX_ENTRIES_DELETED.inc(result.deleted("consumed"))
            if pages and self._horizon is not None and not close:
                self._horizon.committed(sid, snapshot.next_event_seq)
            return result.revision, False
        commit.fence.check(result.value("fence"))
        stored = result.kv("snapshot")
        same_snapshot = stored is not None and stored.value == commit.snapshot_bytes
        stored_first = result.value("first") if events else None
        same_first = (
            not events
            or stored_first == commit.encoded_events[0]
            # (the applied commit's first event is already below the horizon)
            or (stored_first is None and first < horizon_of(result.value("horizon")))
        )
        if stored is not None and same_snapshot and same_first:
            return stored.mod_revision, True  # our own applied commit: a retry
        if result.value("closed") is not None:
            raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {sid} stream is closed")
        current_revision = stored.mod_revision if stored is not None else 0
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
            f"events must continue the stream gaplessly at seq {first}",
        )

    def _delete_consumed(
        self, txn: Txn, session_id: str, consumed_from: int | None, consumed: int
    ) -> bool:
        """Add the delete of the inbox entries [consumed_from, consumed) to a
        commit's txn (one range; None: from the inbox's first key); False
        when there are none. Nothing after the commit reads them: a
        takeover, handoff or wake reads from the snapshot's position. etcd
        walks every key it still indexes in a range, the tombstones of
        deleted ones included until compaction: hence the lower bound."""
        if consumed <= (consumed_from or 0):
            return False
        k = self._keys
        start = (
            k.inbox_prefix(session_id)
            if consumed_from is None
            else k.inbox_entry(session_id, consumed_from)
        )
        txn.delete(start, k.inbox_entry(session_id, consumed), name="consumed")
        return True

    async def snapshot(self, session_id: str) -> tuple[s.SessionSnapshot, int]:
        """The last committed snapshot and its key's mod revision (what the
        next commit must compare)."""
        loaded, _ = await self._read_snapshot(session_id)
        return loaded.snapshot, loaded.revision

    async def _read_snapshot(self, session_id: str) -> tuple[LoadedSnapshot, int]:
        ids.validate_session_id(session_id)
        result = await Txn().read("snapshot", self._keys.snapshot(session_id)).run(self._store)
        kv = result.kv("snapshot")
        if kv is None:
            raise NotFound(
                Reason.SESSION_NOT_FOUND,
                f"session {session_id} not found (or finalized and past its retention)",
            )
        try:
            snapshot = s.SessionSnapshot.FromString(kv.value)
        except DecodeError as exc:
            raise FailedPrecondition(
                Reason.SNAPSHOT_UNREADABLE, f"the snapshot of session {session_id} cannot be parsed"
            ) from exc
        return LoadedSnapshot(snapshot, kv.mod_revision), result.revision

    async def load(
        self, session_id: str, expected_revision: int | None = None
    ) -> AsyncIterator[LoadedSnapshot | list[bytes]]:
        """The snapshot (first), then the serialized history entries of its
        context in bounded batches, read at the snapshot read's revision, so
        the entries are exactly the ones that snapshot names."""
        loaded, read_revision = await self._read_snapshot(session_id)
        if expected_revision is not None and loaded.revision != expected_revision:
            raise Aborted(
                Reason.STALE_CHECKPOINT,
                f"the session committed since the checkpoint (revision {loaded.revision}, "
                f"not {expected_revision})",
            )
        yield loaded
        log = loaded.snapshot.history_log
        if log.next_index > log.context_start:
            async for batch in self._history.read(
                session_id, log.context_start, log.next_index, read_revision
            ):
                yield batch

    async def retire_history(self, fence: s.Fence, below: int, from_index: int) -> int:
        """Delete the history entries below `below` (at most the committed
        context start), in bounded fenced txns; returns how many."""
        owner = Fence.of(fence)
        ids.validate_session_id(owner.session_id)
        k = self._keys
        sid = owner.session_id
        result = await (
            Txn()
            .require(owner.compare(k))
            .read("snapshot", k.snapshot(sid))
            .read_on_failure("fence", k.fence(sid))
            .run(self._store)
        )
        if not result.succeeded:
            owner.check(result.value("fence"))
        raw = result.value("snapshot")
        start = s.SessionSnapshot.FromString(raw).history_log.context_start if raw else 0
        if below > start:
            raise InvalidArgument(
                Reason.INVALID_FIELD,
                f"below_index {below} is beyond the committed context start {start}",
            )
        try:
            return await self._history.retire(sid, min(from_index, below), below, owner.compare(k))
        except GuardFailed:
            fenced = await Txn().read("fence", k.fence(sid)).run(self._store)
            owner.check(fenced.value("fence"))
            raise Aborted(Reason.CONFLICT, "the fence changed while retiring; retry") from None

    async def _page(self, session_id: str, start_seq: int) -> _Page:
        k = self._keys
        result = await (
            Txn()
            .read(
                "events",
                k.event(session_id, start_seq),
                prefix_end(k.events_prefix(session_id)),
                limit=limits.READ_PAGE_EVENTS,
            )
            .read("snapshot", k.snapshot(session_id), keys_only=True)
            .read("fence", k.fence(session_id), keys_only=True)
            .read("closed", k.closed(session_id))
            .read("horizon", k.horizon(session_id))
            .run(self._store)
        )
        closed = result.value("closed")
        # A session exists from its creation (its fence), before its first
        # commit (a child session commits session.started with its first turn).
        exists = result.kv("snapshot") is not None or result.kv("fence") is not None
        return _Page(
            events=[kv.value for kv in result.kvs("events")],
            more=result.more("events"),
            exists=exists,
            closed=int(closed) if closed is not None else None,
            horizon=horizon_of(result.value("horizon")),
            revision=result.revision,
        )

    async def read(
        self, session_id: str, start_seq: int, follow: bool
    ) -> AsyncIterator[list[s.Event]]:
        """Events from `start_seq` in order, in batches (replayed pages, then
        one batch per commit); with `follow`, live until the terminal event.

        A long stream is read in pages of READ_PAGE_EVENTS, so neither this
        process nor a slow reader's path holds more than a page (the gRPC
        stream's flow control paces the reads). A follower watches only for
        its last page: the watch opens before that read (`watch_then_read`),
        so a reader near the head sees new commits at once.

        A cursor below the stream's retention horizon (services/anchor/
        horizon.py) answers OUT_OF_RANGE/BELOW_HORIZON with the earliest seq
        kept in the metadata, also when the horizon passes a slow reader
        between two pages; a live follower gets every event from its watch."""
        ids.validate_session_id(session_id)
        if follow:
            metrics.STREAM_FOLLOWERS.inc()
        try:
            async with contextlib.aclosing(self._read(session_id, start_seq, follow)) as batches:
                async for batch in batches:
                    yield batch
        finally:
            if follow:
                metrics.STREAM_FOLLOWERS.dec()

    async def _read(
        self, session_id: str, start_seq: int, follow: bool
    ) -> AsyncGenerator[list[s.Event], None]:
        k = self._keys
        next_seq = start_seq
        checked = False
        watch = follow
        while True:
            watching = (
                watch_then_read(self._store.client, k.stream_prefix(session_id))
                if watch
                else contextlib.nullcontext()
            )
            async with watching as follower:
                page = await self._page(session_id, next_seq)
                if not checked:
                    if not page.events and not page.exists:
                        raise NotFound(
                            Reason.SESSION_NOT_FOUND,
                            f"session {session_id} not found (or finalized and past its retention)",
                        )
                    if page.closed is not None and start_seq > page.closed:
                        return  # the cursor is past the terminal event: the stream is over
                    checked = True
                # Read in the page's own transaction: [horizon, head) is all
                # there, so a cursor at or above it is gapless; one below it
                # (a slow reader the horizon passed between pages) is told.
                if next_seq < page.horizon:
                    raise below_horizon(session_id, page.horizon, next_seq)
                batch: list[s.Event] = []
                size = 0
                for raw in page.events:
                    event = s.Event.FromString(raw)
                    batch.append(event)
                    size += len(raw)
                    next_seq = event.seq + 1
                    if event.kind in TERMINAL_KINDS:
                        yield batch
                        return
                    if size >= _BATCH_BYTES:
                        yield batch
                        batch, size = [], 0
                if batch:
                    yield batch
                if page.more:
                    watch = False  # catching up: page on, watch only at the end
                    continue
                if not follow or page.closed is not None:
                    return
                if follower is None:
                    watch = True  # caught up by paging: watch, then read the tail
                    continue
                # Live: each commit reaches the reader as one batch (the watch
                # sees its events, then the commit marker it writes last).
                marker = k.commit_marker(session_id)
                batch = []
                async for change in follower.events(page.revision + 1):
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
                return
