"""The stream retention horizon over sealed segments: `StreamRetirement`
(services/anchor/horizon.py) for a stream whose older events are in the
object store.

Each transaction moves the horizon (guarded by the horizon it starts from,
the segment index as read, and the stream being open), drops the segments
that end at or below it from the index, and deletes the tail's keys below
it (at most TRIM_BATCH of them); the dropped segments' objects are deleted
after it. A reader whose page was read before the move and finds an object
gone reads its next page and is told the horizon passed it. An object whose
delete fails (or whose deleter crashed) is an orphan for the sweep.
"""

from __future__ import annotations

import time

import structlog

from baton_runtime.anchor.horizon import PAGE, HorizonMoved
from baton_runtime.anchor.segments import index as ix
from baton_runtime.anchor.segments.log import SegmentLog
from baton_runtime.common import limits
from baton_runtime.common.errors import Unavailable
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.ops import cmp_absent, cmp_mod, cmp_value
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.observability import metrics

log = structlog.get_logger("baton.anchor.segments")


class SegmentedStreamRetirement:
    """Old events leave etcd and the object store together."""

    def __init__(self, store: Store, keys: Keys, segments: SegmentLog) -> None:
        self._store = store
        self._keys = keys
        self._segments = segments

    async def retire(self, session_id: str, low: int, below: int) -> int:
        k = self._keys
        key = self._segments.index_key(session_id)
        found = await Txn().read("index", key).run(self._store)
        stored = found.kv("index")
        index = self._segments.parse(session_id, stored.value if stored else None)
        index_revision = stored.mod_revision if stored else 0
        retired = 0
        while low < below:
            sealed = index.sealed_below
            # Sealed events cost no key to delete; the tail's at most a batch.
            high = below if below <= sealed else min(below, max(low, sealed) + limits.TRIM_BATCH)
            listed = await self._segments.directory(session_id, index)
            dropping = ix.dropping(index, high, listed)
            horizon = (
                cmp_absent(k.horizon(session_id))
                if low == 0
                else cmp_value(k.horizon(session_id), str(low).encode())
            )
            started = time.perf_counter()
            result = await (
                Txn()
                .require(
                    horizon,
                    cmp_mod(key, index_revision) if index_revision else cmp_absent(key),
                    cmp_absent(k.closed(session_id)),
                )
                .delete(k.event(session_id, low), k.event(session_id, high), name="events")
                .delete(
                    k.stream_pages_prefix(session_id), k.stream_page(session_id, high // PAGE + 1)
                )
                .put(k.horizon(session_id), str(high).encode())
                .put(key, dropping.index.SerializeToString())
                .run(self._store)
            )
            metrics.STREAM_TRIM_BATCH_SECONDS.observe(time.perf_counter() - started)
            if not result.succeeded:
                raise HorizonMoved()
            await self._delete(session_id, dropping)
            metrics.STREAM_EVENTS_TRIMMED.inc(high - low)
            retired += high - low
            index, index_revision = dropping.index, result.revision
            low = high
        return retired

    async def _delete(self, session_id: str, dropping: ix.Dropping) -> None:
        paths = [self._segments.segment_path(session_id, ref) for ref in dropping.segments]
        if dropping.directory is not None:
            paths.append(self._segments.directory_path(session_id, dropping.directory))
        try:
            await self._segments.objects.delete(paths)
        except Unavailable as exc:
            log.warning(
                "segments below the horizon not deleted; the sweep will",
                session_id=session_id,
                error=exc.message,
            )
