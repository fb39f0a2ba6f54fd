"""Giving freed heap memory back to the OS (docs/recovery.md, parked memory).

An owner that parks thousands of sessions after a burst frees most of what
their runs held, but glibc's malloc keeps the freed pages of its arenas
(gRPC's threads allocate in arenas of their own) until `malloc_trim` asks
for them back: measured at 10,000 parked sessions, 5.5–7 MiB of the owner's
RSS was such free memory (`bench.idle_rss`). `HeapTrimmer` trims at most
once per interval, and only after something was parked since the last
trim, in a worker thread (a trim walks the heap; the event loop goes on).
Where the C library has no `malloc_trim` (not glibc), it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("baton.heap")

DEFAULT_INTERVAL = 10.0


def load_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim(pad)`, or None without it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """Every `interval` seconds, trims the heap when `changes()` moved since
    the last trim (the owner passes its count of sessions parked so far)."""

    def __init__(
        self,
        changes: Callable[[], int],
        *,
        interval: float = DEFAULT_INTERVAL,
        trim: Callable[[int], int] | None = None,
    ) -> None:
        self._changes = changes
        self._interval = interval
        self._trim = trim if trim is not None else load_trim()
        self._seen = changes()
        self._task: asyncio.Task[None] | None = None
        self.trims = 0

    def start(self) -> None:
        if self._trim is not None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.trim_if_due()

    async def trim_if_due(self) -> bool:
        """Trim now if something changed since the last trim."""
        seen = self._changes()
        if seen == self._seen or self._trim is None:
            return False
        self._seen = seen
        started = time.monotonic()
        await asyncio.to_thread(self._trim, 0)
        self.trims += 1
        log.debug("heap trimmed", seconds=round(time.monotonic() - started, 4))
        return True
