"""One owner instance in its deployment's fleet (docs/design.md §5).

- Membership: registers `d/{deployment}/{instance}` under an etcd lease through
  hooks and keeps the lease alive every TTL/3. A keep-alive answering TTL 0
  means the lease expired (the process was paused or cut off past its TTL):
  the other instances are taking its sessions over, so it stops every run
  and, as a process, exits non-zero for its supervisor to restart it. Its late
  writes are fenced out by the epoch compare in any case.
- Takeover: one stream of the deployment's live instances. When an instance
  disappears (or is found dead at start, owning sessions) this instance takes
  its sessions over, racing the other survivors: the first compare-and-swap
  wins each session, the losers move on. Recovery scales with the active
  sessions, not the parked ones: the listing tells them apart (the owner
  records' `parked` flags and the dead instance's bells, each written in the
  txn of the state it describes), the active ones (running, or parked with
  input waiting) are claimed first at full speed, and the quiet parked ones
  lazily: by a paced background sweep, and at once when a bell rings for
  one (an arrival for a parked session rings the bell of the instance its
  owner record names, dead or not; this instance watches the dead one's
  bells while it sweeps). Every claim is the same fenced takeover (epoch + 1,
  first compare-and-swap wins), so a session woken while a survivor sweeps
  it has exactly one owner.
- Bells: one stream for all of this instance's parked sessions; each bell is
  handed to the host, which wakes a parked session whose inbox moved.
- Reconciliation: every few seconds, a session indexed under this instance
  that the host holds in no state is taken over again, and dead instances
  whose takeover ran out of rounds are tried again: whatever a lost watch
  event or a bug in the host drops, a session with input is run again
  within a bounded time (issue 16).
- Graceful shutdown stops every run, then revokes the lease, so the other
  instances take the sessions over at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common import failpoints, metrics, retry
from services.common.client_answers import OwnedSession
from services.common.errors import BatonError, FailedPrecondition, Reason
from services.common.hooks_client import HooksClient
from services.common.tasks import Background
from services.owner.config import DEFAULT_RECONCILE_INTERVAL
from services.owner.host import OwnerHost

log = structlog.get_logger("baton.owner.fleet")

ADOPT_CONCURRENCY = 32
ADOPT_ROUNDS = 20
DEREGISTER_SECONDS = 2.0
# The lazy claim of quiet parked sessions: a few workers, paced at this many
# claims a second per swept instance (a dead instance's 10,000 parked
# sessions take a minute, leaving etcd and hooks to the live traffic).
SWEEP_CONCURRENCY = 4
DEFAULT_SWEEP_RATE = 200.0
SWEEP_LOG_EVERY = 5.0  # seconds between a long sweep's progress lines


class FleetMembership:
    """Lease, takeover and bell streams of one owner instance."""

    def __init__(
        self,
        host: OwnerHost,
        hooks: HooksClient,
        *,
        address: str,
        lease_ttl: int,
        keepalive_every: float,
        on_lease_lost: Callable[[], Awaitable[None]] | None = None,
        reconcile_every: float = DEFAULT_RECONCILE_INTERVAL,
        sweep_rate: float = DEFAULT_SWEEP_RATE,
    ) -> None:
        self.host = host
        self.hooks = hooks
        self.deployment_id = host.deployment_id
        self.instance_id = host.instance_id
        self.address = address
        self.lease_ttl = lease_ttl
        self.keepalive_every = keepalive_every
        self.lease_id = 0
        self.lease_lost = asyncio.Event()
        self._on_lease_lost = on_lease_lost
        self._background = Background()
        self._adopting: dict[str, bool] = {}  # instance -> run another round after this one
        # Dead instances whose sessions were not all taken over (every round spent).
        self._unfinished: set[str] = set()
        # Sessions indexed under this instance that it did not hold at the
        # last reconciliation: session id -> fence value seen then.
        self._unheld: dict[str, bytes] = {}
        # Quiet parked sessions listed and not claimed yet, by the instance
        # they are indexed under: claimed by the sweep, or at once on a bell.
        self.unclaimed: dict[str, dict[str, OwnedSession]] = {}
        self._wake_slots = asyncio.Semaphore(ADOPT_CONCURRENCY)
        if reconcile_every <= 0:
            raise ValueError("reconcile_every must be positive")
        if sweep_rate <= 0:
            raise ValueError("sweep_rate must be positive")
        self.reconcile_every = reconcile_every
        self.sweep_rate = sweep_rate
        self._log = log.bind(deployment_id=self.deployment_id, instance_id=self.instance_id)

    def start(self) -> None:
        """Join in the background: register (retrying until hooks answers),
        take over this instance id's leftovers, then serve."""
        self._spawn(self._join())

    async def close(self) -> None:
        """Graceful shutdown: stop the streams and every run, then leave the
        deployment so the other instances take the sessions over now rather
        than after the lease TTL."""
        await self._background.cancel_all()
        await self.host.stop()
        if self.lease_id and not self.lease_lost.is_set():
            try:
                async with asyncio.timeout(DEREGISTER_SECONDS):
                    await self.hooks.deregister_instance(self.lease_id)
                self._log.info("deregistered")
            except (BatonError, TimeoutError) as exc:
                self._log.warning("deregistration failed; the lease expires", error=repr(exc))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._background.spawn(coro)

    # -- membership ---------------------------------------------------------------

    async def _join(self) -> None:
        backoff = retry.FLEET.backoff()
        while True:
            try:
                registered = await self.hooks.register_instance(
                    self.deployment_id, self.instance_id, self.lease_ttl, self.address
                )
                break
            except BatonError as exc:
                if not exc.retryable:
                    self._log.error("registration refused", reason=exc.reason, error=exc.message)
                    raise
                pause = backoff.next_delay()
                self._log.warning("registration retry", reason=exc.reason, backoff_s=pause)
                await asyncio.sleep(pause)
        self.lease_id = registered.lease_id
        self._log.info("registered", lease_id=self.lease_id, ttl_s=registered.ttl_seconds)
        self._spawn(self._keep_alive())
        self._spawn(self._watch_bells())
        # Sessions indexed under our own id belong to an earlier process with
        # this instance id: take the active ones over before creating new
        # ones; the quiet parked ones are swept in the background.
        active_taken = asyncio.Event()
        self._schedule_adoption(self.instance_id, active_taken)
        await active_taken.wait()
        self.host.set_ready()
        self._spawn(self._watch_instances())
        self._spawn(self._reconcile())

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_every)
            try:
                async with asyncio.timeout(self.keepalive_every):
                    ttl = await self.hooks.keep_alive_instance(self.lease_id)
            except (BatonError, TimeoutError) as exc:
                # Hooks or etcd unreachable: keep trying. etcd extends leases
                # when it comes back; an expired one answers TTL 0 below.
                self._log.warning("keep-alive failed", error=repr(exc))
                continue
            if ttl <= 0:
                await self._lose_lease()
                return

    async def _lose_lease(self) -> None:
        self._log.error("lease expired: stopping every run; the sessions are taken over")
        self.lease_lost.set()
        await self.host.stop()
        if self._on_lease_lost is not None:
            await self._on_lease_lost()

    # -- takeover -------------------------------------------------------------------

    async def _watch_instances(self) -> None:
        live: set[str] | None = None
        backoff = retry.FLEET.backoff()
        while True:
            try:
                async for change in self.hooks.watch_instances(self.deployment_id):
                    now = {info.instance_id for info in change.instances}
                    dead = set(change.dead_instance_ids)
                    if live is not None:
                        dead |= live - now
                    live = now
                    dead.discard(self.instance_id)
                    for instance_id in sorted(dead):
                        self._schedule_adoption(instance_id)
                    backoff.reset()
            except BatonError as exc:
                self._log.warning("instance watch interrupted", reason=exc.reason)
            await backoff.wait()

    def _schedule_adoption(
        self, instance_id: str, active_taken: asyncio.Event | None = None
    ) -> None:
        if instance_id in self._adopting:
            self._adopting[instance_id] = True
            return
        self._adopting[instance_id] = False
        self._spawn(self._adopt_rounds(instance_id, active_taken))

    async def _adopt_rounds(
        self, instance_id: str, active_taken: asyncio.Event | None = None
    ) -> None:
        try:
            while True:
                await self._adopt_instance(instance_id, active_taken)
                if not self._adopting.get(instance_id):
                    return
                self._adopting[instance_id] = False
        finally:
            self._adopting.pop(instance_id, None)
            if active_taken is not None:
                active_taken.set()

    async def _adopt_instance(
        self, instance_id: str, active_taken: asyncio.Event | None = None
    ) -> None:
        """Take over every session indexed under `instance_id`, until none is
        left there (the others' wins leave the index too): each round the
        active sessions first (then `active_taken` is set), then the quiet
        parked ones, lazily (`_sweep`)."""
        bound = self._log.bind(dead_instance_id=instance_id)
        backoff = retry.FLEET.backoff()
        for _ in range(ADOPT_ROUNDS):
            try:
                owned = await self.hooks.list_instance_sessions(self.deployment_id, instance_id)
            except BatonError as exc:
                bound.warning("listing sessions failed", reason=exc.reason)
                await backoff.wait()
                continue
            if instance_id == self.instance_id:
                # Our own index lists what this process already took over
                # (the takeover keeps the entry under the same instance):
                # taking those again would fence our own runs, round after
                # round.
                owned = [o for o in owned if not self.host.holds(o.fence.session_id)]
            if not owned:
                self._unfinished.discard(instance_id)
                return
            random.shuffle(owned)  # spread the races between the survivors
            active = [o for o in owned if not o.parked or o.input_waiting]
            quiet = [o for o in owned if o.parked and not o.input_waiting]
            bound.info("taking sessions over", active=len(active), parked=len(quiet))
            won, live_again = await self._adopt_all(active)
            if active_taken is not None:
                active_taken.set()
            if quiet and not live_again:
                swept, live_again = await self._sweep(instance_id, quiet, bound)
                won += swept
            if live_again:
                bound.info("instance is live again; not taking over")
                self._unfinished.discard(instance_id)
                return
            bound.info("takeover round done", won=won, listed=len(owned))
            if not won:  # lost every race or failed: let the index settle
                await backoff.wait()
        # Tried again by the reconciler, until nothing is left there (our own
        # id is the reconciler's own business: two sightings first).
        if instance_id != self.instance_id:
            self._unfinished.add(instance_id)
        bound.warning("sessions still indexed under the dead instance after every round")

    async def _adopt_all(self, owned: list[OwnedSession]) -> tuple[int, bool]:
        """Race for each session, a bounded number at a time (a few workers,
        not one task per session: a dead instance may have held thousands).
        Returns (won, whether the instance turned out live)."""
        pending = iter(owned)
        won = 0
        live_again = False

        async def worker() -> None:
            nonlocal won, live_again
            for session in pending:
                if live_again:
                    return
                taken, live = await self._take(session)
                won += taken
                live_again |= live

        await asyncio.gather(*(worker() for _ in range(min(ADOPT_CONCURRENCY, len(owned)))))
        return won, live_again

    async def _take(self, session: OwnedSession) -> tuple[bool, bool]:
        """One takeover: (won, whether its instance turned out live)."""
        try:
            return await self.host.adopt(session), False
        except FailedPrecondition as exc:
            if exc.reason == Reason.INSTANCE_LIVE:
                return False, True
            self._log.error("takeover failed", reason=exc.reason, error=exc.message)
        except BatonError as exc:
            self._log.error("takeover failed", reason=exc.reason, error=exc.message)
        return False, False

    # -- the lazy claim of quiet parked sessions ---------------------------------------

    async def _sweep(
        self, instance_id: str, quiet: list[OwnedSession], bound: structlog.BoundLogger
    ) -> tuple[int, bool]:
        """Claim the quiet parked sessions listed under `instance_id`: a few
        workers at `sweep_rate` claims a second, while a watch of the
        instance's bells claims a woken one at once. The watch starts after
        the backlog is known, and its first answer is every bell already
        rung: an arrival after the listing is never left to the sweep's
        pace. Returns (won, whether the instance turned out live)."""
        backlog = self.unclaimed.setdefault(instance_id, {})
        for session in quiet:
            backlog.setdefault(session.fence.session_id, session)
        order = list(backlog)
        watch = asyncio.ensure_future(self._watch_backlog_bells(instance_id, backlog))
        loop = asyncio.get_running_loop()
        started = last_log = next_at = loop.time()
        won = claimed = 0
        live_again = False
        pending = iter(order)
        bound.info("sweeping parked sessions", sessions=len(order), rate=self.sweep_rate)

        async def worker() -> None:
            nonlocal won, claimed, live_again, next_at, last_log
            for sid in pending:
                if live_again or self.lease_lost.is_set():
                    return
                now = loop.time()
                slot, next_at = max(now, next_at), max(now, next_at) + 1 / self.sweep_rate
                if slot > now:
                    await asyncio.sleep(slot - now)
                session = backlog.pop(sid, None)
                if session is None:
                    continue  # a bell claimed it first
                taken, live = await self._take(session)
                live_again |= live
                claimed += 1
                if taken:
                    won += 1
                    metrics.PARKED_CLAIMS.labels("swept").inc()
                # Tests: a successor killed mid-sweep.
                await failpoints.hit("fleet.swept")
                if loop.time() - last_log >= SWEEP_LOG_EVERY:
                    last_log = loop.time()
                    bound.info("sweep progress", claimed=claimed, won=won, left=len(backlog))

        try:
            await asyncio.gather(*(worker() for _ in range(min(SWEEP_CONCURRENCY, len(order)))))
        finally:
            watch.cancel()
            await asyncio.wait([watch])
            if self.unclaimed.get(instance_id) is backlog:
                # What is left (the instance is live again, the lease was
                # lost) is the next round's or another instance's.
                del self.unclaimed[instance_id]
        bound.info(
            "sweep done",
            claimed=claimed,
            won=won,
            seconds=round(loop.time() - started, 1),
            live_again=live_again,
        )
        return won, live_again

    async def _watch_backlog_bells(
        self, instance_id: str, backlog: dict[str, OwnedSession]
    ) -> None:
        """While `instance_id`'s parked sessions are swept: a bell (input for
        one of them) claims that one at once."""
        backoff = retry.FLEET.backoff()
        while True:
            try:
                async for bells in self.hooks.watch_bells(instance_id):
                    for bell in bells:
                        session = backlog.pop(bell.session_id, None)
                        if session is not None:
                            self._spawn(self._claim_woken(session))
                    backoff.reset()
            except BatonError as exc:
                self._log.warning(
                    "bell watch of a swept instance interrupted",
                    swept_instance_id=instance_id,
                    reason=exc.reason,
                )
            await backoff.wait()

    async def _claim_woken(self, session: OwnedSession) -> None:
        """A parked session of the backlog whose bell rang: take it over now
        (the takeover sees the bell, so the session is not parked under
        this instance and runs at once)."""
        async with self._wake_slots:
            taken, _ = await self._take(session)
        if taken:
            metrics.PARKED_CLAIMS.labels("woken").inc()

    # -- reconciliation -------------------------------------------------------------

    async def _reconcile(self) -> None:
        """The safety net under the watches: every `reconcile_every` seconds,
        take over again what no live run holds. A session indexed under this
        instance that the host holds in no state (running, loading, parked,
        stalled) at two reconciliations in a row, with the same fence, has no
        run anywhere (the index names its owner): this instance takes it
        over from itself (epoch + 1) and runs it. Two sightings, because a
        session being created or transferred here is indexed a moment before
        the host holds it. Dead instances whose takeover rounds ran out are
        tried again."""
        while not self.lease_lost.is_set():
            await asyncio.sleep(self.reconcile_every)
            if self.lease_lost.is_set():
                return  # the sessions are others' now
            for instance_id in sorted(self._unfinished):
                self._schedule_adoption(instance_id)
            try:
                owned = await self.hooks.list_instance_sessions(
                    self.deployment_id, self.instance_id
                )
            except BatonError as exc:
                self._log.warning("reconciliation listing failed", reason=exc.reason)
                continue
            unheld = {
                o.fence.session_id: o.fence.SerializeToString()
                for o in owned
                if not self.host.holds(o.fence.session_id)
            }
            sweeping = self.unclaimed.get(self.instance_id, {})
            orphans = [
                o
                for o in owned
                if self._unheld.get(o.fence.session_id) == o.fence.SerializeToString()
                and o.fence.session_id in unheld
                and o.fence.session_id not in sweeping  # the sweep's, at its pace
            ]
            self._unheld = unheld
            if orphans:
                won, _ = await self._adopt_all(orphans)
                # The others were finalized (their index entry is dropped
                # by the takeover attempt) or taken by someone else.
                if won:
                    self._log.warning(
                        "sessions indexed here had no run: taken over again",
                        sessions=won,
                        session_ids=[o.fence.session_id for o in orphans[:10]],
                    )
                if won < len(orphans):
                    self._log.info(
                        "index entries of finalized or moved sessions dropped",
                        sessions=len(orphans) - won,
                    )

    # -- bells ----------------------------------------------------------------------

    async def _watch_bells(self) -> None:
        backoff = retry.FLEET.backoff()
        while True:
            try:
                async for bells in self.hooks.watch_bells(self.instance_id):
                    for bell in bells:
                        self.host.ring(bell.session_id, bell.inbox_head)
                    backoff.reset()
            except BatonError as exc:
                self._log.warning("bell watch interrupted", reason=exc.reason)
            await backoff.wait()


class UnclaimedSessions(Collector):
    """`baton_parked_unclaimed_sessions`: quiet parked sessions this instance
    listed under a dead instance (or under its own id, left by its earlier
    process) and has not claimed yet (docs/metrics.md)."""

    def __init__(self, fleet: FleetMembership) -> None:
        self._fleet = fleet

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            metrics.PARKED_UNCLAIMED,
            "Quiet parked sessions of dead instances this instance listed and has not "
            "claimed yet (its sweep claims them at a bounded rate; a bell claims one at once)",
        )
        family.add_metric([], sum(len(b) for b in self._fleet.unclaimed.values()))
        yield family
