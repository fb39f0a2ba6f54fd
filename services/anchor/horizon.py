"""A live session's stream retention horizon (docs/design.md §7, §13).

Anchor keeps, per live session, at least the last `keep_events` events and
every event younger than `keep_seconds`; the events below that horizon are
taken out of etcd in bounded transactions, each inside one session's keys
(§10), that also move the session's low-water mark `s/{sid}/horizon` ("first
seq kept"). At every etcd revision the events [horizon, head) are all there,
so a read that checks the horizon in the transaction that reads its page
never sees a gap: below it, it answers OUT_OF_RANGE naming the horizon.

Dating events: an event carries the owner's clock, which anchor does not
trust for deletion. Instead the commit that writes a page's first seq (pages
of `limits.STREAM_PAGE_EVENTS` seqs) stamps the page with anchor's clock
(`s/{sid}/pg/{page}`): every event before that seq was committed no later,
so once the stamp is older than `keep_seconds` they all are. The age rule
thus moves the horizon in whole pages and may keep an event a little longer,
never shorter (up to the skew of anchor replicas' clocks).

Who moves it: the commit that opens a page schedules its session when the
stream holds more than `keep_events` (no I/O on the commit path, the same at
turn 10 and 10,000); a periodic sweep pages through the channel index for
sessions whose events aged out while they were quiet, a bounded number per
round. A finalized session is left as it is: retention (retention.py)
deletes it whole.

Where old events go is one small interface, `StreamRetirement`: without an
object store they are deleted from etcd (`EtcdStreamRetirement`); with one,
most of them are sealed segments already, dropped with the horizon's move
(services/anchor/segments/trim.py), and the segments date the events they
hold as the page stamps did.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog

from baton_runtime._proto.baton.anchor.v1 import segments_pb2 as spb
from baton_runtime.anchor.segments import index as ix
from baton_runtime.common import limits
from baton_runtime.common.errors import BatonError, OutOfRange, Reason
from baton_runtime.common.etcd.keys import Keys, prefix_end, seq_of
from baton_runtime.common.etcd.ops import cmp_absent, cmp_value
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.observability import metrics

if TYPE_CHECKING:
    from baton_runtime.anchor.segments.log import SegmentLog

log = structlog.get_logger("baton.anchor.horizon")

DEFAULT_KEEP_EVENTS = 100_000
DEFAULT_KEEP_SECONDS = 7 * 24 * 3600.0
PAGE = limits.STREAM_PAGE_EVENTS
ROUND_EVENTS = limits.TRIM_BATCH * limits.TRIM_ROUND_BATCHES
# Sessions examined per sweep round, and sessions waiting for a trim (more
# are dropped: the next page they open, or the sweep, brings them back).
SWEEP_SESSIONS = 256
MAX_PENDING = 4096


@dataclass(frozen=True)
class StreamPolicy:
    """What a live session's stream keeps."""

    keep_events: int = DEFAULT_KEEP_EVENTS
    keep_seconds: float = DEFAULT_KEEP_SECONDS

    def __post_init__(self) -> None:
        # The last event always stays: the next commit compares its presence.
        if self.keep_events < 1:
            raise ValueError("a stream keeps at least its last event")

    def first_kept(self, head: int, dates: Sequence[tuple[int, int]], now_ms: int) -> int:
        """The lowest seq this policy must keep, for a stream whose next seq is
        `head` and whose events are dated by `dates` ((seq, unix ms),
        ascending: every event below seq was committed no later than ms;
        page stamps and sealed segments): the older of the count rule's and
        the age rule's horizon."""
        by_count = max(head - self.keep_events, 0)
        if self.keep_seconds <= 0:
            return by_count
        cutoff = now_ms - int(self.keep_seconds * 1000)
        by_age = 0
        for seq, dated_ms in dates:
            if dated_ms > cutoff:
                break  # dated within the window: what follows is younger
            by_age = seq
        return min(by_count, by_age)

    def may_trim(self, head: int) -> bool:
        """Cheap: can anything be below the horizon of a stream this long?"""
        return head > self.keep_events


