"""When anchor seals: off every commit's path, in the background, a few
sessions at a time.

A commit tells the schedule what it wrote (`committed`: counts and bytes,
no I/O). A session whose tail reaches a segment's worth (what the last seal
read it left, plus the commits since) is sealed soon; a session quiet for `idle_seconds` has both
its tails sealed whole (`flush`: the stream keeps its last event), so an
idle or parked session keeps almost nothing in etcd. The schedule is kept
per anchor replica and is a hint only: what is sealed is read from etcd,
and a session this replica does not know about (its commits went to
another, or this one restarted) is flushed when the stream sweep visits it
(`swept`).

While the object store fails, sealing pauses (`baton_sealing_stalled` is 1,
each retry waits longer, up to 10 s): the tails in etcd grow, commits and
reads of the tails go on, and sealing resumes by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from baton_runtime.anchor.segments.seal import SEAL_BYTES, SEAL_RECORDS, LogSealer, Sealed
from baton_runtime.common import retry
from baton_runtime.common.errors import BatonError, Reason
from baton_runtime.common.observability import metrics

log = structlog.get_logger("baton.anchor.segments")

DEFAULT_IDLE_SECONDS = 300.0
# Sessions whose commits this replica follows, and sessions waiting to be
# sealed: past these, the oldest is flushed early (active) or dropped
# (pending: the sweep brings it back).
MAX_ACTIVE = 65536
MAX_PENDING = 16384
# Segments sealed for one session in one go; a longer backlog waits its turn.
ROUND_SEGMENTS = 8


@dataclass(frozen=True)
class _Due:
    """What is due for a session: which tails, sealed whole or by segments."""

    events: bool = True
    history: bool = True
    flush: bool = False

    def __or__(self, other: _Due) -> _Due:
        return _Due(
            self.events or other.events,
            self.history or other.history,
            self.flush or other.flush,
        )


_FLUSH = _Due(flush=True)
_NOTHING = _Due(events=False, history=False)


@dataclass
class _Growth:
    """What a session's tails hold as far as this replica knows: what its
    last seal left in each, plus the commits since."""

    last_commit: float = 0.0
    events: int = 0
    event_bytes: int = 0
    entries: int = 0
    entry_bytes: int = 0


class SealSchedule:
    """Seals sessions' event and history tails in the background of one
    anchor, `concurrency` sessions at a time."""

    def __init__(
        self,
        events: LogSealer,
        history: LogSealer,
        *,
        idle_seconds: float = DEFAULT_IDLE_SECONDS,
        concurrency: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.events = events
        self.history = history
        self._idle = idle_seconds
        self._concurrency = concurrency
        self._clock = clock
        self._active: OrderedDict[str, _Growth] = OrderedDict()
        self._pending: dict[str, _Due] = {}  # oldest first
        self._busy: set[str] = set()
        self._again: dict[str, _Due] = {}
        self._wake = asyncio.Event()
        self._backoff = retry.SEALING.backoff()
        self._stalled_until = 0.0

    # -- what commits and the sweep say (no I/O) --------------------------------

    def committed(
        self, session_id: str, events: int, event_bytes: int, entries: int, entry_bytes: int
    ) -> None:
        growth = self._active.pop(session_id, None) or _Growth()
        self._active[session_id] = growth
        growth.last_commit = self._clock()
        growth.events += events
        growth.event_bytes += event_bytes
        growth.entries += entries
        growth.entry_bytes += entry_bytes
        stream = growth.events >= SEAL_RECORDS or growth.event_bytes >= SEAL_BYTES
        history = growth.entries >= SEAL_RECORDS or growth.entry_bytes >= SEAL_BYTES
        if stream:
            growth.events = growth.event_bytes = 0
        if history:
            growth.entries = growth.entry_bytes = 0
        if stream or history:
            self._schedule(session_id, _Due(events=stream, history=history))
        if len(self._active) > MAX_ACTIVE:
            oldest, _ = self._active.popitem(last=False)
            self._schedule(oldest, _FLUSH)

    def swept(self, session_id: str) -> None:
        """The stream sweep visited a session: flush it unless this replica
        saw it commit within the idle time."""
        if session_id not in self._active:
            self._schedule(session_id, _FLUSH)

    def _schedule(self, session_id: str, due: _Due) -> None:
        if session_id in self._busy:
            self._again[session_id] = self._again.get(session_id, _NOTHING) | due
            return
        if session_id in self._pending:
            self._pending[session_id] |= due
        elif len(self._pending) < MAX_PENDING:
            self._pending[session_id] = due
        self._wake.set()

    @property
    def stalled(self) -> bool:
        return self._stalled_until > 0.0

    # -- the background -----------------------------------------------------------

    async def run(self) -> None:
        """Workers sealing what is pending, and the idle check, until cancelled."""
        async with asyncio.TaskGroup() as group:
            for _ in range(self._concurrency):
                group.create_task(self._work())
            group.create_task(self._watch_idle())

    async def _watch_idle(self) -> None:
        """Schedule the flush of sessions quiet for the idle time."""
        tick = max(0.05, min(self._idle / 4, 5.0))
        while True:
            await asyncio.sleep(tick)
            cutoff = self._clock() - self._idle
            while self._active:
                session_id, growth = next(iter(self._active.items()))
                if growth.last_commit > cutoff:
                    break
                del self._active[session_id]
                self._schedule(session_id, _FLUSH)

    async def _work(self) -> None:
        while True:
            session_id, due = await self._next()
            self._busy.add(session_id)
            try:
                await self._seal_logged(session_id, due)
            finally:
                self._busy.discard(session_id)
                again = self._again.pop(session_id, None)
                if again is not None:
                    self._schedule(session_id, again)

    async def _next(self) -> tuple[str, _Due]:
        while True:
            wait = self._stalled_until - asyncio.get_running_loop().time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if self._pending:
                session_id = next(iter(self._pending))
                return session_id, self._pending.pop(session_id)
            self._wake.clear()
            await self._wake.wait()

    async def _seal_logged(self, session_id: str, due: _Due) -> None:
        try:
            sealed, more = await self._seal_due(session_id, due)
        except BatonError as exc:
            if exc.reason == Reason.OBJECT_STORE_UNAVAILABLE:
                self._stall(exc)
                self._schedule(session_id, due)
            else:
                log.warning(
                    "sealing failed",
                    session_id=session_id,
                    reason=exc.reason,
                    error=exc.message,
                )
            return
        if sealed:
            self._resume()
        if more:
            self._schedule(session_id, due)

    async def seal(self, session_id: str, *, flush: bool) -> tuple[int, bool]:
        """Seal both of the session's tails (up to ROUND_SEGMENTS segments
        each): the records sealed, and whether there may be more."""
        return await self._seal_due(session_id, _Due(flush=flush))

    async def _seal_due(self, session_id: str, due: _Due) -> tuple[int, bool]:
        sealed = 0
        more = False
        for sealer, wanted in ((self.events, due.events), (self.history, due.history)):
            for _ in range(ROUND_SEGMENTS if wanted else 0):
                done = await sealer.seal(session_id, flush=due.flush)
                sealed += done.records
                if not done.more:
                    self._left(session_id, sealer is self.events, done)
                    break
            else:
                more = more or wanted
        return sealed, more

    def _left(self, session_id: str, stream: bool, done: Sealed) -> None:
        """Count on from what a seal left in the tail (with the commits
        counted since it was scheduled, some twice: a seal due a commit
        early costs one read, one due late lets the tail creep)."""
        growth = self._active.get(session_id)
        if growth is None:
            return
        if stream:
            growth.events += done.left
            growth.event_bytes += done.left_bytes
        else:
            growth.entries += done.left
            growth.entry_bytes += done.left_bytes

    def _stall(self, exc: BatonError) -> None:
        if not self.stalled:
            log.warning("sealing paused: the object store fails", error=exc.message)
        metrics.SEALING_STALLED.set(1)
        delay = self._backoff.next_delay()
        self._stalled_until = asyncio.get_running_loop().time() + delay

    def _resume(self) -> None:
        if self.stalled:
            log.info("sealing resumed: the object store answers")
            metrics.SEALING_STALLED.set(0)
            self._stalled_until = 0.0
            self._backoff.reset()
