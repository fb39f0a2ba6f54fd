"""Claiming a dead instance's sessions (docs/recovery.md): one fenced
takeover (`claim`), a bounded race over many (`claim_all`), and the lazy,
paced claim of its quiet parked sessions (`ParkedSweep`), with the gauge of
what is left to claim (`UnclaimedSessions`).

Every claim is the same fenced takeover (epoch + 1, first compare-and-swap
wins), so a session woken while a survivor sweeps it has exactly one owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import NamedTuple

import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton_runtime.common import failpoints, retry
from baton_runtime.common.clients.answers import OwnedSession
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError, FailedPrecondition, Reason
from baton_runtime.common.observability import metrics
from baton_runtime.common.tasks import Background
from baton_runtime.owner.host.host import OwnerHost

log = structlog.get_logger("baton.owner.sweep")

ADOPT_CONCURRENCY = 32
# The lazy claim of quiet parked sessions: a few workers, paced at this many
# claims a second per swept instance (a dead instance's 10,000 parked
# sessions take a minute, leaving etcd and hooks to the live traffic).
SWEEP_CONCURRENCY = 4
DEFAULT_SWEEP_RATE = 200.0
SWEEP_LOG_EVERY = 5.0  # seconds between a long sweep's progress lines


class Claimed(NamedTuple):
    """What a run of claims came to: how many this instance won, and whether
    the instance they were listed under turned out live (then it keeps them)."""

    won: int
    live_again: bool


async def claim(host: OwnerHost, session: OwnedSession) -> Claimed:
    """One takeover of `session` by this host."""
    try:
        return Claimed(int(await host.adopt(session)), False)
    except FailedPrecondition as exc:
        if exc.reason == Reason.INSTANCE_LIVE:
            return Claimed(0, True)
        log.error("takeover failed", reason=exc.reason, error=exc.message)
    except BatonError as exc:
        log.error("takeover failed", reason=exc.reason, error=exc.message)
    return Claimed(0, False)


async def claim_all(host: OwnerHost, owned: list[OwnedSession]) -> Claimed:
    """Race for each session, a bounded number at a time (a few workers, not
    one task per session: a dead instance may have held thousands)."""
    pending = iter(owned)
    won = 0
    live_again = False

    async def worker() -> None:
        nonlocal won, live_again
        for session in pending:
            if live_again:
                return
            claimed = await claim(host, session)
            won += claimed.won
            live_again |= claimed.live_again

    await asyncio.gather(*(worker() for _ in range(min(ADOPT_CONCURRENCY, len(owned)))))
    return Claimed(won, live_again)


class Pacer:
    """Slots `rate` a second apart, shared by a sweep's workers."""

    def __init__(self, rate: float) -> None:
        self._gap = 1 / rate
        self._next = 0.0

    async def wait(self) -> None:
        now = asyncio.get_running_loop().time()
        slot = max(now, self._next)
        self._next = slot + self._gap
        if slot > now:
            await asyncio.sleep(slot - now)


