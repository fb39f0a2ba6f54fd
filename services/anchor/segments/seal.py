"""Sealing one log's tail into the object store: a full segment (or, for a
quiet session, whatever the tail holds) is written once as an immutable
object, then ONE guarded etcd transaction records it in the log's index and
deletes its keys. Never on a commit's path (services/anchor/segments/
schedule.py decides when).

The steps, each a failpoint (services/common/failpoints.py):

1. read the index and the tail at one revision (a segment's worth of keys
   and one more, more pages at that revision while the segment is not full);
2. write the object (and, every MAX_RECENT seals, a new directory listing
   the older refs) — `seal.before_put`, `seal.after_put`;
3. the transaction: the index as read (its mod revision) and the session
   alive (its fence) are compared; the new index is put; the sealed keys
   (and the stream's page stamps they date) are deleted — `seal.after_txn`;
4. the replaced directory is deleted.

A crash anywhere loses nothing (until step 3 the keys are there; after it the
object is recorded) and duplicates nothing (the index says where the tail
starts). An object written by a writer that crashed before step 3, or lost
the compare to another replica (then it deletes its own object), is an
orphan: nobody refers to it, and the sweep (sweep.py) deletes it after the
grace period. A writer that took longer than half the grace period between
its write and its transaction gives up, so the sweep never deletes an
object that is about to be recorded.

The stream keeps its last event in etcd: the next commit compares its
presence (docs/design.md §16, "gapless stream without a head key").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from baton_runtime._proto.baton.anchor.v1 import segments_pb2 as pb
from baton_runtime.anchor.horizon import PAGE
from baton_runtime.anchor.segments import index as ix
from baton_runtime.anchor.segments.format import (
    directory_object,
    encode_object,
    new_nonce,
    segment_object,
)
from baton_runtime.anchor.segments.log import SegmentLog
from baton_runtime.common import failpoints, limits
from baton_runtime.common.etcd.keys import prefix_end, seq_of
from baton_runtime.common.etcd.ops import cmp_absent, cmp_mod, cmp_present
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn, TxnResult
from baton_runtime.common.observability import metrics

log = structlog.get_logger("baton.anchor.segments")

SEAL_RECORDS = 128
"""Records in a segment at most: a tail this long is sealed."""
SEAL_BYTES = 16 * 1024
"""A tail holding this many bytes of records is sealed (a segment holds
this much and at most one record more)."""


@dataclass(frozen=True)
class Sealed:
    """What one `seal` did: the records sealed (0: none), whether the tail
    held more than it sealed (a full segment more, or any record more when
    flushing), and what it left (records that could be sealed, and about
    their bytes): the schedule counts on from there."""

    records: int = 0
    more: bool = False
    left: int = 0
    left_bytes: int = 0


@dataclass(frozen=True)
class _Tail:
    """What step 1 read."""

    index: pb.SegmentIndex
    index_revision: int  # the index key's mod revision (0: absent)
    first: int
    records: list[bytes]
    # The tail holds records after these (that could be sealed).
    more: bool
    # How many (the stream's last event aside).
    left: int
    # The stream: its stamps, (seq, unix ms) ascending.
    stamps: list[tuple[int, int]]
    # A segment's worth (else sealed only when flushing).
    full: bool
    # The session's fence exists (it was not deleted).
    alive: bool


class LogSealer:
    """Seals the tails of one log kind (events or history) of any session."""

    def __init__(
        self,
        store: Store,
        segments: SegmentLog,
        *,
        grace_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self.segments = segments
        self._keys = segments.keys
        self._grace = grace_seconds
        self._clock = clock
        self._stream = segments.kind == pb.SEGMENT_LOG_EVENTS

    def _prefix(self, session_id: str) -> bytes:
        k = self._keys
        return k.events_prefix(session_id) if self._stream else k.history_prefix(session_id)

    def _key(self, session_id: str, seq: int) -> bytes:
        k = self._keys
        return k.event(session_id, seq) if self._stream else k.history_entry(session_id, seq)

    async def seal(self, session_id: str, *, flush: bool) -> Sealed:
        """Seal the next segment of the session's tail if it is full (with
        `flush`: whatever it holds). Nothing sealed also when another
        replica sealed first."""
        tail = await self._read_tail(session_id, flush)
        if tail is None:
            return Sealed()
        if not tail.records or not (tail.full or flush) or not tail.alive:
            # (What the tail holds, for the schedule to count on from.)
            return Sealed(left=len(tail.records), left_bytes=sum(map(len, tail.records)))
        started = time.monotonic()
        await failpoints.hit("seal.before_put")
        roll = ix.rolls_over(tail.index)
        ref, directory, written = await self._write(session_id, tail, roll)
        await failpoints.hit("seal.after_put")
        if time.monotonic() - started > self._grace / 2:
            log.warning("sealing too slow; giving the objects up", session_id=session_id)
            await self.segments.objects.delete(written)
            return Sealed()
        result = await self._record(session_id, tail, ref, roll, directory)
        if not result.succeeded:
            # Another replica sealed (or trimmed) first, or the session is gone.
            await self.segments.objects.delete(written)
            return Sealed()
        await failpoints.hit("seal.after_txn")
        if roll and tail.index.HasField("directory"):
            replaced = self.segments.directory_path(session_id, tail.index.directory)
            await self.segments.objects.delete([replaced])
        metrics.SEGMENTS_SEALED.labels(self.segments.name).inc()
        metrics.SEALED_BYTES.labels(self.segments.name).inc(sum(map(len, tail.records)))
        log.debug(
            "segment sealed",
            session_id=session_id,
            log=self.segments.name,
            first=ref.first,
            end=ref.end,
        )
        size = sum(map(len, tail.records))
        left_bytes = tail.left * size // len(tail.records)
        return Sealed(len(tail.records), tail.more, tail.left, left_bytes)

    async def _read_tail(self, session_id: str, flush: bool) -> _Tail | None:
        """The records to seal (a segment's worth at most), read at one
        revision; None when the stream has no event."""
        k = self._keys
        prefix = self._prefix(session_id)
        txn = (
            Txn()
            .read("index", self.segments.index_key(session_id))
            .read("tail", prefix, prefix_end(prefix), limit=SEAL_RECORDS + 1)
            .read("fence", k.fence(session_id), keys_only=True)
        )
        if self._stream:
            pages = k.stream_pages_prefix(session_id)
            txn.read("marker", k.commit_marker(session_id))
            txn.read("pages", pages, prefix_end(pages), limit=limits.READ_PAGE_EVENTS)
        result = await txn.run(self._store)
        stored = result.kv("index")
        index = self.segments.parse(session_id, stored.value if stored is not None else None)
        # The stream keeps its last event: the next commit compares it.
        marker = result.value("marker") if self._stream else None
        end = int(marker) if marker is not None else None
        if self._stream and end is None:
            return None
        first, records, follows = await self._records(session_id, index, result, end)
        full = len(records) >= SEAL_RECORDS or sum(map(len, records)) >= SEAL_BYTES
        # Flushing: any record left; else a backlog of another full segment
        # (the range's count holds every key of the tail, however limited).
        left = result.count("tail") - len(records) - (1 if self._stream else 0)
        more = follows and (flush or left >= SEAL_RECORDS)
        stamps = []
        if self._stream:
            stamps = [(seq_of(kv.key) * PAGE, int(kv.value)) for kv in result.kvs("pages")]
        return _Tail(
            index,
            stored.mod_revision if stored is not None else 0,
            first,
            records,
            more,
            max(left, 0),
            stamps,
            full=full,
            alive=result.kv("fence") is not None,
        )

    async def _records(
        self, session_id: str, index: pb.SegmentIndex, result: TxnResult, end: int | None
    ) -> tuple[int, list[bytes], bool]:
        """The consecutive records from the tail's start, up to a segment's
        worth (below `end` when given), paging on at the first read's
        revision; and whether a record that could be sealed follows them."""
        kvs = [kv for kv in result.kvs("tail") if seq_of(kv.key) >= index.sealed_below]
        more = result.more("tail")
        first = seq_of(kvs[0].key) if kvs else index.sealed_below
        records: list[bytes] = []
        size = 0
        expected = first
        while True:
            for kv in kvs:
                seq = seq_of(kv.key)
                if seq != expected or (end is not None and seq >= end):
                    return first, records, False
                if len(records) >= SEAL_RECORDS or size >= SEAL_BYTES:
                    return first, records, True
                records.append(kv.value)
                size += len(kv.value)
                expected += 1
            if not more:
                return first, records, False
            page = await (
                Txn()
                .read(
                    "tail",
                    self._key(session_id, expected),
                    prefix_end(self._prefix(session_id)),
                    limit=limits.READ_PAGE_EVENTS,
                    revision=result.revision,
                )
                .run(self._store)
            )
            kvs, more = list(page.kvs("tail")), page.more("tail")

    async def _write(
        self, session_id: str, tail: _Tail, roll: bool
    ) -> tuple[pb.SegmentRef, pb.SegmentRef | None, list[str]]:
        """Step 2: the segment's object, and with `roll` a new directory
        (unless every older segment was dropped); their refs and paths."""
        segments = self.segments
        end = tail.first + len(tail.records)
        raw, digest = encode_object(
            segment_object(segments.kind, session_id, tail.first, tail.records)
        )
        ref = pb.SegmentRef(
            first=tail.first,
            end=end,
            nonce=new_nonce(),
            size=len(raw),
            sha256=digest,
            dated_ms=self._dated(end, tail.stamps),
        )
        directory: pb.SegmentRef | None = None
        listed: list[pb.SegmentRef] = []
        if roll:
            listed = ix.rolled(tail.index, await segments.directory(session_id, tail.index))
        written = [segments.segment_path(session_id, ref)]
        await segments.objects.put(written[0], raw)
        if listed:
            raw_dir, dir_digest = encode_object(directory_object(segments.kind, session_id, listed))
            directory = pb.SegmentRef(
                first=listed[0].first,
                end=listed[-1].end,
                nonce=new_nonce(),
                size=len(raw_dir),
                sha256=dir_digest,
                dated_ms=max(r.dated_ms for r in listed),
            )
            written.append(segments.directory_path(session_id, directory))
            await segments.objects.put(written[1], raw_dir)
        return ref, directory, written

    def _dated(self, end: int, stamps: list[tuple[int, int]]) -> int:
        """An upper bound of the commit time of the records below `end`: the
        stamp of the first stream page at or after it, else now."""
        for seq, stamped_ms in stamps:
            if seq >= end:
                return stamped_ms
        return int(self._clock() * 1000)

    async def _record(
        self,
        session_id: str,
        tail: _Tail,
        ref: pb.SegmentRef,
        roll: bool,
        directory: pb.SegmentRef | None,
    ) -> TxnResult:
        """Step 3: one transaction records the segment and deletes its keys."""
        k = self._keys
        key = self.segments.index_key(session_id)
        after = ix.sealed(tail.index, ref, roll=roll, directory=directory)
        txn = (
            Txn()
            .require(
                cmp_mod(key, tail.index_revision) if tail.index_revision else cmp_absent(key),
                cmp_present(k.fence(session_id)),
            )
            .put(key, after.SerializeToString())
            .delete(self._prefix(session_id), self._key(session_id, ref.end))
        )
        if self._stream:
            # A page's stamp dates the events before its first seq: those up
            # to the segment's end are the segment's now.
            txn.delete(
                k.stream_pages_prefix(session_id), k.stream_page(session_id, ref.end // PAGE + 1)
            )
        return await txn.run(self._store)
