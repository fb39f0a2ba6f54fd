"""The owner host: the sessions one owner instance holds.

A session held here is in one of three states:
- running: a `SessionRun` in `runs` (snapshot in memory, inbox stream open);
- parked: a `ParkedSession` in `parked` (fence and consumed inbox position,
  no snapshot, no stream) after its run parked it, or after a takeover of a
  session that was parked and received nothing since. A bell (one WatchBells
  stream per instance, see `services.owner.fleet`) whose inbox head is beyond
  the consumed position wakes it: unpark, load the snapshot, run again with
  the same fence;
- activating: in `_activating` while the snapshot is loaded (wake, takeover,
  retry after a failed run).

Sessions arrive through StartSession (created here: by ingress, or, for a
child session, by the owner of its parent, possibly this one; see
services/owner/children.py) and through takeovers of the sessions of dead
instances of this deployment (`adopt`, driven by the fleet). Which authored
agent runs a session is the catalog's answer for its parent link (the root
agent for a session without one). A successor continues from the last
committed snapshot and its inbox position: committed steps are never
executed again; the one step in flight when the previous owner died (its
model and tool calls were never committed) is executed again — at-least-once
for that step only (DESIGN.md §4).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from baton.session.v1 import session_pb2 as s
from services.common import failpoints, ids, metrics
from services.common.clients import (
    AnchorClient,
    DrainBlocker,
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
from services.owner.agent import Agent, AgentCatalog
from services.owner.children import Children, ChildStart
from services.owner.handoff import HandoffBroker, HandoffOffer
from services.owner.session import (
    SNAPSHOT_FORMAT,
    RunExit,
    RunIdentity,
    SessionRun,
    commit_step,
    initial_snapshot,
    make_event,
    safe_error,
)

log = structlog.get_logger("baton.owner")

READY_WAIT_SECONDS = 10.0
RETRY_FIRST_SECONDS = 0.2
RETRY_MAX_SECONDS = 5.0
FAILED_RUN_MAX_DELAY_SECONDS = 30.0
DEFAULT_RESTART_BUDGET = 5
DRAIN_CONCURRENCY = 32  # parked sessions woken at once for a drain
DRAIN_REPORT_BLOCKERS = 50

# Which failures are deterministic (the one table: docs/failures.md):
# - a commit that can never succeed (an entry, event, snapshot or commit over
#   its limit; anything anchor refuses as INVALID_ARGUMENT) and a model
#   request the endpoint rejects: the turn fails with the reason
#   (`SessionRun._fail_refused`, MODEL_REJECTED); nothing restarts;
# - a run that fails for any other non-retryable reason (authored code
#   raising in Agent.on_load, owner code crashing, an unreadable snapshot or
#   history): restarted with backoff, at most `restart_budget` times in a row,
#   then the session stalls (`_stall`);
# - retryable errors (etcd unavailable, deadlines, CAS conflicts) and a full
#   etcd (STORE_FULL) are not deterministic: restarted (or, for a commit,
#   retried) with backoff, never counted.


@dataclass(slots=True)
class ParkedSession:
    """All a parked session costs: its fence and consumed inbox position."""

    run_id: str
    epoch: int
    inbox_next_seq: int
    deadline: float = 0.0  # the session-lifetime deadline (unix seconds); 0 = none


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
        self._clock = clock
        self.runs: dict[str, SessionRun] = {}
        self.parked: dict[str, ParkedSession] = {}
        self._activating: set[str] = set()
        self._adopting: set[str] = set()
        self._arriving = InFlight()  # sessions being created here
        self._bells: dict[str, int] = {}
        self._failures: dict[str, int] = {}  # consecutive failed runs per session
        self._transient: dict[str, int] = {}  # consecutive transient failures per session
        self.restart_budget = restart_budget
        self.stalled: dict[str, s.Fence] = {}  # restart budget spent: held, not run
        self._resuming: set[str] = set()  # stalled sessions an operator is resuming
        self.drain_to = ""  # an operator's drain target ("" = not draining)
        self.drained = 0  # sessions moved to it
        self._drain_slots = asyncio.Semaphore(DRAIN_CONCURRENCY)
        self._drain_waking: set[str] = set()
        self._drain_pump: asyncio.Task[None] | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._background = Background()
        self._ready = asyncio.Event()
        self._stopped = False
        self._log = log.bind(deployment_id=self.deployment_id, instance_id=self.instance_id)
        self.handoffs = HandoffBroker(
            self.deployment_id,
            self.instance_id,
            hooks,
            anchor,
            self._launch_transferred,
            readable_formats=readable_formats,
            catalog=self.catalog,
        )
        self.children = Children(
            self.deployment_id, self.instance_id, hooks, self.start_child, self._offer
        )

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
        if self._drain_pump is not None:
            self._drain_pump.cancel()
        await self.handoffs.close()
        await self.children.close()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self.parked.clear()
        self._bells.clear()
        self._failures.clear()
        self._transient.clear()
        self.stalled.clear()
        await self._background.cancel_all()

    async def close(self) -> None:
        await self.stop()

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
        ids.validate_deployment_id(deployment_id)
        ids.validate_channel(channel)
        if deployment_id != self.deployment_id:
            raise FailedPrecondition(
                Reason.WRONG_DEPLOYMENT,
                f"this owner runs deployment {self.deployment_id}, not {deployment_id}",
            )
        inbox = ids.inbox_token(session_id)
        await self._wait_ready()
        running = self.runs.get(session_id)
        if running is not None:
            return StartedSession(session_id, running.run_id, False, inbox)
        parked = self.parked.get(session_id)
        if parked is not None:
            return StartedSession(session_id, parked.run_id, False, inbox)
        run_id = ids.new_run_id()
        owner = s.OwnerIdentity(
            owner_run_id=run_id, deployment_id=self.deployment_id, instance_id=self.instance_id
        )
        with self._arriving.hold(session_id):
            try:
                created = await self.hooks.create_session(session_id, owner, channel, aliases)
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
        ids.validate_deployment_id(start.deployment_id)
        ids.validate_channel(start.channel)
        if start.deployment_id != self.deployment_id:
            raise FailedPrecondition(
                Reason.WRONG_DEPLOYMENT,
                f"this owner runs deployment {self.deployment_id}, not {start.deployment_id}",
            )
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
        owner = s.OwnerIdentity(
            owner_run_id=run_id, deployment_id=self.deployment_id, instance_id=self.instance_id
        )
        try:
            with self._arriving.hold(session_id):
                created = await self.hooks.create_session(
                    session_id, owner, start.channel, [], parent, start.first_command
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

    def _offer(self, session_id: str, entry: s.InboxEntry) -> None:
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
            self._run_failed(identity.fence, FailedPrecondition(Reason.UNKNOWN_SUBAGENT, str(exc)))
            return
        run = SessionRun(
            identity,
            snapshot,
            agent,
            self.hooks,
            self.anchor,
            park_after=self.park_after,
            snapshot_revision=revision,
            hand_off=self.handoffs.hand_off,
            seed=seed,
            handoff_id=handoff_id,
            context=context,
            drain=self.handoffs.drain,
            drain_to=self.drain_to,
            children=self.children,
            subagents=self.catalog.subagent,
            unstarted=unstarted,
        )
        self.runs[run.session_id] = run
        self._spawn(self._drive(run))

    async def _drive(self, run: SessionRun) -> None:
        sid = run.session_id
        try:
            exit = await run.run()
        except Exception:  # noqa: BLE001 - a broken run must not take the host down
            self._log.exception("run crashed", session_id=sid, run_id=run.run_id)
            exit = RunExit.FAILED
        if self.runs.get(sid) is run:
            del self.runs[sid]
        if run.drained:
            self.drained += 1
        self._drain_slot_done(sid)
        if self._stopped:
            return
        if exit is RunExit.FAILED:
            # Everything durable is in etcd: run again from the last snapshot.
            # Unpark too: a park may have taken effect though its answer was lost.
            if run.progressed:
                self._failures.pop(sid, None)
            self._run_failed(run.identity.fence, run.failure)
            return
        self._failures.pop(sid, None)
        self._transient.pop(sid, None)
        if exit is RunExit.PARKED:
            try:
                # Tests: a host that loses a parked session (the reconciler
                # in services/owner/fleet.py must find it again).
                await failpoints.hit("host.hold_parked")
            except Unavailable:
                self._log.warning("failpoint: parked session dropped", session_id=sid)
                return
            timeout = run.snapshot.timeout
            deadline = timeout.deadline.ToSeconds() if timeout.duration_seconds else 0
            fence = run.identity.fence
            self._hold(
                sid, ParkedSession(run.run_id, fence.epoch, run.snapshot.inbox_next_seq, deadline)
            )
        else:
            self._bells.pop(sid, None)

    # -- handoffs to this deployment ------------------------------------------------

    async def accept_handoff(self, offer: HandoffOffer) -> HandoffAccepted:
        await self._wait_ready()
        return await self.handoffs.accept(offer)

    def _launch_transferred(
        self,
        fence: s.Fence,
        snapshot: s.SessionSnapshot,
        revision: int,
        seed: Sequence[s.InboxEntry],
        handoff_id: str,
        context: Sequence[s.ChatMessage],
    ) -> None:
        """Run a session transferred here from its checkpoint, with the
        trigger in hand (`seed`). A repeat of a running handoff is ignored."""
        sid = fence.session_id
        if self._stopped:
            return
        running = self.runs.get(sid)
        if running is not None and running.identity.fence.epoch >= fence.epoch:
            return  # this run already, or a newer one
        # Anything else held here for the session is older (a parked entry,
        # an activation retrying an earlier fence): the new fence wins.
        self._unhold(sid)
        identity = RunIdentity(fence, self.deployment_id, self.instance_id)
        self._launch(identity, snapshot, revision, seed, handoff_id, context)

    # -- drain and adoption (issue 12) -------------------------------------------------

    def drain(self, to_deployment_id: str) -> DrainReport:
        """Hand every session held here to `to_deployment_id` through the
        ordinary handoff: running ones the next time they are idle, parked
        ones after waking them (DRAIN_CONCURRENCY at a time). Safe to repeat;
        returns the progress report."""
        target = ids.validate_deployment_id(to_deployment_id)
        if target == self.deployment_id:
            raise InvalidArgument(
                Reason.INVALID_FIELD, f"deployment {target} cannot be drained to itself"
            )
        if target != self.drain_to:
            self._log.info("drain started", to_deployment_id=target, sessions=self.held())
            self.drain_to = target
            self.drained = 0
        for run in list(self.runs.values()):
            run.request_drain(target)
        if self._drain_pump is None or self._drain_pump.done():
            self._drain_pump = asyncio.get_running_loop().create_task(self._wake_parked())
        return self.drain_report()

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
            or session_id in self.handoffs.transferring
            or session_id in self._activating
            or session_id in self._adopting
            or session_id in self.parked
            or session_id in self.stalled
        )

    async def _wake_parked(self) -> None:
        """Wake parked sessions for the drain, a bounded number at a time:
        each slot is freed when its run ends (moved, or anything else)."""
        while self.drain_to and not self._stopped:
            waiting = [sid for sid in self.parked if sid not in self._drain_waking]
            if not waiting:
                return
            await self._drain_slots.acquire()
            sid = waiting[0]
            if sid not in self.parked or self._stopped:
                self._drain_slots.release()
                continue
            self._drain_waking.add(sid)
            self._wake(sid)

    def _drain_slot_done(self, session_id: str) -> None:
        if session_id in self._drain_waking:
            self._drain_waking.discard(session_id)
            self._drain_slots.release()

    def drain_report(self) -> DrainReport:
        blockers: list[DrainBlocker] = []

        def blocked(sid: str, reason: str, detail: str) -> None:
            if len(blockers) < DRAIN_REPORT_BLOCKERS:
                blockers.append(DrainBlocker(sid, reason, detail))

        for sid, run in self.runs.items():
            refusal = self.handoffs.last_refusal.get(sid)
            if run.state.turn_open:
                blocked(sid, Reason.SESSION_BUSY, "a turn is open; it moves when it settles")
            elif run.state.handles.busy():
                blocked(sid, Reason.SESSION_BUSY, "a child session works for it; it moves after")
            elif run.pending:
                blocked(sid, Reason.SESSION_BUSY, f"{run.pending} command(s) to process first")
            elif refusal is not None:
                blocked(sid, refusal[0], refusal[1])
            else:
                blocked(sid, Reason.SESSION_BUSY, "moving")
        for sid in self._activating - set(self.runs):
            blocked(sid, Reason.WAKING, "loading")
        for sid in self.parked:
            blocked(sid, Reason.WAKING, "parked; woken for the drain")
        for sid in self.stalled:
            blocked(sid, Reason.STALLED, "the restart budget is spent (session.stalled)")
        return DrainReport(
            deployment_id=self.deployment_id,
            instance_id=self.instance_id,
            to_deployment_id=self.drain_to,
            moved=self.drained,
            remaining=self.held(),
            blockers=tuple(blockers),
        )

    async def adopt_orphan(self, session_id: str) -> Moved:
        await self._wait_ready()
        return await self.handoffs.adopt(session_id)

    # -- parking and bells -------------------------------------------------------

    def _hold(self, session_id: str, parked: ParkedSession) -> None:
        """Keep a session parked; wake it at once if a bell already rang, and
        at its lifetime deadline (so the timeout fires while parked).

        Never over a newer fence: a run that parks after this instance took
        the session over again (a later epoch, running or parked) parks a
        fence that is already dead, and holding it would hide the live one
        (its bells would wake the dead fence, which is refused, and nothing
        would run the session again)."""
        running = self.runs.get(session_id)
        held = self.parked.get(session_id)
        if (running is not None and running.identity.fence.epoch > parked.epoch) or (
            held is not None and held.epoch > parked.epoch
        ):
            self._log.info("stale park ignored", session_id=session_id, epoch=parked.epoch)
            return
        self._unhold(session_id)
        self.parked[session_id] = parked
        if parked.deadline:
            delay = max(0.0, parked.deadline - self._clock())
            self._timers[session_id] = asyncio.get_running_loop().call_later(
                delay, self._wake, session_id
            )
        if self._bells.pop(session_id, -1) > parked.inbox_next_seq:
            self._wake(session_id)

    def ring(self, session_id: str, inbox_head: int) -> None:
        """A bell: the session's inbox reached `inbox_head`. Duplicate and
        stale bells (at or below the consumed position) are ignored."""
        parked = self.parked.get(session_id)
        if parked is not None:
            if inbox_head > parked.inbox_next_seq:
                self._wake(session_id)
            return
        if (
            session_id in self.runs
            or session_id in self._activating
            or (session_id in self._adopting)
        ):
            # Rung while the run parks (or the session is being loaded):
            # re-checked when it lands in `parked`.
            if inbox_head > self._bells.get(session_id, -1):
                self._bells[session_id] = inbox_head

    def _unhold(self, session_id: str) -> ParkedSession | None:
        """Forget a parked session and its deadline timer."""
        parked = self.parked.pop(session_id, None)
        if parked is not None:
            timer = self._timers.pop(session_id, None)
            if timer is not None:
                timer.cancel()
        return parked

    def _wake(self, session_id: str) -> None:
        parked = self._unhold(session_id)
        if parked is None or self._stopped:
            return
        fence = s.Fence(session_id=session_id, owner_run_id=parked.run_id, epoch=parked.epoch)
        self._start_activation(fence, unpark=True)

    def _start_activation(
        self, fence: s.Fence, *, unpark: bool = False, delay: float = 0.0
    ) -> None:
        self._activating.add(fence.session_id)
        self._spawn(self._activate(fence, unpark=unpark, delay=delay))

    async def _activate(self, fence: s.Fence, *, unpark: bool, delay: float) -> None:
        """Unpark (when asked), load the last snapshot and run the session;
        retry transient failures until it runs or is lost."""
        sid = fence.session_id
        bound = self._log.bind(session_id=sid, run_id=fence.owner_run_id)
        backoff = max(delay, RETRY_FIRST_SECONDS)
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
                    self._bells.pop(sid, None)
                    self._failures.pop(sid, None)
                    return
                except BatonError as exc:
                    if not (exc.retryable or exc.reason == Reason.STORE_FULL):
                        bound.error("cannot run session", reason=exc.reason, error=exc.message)
                        failed = exc
                        return
                    bound.warning("activation retry", reason=exc.reason, backoff_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_SECONDS)
        finally:
            self._activating.discard(sid)
            if sid not in self.runs:
                self._drain_slot_done(sid)
            if failed is not None:
                self._run_failed(fence, failed)

    async def _run_from_snapshot(self, fence: s.Fence) -> None:
        identity = RunIdentity(fence, self.deployment_id, self.instance_id)
        context: list[s.ChatMessage] = []
        try:
            loaded = await self.anchor.load_session(fence.session_id)
            snapshot, revision, context = loaded.snapshot, loaded.revision, loaded.context
        except NotFound:
            snapshot, revision = await self._first_snapshot(identity)
        if snapshot.status == s.SESSION_STATUS_FINALIZED:
            self._bells.pop(fence.session_id, None)
            return
        self._launch(identity, snapshot, revision, context=context)

    # -- failed runs: backoff, restart budget, stall --------------------------------

    def _run_failed(self, fence: s.Fence, failure: BaseException | None) -> None:
        """Restart a failed run with backoff. Transient failures (the store,
        the network) restart without limit; a session whose runs keep failing
        deterministically (DETERMINISTIC_FAILURES) gets `restart_budget`
        restarts, then stalls."""
        sid = fence.session_id
        transient = isinstance(failure, BatonError) and (
            failure.retryable or failure.reason == Reason.STORE_FULL
        )
        if transient:
            count = self._transient[sid] = self._transient.get(sid, 0) + 1
            delay = min(RETRY_FIRST_SECONDS * 2 ** (count - 1), RETRY_MAX_SECONDS)
        else:
            count = self._failures[sid] = self._failures.get(sid, 0) + 1
            if count > self.restart_budget:
                self._spawn(self._stall(fence, failure, count))
                return
            delay = min(RETRY_FIRST_SECONDS * 2 ** (count - 1), FAILED_RUN_MAX_DELAY_SECONDS)
        metrics.RESTARTS.inc()
        self._log.warning(
            "run failed; restarting it",
            session_id=sid,
            delay_s=delay,
            transient=transient,
            failures=count,
            error=repr(failure)[:300],
        )
        self._start_activation(fence, unpark=True, delay=delay)

    async def _stall(self, fence: s.Fence, failure: BaseException | None, count: int) -> None:
        """The restart budget is spent: hold the session without running it
        (its inbox keeps every accepted command) and say so on its stream.
        An operator's resume (`resume_stalled`), a restart of this instance,
        or another instance taking the session over runs it again with a
        fresh budget."""
        sid = fence.session_id
        self.stalled[sid] = fence
        if isinstance(failure, BatonError):
            cause = f"{failure.reason}: {failure.message}"
        else:
            cause = safe_error(failure) if failure is not None else "unknown"
        message = f"{count} runs in a row failed; the last: {cause}"[:500]
        self._log.error("session stalled: restart budget spent", session_id=sid, error=message)
        identity = RunIdentity(fence, self.deployment_id, self.instance_id)
        event = make_event(
            identity,
            s.EVENT_KIND_SESSION_STALLED,
            error=s.ErrorDetail(reason=Reason.RESTART_BUDGET_SPENT, message=message),
        )
        try:
            snapshot, revision = await self.anchor.snapshot_with_revision(sid)
            await commit_step(self.anchor, identity, snapshot, [event], False, revision)
        except Fenced:
            self.stalled.pop(sid, None)  # someone else runs it now
        except BatonError as exc:
            self._log.error("stall not reported on the stream", session_id=sid, reason=exc.reason)

    async def resume_stalled(self, session_id: str) -> s.Fence | None:
        """An operator's resume (docs/failures.md): run a session stalled here
        again, its restart budget renewed and its inbox kept. Commits
        `session.resumed` first (so introspection stops reporting the stall),
        then activates the run; the session stays held as stalled until then.
        None when this instance holds the session but it is not stalled (a
        repeated or concurrent resume); NotFound when it does not hold it;
        Fenced when another run owns it now."""
        ids.validate_session_id(session_id)
        fence = self.stalled.get(session_id)
        if fence is None or session_id in self._resuming:
            if self.holds(session_id):
                return None
            raise NotFound(
                Reason.SESSION_NOT_FOUND, f"this instance does not hold session {session_id}"
            )
        identity = RunIdentity(fence, self.deployment_id, self.instance_id)
        self._resuming.add(session_id)
        try:
            snapshot, revision = await self.anchor.snapshot_with_revision(session_id)
            event = make_event(identity, s.EVENT_KIND_SESSION_RESUMED)
            await commit_step(self.anchor, identity, snapshot, [event], False, revision)
        except Fenced:
            self.stalled.pop(session_id, None)  # someone else runs it now
            raise
        finally:
            self._resuming.discard(session_id)
        if self.stalled.pop(session_id, None) is None:
            return None  # the instance stopped meanwhile
        self._failures.pop(session_id, None)
        self._transient.pop(session_id, None)
        metrics.RESUMES.inc()
        self._log.info("stalled session resumed by an operator", session_id=session_id)
        self._start_activation(fence, unpark=True)
        return fence

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

    # -- takeover ----------------------------------------------------------------

    async def adopt(self, owned: OwnedSession) -> bool:
        """Take over a session of a dead instance of this deployment.

        True when this host now holds it; False when another instance won the
        race or the session is finalized. Raises FailedPrecondition/
        INSTANCE_LIVE when the instance is not dead after all. Transient
        failures are retried with the same successor run id, so a takeover
        whose answer was lost is recognised as ours."""
        sid = owned.fence.session_id
        if owned.owner.instance_id == self.instance_id and self.holds(sid):
            return False  # ours already (listed before it arrived or was taken over)
        successor = s.OwnerIdentity(
            owner_run_id=ids.new_run_id(),
            deployment_id=self.deployment_id,
            instance_id=self.instance_id,
        )
        bound = self._log.bind(session_id=sid, run_id=successor.owner_run_id)
        self._adopting.add(sid)
        backoff = RETRY_FIRST_SECONDS
        try:
            while True:
                if self._stopped:
                    return False
                try:
                    taken = await self.hooks.take_over_session(
                        owned.fence, owned.owner.instance_id, successor
                    )
                    break
                except Fenced:
                    return False  # another instance won
                except FailedPrecondition as exc:
                    if exc.reason == Reason.SESSION_FINALIZED:
                        return False
                    raise
                except BatonError as exc:
                    if not exc.retryable:
                        raise
                    bound.warning("takeover retry", reason=exc.reason, backoff_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_SECONDS)
            metrics.TAKEOVERS.inc()
            bound.info(
                "session taken over",
                from_instance=owned.owner.instance_id,
                epoch=taken.fence.epoch,
                parked=taken.parked,
            )
            if taken.parked:
                parked = ParkedSession(
                    taken.fence.owner_run_id, taken.fence.epoch, taken.inbox_head
                )
                self._hold(sid, parked)
            else:
                self._start_activation(taken.fence)
            return True
        finally:
            self._adopting.discard(sid)
