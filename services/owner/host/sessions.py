"""The sessions one owner instance holds, and their lifecycle (the floor
of `OwnerHost`, host.py): launching a run and acting on how it ended,
(re)activating a session from its last snapshot (a wake, a takeover, a
restart), holding parked sessions and ringing their bells.

A session held here is in one of four states:
- running: a `SessionRun` in `runs` (snapshot in memory, inbox stream open);
- parked: in `parking` (parking.py: fence and consumed inbox position, no
  snapshot, no stream) after its run parked it, or after a takeover of a
  session that was parked and received nothing since; a bell or its
  lifetime deadline wakes it;
- activating: in `_activating` while the snapshot is loaded (wake, takeover,
  restart after a failed run);
- stalled: its restart budget is spent (restarts.py).

A successor continues from the last committed snapshot and its inbox
position: committed steps are never executed again; the one step in flight
when the previous owner died (its model and tool calls were never
committed) is executed again — at-least-once for that step only (docs/design.md
§4).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sized
from dataclasses import dataclass
from typing import Any

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import failpoints, ids, retry
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import (
    BatonError,
    FailedPrecondition,
    Fenced,
    NotFound,
    Reason,
    Unavailable,
)
from baton_runtime.common.tasks import Background
from baton_runtime.owner.agents.api import Agent, AgentCatalog
from baton_runtime.owner.handoff.acceptance import HandoffAcceptance
from baton_runtime.owner.handoff.attempt import HandoffAttempts
from baton_runtime.owner.handoff.checkpoint import CheckpointRules
from baton_runtime.owner.host.adoption import Adoption
from baton_runtime.owner.host.drains import Drains
from baton_runtime.owner.host.inflight import InFlight
from baton_runtime.owner.host.parking import ParkedSession, Parking
from baton_runtime.owner.host.restarts import DEFAULT_RESTART_BUDGET, Restarts, transient
from baton_runtime.owner.rules.held import RunIdentity, make_event
from baton_runtime.owner.run.children import Children
from baton_runtime.owner.run.commit import commit_step
from baton_runtime.owner.run.session import SessionRun
from baton_runtime.owner.run.snapshots import SNAPSHOT_FORMAT, initial_snapshot, lifetime_deadline
from baton_runtime.owner.run.terms import RunExit, RunServices, RunStart

log = structlog.get_logger("baton.owner")

READY_WAIT_SECONDS = 10.0


@dataclass(frozen=True)
class HostSettings:
    """How one owner instance holds its sessions (from `OwnerConfig`): who
    it is, the idle time before a run parks (None: never parks), the
    snapshot formats it can read (a handoff from an older or newer build),
    the deterministic failures a session may have before it stalls, and the
    clock parking reads deadlines with."""

    deployment_id: str
    instance_id: str
    park_after: float | None = None
    readable_formats: frozenset[int] = frozenset({SNAPSHOT_FORMAT})
    restart_budget: int = DEFAULT_RESTART_BUDGET
    clock: Callable[[], float] = time.time


class HostedSessions:
    """The sessions of one instance: launch, drive, activate, park."""

    children: Children  # set by OwnerHost, which is the children's LocalOwner

    def __init__(
        self, settings: HostSettings, agent: Agent, hooks: HooksClient, anchor: AnchorClient
    ) -> None:
        self.deployment_id = ids.validate_deployment_id(settings.deployment_id)
        self.instance_id = ids.validate_id(settings.instance_id, "instance_id")
        self.agent = agent
        self.catalog = AgentCatalog(agent)
        self.hooks = hooks
        self.anchor = anchor
        self.park_after = settings.park_after
        self.runs: dict[str, SessionRun] = {}
        self._activating: set[str] = set()
        self._arriving = InFlight()  # sessions being created here
        # Session id -> transfers to this instance in flight (the transfer may
        # have moved the ownership index here before the run is launched).
        self._transferring = InFlight()
        self._background = Background()
        self._ready = asyncio.Event()
        self._stopped = False
        self._log = log.bind(deployment_id=self.deployment_id, instance_id=self.instance_id)
        self.parking = Parking(self, self._log, settings.clock)
        self.restarts = Restarts(
            (self.deployment_id, self.instance_id),
            hooks,
            anchor,
            self,
            self._log,
            settings.restart_budget,
        )
        self.drains = Drains(self.deployment_id, self.instance_id, self.parking, self._log)
        rules = CheckpointRules(self.deployment_id, settings.readable_formats, self.catalog)
        self.attempts = HandoffAttempts(self.deployment_id, self.instance_id, hooks)
        self.acceptance = HandoffAcceptance(self.instance_id, hooks, anchor, rules)
        self.adoption = Adoption(self.instance_id, hooks, anchor, rules)

    @property
    def parked(self) -> dict[str, ParkedSession]:
        return self.parking.parked

    @property
    def stalled(self) -> dict[str, s.Fence]:
        return self.restarts.stalled

    @property
    def drain_to(self) -> str:
        return self.drains.target

    # -- lifecycle ------------------------------------------------------------

    def set_ready(self) -> None:
        """The instance holds its lease: sessions may be created here."""
        self._ready.set()

    async def _wait_ready(self) -> None:
        if self._stopped:
            raise Unavailable(Reason.UPSTREAM_UNAVAILABLE, "this owner instance lost its lease")
        if self._ready.is_set():
            return
        try:
            async with asyncio.timeout(READY_WAIT_SECONDS):
                await self._ready.wait()
        except TimeoutError as exc:
            raise Unavailable(
                Reason.UPSTREAM_UNAVAILABLE, "this owner instance is not registered yet"
            ) from exc

    async def stop(self) -> None:
        """Stop every run and forget every session (the lease is lost, or the
        instance shuts down: other instances take them over). Later
        StartSession calls are refused."""
        self._stopped = True
        await self.drains.stop()
        await self.attempts.close()
        await self.children.close()
        self.parking.stop()
        await self.restarts.stop()
        await self._background.cancel_all()

    async def close(self) -> None:
        await self.stop()

    def sessions_by_state(self) -> dict[str, Sized]:
        """The sessions held, by state (metering.HeldView)."""
        return {"running": self.runs, "parked": self.parked, "stalled": self.stalled}

    def oldest_pending_accepted(self) -> float | None:
        """When the oldest command a run has read and not taken up yet was
        accepted (epoch seconds); None when none waits (metering.HeldView)."""
        times = (run.oldest_pending_accepted() for run in self.runs.values())
        return min((t for t in times if t is not None), default=None)

    def draining(self) -> bool:
        """An operator's drain target is set (metering.HeldView)."""
        return bool(self.drains.target)

    def held(self) -> int:
        """Sessions this instance holds: running, loading, parked or stalled."""
        return len(set(self.runs) | self._activating | set(self.parked) | set(self.stalled))

    def holds(self, session_id: str) -> bool:
        """Whether this instance holds the session in any state: arriving
        (being created here, or transferred here by a handoff or an
        adoption), running, loading, being taken over, parked or stalled."""
        return (
            session_id in self.runs
            or session_id in self._arriving
            or session_id in self._transferring
            or session_id in self._activating
            or session_id in self.restarts.adopting
            or session_id in self.parked
            or session_id in self.stalled
        )

    # -- runs ------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        # A run outlives the RPC that started it: not under its request id.
        self._background.spawn(coro, fresh_context=True)

    async def _commit_started(self, identity: RunIdentity, snapshot: s.SessionSnapshot) -> int:
        """Commit session.started with the first snapshot (which must not
        exist yet); returns the snapshot's revision."""
        event = make_event(identity, s.EVENT_KIND_SESSION_STARTED)
        revision = await commit_step(self.anchor, identity, snapshot, [event], False, 0)
        assert revision is not None
        return revision

    def _launch(self, identity: RunIdentity, start: RunStart) -> None:
        running = self.runs.get(identity.fence.session_id)
        if running is not None and running.identity.fence.epoch > identity.fence.epoch:
            return  # a stale activation: a newer run holds the session here
        try:
            snapshot = start.snapshot
            agent = self.catalog.agent_for(snapshot.parent if snapshot.HasField("parent") else None)
        except LookupError as exc:
            # Not this build's code (cannot happen for a child created here):
            # a deterministic failure, counted by the restart budget.
            failure = FailedPrecondition(Reason.UNKNOWN_SUBAGENT, str(exc))
            self.restarts.run_failed(identity.fence, failure)
            return
        services = RunServices(
            self.hooks,
            self.anchor,
            self.catalog,
            attempts=self.attempts,
            children=self.children,
            park_after=self.park_after,
        )
        run = SessionRun(identity, agent, start, services, drain_to=self.drains.target)
        self.runs[run.session_id] = run
        self._spawn(self._drive(run))

    async def _drive(self, run: SessionRun) -> None:
        """Run `run`, then act on how it ended."""
        sid = run.session_id
        try:
            exit = await run.run()
        except Exception:  # noqa: BLE001 - a broken run must not take the host down
            self._log.exception("run crashed", session_id=sid, run_id=run.run_id)
            exit = RunExit.FAILED
        if self.runs.get(sid) is run:
            del self.runs[sid]
        if run.drained:
            self.drains.moved += 1
        self.drains.slot_done(sid)
        if self._stopped:
            return
        if exit is RunExit.FAILED:
            # Everything durable is in etcd: run again from the last snapshot.
            # Unpark too: a park may have taken effect though its answer was lost.
            if run.progressed:
                self.restarts.forget_failures(sid)
            self.restarts.run_failed(run.identity.fence, run.failure)
            return
        self.restarts.ended(sid)
        if exit is RunExit.PARKED:
            await self._hold_parked(run)
        else:
            self.parking.bells.pop(sid, None)

    async def _hold_parked(self, run: SessionRun) -> None:
        try:
            # Tests: a host that loses a parked session (the reconciler
            # in services/owner/host/fleet.py must find it again).
            await failpoints.hit("host.hold_parked")
        except Unavailable:
            self._log.warning("failpoint: parked session dropped", session_id=run.session_id)
            return
        parked = ParkedSession(
            run.run_id,
            run.identity.fence.epoch,
            run.snapshot.inbox_next_seq,
            lifetime_deadline(run.snapshot),
        )
        self._hold(run.session_id, parked)

    def _hold(self, session_id: str, parked: ParkedSession) -> None:
        running = self.runs.get(session_id)
        self.parking.hold(session_id, parked, running.identity.fence.epoch if running else 0)

    def ring(self, session_id: str, inbox_head: int) -> None:
        """A bell: the session's inbox reached `inbox_head` (parking.py)."""
        if failpoints.armed("host.ring"):
            # Tests: a bell that never reaches its parked session (the
            # reconciler in services/owner/host/fleet.py must wake it).
            self._log.warning("failpoint: bell dropped", session_id=session_id)
            return
        busy = (
            session_id in self.runs
            or session_id in self._activating
            or session_id in self.restarts.adopting
        )
        self.parking.ring(session_id, inbox_head, busy=busy)

    def wake_parked(self, session_id: str) -> bool:
        """Wake a session held parked here (the reconciler: its bell rang and
        never reached it). False when it is not parked here (any more)."""
        if session_id not in self.parking.parked:
            return False
        self.parking.wake(session_id)
        return True

    # -- activation: wake, takeover, restart ------------------------------------------

    def start_activation(self, fence: s.Fence, *, unpark: bool = False, delay: float = 0.0) -> None:
        """Load the session's last snapshot and run it (after `delay`);
        `unpark` first. The `parking.Activator` of parking and restarts."""
        self._activating.add(fence.session_id)
        self._spawn(self._activate(fence, unpark=unpark, delay=delay))

    async def _activate(self, fence: s.Fence, *, unpark: bool, delay: float) -> None:
        """Unpark (when asked), load the last snapshot and run the session;
        retry transient failures until it runs or is lost."""
        sid = fence.session_id
        bound = self._log.bind(session_id=sid, run_id=fence.owner_run_id)
        backoff = retry.ACTIVATION.backoff(first=max(delay, retry.ACTIVATION.first))
        failed: BatonError | None = None
        try:
            if delay:
                await asyncio.sleep(delay)
            while not self._stopped:
                try:
                    if unpark:
                        await self.hooks.set_parked(fence, False)
                        unpark = False
                    await self._run_from_snapshot(fence)
                    return
                except (Fenced, NotFound) as exc:
                    bound.info("session no longer ours", reason=exc.reason)
                    self.parking.bells.pop(sid, None)
                    self.restarts.forget_failures(sid)
                    return
                except BatonError as exc:
                    if not transient(exc):
                        bound.error("cannot run session", reason=exc.reason, error=exc.message)
                        failed = exc
                        return
                    pause = backoff.next_delay()
                    bound.warning("activation retry", reason=exc.reason, backoff_s=pause)
                    await asyncio.sleep(pause)
        finally:
            self._activating.discard(sid)
            if sid not in self.runs:
                self.drains.slot_done(sid)
            if failed is not None:
                self.restarts.run_failed(fence, failed)

    async def _run_from_snapshot(self, fence: s.Fence) -> None:
        identity = RunIdentity(fence, self.deployment_id, self.instance_id)
        context: list[s.ChatMessage] = []
        try:
            loaded = await self.anchor.load_session(fence.session_id)
            snapshot, revision, context = loaded.snapshot, loaded.revision, loaded.context
        except NotFound:
            snapshot, revision = await self._first_snapshot(identity)
        if snapshot.status == s.SESSION_STATUS_FINALIZED:
            self.parking.bells.pop(fence.session_id, None)
            return
        self._launch(identity, RunStart(snapshot, revision, context=context))

    async def _first_snapshot(self, identity: RunIdentity) -> tuple[s.SessionSnapshot, int]:
        """The creator died between CreateSession and its first commit: commit
        session.started now, from what hooks knows (channel, claimed tokens)."""
        sid = identity.fence.session_id
        found = await self.hooks.lookup(ids.inbox_token(sid))
        tokens = await self.hooks.claim(identity.fence, [])
        snapshot = initial_snapshot(
            sid, found.channel, self.deployment_id, tokens, parent=found.parent
        )
        revision = await self._commit_started(identity, snapshot)
        self._log.info("session started by its successor", session_id=sid)
        return snapshot, revision
