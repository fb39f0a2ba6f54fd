"""The session journal on etcd: fenced commits, snapshot loads and history
retirement (the stream's readers are services/anchor/stream.py).

A commit is one fenced transaction holding a step's events, the history
entries the step appended (through `HistoryStore`) and the new snapshot,
which stays bounded: nothing in it grows with the session's age, so a
commit costs the same at turn 10 and at turn 10,000. The stream itself is
bounded by its retention horizon (services/anchor/horizon.py). What a
commit may hold, and what a refused one means, are services/anchor/commits.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.commits import (
    EncodedCommit,
    RefusedRead,
    check_consumed_from,
    encode_commit,
    refused_commit,
)
from baton_runtime.anchor.history import EtcdHistory, GuardFailed, HistoryStore
from baton_runtime.anchor.horizon import StreamHorizon, horizon_of, opened_pages
from baton_runtime.anchor.segments.format import Corrupt
from baton_runtime.anchor.segments.index import parse_index
from baton_runtime.anchor.segments.log import SegmentLog
from baton_runtime.anchor.segments.schedule import SealSchedule
from baton_runtime.anchor.stream import EventStream
from baton_runtime.common import ids
from baton_runtime.common.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
)
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.ops import cmp_absent, cmp_mod, cmp_present
from baton_runtime.common.etcd.scope import ScopeCheck
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Fence, Txn, TxnResult
from baton_runtime.common.observability import metrics

DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True)
class LoadedSnapshot:
    """The first part of a load: the snapshot and its key's mod revision."""

    snapshot: s.SessionSnapshot
    revision: int


