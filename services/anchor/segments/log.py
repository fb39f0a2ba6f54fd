"""Reading one of a session's logs (events or history) back from its sealed
segments: the index's refs, a directory's refs, a segment's records, each
checked (services/anchor/segments/format.py).

What a missing object means depends on the reader's index: one read at an
etcd revision may name a segment that was dropped since (the horizon passed,
the context moved). So a missing object raises `SegmentGone`; the reader
reads the index again and, if it still names the segment, it is lost:
`lost` (DATA_LOSS, OBJECT_CORRUPT, logged and counted). A checksum that does
not match is lost at once.
"""

from __future__ import annotations

from collections import OrderedDict

import structlog

from baton_runtime._proto.baton.anchor.v1 import segments_pb2 as pb
from baton_runtime.anchor.segments import index as ix
from baton_runtime.anchor.segments.format import (
    LOG_NAMES,
    Corrupt,
    ObjectNames,
    decode_object,
)
from baton_runtime.anchor.segments.objects import ObjectMissing, ObjectStore
from baton_runtime.common.errors import DataLoss, Reason
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.observability import metrics

log = structlog.get_logger("baton.anchor.segments")

# Refs of directories kept decoded (immutable, so a name is a key that never
# goes stale): about 10 MB at most.
_DIRECTORY_CACHE_REFS = 50_000


class SegmentGone(Exception):
    """An object the reader's index named is not in the store."""

    def __init__(self, ref: pb.SegmentRef) -> None:
        super().__init__(f"segment [{ref.first}, {ref.end})")
        self.ref = ref


class SegmentLog:
    """One log kind of every session: its index key, its objects."""

    def __init__(self, objects: ObjectStore, keys: Keys, kind: pb.SegmentLog.ValueType) -> None:
        self.objects = objects
        self.keys = keys
        self.kind = kind
        self.name = LOG_NAMES[kind]
        self.names = ObjectNames.of(keys.root)
        self._directories: OrderedDict[str, list[pb.SegmentRef]] = OrderedDict()
        self._cached_refs = 0

    def index_key(self, session_id: str) -> bytes:
        return self.keys.segment_index(session_id, self.name)

    def segment_path(self, session_id: str, ref: pb.SegmentRef) -> str:
        return self.names.segment(session_id, self.kind, ref)

    def directory_path(self, session_id: str, ref: pb.SegmentRef) -> str:
        return self.names.directory(session_id, self.kind, ref)

    def parse(self, session_id: str, raw: bytes | None) -> pb.SegmentIndex:
        try:
            return ix.parse_index(raw)
        except Corrupt as exc:
            raise self.lost(session_id, None, str(exc)) from exc

    async def directory(self, session_id: str, index: pb.SegmentIndex) -> list[pb.SegmentRef]:
        """The refs the index's directory lists ([] without one)."""
        if not index.HasField("directory"):
            return []
        ref = index.directory
        path = self.directory_path(session_id, ref)
        cached = self._directories.get(path)
        if cached is not None:
            self._directories.move_to_end(path)
            return cached
        payload = await self._fetch(session_id, ref, path, directory=True)
        refs = list(payload.segments)
        self._directories[path] = refs
        self._cached_refs += len(refs)
        while self._cached_refs > _DIRECTORY_CACHE_REFS and len(self._directories) > 1:
            _, evicted = self._directories.popitem(last=False)
            self._cached_refs -= len(evicted)
        return refs

    async def refs_from(
        self, session_id: str, index: pb.SegmentIndex, start: int
    ) -> list[pb.SegmentRef]:
        """The live refs of segments ending after `start`, ascending."""
        refs = list(index.recent)
        if ix.needs_directory(index, start):
            refs = await self.directory(session_id, index) + refs
        return [ref for ref in ix.live(refs, index.dropped_below) if ref.end > start]

    async def records(self, session_id: str, ref: pb.SegmentRef) -> list[bytes]:
        """A segment's records [ref.first, ref.end), checked."""
        payload = await self._fetch(
            session_id, ref, self.segment_path(session_id, ref), directory=False
        )
        return list(payload.records)

    async def _fetch(
        self, session_id: str, ref: pb.SegmentRef, path: str, *, directory: bool
    ) -> pb.SegmentObject:
        try:
            raw = await self.objects.get(path)
        except ObjectMissing:
            raise SegmentGone(ref) from None
        try:
            return decode_object(raw, ref, self.kind, session_id, directory=directory)
        except Corrupt as exc:
            raise self.lost(session_id, ref, str(exc)) from exc

    def lost(self, session_id: str, ref: pb.SegmentRef | None, why: str) -> DataLoss:
        """The error (logged, counted) for a recorded object that cannot be
        read back: never a gap in what the reader gets."""
        metrics.OBJECTS_CORRUPT.labels(self.name).inc()
        where = f"[{ref.first}, {ref.end})" if ref is not None else "index"
        log.error(
            "sealed object unreadable",
            session_id=session_id,
            log=self.name,
            segment=where,
            reason=Reason.OBJECT_CORRUPT,
            error=why,
        )
        return DataLoss(
            Reason.OBJECT_CORRUPT,
            f"the {self.name} segment {where} of session {session_id} cannot be read back: {why}",
            session_id=session_id,
        )
