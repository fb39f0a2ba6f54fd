"""Deleting objects: all of a session's, and those nobody refers to.

- `delete_session`: every object under the session's prefix (finalized-
  session retention, services/anchor/retention.py, after its keys: no seal
  can record an object once the session's fence is gone).
- The orphan sweep: every `grace_seconds`, a walk of the store's listing,
  session by session (one etcd read each: the fence and both indexes), that
  deletes objects older than the grace period which no index refers to: a
  writer crashed between its object and its transaction, lost the race to
  another replica and could not delete its object, or its delete after a
  move of the horizon failed; and every object of a session that is gone.
  A sealer gives up an object it could not record within half the grace
  period (seal.py), so the sweep never takes one about to be recorded. Each
  anchor replica sweeps; deleting twice is harmless.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog

from baton_runtime.anchor.segments import index as ix
from baton_runtime.anchor.segments.format import ObjectNames
from baton_runtime.anchor.segments.log import SegmentGone, SegmentLog
from baton_runtime.anchor.segments.objects import ListedObject, ObjectStore
from baton_runtime.common.errors import BatonError
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.observability import metrics

log = structlog.get_logger("baton.anchor.segments")

DEFAULT_GRACE_SECONDS = 3600.0


class ObjectSweep:
    """The objects of one etcd prefix's sessions."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        objects: ObjectStore,
        logs: Sequence[SegmentLog],
        *,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self._objects = objects
        self._logs = logs
        self._names = ObjectNames.of(keys.root)
        self.grace_seconds = grace_seconds
        self._clock = clock

    async def delete_session(self, session_id: str) -> int:
        """Every object of the session; how many."""
        paths = [
            listed.path
            async for chunk in self._objects.list(self._names.session_prefix(session_id))
            for listed in chunk
        ]
        await self._objects.delete(paths)
        return len(paths)

    async def run(self) -> None:
        """Sweep every grace period until cancelled; failures are logged."""
        while True:
            await asyncio.sleep(self.grace_seconds)
            try:
                await self.sweep()
            except BatonError as exc:
                log.warning("orphan sweep failed", reason=exc.reason, error=exc.message)

    async def sweep(self) -> int:
        """One walk of the store; returns how many objects were deleted."""
        cutoff = self._clock() - self.grace_seconds
        deleted = 0
        session: str | None = None
        group: list[ListedObject] = []
        async for chunk in self._objects.list(self._names.sessions_prefix()):
            for listed in chunk:
                owner = self._names.session_of(listed.path)
                if owner is None:
                    continue
                if owner != session and group:
                    assert session is not None
                    deleted += await self._collect(session, group, cutoff)
                    group = []
                session = owner
                group.append(listed)
        if group and session is not None:
            deleted += await self._collect(session, group, cutoff)
        return deleted

    async def _collect(self, session_id: str, listed: list[ListedObject], cutoff: float) -> int:
        """Delete the session's objects older than `cutoff` that no index
        refers to (all of them once the session is gone)."""
        old = [item.path for item in listed if item.modified < cutoff]
        if not old:
            return 0
        txn = Txn().read("fence", self._keys.fence(session_id), keys_only=True)
        for segments in self._logs:
            txn.read(segments.name, segments.index_key(session_id))
        found = await txn.run(self._store)
        referenced: set[str] = set()
        if found.kv("fence") is not None:
            for segments in self._logs:
                try:
                    referenced |= await self._referenced(
                        session_id, segments, found.value(segments.name)
                    )
                except SegmentGone:
                    # A directory is missing: what it listed cannot be told
                    # from orphans. Leave the session's objects be.
                    log.error("a segment directory is missing", session_id=session_id)
                    return 0
        orphans = [path for path in old if path not in referenced]
        if orphans:
            await self._objects.delete(orphans)
            metrics.ORPHANS_DELETED.inc(len(orphans))
            log.info("orphan objects deleted", session_id=session_id, count=len(orphans))
        return len(orphans)

    async def _referenced(
        self, session_id: str, segments: SegmentLog, raw: bytes | None
    ) -> set[str]:
        index = segments.parse(session_id, raw)
        refs = list(index.recent)
        paths: set[str] = set()
        if index.HasField("directory"):
            paths.add(segments.directory_path(session_id, index.directory))
            refs = await segments.directory(session_id, index) + refs
        for ref in ix.live(refs, index.dropped_below):
            paths.add(segments.segment_path(session_id, ref))
        return paths
