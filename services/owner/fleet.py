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
  wins each session, the losers move on.
- Bells: one stream for all of this instance's parked sessions; each bell is
  handed to the host, which wakes a parked session whose inbox moved.
- Reconciliation: every few seconds, a session indexed under this instance
  that the host holds in no state is taken over again, and dead instances
  whose takeover ran out of rounds are tried again: whatever a lost watch
  event or a bug in the host drops, a session with input is run again
  within a bounded time (issue 16).
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

from services.common import retry
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
        self._announced_drain = ""  # the drain target the registry entry names
        self._on_lease_lost = on_lease_lost
        self._background = Background()
        self._adopting: dict[str, bool] = {}  # instance -> run another round after this one
        # Dead instances whose sessions were not all taken over (every round spent).
        self._unfinished: set[str] = set()
        # Sessions indexed under this instance that it did not hold at the
        # last reconciliation: session id -> fence value seen then.
        self._unheld: dict[str, bytes] = {}
        if reconcile_every <= 0:
            raise ValueError("reconcile_every must be positive")
        self.reconcile_every = reconcile_every
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
        # this instance id: take them over before creating new ones.
        await self._adopt_instance(self.instance_id)
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

    def _schedule_adoption(self, instance_id: str) -> None:
        if instance_id in self._adopting:
            self._adopting[instance_id] = True
            return
        self._adopting[instance_id] = False
        self._spawn(self._adopt_rounds(instance_id))

    async def _adopt_rounds(self, instance_id: str) -> None:
        try:
            while True:
                await self._adopt_instance(instance_id)
                if not self._adopting.get(instance_id):
                    return
                self._adopting[instance_id] = False
        finally:
            self._adopting.pop(instance_id, None)

    async def _adopt_instance(self, instance_id: str) -> None:
        """Take over every session indexed under `instance_id`, until none is
        left there (the others' wins leave the index too)."""
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
            bound.info("taking sessions over", sessions=len(owned))
            won, live_again = await self._adopt_all(owned)
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
                try:
                    if await self.host.adopt(session):
                        won += 1
                except FailedPrecondition as exc:
                    if exc.reason != Reason.INSTANCE_LIVE:
                        self._log.error("takeover failed", reason=exc.reason, error=exc.message)
                        continue
                    live_again = True
                except BatonError as exc:
                    self._log.error("takeover failed", reason=exc.reason, error=exc.message)

        await asyncio.gather(*(worker() for _ in range(min(ADOPT_CONCURRENCY, len(owned)))))
        return won, live_again

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
            orphans = [
                o
                for o in owned
                if self._unheld.get(o.fence.session_id) == o.fence.SerializeToString()
                and o.fence.session_id in unheld
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