def opened_pages(first_seq: int, count: int) -> list[int]:
    """The pages after the first whose first seq is among [first_seq,
    first_seq + count) (page 0 dates nothing)."""
    first_page = max(-(-first_seq // PAGE), 1)
    return list(range(first_page, (first_seq + count - 1) // PAGE + 1)) if count else []


def horizon_of(raw: bytes | None) -> int:
    """The first seq kept, from the horizon key's value (absent: 0)."""
    return int(raw) if raw else 0


def below_horizon(session_id: str, horizon: int, start_seq: int) -> OutOfRange:
    return OutOfRange(
        Reason.BELOW_HORIZON,
        f"seq {start_seq} of session {session_id} is below the stream's retention horizon; "
        f"the earliest seq kept is {horizon}",
        earliest_seq=str(horizon),
        session_id=session_id,
    )


class HorizonMoved(Exception):
    """Another anchor replica moved the horizon first, or the stream closed."""


class StreamRetirement(Protocol):
    async def retire(self, session_id: str, low: int, below: int) -> int:
        """Take the events [low, below) out of etcd and move the horizon from
        `low` to `below`, at most TRIM_BATCH events per transaction, each
        guarded by the horizon it starts from and by the stream being open.
        Returns how many events were deleted; raises HorizonMoved when a guard
        fails (what was done stays done)."""
        ...


class EtcdStreamRetirement:
    """Old events are deleted. (An archive would read each batch and write it
    to its store before the same transaction.)"""

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._keys = keys

    async def retire(self, session_id: str, low: int, below: int) -> int:
        k = self._keys
        deleted = 0
        while low < below:
            high = min(low + limits.TRIM_BATCH, below)
            current = (
                cmp_absent(k.horizon(session_id))
                if low == 0
                else cmp_value(k.horizon(session_id), str(low).encode())
            )
            started = time.perf_counter()
            result = await (
                Txn()
                .require(current, cmp_absent(k.closed(session_id)))
                .delete(k.event(session_id, low), k.event(session_id, high), name="events")
                # The stamps of pages that begin at or below `high` date only
                # events now gone.
                .delete(
                    k.stream_pages_prefix(session_id), k.stream_page(session_id, high // PAGE + 1)
                )
                .put(k.horizon(session_id), str(high).encode())
                .run(self._store)
            )
            metrics.STREAM_TRIM_BATCH_SECONDS.observe(time.perf_counter() - started)
            if not result.succeeded:
                raise HorizonMoved()
            count = result.deleted("events")
            metrics.STREAM_EVENTS_TRIMMED.inc(count)
            deleted += count
            low = high
        return deleted


@dataclass(frozen=True)
class _Stream:
    head: int
    horizon: int
    # (seq, unix ms), ascending: see StreamPolicy.first_kept.
    dates: list[tuple[int, int]]


class StreamHorizon:
    """Moves live sessions' horizons in the background of one anchor: the
    sessions commits schedule, then a sweep round every `interval_seconds`.
    Every anchor replica runs one; the horizon guard makes racing replicas
    harmless."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        policy: StreamPolicy,
        retirement: StreamRetirement | None = None,
        *,
        segments: SegmentLog | None = None,
        swept: Callable[[str], None] | None = None,
        interval_seconds: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self.policy = policy
        self._retirement = retirement or EtcdStreamRetirement(store, keys)
        # The stream's sealed segments date its older events (the age rule).
        self._segments = segments
        # Told of every session a sweep round visits (the seal schedule).
        self._swept = swept
        self._interval = interval_seconds
        self._clock = clock
        self._pending: dict[str, None] = {}  # an ordered set: trims due, oldest first
        self._wake = asyncio.Event()
        self._cursor = b""  # the last channel-index key the sweep examined

    def committed(self, session_id: str, head: int) -> None:
        """A commit opened a stream page: schedule the session's trim once its
        stream is longer than the events kept by count. No I/O."""
        if self.policy.may_trim(head):
            self._schedule(session_id)

    def _schedule(self, session_id: str) -> None:
        if session_id in self._pending or len(self._pending) < MAX_PENDING:
            self._pending[session_id] = None
            self._wake.set()

    async def run(self) -> None:
        """Trim what is scheduled as it comes; sweep every interval. Failures
        are logged; the session comes back with its next page or sweep."""
        loop = asyncio.get_running_loop()
        next_sweep = loop.time() + self._interval
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(next_sweep - loop.time(), 0.0))
            self._wake.clear()
            for session_id in list(self._pending):
                del self._pending[session_id]
                await self._trim_logged(session_id)
            if loop.time() >= next_sweep:
                try:
                    await self.sweep()
                except BatonError as exc:
                    log.warning("stream sweep failed", reason=exc.reason, error=exc.message)
                next_sweep = loop.time() + self._interval

    async def _trim_logged(self, session_id: str) -> int:
        try:
            return await self.trim(session_id)
        except BatonError as exc:
            log.warning(
                "stream trim failed", session_id=session_id, reason=exc.reason, error=exc.message
            )
            return 0

    async def trim(self, session_id: str) -> int:
        """One round for one session: retire up to ROUND_EVENTS events below
        its horizon (a longer backlog is scheduled again). Returns how many
        were deleted."""
        stream = await self._read(session_id)
        if stream is None:
            return 0
        wanted = self.policy.first_kept(stream.head, stream.dates, int(self._clock() * 1000))
        below = min(wanted, stream.horizon + ROUND_EVENTS)
        if below <= stream.horizon:
            return 0
        try:
            deleted = await self._retirement.retire(session_id, stream.horizon, below)
        except HorizonMoved:
            return 0  # another replica got there first, or the stream closed
        if below < wanted:
            self._schedule(session_id)
        log.debug("stream trimmed", session_id=session_id, horizon=below, deleted=deleted)
        return deleted

    async def _read(self, session_id: str) -> _Stream | None:
        """The stream's head, horizon and its oldest dates (sealed segments,
        then page stamps); None when it is closed or has no events."""
        k = self._keys
        result = await (
            Txn()
            .read("horizon", k.horizon(session_id))
            .read("marker", k.commit_marker(session_id))
            .read("closed", k.closed(session_id), keys_only=True)
            .read(
                "pages",
                k.stream_pages_prefix(session_id),
                prefix_end(k.stream_pages_prefix(session_id)),
                limit=ROUND_EVENTS // PAGE + 2,
            )
            .read("index", k.segment_index(session_id, "ev"))
            .run(self._store)
        )
        marker = result.value("marker")
        if marker is None or result.kv("closed") is not None:
            return None
        dates = await self._segment_dates(session_id, result.value("index"))
        sealed = dates[-1][0] if dates else 0
        for kv in result.kvs("pages"):
            with contextlib.suppress(ValueError):
                seq = seq_of(kv.key) * PAGE
                if seq > sealed:
                    dates.append((seq, int(kv.value)))
        return _Stream(int(marker) + 1, horizon_of(result.value("horizon")), dates)

    async def _segment_dates(self, session_id: str, raw: bytes | None) -> list[tuple[int, int]]:
        """The dates of the stream's sealed segments (the age rule only;
        a directory is read only when it is not old as a whole)."""
        if self._segments is None or not raw or self.policy.keep_seconds <= 0:
            return []
        index = self._segments.parse(session_id, raw)
        listed: list[spb.SegmentRef] = []
        cutoff = int(self._clock() * 1000) - int(self.policy.keep_seconds * 1000)
        if index.HasField("directory") and index.directory.dated_ms > cutoff:
            listed = await self._segments.directory(session_id, index)
        return ix.dates(index, listed)

    async def sweep(self) -> int:
        """One round: the next SWEEP_SESSIONS sessions of the channel index
        (from where the last round stopped, wrapping at its end), each trimmed
        once. Returns how many events were deleted."""
        prefix = self._keys.channels_prefix()
        start = self._cursor + b"\0" if self._cursor else prefix
        page = await (
            Txn()
            .read("sessions", start, prefix_end(prefix), keys_only=True, limit=SWEEP_SESSIONS)
            .run(self._store)
        )
        found = page.kvs("sessions")
        self._cursor = found[-1].key if found and page.more("sessions") else b""
        deleted = 0
        for kv in found:
            session_id = kv.key.rsplit(b"/", 1)[-1].decode()
            if self._swept is not None:
                self._swept(session_id)
            deleted += await self._trim_logged(session_id)
        return deleted
