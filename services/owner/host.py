"""The owner host: the sessions one owner instance holds, and their lifecycle.

A session held here is in one of four states:
- running: a `SessionRun` in `runs` (snapshot in memory, inbox stream open);
- parked: in `parking` (parking.py: fence and consumed inbox position, no
  snapshot, no stream) after its run parked it, or after a takeover of a
  session that was parked and received nothing since; a bell or its
  lifetime deadline wakes it;
- activating: in `_activating` while the snapshot is loaded (wake, takeover,
  restart after a failed run);
- stalled: its restart budget is spent (restarts.py).

Sessions arrive through StartSession (created here: by ingress, or, for a
child session, by the owner of its parent, possibly this one; see
services/owner/children.py), through handoffs from other deployments
(acceptance.py: checked there, transferred and launched here), adoptions
(adoption.py) and takeovers of the sessions of dead instances of this
deployment (`adopt`, driven by the fleet). Which authored agent runs a
session is the catalog's answer for its parent link (the root agent for a
session without one). A successor continues from the last committed
snapshot and its inbox position: committed steps are never executed again;
the one step in flight when the previous owner died (its model and tool
calls were never committed) is executed again — at-least-once for that step
only (DESIGN.md §4). An operator's drain is drains.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import structlog

from baton.session.v1 import session_pb2 as s
from services.common import failpoints, ids, retry
from services.common.clients import (
    AnchorClient,
    DrainReport,
    HandoffAccepted,
    HooksClient,
    Moved,
    OwnedSession,
    StartedSession,
)
from services.common.errors import (
    AlreadyExists,
    BatonError,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    NotFound,
    Reason,
    Unavailable,
)
from services.common.inflight import InFlight
from services.common.tasks import Background
from services.owner.acceptance import TRANSFER_SETTLE_SECONDS, HandoffAcceptance, HandoffOffer
from services.owner.adoption import Adoption
from services.owner.agent import Agent, AgentCatalog
from services.owner.checkpoint import Arrival, CheckpointRules
from services.owner.children import Children, ChildStart
from services.owner.commit import commit_step
from services.owner.drains import Drains
from services.owner.handoff import HandoffAttempts
from services.owner.held import RunIdentity, make_event
from services.owner.parking import ParkedSession, Parking
from services.owner.restarts import DEFAULT_RESTART_BUDGET, Restarts, transient
from services.owner.session import RunExit, SessionRun
from services.owner.turns import SNAPSHOT_FORMAT, initial_snapshot

log = structlog.get_logger("baton.owner")

READY_WAIT_SECONDS = 10.0


class OwnerHost:
    """Starts, runs, parks, wakes and adopts the sessions of one instance."""

    def __init__(
        self,
        deployment_id: str,
        instance_id: str,
        agent: Agent,
        hooks: HooksClient,
        anchor: AnchorClient,
        *,
        park_after: float | None = None,
        clock: Callable[[], float] = time.time,
        readable_formats: frozenset[int] = frozenset({SNAPSHOT_FORMAT}),
        restart_budget: int = DEFAULT_RESTART_BUDGET,
    ) -> None:
        self.deployment_id = ids.validate_deployment_id(deployment_id)
        self.instance_id = ids.validate_id(instance_id, "instance_id")
        self.agent = agent
        self.catalog = AgentCatalog(agent)
        self.hooks = hooks
        self.anchor = anchor
        self.park_after = park_after
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
        self.parking = Parking(self, self._log, clock)
        self.restarts = Restarts(
            (self.deployment_id, self.instance_id),
            hooks,
            anchor,
            self,
            self._log,
            restart_budget,
        )
        self.drains = Drains(self.deployment_id, self.instance_id, self.parking, self._log)
        rules = CheckpointRules(self.deployment_id, readable_formats, self.catalog)
        self.attempts = HandoffAttempts(self.deployment_id, self.instance_id, hooks)
        self.acceptance = HandoffAcceptance(self.instance_id, hooks, anchor, rules)
        self.adoption = Adoption(self.instance_id, hooks, anchor, rules)
        self.children = Children(self.deployment_id, self.instance_id, hooks, self)

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

    # -- sessions created here -----------------------------------------------

    async def start_session(
        self,
        session_id: str,
        deployment_id: str,
        channel: str,
        aliases: list[str],
        *,
        timeout_seconds: int = 0,
        token_budget: int = 0,
    ) -> StartedSession:
        """Create the session (epoch 1), commit session.started, run it; or
        find it started."""
        ids.validate_session_id(session_id)
        self._check_deployment(deployment_id)
        ids.validate_channel(channel)
        inbox = ids.inbox_token(session_id)
        await self._wait_ready()
        known = self.runs.get(session_id) or self.parked.get(session_id)
        if known is not None:
            return StartedSession(session_id, known.run_id, False, inbox)
        run_id = ids.new_run_id()
        with self._arriving.hold(session_id):
            try:
                created = await self.hooks.create_session(
                    session_id, self._owner(run_id), channel, aliases
                )
            except AlreadyExists as exc:
                if exc.reason == Reason.SESSION_EXISTS:
                    run_id = exc.metadata.get("owner_run_id", "")
                    return StartedSession(session_id, run_id, False, inbox)
                raise
            identity = RunIdentity(created.fence, self.deployment_id, self.instance_id)
            snapshot = initial_snapshot(
                session_id,
                channel,
                self.deployment_id,
                list(created.hooks),
                timeout_seconds=timeout_seconds,
                token_budget=token_budget,
            )
            revision = await self._commit_started(identity, snapshot)
            self._launch(identity, snapshot, revision)
        self._log.info("session started", session_id=session_id, run_id=run_id, channel=channel)
        return StartedSession(session_id, run_id, True, inbox)

    async def start_child(self, start: ChildStart) -> StartedSession:
        """Create a child session (DESIGN.md §11) with its first work in its
        inbox (one hooks transaction) and run it with that work in hand. Its
        first commit carries session.started with its first turn (its stream
        exists from the create: a follower waits for it); an owner that
        finds no snapshot (this one died first) commits session.started from
        the parent link hooks keeps. The run id is derived from the session
        and this instance, so a retried start repeats the same create."""
        session_id = ids.validate_session_id(start.session_id)
        self._check_deployment(start.deployment_id)
        ids.validate_channel(start.channel)
        parent = start.parent
        self._validate_parent_link(parent, list(start.aliases))
        inbox = ids.inbox_token(session_id)
        await self._wait_ready()
        known = self.runs.get(session_id) or self.parked.get(session_id)
        if known is not None:
            return StartedSession(session_id, known.run_id, False, inbox)
        if session_id in self._activating:
            return StartedSession(session_id, "", False, inbox)
        run_id = ids.run_id_for(f"{session_id}/{self.instance_id}")
        try:
            with self._arriving.hold(session_id):
                created = await self.hooks.create_session(
                    session_id, self._owner(run_id), start.channel, [], parent, start.first_command
                )
        except AlreadyExists as exc:
            if exc.reason == Reason.SESSION_EXISTS:
                found = exc.metadata.get("owner_run_id", "")
                return StartedSession(session_id, found, False, inbox)
            raise
        if session_id in self.runs:  # a concurrent start of the same child won
            return StartedSession(session_id, run_id, False, inbox)
        identity = RunIdentity(created.fence, self.deployment_id, self.instance_id)
        snapshot = initial_snapshot(
            session_id, start.channel, self.deployment_id, list(created.hooks), parent=parent
        )
        seed = [created.first_entry] if created.first_entry is not None else []
        self._launch(identity, snapshot, 0, seed=seed, unstarted=True)
        self._log.info(
            "child session started",
            session_id=session_id,
            run_id=run_id,
            parent_session_id=parent.parent_session_id,
        )
        return StartedSession(session_id, run_id, True, inbox, first_command_appended=bool(seed))

    def _check_deployment(self, deployment_id: str) -> None:
        ids.validate_deployment_id(deployment_id)
        if deployment_id != self.deployment_id:
            raise FailedPrecondition(
                Reason.WRONG_DEPLOYMENT,
                f"this owner runs deployment {self.deployment_id}, not {deployment_id}",
            )

    def _owner(self, run_id: str) -> s.OwnerIdentity:
        return s.OwnerIdentity(
            owner_run_id=run_id, deployment_id=self.deployment_id, instance_id=self.instance_id
        )

    def _validate_parent_link(self, parent: s.ParentLink, aliases: list[str]) -> None:
        ids.validate_session_id(parent.parent_session_id)
        if aliases:
            raise InvalidArgument(Reason.INVALID_FIELD, "a child session takes no aliases")
        if parent.kind not in (
            s.TASK_KIND_SUBAGENT,
            s.TASK_KIND_BACKGROUND,
            s.TASK_KIND_WORKFLOW,
        ):
            raise InvalidArgument(Reason.INVALID_FIELD, "parent.kind is required")
        try:
            self.catalog.agent_for(parent)
        except LookupError as exc:
            raise InvalidArgument(Reason.UNKNOWN_SUBAGENT, str(exc)) from exc

    def offer(self, session_id: str, entry: s.InboxEntry) -> None:
        """An entry this process just appended to a session's inbox: a run of
        it here takes it at once (its inbox stream would deliver it a hop
        later; the run ignores whichever comes second)."""
        run = self.runs.get(session_id)
        if run is not None:
            run.offer(entry)

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

    def _launch(
        self,
        identity: RunIdentity,
        snapshot: s.SessionSnapshot,
        revision: int | None,
        seed: Sequence[s.InboxEntry] = (),
        handoff_id: str = "",
        context: Sequence[s.ChatMessage] = (),
        unstarted: bool = False,
    ) -> None:
        running = self.runs.get(identity.fence.session_id)
        if running is not None and running.identity.fence.epoch > identity.fence.epoch:
            return  # a stale activation: a newer run holds the session here
        try:
            agent = self.catalog.agent_for(snapshot.parent if snapshot.HasField("parent") else None)
        except LookupError as exc:
            # Not this build's code (cannot happen for a child created here):
            # a deterministic failure, counted by the restart budget.
            failure = FailedPrecondition(Reason.UNKNOWN_SUBAGENT, str(exc))
            self.restarts.run_failed(identity.fence, failure)
            return
        run = SessionRun(
            identity,
            snapshot,
            agent,
            self.hooks,
            self.anchor,
            park_after=self.park_after,
            snapshot_revision=revision,
            attempts=self.attempts,
            seed=seed,
            handoff_id=handoff_id,
            context=context,
            drain_to=self.drains.target,
            children=self.children,
            subagents=self.catalog.subagent,
            unstarted=unstarted,
        )
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
            # in services/owner/fleet.py must find it again).
            await failpoints.hit("host.hold_parked")
        except Unavailable:
            self._log.warning("failpoint: parked session dropped", session_id=run.session_id)
            return
        timeout = run.snapshot.timeout
        deadline = timeout.deadline.ToSeconds() if timeout.duration_seconds else 0
        parked = ParkedSession(
            run.run_id, run.identity.fence.epoch, run.snapshot.inbox_next_seq, deadline
        )
        self._hold(run.session_id, parked)

    def _hold(self, session_id: str, parked: ParkedSession) -> None:
        running = self.runs.get(session_id)
        self.parking.hold(session_id, parked, running.identity.fence.epoch if running else 0)

    def ring(self, session_id: str, inbox_head: int) -> None:
        """A bell: the session's inbox reached `inbox_head` (parking.py)."""
        busy = (
            session_id in self.runs
            or session_id in self._activating
            or session_id in self.restarts.adopting
        )
        self.parking.ring(session_id, inbox_head, busy=busy)

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
        self._launch(identity, snapshot, revision, context=context)

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

    async def adopt(self, owned: OwnedSession) -> bool:
        """Take over a session of a dead instance of this deployment
        (restarts.py). True when this host now holds it; False when another
        instance won the race or the session is finalized."""
        sid = owned.fence.session_id
        if owned.owner.instance_id == self.instance_id and self.holds(sid):
            return False  # ours already (listed before it arrived or was taken over)
        taken = await self.restarts.take_over(owned)
        if taken is None:
            return False
        if taken.parked:
            self._hold(
                sid, ParkedSession(taken.fence.owner_run_id, taken.fence.epoch, taken.inbox_head)
            )
        else:
            self.start_activation(taken.fence)
        return True

    # -- sessions arriving from other deployments ---------------------------------------

    async def accept_handoff(self, offer: HandoffOffer) -> HandoffAccepted:
        """Prepare, transfer, start (acceptance.py). Shielded: a caller that
        goes away (the old owner died, its deadline passed) must not cancel a
        transfer in flight or the start of a transferred session."""
        await self._wait_ready()
        task = self._background.spawn(self._accept(offer), outcome_optional=True)
        return await asyncio.shield(task)

    async def _accept(self, offer: HandoffOffer) -> HandoffAccepted:
        async with self.acceptance.offer(offer) as arrival:
            if isinstance(arrival, HandoffAccepted):
                return arrival  # a repeat of a handoff that moved the session
            # Settled in the background (replays until a definite answer) and
            # started there on success: the caller waits a bounded time only.
            settling = self._background.spawn(self._arrive(arrival), outcome_optional=True)
            try:
                moved = await asyncio.wait_for(asyncio.shield(settling), TRANSFER_SETTLE_SECONDS)
            except TimeoutError as exc:
                handoff_id = arrival.transfer.handoff_id
                self._log.warning(
                    "transfer outcome still unknown; settling it in the background",
                    session_id=arrival.session_id,
                    handoff_id=handoff_id,
                )
                raise Unavailable(
                    Reason.UPSTREAM_UNAVAILABLE,
                    f"the transfer of handoff {handoff_id} is not settled yet",
                ) from exc
            return HandoffAccepted(arrival.transfer.successor, moved.fence, moved.replayed)

    async def adopt_orphan(self, session_id: str) -> Moved:
        """Take over a session whose deployment has no live owner left (adoption.py)."""
        await self._wait_ready()
        arrival = await self.adoption.prepare(session_id)
        moved = await self._arrive(arrival)
        self._log.info(
            "orphaned session adopted",
            session_id=arrival.session_id,
            handoff_id=arrival.transfer.handoff_id,
            epoch=moved.fence.epoch,
            replayed=moved.replayed,
        )
        return moved

    async def _arrive(self, arrival: Arrival) -> Moved:
        """Transfer the session here, then run it from its checkpoint with
        the trigger in hand. A repeat of a running handoff is ignored."""
        sid = arrival.session_id
        with self._transferring.hold(sid):
            moved = await self.acceptance.transfer(arrival)
            if self._stopped:
                return moved
            running = self.runs.get(sid)
            if running is not None and running.identity.fence.epoch >= moved.fence.epoch:
                return moved  # this run already, or a newer one
            # Anything else held here for the session is older (a parked entry,
            # an activation retrying an earlier fence): the new fence wins.
            self.parking.unhold(sid)
            identity = RunIdentity(moved.fence, self.deployment_id, self.instance_id)
            loaded, revision = arrival.loaded, arrival.transfer.snapshot_revision
            handoff_id = arrival.transfer.handoff_id
            self._launch(
                identity, loaded.snapshot, revision, arrival.seed, handoff_id, loaded.context
            )
        return moved

    # -- drain (issue 12) ----------------------------------------------------------------

    def drain(self, to_deployment_id: str) -> DrainReport:
        """Hand every session held here to `to_deployment_id` (drains.py).
        Safe to repeat; returns the progress report."""
        self.drains.start(to_deployment_id, self.held())
        for run in list(self.runs.values()):
            run.request_drain(self.drains.target)
        self.drains.pump()
        return self.drain_report()

    def drain_report(self) -> DrainReport:
        return self.drains.report(
            self.runs,
            self._activating - set(self.runs),
            self.parked,
            self.stalled,
            self.attempts.last_refusal,
            self.held(),
        )
