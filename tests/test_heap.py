"""Giving freed heap back to the OS (services/owner/host/heap.py)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import pytest

from baton_runtime.owner.host.heap import HeapTrimmer, load_trim


def _recorder(calls: list[int]) -> Callable[[int], int]:
    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    return trim


async def test_it_trims_only_after_something_changed_and_once_per_change() -> None:
    calls: list[int] = []
    parks = [0]
    trimmer = HeapTrimmer(lambda: parks[0], trim=_recorder(calls))
    assert not await trimmer.trim_if_due()  # nothing parked yet
    parks[0] = 3
    assert await trimmer.trim_if_due()
    assert not await trimmer.trim_if_due()  # nothing new since
    parks[0] = 4
    assert await trimmer.trim_if_due()
    assert calls == [0, 0] and trimmer.trims == 2


async def test_its_task_trims_on_its_interval_and_ends_on_close() -> None:
    calls: list[int] = []
    parks = [0]
    trimmer = HeapTrimmer(lambda: parks[0], interval=0.01, trim=_recorder(calls))
    trimmer.start()
    parks[0] = 1
    for _ in range(200):
        if calls:
            break
        await asyncio.sleep(0.01)
    await trimmer.close()
    assert calls == [0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_glibc_has_malloc_trim_and_it_answers() -> None:
    trim = load_trim()
    assert trim is not None
    assert trim(0) in (0, 1)