class ParkedSweep:
    """The quiet parked sessions listed under dead instances (or under this
    instance's own id, left by its earlier process) and not claimed yet:
    claimed by a paced sweep, or at once when a bell rings for one."""

    def __init__(
        self,
        host: OwnerHost,
        hooks: HooksClient,
        background: Background,
        *,
        rate: float,
        stopped: asyncio.Event,
    ) -> None:
        if rate <= 0:
            raise ValueError("sweep_rate must be positive")
        self.host = host
        self.hooks = hooks
        self.rate = rate
        self._background = background
        self._stopped = stopped  # the lease is lost: the sessions are others' now
        # Instance -> session id -> its listing.
        self.unclaimed: dict[str, dict[str, OwnedSession]] = {}
        self._wake_slots = asyncio.Semaphore(ADOPT_CONCURRENCY)

    def sweeping(self, instance_id: str) -> dict[str, OwnedSession]:
        """What is left to claim of `instance_id`'s listing (empty: none)."""
        return self.unclaimed.get(instance_id, {})

    def left(self) -> int:
        return sum(len(backlog) for backlog in self.unclaimed.values())

    async def sweep(
        self, instance_id: str, quiet: list[OwnedSession], bound: structlog.BoundLogger
    ) -> Claimed:
        """Claim the quiet parked sessions listed under `instance_id`: a few
        workers at `rate` claims a second, while a watch of the instance's
        bells claims a woken one at once. The watch starts after the backlog
        is known, and its first answer is every bell already rung: an
        arrival after the listing is never left to the sweep's pace."""
        backlog = self.unclaimed.setdefault(instance_id, {})
        for session in quiet:
            backlog.setdefault(session.fence.session_id, session)
        order = iter(list(backlog))
        watch = asyncio.ensure_future(self._watch_bells(instance_id, backlog))
        progress = _Progress(bound, len(backlog), self.rate)
        pacer = Pacer(self.rate)
        try:
            await asyncio.gather(
                *(
                    self._sweep_worker(order, backlog, pacer, progress)
                    for _ in range(min(SWEEP_CONCURRENCY, len(backlog)))
                )
            )
        finally:
            watch.cancel()
            await asyncio.wait([watch])
            if self.unclaimed.get(instance_id) is backlog:
                # What is left (the instance is live again, the lease was
                # lost) is the next round's or another instance's.
                del self.unclaimed[instance_id]
        progress.done()
        return Claimed(progress.won, progress.live_again)

    async def _sweep_worker(
        self,
        order: Iterable[str],
        backlog: dict[str, OwnedSession],
        pacer: Pacer,
        progress: _Progress,
    ) -> None:
        for sid in order:
            if progress.live_again or self._stopped.is_set():
                return
            await pacer.wait()
            session = backlog.pop(sid, None)
            if session is None:
                continue  # a bell claimed it first
            claimed = await claim(self.host, session)
            if claimed.won:
                metrics.PARKED_CLAIMS.labels("swept").inc()
            progress.claimed(claimed, left=len(backlog))
            # Tests: a successor killed mid-sweep.
            await failpoints.hit("fleet.swept")

    async def _watch_bells(self, instance_id: str, backlog: dict[str, OwnedSession]) -> None:
        """While `instance_id`'s parked sessions are swept: a bell (input for
        one of them) claims that one at once."""
        backoff = retry.FLEET.backoff()
        while True:
            try:
                async for bells in self.hooks.watch_bells(instance_id):
                    for bell in bells:
                        session = backlog.pop(bell.session_id, None)
                        if session is not None:
                            self._background.spawn(self._claim_woken(session))
                    backoff.reset()
            except BatonError as exc:
                log.warning(
                    "bell watch of a swept instance interrupted",
                    swept_instance_id=instance_id,
                    reason=exc.reason,
                )
            await backoff.wait()

    async def _claim_woken(self, session: OwnedSession) -> None:
        """A parked session of the backlog whose bell rang: take it over now
        (the takeover sees the bell, so the session is not parked under this
        instance and runs at once)."""
        async with self._wake_slots:
            claimed = await claim(self.host, session)
        if claimed.won:
            metrics.PARKED_CLAIMS.labels("woken").inc()


class _Progress:
    """A sweep's counts and its progress lines (one every SWEEP_LOG_EVERY s)."""

    def __init__(self, bound: structlog.BoundLogger, sessions: int, rate: float) -> None:
        self._log = bound
        self._loop = asyncio.get_running_loop()
        self._started = self._last_log = self._loop.time()
        self.won = self.count = 0
        self.live_again = False
        bound.info("sweeping parked sessions", sessions=sessions, rate=rate)

    def claimed(self, claimed: Claimed, *, left: int) -> None:
        self.count += 1
        self.won += claimed.won
        self.live_again |= claimed.live_again
        if self._loop.time() - self._last_log >= SWEEP_LOG_EVERY:
            self._last_log = self._loop.time()
            self._log.info("sweep progress", claimed=self.count, won=self.won, left=left)

    def done(self) -> None:
        self._log.info(
            "sweep done",
            claimed=self.count,
            won=self.won,
            seconds=round(self._loop.time() - self._started, 1),
            live_again=self.live_again,
        )


class UnclaimedSessions(Collector):
    """`baton_parked_unclaimed_sessions`: quiet parked sessions this instance
    listed under a dead instance (or under its own id, left by its earlier
    process) and has not claimed yet (docs/metrics.md)."""

    def __init__(self, sweep: ParkedSweep) -> None:
        self._sweep = sweep

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            metrics.PARKED_UNCLAIMED,
            "Quiet parked sessions of dead instances this instance listed and has not "
            "claimed yet (its sweep claims them at a bounded rate; a bell claims one at once)",
        )
        family.add_metric([], self._sweep.left())
        yield family
