"""A session's event stream: replayed in pages (sealed segments from the
object store, then the tail from etcd), then followed live from a watch
until the terminal event.

A long stream is read a page at a time (a segment, or READ_PAGE_EVENTS keys
of the tail), so neither this process nor a slow reader's path holds more
than a page; a cursor below the retention horizon (services/anchor/
horizon.py) is told where the stream now starts. Each page is one etcd
transaction that reads the segment index with the tail and the horizon, so
a reader at any revision finds every event once: a key a seal deleted after
that revision is in the segment the index then names
(services/anchor/segments/). What goes to the reader, replayed or live, is
in pages of at most limits.MAX_PAGE_BYTES (services/common/streams/pages.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass

from baton_runtime._proto.baton.anchor.v1 import segments_pb2 as spb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.commits import TERMINAL_KINDS
from baton_runtime.anchor.horizon import below_horizon, horizon_of
from baton_runtime.anchor.segments.index import parse_index
from baton_runtime.anchor.segments.log import SegmentGone, SegmentLog
from baton_runtime.common import ids, limits
from baton_runtime.common.errors import FailedPrecondition, NotFound, OutOfRange, Reason
from baton_runtime.common.etcd.keys import Keys, prefix_end, seq_of
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.etcd.watch import Follower, watch_then_read
from baton_runtime.common.observability import metrics
from baton_runtime.common.streams.pages import byte_pages


@dataclass(frozen=True)
class _Page:
    """One read of a stream page, with what the reader checks in it."""

    events: Sequence[bytes]
    more: bool
    exists: bool
    closed: int | None
    # The first seq kept (the retention horizon, services/anchor/horizon.py).
    horizon: int
    # The seq the next commit writes first (the commit marker's last seq + 1).
    head: int
    revision: int
    # The stream's sealed segments (services/anchor/segments/).
    index: spb.SegmentIndex


class EventStream:
    """ReadEvents over one etcd store and, with `segments`, the object store
    its sealed segments are in."""

    def __init__(self, store: Store, keys: Keys, segments: SegmentLog | None = None) -> None:
        self._store = store
        self._keys = keys
        self._segments = segments

    async def _page(self, session_id: str, start_seq: int, sealed: bool = False) -> _Page:
        """One page's read. `sealed`: the cursor is known to be below the
        sealed part (it never shrinks), so the tail's events are not wanted."""
        k = self._keys
        result = await (
            Txn()
            .read(
                "events",
                k.event(session_id, start_seq),
                prefix_end(k.events_prefix(session_id)),
                limit=1 if sealed else limits.READ_PAGE_EVENTS,
                keys_only=sealed,
            )
            .read("snapshot", k.snapshot(session_id), keys_only=True)
            .read("fence", k.fence(session_id), keys_only=True)
            .read("closed", k.closed(session_id))
            .read("horizon", k.horizon(session_id))
            .read("marker", k.commit_marker(session_id))
            .read("index", k.segment_index(session_id, "ev"))
            .run(self._store)
        )
        marker = result.value("marker")
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
            head=int(marker) + 1 if marker else 0,
            revision=result.revision,
            index=self._parse_index(session_id, result.value("index")),
        )

    def _parse_index(self, session_id: str, raw: bytes | None) -> spb.SegmentIndex:
        if self._segments is not None:
            return self._segments.parse(session_id, raw)
        index = parse_index(raw)
        if index.sealed_below:
            raise FailedPrecondition(
                Reason.OBJECT_STORE_UNAVAILABLE,
                f"session {session_id} has sealed segments and this anchor has no object "
                "store (--object-store)",
            )
        return index

    async def read(
        self,
        session_id: str,
        start_seq: int,
        follow: bool,
        caught_up: Callable[[int], None] | None = None,
    ) -> AsyncGenerator[list[s.Event], None]:
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
        between two pages; a live follower gets every event from its watch.
        A cursor beyond the head (more than one past the last event: no
        commit will ever write it next, so following it would wait for
        nothing) answers OUT_OF_RANGE/BEYOND_HEAD with `next_seq`, the
        head, in the metadata; past a closed stream's end is just its end."""
        ids.validate_session_id(session_id)
        if follow:
            metrics.STREAM_FOLLOWERS.inc()
        try:
            reading = self._read(session_id, start_seq, follow, caught_up)
            async with contextlib.aclosing(reading) as batches:
                async for batch in batches:
                    yield batch
        finally:
            if follow:
                metrics.STREAM_FOLLOWERS.dec()

    async def _read(
        self,
        session_id: str,
        start_seq: int,
        follow: bool,
        caught_up: Callable[[int], None] | None = None,
    ) -> AsyncGenerator[list[s.Event], None]:
        cursor = _Cursor(start_seq)
        checked = False
        watch = follow
        sealed_below = 0  # the sealed part as last read (it never shrinks)
        gone: int | None = None  # the nonce of a segment found missing once
        while True:
            watching = (
                watch_then_read(
                    self._store.client, self._keys.stream_prefix(session_id), puts_only=True
                )
                if watch
                else contextlib.nullcontext()
            )
            sealed_page: _Page | None = None
            async with watching as follower:
                hint = cursor.next_seq < sealed_below
                page = await self._page(session_id, cursor.next_seq, sealed=hint)
                if hint and cursor.next_seq >= page.index.sealed_below:
                    # (The index is gone: the session was deleted. Read it whole.)
                    page = await self._page(session_id, cursor.next_seq)
                if not checked:
                    if not page.events and not page.exists:
                        raise NotFound(
                            Reason.SESSION_NOT_FOUND,
                            f"session {session_id} not found (or finalized and past its retention)",
                        )
                    if page.closed is not None and start_seq > page.closed:
                        return  # the cursor is past the terminal event: the stream is over
                    if start_seq > page.head:
                        raise beyond_head(session_id, page.head, start_seq)
                    checked = True
                # Read in the page's own transaction: [horizon, head) is all
                # there (sealed or in etcd), so a cursor at or above it is
                # gapless; one below it (a slow reader the horizon passed
                # between pages) is told.
                if cursor.next_seq < page.horizon:
                    raise below_horizon(session_id, page.horizon, cursor.next_seq)
                if cursor.next_seq < page.index.sealed_below:
                    sealed_page = page  # read outside the watch (none is wanted)
                else:
                    for batch in cursor.batches(page.events):
                        yield batch
                    if cursor.ended:
                        return
                    if page.more:
                        watch = False  # catching up: page on, watch only at the end
                        continue
                    if not follow or page.closed is not None:
                        return
                    if follower is None:
                        watch = True  # caught up by paging: watch, then read the tail
                        continue
                    if caught_up is not None:
                        caught_up(cursor.next_seq)
                    async for batch in self._live(session_id, follower, page.revision, cursor):
                        yield batch
                    return
            watch = False
            sealed_below = sealed_page.index.sealed_below
            try:
                async for batch in self._sealed(session_id, sealed_page.index, cursor):
                    yield batch
            except SegmentGone as missing:
                # Dropped since the page's read (the horizon passed: the next
                # page says so), or lost: found missing twice.
                assert self._segments is not None
                if gone == missing.ref.nonce:
                    raise self._segments.lost(
                        session_id, missing.ref, "the object is missing"
                    ) from None
                gone = missing.ref.nonce
                continue
            if cursor.ended:
                return

    async def _sealed(
        self, session_id: str, index: spb.SegmentIndex, cursor: _Cursor
    ) -> AsyncGenerator[list[s.Event], None]:
        """The events of the segment holding the cursor, from the cursor."""
        assert self._segments is not None
        refs = await self._segments.refs_from(session_id, index, cursor.next_seq)
        if not refs or refs[0].first > cursor.next_seq:
            raise self._segments.lost(
                session_id, None, f"no segment holds seq {cursor.next_seq} of the sealed stream"
            )
        ref = refs[0]
        records = await self._segments.records(session_id, ref)
        for batch in cursor.batches(records[cursor.next_seq - ref.first :]):
            yield batch

    async def _live(
        self, session_id: str, follower: Follower, revision: int, cursor: _Cursor
    ) -> AsyncGenerator[list[s.Event], None]:
        """Live: each commit reaches the reader as one batch (the watch sees
        its events, then the commit marker it writes last; the horizon's
        deletions are left out by etcd), in pages of MAX_PAGE_BYTES (a
        commit may hold up to MAX_COMMIT_BYTES of events)."""
        marker = self._keys.commit_marker(session_id)
        batch: list[tuple[int, s.Event]] = []
        async for change in follower.events(revision + 1):
            key = change.kv.key
            if key == marker:
                if batch:
                    for page in byte_pages(batch):
                        yield page
                    if batch[-1][1].kind in TERMINAL_KINDS:
                        return
                    batch = []
                continue
            if seq_of(key) < cursor.next_seq:
                continue
            event = s.Event.FromString(change.kv.value)
            batch.append((len(change.kv.value), event))
            cursor.next_seq = event.seq + 1


def beyond_head(session_id: str, head: int, start_seq: int) -> OutOfRange:
    return OutOfRange(
        Reason.BEYOND_HEAD,
        f"seq {start_seq} of session {session_id} is beyond the stream's head: the next "
        f"event will be seq {head}; read or follow from a seq up to {head}",
        next_seq=str(head),
        session_id=session_id,
    )


class _Cursor:
    """A reader's position: the next seq it wants, and whether it has read
    the terminal event."""

    def __init__(self, next_seq: int) -> None:
        self.next_seq = next_seq
        self.ended = False

    def batches(self, page: Sequence[bytes]) -> Iterator[list[s.Event]]:
        """A read page's events up to the terminal event, in pages of at
        most MAX_PAGE_BYTES."""
        return byte_pages(self._through_terminal(page))

    def _through_terminal(self, page: Sequence[bytes]) -> Iterator[tuple[int, s.Event]]:
        for raw in page:
            event = s.Event.FromString(raw)
            self.next_seq = event.seq + 1
            yield len(raw), event
            if event.kind in TERMINAL_KINDS:
                self.ended = True
                return
