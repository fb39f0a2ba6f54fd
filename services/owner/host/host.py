"""The owner host: how sessions come to one owner instance, and leave it by
a drain. Their lifecycle once here (launch, runs, activation, parking) is
`HostedSessions`' (sessions.py).

Sessions arrive through StartSession (created here: by ingress, or, for a
child session, by the owner of its parent, possibly this one; see
services/owner/run/children.py), through handoffs from other deployments
(acceptance.py: checked there, transferred and launched here), adoptions
(adoption.py) and takeovers of the sessions of dead instances of this
deployment (`adopt`, driven by the fleet; restarts.py). Which authored
agent runs a session is the catalog's answer for its parent link (the root
agent for a session without one). An operator's drain is drains.py's.
"""

from __future__ import annotations

import asyncio

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.answers import (
    DrainReport,
    HandoffAccepted,
    Moved,
    OwnedSession,
    StartedSession,
    Undrained,
)
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
    Unavailable,
)
from baton_runtime.owner.agents.api import Agent
from baton_runtime.owner.handoff.acceptance import TRANSFER_ANSWER_SECONDS, HandoffOffer
from baton_runtime.owner.handoff.checkpoint import Arrival
from baton_runtime.owner.host.parking import ParkedSession
from baton_runtime.owner.host.sessions import HostedSessions, HostSettings
from baton_runtime.owner.rules.held import RunIdentity
from baton_runtime.owner.run.children import Children, ChildStart
from baton_runtime.owner.run.snapshots import initial_snapshot
from baton_runtime.owner.run.terms import RunStart


