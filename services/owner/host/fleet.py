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
- Reconciliation (reconcile.py): every few seconds, a session indexed under
  this instance that the host holds in no state is taken over again, a
  parked one whose bell was lost is woken, and dead instances whose
  takeover ran out of rounds are tried again: whatever a lost watch event
  or a bug in the host drops, a session with input is run again within a
  bounded time (issue 16).
- Drains: the target of an operator's drain is announced in the registry
  entry on the next keep-alive (SetInstanceDrain), for `baton deployments list`.
- Graceful shutdown stops every run, then revokes the lease, so the other
  instances take the sessions over at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from baton_runtime.common import failpoints, retry
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError
from baton_runtime.common.etcd.keys import NO_AGENT, AgentLabel
from baton_runtime.common.tasks import Background
from baton_runtime.owner.host.host import OwnerHost
from baton_runtime.owner.host.reconcile import Reconciler
from baton_runtime.owner.host.sweep import DEFAULT_SWEEP_RATE, ParkedSweep, claim_all

log = structlog.get_logger("baton.owner.fleet")

# How often a round of reconciliation runs (docs/design.md §5; owner --reconcile-interval).
DEFAULT_RECONCILE_INTERVAL = 15.0
ADOPT_ROUNDS = 20
DEREGISTER_SECONDS = 2.0


class FleetMembership:
    """Lease, takeover and bell streams of one owner instance."""

    def __init__(
        self,
        host: OwnerHost,
        hooks: HooksClient,
        *,
        address: str,
        lease_ttl: int,
        agent: AgentLabel = NO_AGENT,
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
        self.agent = agent  # registered with the instance, for operators
        self.lease_ttl = lease_ttl
        self.keepalive_every = keepalive_every
        self.lease_id = 0
        self.lease_lost = asyncio.Event()
        self._announced_drain = ""  # the drain target the registry entry names
        self._on_lease_lost = on_lease_lost
        self._background = Background()
        self._adopting: dict[str, bool] = {}  # instance -> run another round after this one
        # Dead instances whose sessions were not all taken over (every round spent).
        self._unfinished: set[str] = set()
        # Quiet parked sessions listed and not claimed yet: claimed by the
        # sweep, or at once on a bell.
        self.parked = ParkedSweep(
            host, hooks, self._background, rate=sweep_rate, stopped=self.lease_lost
        )
        if reconcile_every <= 0:
            raise ValueError("reconcile_every must be positive")
        self.reconcile_every = reconcile_every
        self._log = log.bind(deployment_id=self.deployment_id, instance_id=self.instance_id)
        self.reconciler = Reconciler(host, hooks, self.parked, self._log)

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
                    self.deployment_id, self.instance_id, self.lease_ttl, self.address, self.agent
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
        """A keep-alive every interval, on a fixed beat: one that fails or
        hangs (bounded by the interval) costs that beat only, so at TTL/3
        the lease outlives one lost keep-alive with an interval to spare.
        (Sleeping a full interval after a hung one left the next keep-alive
        three intervals after the last renewal: the lease's whole TTL, and
        one hang cost the lease; issue 38's network faults.)"""
        loop = asyncio.get_running_loop()
        beat = loop.time()
        failed = 0
        while True:
            beat = max(beat + self.keepalive_every, loop.time())
            await asyncio.sleep(beat - loop.time())
            try:
                async with asyncio.timeout(self.keepalive_every):
                    await failpoints.hit("fleet.keep_alive")
                    ttl = await self.hooks.keep_alive_instance(self.lease_id)
            except (BatonError, TimeoutError) as exc:
                # Hooks or etcd unreachable: keep trying. etcd extends leases
                # when it comes back; an expired one answers TTL 0 below.
                self._log.warning("keep-alive failed", error=repr(exc))
                failed += 1
                continue
            if ttl <= 0:
                await self._lose_lease()
                return
            if failed:
                self._log.info("keep-alive answered again", failed=failed, ttl_s=ttl)
                failed = 0
            await self._announce_drain()

    async def _announce_drain(self) -> None:
        """Record the host's drain target in this instance's registry entry
        when it changed since the last announcement (looked at on every
        keep-alive, so the registry says DRAINING within one interval)."""
        target = self.host.drains.target
        if target == self._announced_drain:
            return
        try:
            async with asyncio.timeout(self.keepalive_every):
                await self.hooks.set_instance_drain(
                    self.deployment_id, self.instance_id, self.lease_id, target
                )
        except (BatonError, TimeoutError) as exc:  # the next keep-alive tries again
            self._log.warning("drain announcement failed", error=repr(exc))
            return
        self._announced_drain = target

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
        parked ones, lazily (`ParkedSweep.sweep`)."""
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
            won, live_again = await claim_all(self.host, active)
            if active_taken is not None:
                active_taken.set()
            if quiet and not live_again:
                swept, live_again = await self.parked.sweep(instance_id, quiet, bound)
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

    # -- reconciliation -------------------------------------------------------------

    async def _reconcile(self) -> None:
        """The safety net under the watches (reconcile.py): every
        `reconcile_every` seconds, one round of this instance's reconciler,
        and dead instances whose takeover rounds ran out are tried again."""
        while not self.lease_lost.is_set():
            await asyncio.sleep(self.reconcile_every)
            if self.lease_lost.is_set():
                return  # the sessions are others' now
            for instance_id in sorted(self._unfinished):
                self._schedule_adoption(instance_id)
            try:
                await self.reconciler.round()
            except BatonError as exc:
                self._log.warning("reconciliation listing failed", reason=exc.reason)

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
