"""The model history behind `HistoryStore` (services/anchor/history.py) with
its sealed segments in the object store: a session's etcd bytes do not grow
with its context.

- `stage`: unchanged, the step's fenced commit writes the new entries as
  keys (the tail); the seal schedule moves them into segments later.
- `read_newest`: the snapshot's transaction also reads the history's
  segment index, so a load knows at that one revision which entries are
  sealed and which are in the tail.
- `read`: the sealed part from the object store, segment by segment, then
  the tail as `EtcdHistory` reads it (carried, then pages at the revision).
- `retire`: the tail's keys as before, then the segments ending at or below
  the retired index are dropped from the index (guarded by the owner's
  fence) and their objects deleted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from aetcd import rpc

from baton_runtime._proto.baton.anchor.v1 import segments_pb2 as pb
from baton_runtime.anchor.history import EtcdHistory, GuardFailed
from baton_runtime.anchor.segments import index as ix
from baton_runtime.anchor.segments.log import SegmentGone, SegmentLog
from baton_runtime.common import limits
from baton_runtime.common.errors import Aborted, FailedPrecondition, Reason, Unavailable
from baton_runtime.common.etcd.ops import cmp_absent, cmp_mod
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn, TxnResult

_INDEX = "history.index"
# Index updates lost to a concurrent seal, retried at once.
_RACES = 8


class SegmentedHistory:
    """History entries: the tail in etcd (`EtcdHistory`), the rest sealed."""

    def __init__(self, tail: EtcdHistory, store: Store, segments: SegmentLog) -> None:
        self._tail = tail
        self._store = store
        self._segments = segments

    async def stage(
        self, session_id: str, first_index: int, entries: Sequence[bytes]
    ) -> list[rpc.RequestOp]:
        return await self._tail.stage(session_id, first_index, entries)

    def read_newest(self, txn: Txn, session_id: str) -> Txn:
        return self._tail.read_newest(txn, session_id).read(
            _INDEX, self._segments.index_key(session_id)
        )

    async def read(
        self,
        session_id: str,
        start: int,
        end: int,
        revision: int,
        carried: TxnResult | None = None,
    ) -> AsyncIterator[list[bytes]]:
        """Entries [start, end) as of `revision`: the sealed ones, then the tail."""
        index = await self._index_at(session_id, revision, carried)
        sealed_end = min(end, index.sealed_below)
        if start < sealed_end:
            async for batch in self._sealed(session_id, index, start, sealed_end):
                yield batch
        tail_start = max(start, index.sealed_below)
        if tail_start < end:
            async for batch in self._tail.read(session_id, tail_start, end, revision, carried):
                yield batch

    async def _index_at(
        self, session_id: str, revision: int, carried: TxnResult | None
    ) -> pb.SegmentIndex:
        key = self._segments.index_key(session_id)
        if carried is not None:
            try:
                return self._segments.parse(session_id, carried.value(_INDEX))
            except KeyError:
                pass  # (a result read without the index)
        result = await Txn().read(_INDEX, key, revision=revision).run(self._store)
        return self._segments.parse(session_id, result.value(_INDEX))

    async def _sealed(
        self, session_id: str, index: pb.SegmentIndex, start: int, end: int
    ) -> AsyncIterator[list[bytes]]:
        """Entries [start, end) from the segments, in batches of about
        READ_PAGE_BYTES; a gap is HISTORY_INCOMPLETE."""
        expected = start
        refs = await self._segments.refs_from(session_id, index, start)
        retried = False
        while expected < end:
            ref = refs[0] if refs else None
            if ref is None or ref.first > expected:
                raise FailedPrecondition(
                    Reason.HISTORY_INCOMPLETE,
                    f"history entry {expected} of session {session_id} is in no segment "
                    f"(the context is [{start}, {end}))",
                )
            try:
                records = await self._segments.records(session_id, ref)
            except SegmentGone:
                # Dropped or replaced since the revision read: the index now.
                if retried:
                    raise self._segments.lost(session_id, ref, "the object is missing") from None
                retried = True
                now = await self._current(session_id)
                if now.dropped_below > expected:
                    raise Aborted(
                        Reason.CONFLICT,
                        f"the context of session {session_id} moved while it loaded; retry",
                    ) from None
                refs = await self._segments.refs_from(session_id, now, expected)
                continue
            for batch in _batches(records[expected - ref.first : min(end, ref.end) - ref.first]):
                yield batch
            expected = min(end, ref.end)
            refs = refs[1:]

    async def _current(self, session_id: str) -> pb.SegmentIndex:
        result = await Txn().read(_INDEX, self._segments.index_key(session_id)).run(self._store)
        return self._segments.parse(session_id, result.value(_INDEX))

    async def retire(self, session_id: str, from_index: int, below: int, guard: rpc.Compare) -> int:
        """The tail's entries [from_index, below) (EtcdHistory.retire), then
        the segments ending at or below `below`. Raises GuardFailed when the
        guard fails; an object store that fails leaves the objects to the
        orphan sweep."""
        deleted = await self._tail.retire(session_id, from_index, below, guard)
        key = self._segments.index_key(session_id)
        for _ in range(_RACES):
            found = await Txn().read(_INDEX, key).run(self._store)
            stored = found.kv(_INDEX)
            index = self._segments.parse(session_id, stored.value if stored else None)
            segmented = index.recent or index.HasField("directory")
            if below <= index.dropped_below or not segmented:
                return deleted
            listed = await self._segments.directory(session_id, index)
            dropping = ix.dropping(index, below, listed)
            result = await (
                Txn()
                .require(guard, cmp_mod(key, stored.mod_revision) if stored else cmp_absent(key))
                .put(key, dropping.index.SerializeToString())
                .run(self._store)
            )
            if result.succeeded:
                await self._delete(session_id, dropping)
                return deleted + sum(ref.end - ref.first for ref in dropping.segments)
            if not (await Txn().require(guard).run(self._store)).succeeded:
                raise GuardFailed()
        raise Aborted(Reason.CONFLICT, "the history index kept changing while retiring; retry")

    async def _delete(self, session_id: str, dropping: ix.Dropping) -> None:
        paths = [self._segments.segment_path(session_id, ref) for ref in dropping.segments]
        if dropping.directory is not None:
            paths.append(self._segments.directory_path(session_id, dropping.directory))
        try:
            await self._segments.objects.delete(paths)
        except Unavailable:
            pass  # unreferenced now: the orphan sweep deletes them


def _batches(records: Sequence[bytes]) -> list[list[bytes]]:
    """Consecutive runs of about READ_PAGE_BYTES (at least one entry)."""
    out: list[list[bytes]] = []
    batch: list[bytes] = []
    size = 0
    for raw in records:
        if batch and size + len(raw) > limits.READ_PAGE_BYTES:
            out.append(batch)
            batch, size = [], 0
        batch.append(raw)
        size += len(raw)
    if batch:
        out.append(batch)
    return out
