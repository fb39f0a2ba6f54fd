"""A bound on the calls one client has in flight to a peer service
(admission control at the caller; docs/recovery.md, owner overload).

An owner handed thousands of sessions at once (a burst of new sessions, a
takeover, a wave of wakes) would otherwise send every session's next call at
once: the peer queues them all, each waits out its deadline there, the runs
that time out restart and send their calls again, and the lease keep-alive
waits in the same queue until the lease is lost. With `CallSlots`, at most
`limit` calls are in flight; the rest wait in this process, unsent, in
arrival order, and a call's deadline starts when it is sent, so a wait here
never times a call out. Calls the process's membership hangs on (the lease
keep-alive) are never held back: the client lists them as `unlimited`.

While metrics are served, `baton_rpc_client_calls_in_flight` and
`baton_rpc_client_calls_waiting` show the slots per target service, and
`baton_rpc_client_slot_wait_seconds` how long the calls that had to wait
waited.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from baton_runtime.common.observability import metrics


class CallSlots:
    """At most `limit` calls in flight; more wait for a slot, first come
    first served."""

    def __init__(self, limit: int, target: str) -> None:
        if limit < 1:
            raise ValueError(f"a call limit must be at least 1, not {limit}")
        self.limit = limit
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        metrics.RPC_CLIENT_IN_FLIGHT.labels(target).set_function(lambda: self.in_flight)
        metrics.RPC_CLIENT_WAITING.labels(target).set_function(lambda: self.waiting)
        self._waited = metrics.RPC_CLIENT_SLOT_WAIT_SECONDS.labels(target)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """One slot for the duration of the block."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        started = time.monotonic()
        try:
            await waiter  # `_release` hands its slot over: in_flight stays counted
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot as it was cancelled: pass it on
            elif waiter in self._waiters:  # (a release may have dropped it already)
                self._waiters.remove(waiter)
            raise
        self._waited.observe(time.monotonic() - started)

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the next caller
                return
        self.in_flight -= 1