class OwnerHost(HostedSessions):
    """Starts, adopts, takes over and drains the sessions of one instance."""

    def __init__(
        self, settings: HostSettings, agent: Agent, hooks: HooksClient, anchor: AnchorClient
    ) -> None:
        super().__init__(settings, agent, hooks, anchor)
        self.children = Children(self.deployment_id, self.instance_id, hooks, self)

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
        known = self._held_here(session_id, inbox)
        if known is not None:
            return known
        run_id = ids.new_run_id()
        with self._arriving.hold(session_id):
            try:
                created = await self.hooks.create_session(
                    session_id, self._owner(run_id), channel, aliases
                )
            except AlreadyExists as exc:
                return _started_elsewhere(exc, session_id, inbox)
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
            self._launch(identity, RunStart(snapshot, revision))
        self._log.info("session started", session_id=session_id, run_id=run_id, channel=channel)
        return StartedSession(session_id, run_id, True, inbox)

    async def start_child(self, start: ChildStart) -> StartedSession:
        """Create a child session (docs/design.md §11) with its first work in its
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
        known = self._held_here(session_id, inbox)
        if known is not None:
            return known
        if session_id in self._activating:
            return StartedSession(session_id, "", False, inbox)
        run_id = ids.run_id_for(f"{session_id}/{self.instance_id}")
        try:
            with self._arriving.hold(session_id):
                created = await self.hooks.create_session(
                    session_id, self._owner(run_id), start.channel, [], parent, start.first_command
                )
        except AlreadyExists as exc:
            return _started_elsewhere(exc, session_id, inbox)
        if session_id in self.runs:  # a concurrent start of the same child won
            return StartedSession(session_id, run_id, False, inbox)
        identity = RunIdentity(created.fence, self.deployment_id, self.instance_id)
        snapshot = initial_snapshot(
            session_id, start.channel, self.deployment_id, list(created.hooks), parent=parent
        )
        seed = [created.first_entry] if created.first_entry is not None else []
        self._launch(identity, RunStart(snapshot, 0, seed=seed, unstarted=True))
        self._log.info(
            "child session started",
            session_id=session_id,
            run_id=run_id,
            parent_session_id=parent.parent_session_id,
        )
        return StartedSession(session_id, run_id, True, inbox, first_command_appended=bool(seed))

    def _held_here(self, session_id: str, inbox: str) -> StartedSession | None:
        """A start of a session this instance runs or holds parked: found."""
        known = self.runs.get(session_id) or self.parked.get(session_id)
        if known is None:
            return None
        return StartedSession(session_id, known.run_id, False, inbox)

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
            # Held as its park recorded it: consumed position and lifetime
            # deadline (woken then, so the timeout fires while parked).
            parked = ParkedSession(
                taken.fence.owner_run_id,
                taken.fence.epoch,
                taken.inbox_head,
                taken.timeout_deadline,
            )
            self._hold(sid, parked)
        else:
            self.start_activation(taken.fence)
        return True

    async def resume_stalled(self, session_id: str) -> s.Fence | None:
        """An operator's resume of a session stalled here (restarts.py,
        docs/failures.md). None when this instance holds the session but it is
        not stalled (a repeated or concurrent resume); NotFound when it does
        not hold it; Fenced when another run owns it now."""
        ids.validate_session_id(session_id)
        fence = await self.restarts.resume(session_id)
        if fence is None and not self.holds(session_id):
            raise NotFound(
                Reason.SESSION_NOT_FOUND, f"this instance does not hold session {session_id}"
            )
        return fence

    # -- sessions arriving from other deployments ---------------------------------------

    async def accept_handoff(self, offer: HandoffOffer) -> HandoffAccepted:
        """Prepare, transfer, start (acceptance.py). Shielded: a caller that
        goes away (the old owner died, its deadline passed) must not cancel a
        transfer in flight or the start of a transferred session."""
        await self._wait_ready()
        self.acceptance.check_offer(offer)  # bad input is refused as such first
        if self.drains.target:
            # An operator retires this deployment: it takes no sessions (the
            # offering owner keeps the session and answers the trigger).
            raise FailedPrecondition(
                Reason.DEPLOYMENT_DRAINING,
                f"deployment {self.deployment_id} is being drained to {self.drains.target}; "
                "it takes no sessions",
            )
        task = self._background.spawn(self._accept(offer), outcome_optional=True)
        return await asyncio.shield(task)

    async def _accept(self, offer: HandoffOffer) -> HandoffAccepted:
        async with self.acceptance.offer(offer) as arrival:
            if isinstance(arrival, HandoffAccepted):
                return arrival  # a repeat of a handoff that moved the session
            # Transferred in the background (replays until a definite answer)
            # and started there on success: the caller waits a bounded time only.
            arriving = self._background.spawn(self._arrive(arrival), outcome_optional=True)
            try:
                moved = await asyncio.wait_for(asyncio.shield(arriving), TRANSFER_ANSWER_SECONDS)
            except TimeoutError as exc:
                handoff_id = arrival.transfer.handoff_id
                self._log.warning(
                    "transfer outcome still unknown; settling it in the background",
                    session_id=arrival.session_id,
                    handoff_id=handoff_id,
                )
                raise Unavailable(
                    Reason.UPSTREAM_UNAVAILABLE,
                    f"the transfer of handoff {handoff_id} has no definite answer yet",
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
            loaded, transfer = arrival.loaded, arrival.transfer
            start = RunStart(
                loaded.snapshot,
                transfer.snapshot_revision,
                seed=arrival.seed,
                handoff_id=transfer.handoff_id,
                context=loaded.context,
            )
            self._launch(identity, start)
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

    def undrain(self) -> Undrained:
        """Stop an operator's drain (drains.py): the sessions held here stay,
        and this deployment takes handoffs again. Safe to repeat."""
        target, moved = self.drains.cancel()
        for run in list(self.runs.values()):
            run.request_drain("")
        return Undrained(self.deployment_id, self.instance_id, target, moved, self.held())

    def drain_report(self) -> DrainReport:
        return self.drains.report(
            self.runs,
            self._activating - set(self.runs),
            self.parked,
            self.stalled,
            self.attempts.last_refusal,
            self.held(),
        )


def _started_elsewhere(exc: AlreadyExists, session_id: str, inbox: str) -> StartedSession:
    """A create that found the session started (by another start, or
    another instance): found, with its owner's run id. Any other conflict
    is raised."""
    if exc.reason != Reason.SESSION_EXISTS:
        raise exc
    return StartedSession(session_id, exc.metadata.get("owner_run_id", ""), False, inbox)
