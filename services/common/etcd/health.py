"""Health that follows the store (hooks and anchor): a server whose etcd
cannot take writes says NOT_SERVING, so probes and balancers stop routing to
it, and SERVING again once etcd recovers.

Three conditions count: etcd unreachable for longer than `unreachable_after`
(a blip does not flap the status, STORE_UNAVAILABLE); etcd's NOSPACE alarm,
raised when its database reached the quota (every write fails until an
operator compacts, defragments and disarms it; docs/storage.md "etcd space";
STORE_FULL); and etcd's CORRUPT alarm, raised by its corruption checks when
members' data differ (every write fails until an operator replaces the bad
member and disarms it; docs/etcd.md "corruption"; STORE_CORRUPT). Each is
logged once when it starts and once when it ends, with its reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from baton_runtime.common.errors import BatonError, Reason
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.observability import metrics

log = structlog.get_logger("baton.store_health")


class StoreHealth:
    """Polls etcd's alarms and reports the store's usability."""

    def __init__(
        self,
        store: Store,
        set_serving: Callable[[bool], Awaitable[None]],
        *,
        interval: float = 1.0,
        unreachable_after: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._set_serving = set_serving
        self._interval = interval
        self._unreachable_after = unreachable_after
        self._clock = clock
        self._failing_since: float | None = None
        self.reason = ""  # why the store is unusable; "" while it is usable
        metrics.STORE_SERVING.set(1)

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self._interval)

    async def check(self) -> str:
        """Probe once, update health; returns the current reason ("" = fine)."""
        reason = ""
        try:
            alarms = await self._store.alarms()
            self._failing_since = None
            if "CORRUPT" in alarms:  # first: no room to make fixes this
                reason = Reason.STORE_CORRUPT
            elif "NOSPACE" in alarms:
                reason = Reason.STORE_FULL
        except BatonError:
            now = self._clock()
            if self._failing_since is None:
                self._failing_since = now
            if now - self._failing_since >= self._unreachable_after:
                reason = Reason.STORE_UNAVAILABLE
            else:
                reason = self.reason  # too early to change anything
        if reason != self.reason:
            if reason:
                log.error("store unusable; health NOT_SERVING", reason=reason)
            else:
                log.info("store usable again; health SERVING", previous_reason=self.reason)
            self.reason = reason
            metrics.STORE_SERVING.set(0 if reason else 1)
            await self._set_serving(not reason)
        return reason
