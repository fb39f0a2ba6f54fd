"""The deduplication window (docs/design.md §3): etcd leases that expire the keys
a live session would otherwise accumulate per command — delivery ids
(`dlv/…`) and handoff records (`xfer/…`) — without any scan.

Each hooks replica holds one lease at a time and attaches every such key it
writes to it (`put(..., lease=)`). A lease serves the keys written during
one bucket of `width` seconds (by this process's monotonic clock, so a wall
clock step never reuses an old lease) and is granted with a TTL of
`window + 2 * width`: a key written at most `width` after its lease was
granted lives at least `window` (one more width covers a txn in flight when
its bucket ends), and at most `window + 2 * width`. etcd deletes the keys
when their lease expires; nothing here ever lists them.

So a repeat of a delivery id inside the window always finds its key (the
append compares it absent in the same txn), across replicas and restarts:
the key's lifetime is etcd's, not a process's. After the window, the id is
a new command. A replica keeps about `window / width + 2` live leases (17
with the default width of window/16); a restarted one grants new ones and
leaves its predecessor's to expire.

A lease etcd no longer knows (revoked by an operator, lost with a restored
backup) fails the txn that names it with LeaseNotFound (nothing was written): `run`
drops it and builds the txn again under a new one.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Protocol

from baton_runtime.common.errors import Aborted, Reason, Unavailable
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn, TxnResult
from baton_runtime.common.observability import metrics

DEFAULT_WINDOW_SECONDS = 24 * 3600.0
BUCKETS_PER_WINDOW = 16
MIN_BUCKET_SECONDS = 1.0

_LEASE_ATTEMPTS = 3

_ROTATED = metrics.DEDUPE_LEASES_GRANTED.labels("rotated")
_MISSING = metrics.DEDUPE_LEASES_GRANTED.labels("missing")


def bucket_width(window_seconds: float) -> float:
    return max(window_seconds / BUCKETS_PER_WINDOW, MIN_BUCKET_SECONDS)


def lease_ttl(window_seconds: float) -> int:
    """The TTL of a bucket's lease: the window plus two bucket widths."""
    return math.ceil(window_seconds + 2 * bucket_width(window_seconds))


class LeasedTxn(Protocol):
    """Builds a txn that puts its window-bound keys under `lease_id` (0: it
    puts none). Pure, no I/O: `ExpiryLeases.run` calls it again under a new
    lease when etcd forgot the one it named, so the caller's txn is built,
    not run, by the caller (claims, inbox appends, transfers)."""

    def __call__(self, lease_id: int, /) -> Txn: ...


class ExpiryLeases:
    """This replica's current window lease, rotated every bucket width."""

    def __init__(
        self,
        store: Store,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_seconds = window_seconds
        self.width = bucket_width(window_seconds)
        self.ttl = lease_ttl(window_seconds)
        self._store = store
        self._clock = clock
        self._lease_id = 0
        self._granted = 0.0  # by `clock`
        self._missing = False  # the last lease was forgotten (LeaseNotFound)
        self._granting = asyncio.Lock()

    async def current(self) -> int:
        """The lease id to attach a key written now to (granted when the
        bucket changed). Raises Unavailable when etcd cannot grant one."""
        if self._lease_id and self._clock() - self._granted < self.width:
            return self._lease_id
        async with self._granting:  # one grant when many appenders need one
            if self._lease_id and self._clock() - self._granted < self.width:
                return self._lease_id
            granted_at = self._clock()
            lease_id, _ = await self._store.grant_lease(self.ttl)
            (_MISSING if self._missing else _ROTATED).inc()
            self._lease_id, self._granted, self._missing = lease_id, granted_at, False
            return lease_id

    def forget(self, lease_id: int) -> None:
        """etcd does not know `lease_id` (LeaseNotFound): the next `current`
        grants a new one."""
        if lease_id and lease_id == self._lease_id:
            self._lease_id = 0
            self._missing = True

    async def run(self, build: LeasedTxn, *, leased: bool = True) -> TxnResult:
        """Run the txn `build(lease id)` makes (`leased=False`: it puts no
        key under the lease, which is then 0); built again under a new lease
        when etcd no longer knows the one it named."""
        for _ in range(_LEASE_ATTEMPTS):
            lease = await self.current() if leased else 0
            try:
                return await build(lease).run(self._store)
            except Aborted as exc:
                if exc.reason != Reason.LEASE_NOT_FOUND or not lease:
                    raise
                self.forget(lease)
        raise Unavailable(Reason.LEASE_NOT_FOUND, "etcd kept forgetting the window lease; retry")