class Journal:
    """Domain operations of the anchor service over one etcd store; its
    `events` reads the streams (services/anchor/stream.py)."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        history: HistoryStore | None = None,
        *,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        horizon: StreamHorizon | None = None,
        segments: SegmentLog | None = None,
        sealer: SealSchedule | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self._history = history or EtcdHistory(store, keys)
        self._horizon = horizon
        self._sealer = sealer
        self._retention_seconds = retention_seconds
        self._clock = clock
        self.events = EventStream(store, keys, segments)

    @property
    def horizon(self) -> StreamHorizon | None:
        """What moves live streams' retention horizons (None: nothing does)."""
        return self._horizon

    @property
    def sealer(self) -> SealSchedule | None:
        """What seals sessions' logs into the object store (None: no store)."""
        return self._sealer

    async def commit(
        self,
        fence: s.Fence,
        events: Sequence[s.Event],
        snapshot: s.SessionSnapshot,
        close: bool,
        expected_snapshot_revision: int | None = None,
        history: Sequence[s.ChatMessage] = (),
        consumed_from: int | None = None,
        scope: ScopeCheck | None = None,
    ) -> tuple[int, bool]:
        """One fenced txn: events + history entries + snapshot (+ the closed
        marker and the retention index entry), deleting the inbox entries
        the snapshot says are consumed, from `consumed_from` (the replaced
        snapshot's position; None: from the inbox's first key).

        Returns (revision, replayed). With `expected_snapshot_revision` the txn
        also compares the snapshot's mod revision, so no delayed or reordered
        commit can roll the snapshot back. A retry of an applied commit (the
        stored snapshot and first event are byte-identical) writes nothing and
        reports replayed. `scope`: the caller's deployment, checked in the txn."""
        commit = encode_commit(fence, events, snapshot, close, history)
        check_consumed_from(consumed_from, snapshot)
        txn = self._commit_txn(commit, expected_snapshot_revision, scope)
        pages = self._stamp_pages(txn, commit)
        if commit.history:
            first_index = snapshot.history_log.next_index - len(commit.history)
            txn.success += await self._history.stage(fence.session_id, first_index, commit.history)
        deletes = self._delete_consumed(
            txn, fence.session_id, consumed_from, snapshot.inbox_next_seq
        )
        self._finish_txn(txn, commit)
        result = await txn.run(self._store)
        if not result.succeeded:
            return self._refused(commit, result, expected_snapshot_revision, scope), True
        metrics.EVENTS_COMMITTED.inc(len(events))
        metrics.COMMIT_BYTES.observe(commit.size)
        if deletes:
            metrics.INBOX_ENTRIES_DELETED.inc(result.deleted("consumed"))
        if pages and self._horizon is not None and not close:
            self._horizon.committed(fence.session_id, snapshot.next_event_seq)
        if self._sealer is not None:
            self._sealer.committed(
                fence.session_id,
                len(events),
                sum(map(len, commit.encoded_events)),
                len(commit.history),
                sum(map(len, commit.history)),
            )
        if scope is not None:
            scope.passed(fence.session_id, fence.epoch, fence.owner_run_id)
        return result.revision, False

    def _stamp_pages(self, txn: Txn, commit: EncodedCommit) -> list[int]:
        """A page the commit opens is stamped with anchor's clock: it dates the
        events before it for the stream's retention horizon."""
        pages = opened_pages(commit.first_seq, len(commit.events))
        now_ms = str(int(self._clock() * 1000)).encode()
        for page in pages:
            txn.put(self._keys.stream_page(commit.fence.session_id, page), now_ms)
        return pages

    def _commit_txn(
        self,
        commit: EncodedCommit,
        expected_snapshot_revision: int | None,
        scope: ScopeCheck | None,
    ) -> Txn:
        """The commit's compares (fence, the caller's scope when given,
        stream open, the snapshot's revision when expected, the stream
        continuing gaplessly at its first seq), snapshot and events."""
        k = self._keys
        fence = commit.fence
        sid = fence.session_id
        txn = Txn().require(fence.compare(k), cmp_absent(k.closed(sid)))
        if scope is not None:
            txn.require(*scope.compares(k, sid, fence.epoch))
            txn.read_on_failure("owner", k.owner(sid))
        if expected_snapshot_revision is not None:
            txn.require(
                cmp_absent(k.snapshot(sid))
                if expected_snapshot_revision == 0
                else cmp_mod(k.snapshot(sid), expected_snapshot_revision)
            )
        first = commit.first_seq
        txn.require(cmp_absent(k.event(sid, first)))
        if first > 0:
            txn.require(cmp_present(k.event(sid, first - 1)))
        txn.put(k.snapshot(sid), commit.snapshot_bytes)
        for event, raw in zip(commit.events, commit.encoded_events, strict=True):
            txn.put(k.event(sid, event.seq), raw)
        return txn

    def _finish_txn(self, txn: Txn, commit: EncodedCommit) -> None:
        """The closed marker and retention entry of a closing commit, the
        commit marker, and what a refused txn reads back."""
        k = self._keys
        sid = commit.fence.session_id
        events = commit.events
        if commit.close:
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
            txn.read_on_failure("sealed", k.segment_index(sid, "ev"))

    @staticmethod
    def _refused(
        commit: EncodedCommit,
        result: TxnResult,
        expected_snapshot_revision: int | None,
        scope: ScopeCheck | None,
    ) -> int:
        """A refused commit: FENCED, out of the caller's scope, or
        `refused_commit` on what it read."""
        fence = commit.fence
        fence.check(result.value("fence"))
        if scope is not None:
            scope.confirm(fence.session_id, fence.epoch, fence.owner_run_id, result.value("owner"))
        stored = result.kv("snapshot")
        seen = RefusedRead(
            snapshot=stored.value if stored is not None else None,
            snapshot_revision=stored.mod_revision if stored is not None else 0,
            first_event=result.value("first") if commit.events else None,
            closed=result.value("closed") is not None,
            # (read back with the first event: a snapshot-only commit has neither)
            horizon=horizon_of(result.value("horizon")) if commit.events else 0,
            sealed_below=_sealed_below(result.value("sealed")) if commit.events else 0,
        )
        return refused_commit(commit, seen, expected_snapshot_revision)

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

    async def snapshot_and_horizon(self, session_id: str) -> tuple[s.SessionSnapshot, int, int]:
        """`snapshot` and the stream's retention horizon (the first seq kept),
        read in one transaction: at that revision [horizon, head) are all
        stored (services/anchor/horizon.py)."""
        ids.validate_session_id(session_id)
        k = self._keys
        result = await (
            Txn()
            .read("snapshot", k.snapshot(session_id))
            .read("horizon", k.horizon(session_id))
            .run(self._store)
        )
        loaded = self._decode_snapshot(session_id, result.kv("snapshot"))
        return loaded.snapshot, loaded.revision, horizon_of(result.value("horizon"))

    async def _read_snapshot(
        self, session_id: str, *, with_newest_history: bool = False
    ) -> tuple[LoadedSnapshot, TxnResult]:
        """The snapshot, and the read's result (its revision; with
        `with_newest_history`, the newest page of history entries too)."""
        ids.validate_session_id(session_id)
        txn = Txn().read("snapshot", self._keys.snapshot(session_id))
        if with_newest_history:
            txn = self._history.read_newest(txn, session_id)
        result = await txn.run(self._store)
        return self._decode_snapshot(session_id, result.kv("snapshot")), result

    @staticmethod
    def _decode_snapshot(session_id: str, kv: Any) -> LoadedSnapshot:
        """The stored snapshot `kv` (None: NOT_FOUND)."""
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
        return LoadedSnapshot(snapshot, kv.mod_revision)

    async def load(
        self, session_id: str, expected_revision: int | None = None
    ) -> AsyncIterator[LoadedSnapshot | list[bytes]]:
        """The snapshot (first), then the serialized history entries of its
        context in bounded batches, read at the snapshot read's revision, so
        the entries are exactly the ones that snapshot names. The snapshot's
        read carries the newest page of entries (`read_newest`): a context
        that fits in it costs no second read."""
        loaded, result = await self._read_snapshot(session_id, with_newest_history=True)
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
                session_id, log.context_start, log.next_index, result.revision, carried=result
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


def _sealed_below(raw: bytes | None) -> int:
    """The seq below which the stream's events are sealed (0: none, or an
    index that cannot be parsed: then nothing counts as sealed)."""
    try:
        return parse_index(raw).sealed_below
    except Corrupt:
        return 0
