"""Ingress-driven upgrade (DESIGN.md §6): both sides of a handoff.

The old owner (A): a run that finds an eligible trigger (see
`SessionRun._is_trigger`) calls `HandoffBroker.hand_off`, which
1. names a handoff id; the checkpoint is the run's last committed snapshot
   (its mod revision) plus the trigger's inbox seq;
2. resolves the live instances of the exact target deployment through the
   registry (none: skip) and calls AcceptHandoff on one of them;
3. on success the run ends (its fence is dead). On a refusal (a checkpoint
   the target cannot read, a later arrival, ...) nothing was written and the
   run processes the trigger itself. On an uncertain outcome (the call timed
   out, the target died) it settles the question with a fenced commit of its
   unchanged snapshot: if that commit succeeds, no transfer happened before
   it and none can happen after it (the transfer compares the snapshot
   revision), so the run processes the trigger; if it is FENCED, the session
   moved.

The new owner (B), in one call (`accept`): prepares a candidate — the agent
is this build's code; the checkpoint (the bounded snapshot A committed and
the history entries of its context: sent by A when small, else loaded from
anchor at the revision A names) must be readable, in a snapshot format this
build reads, idle, still the latest commit, with the trigger as its next
inbox entry —
then calls Transfer on hooks (one etcd txn: fence, exact claim set, trigger
is the inbox head, snapshot revision, unused handoff id) and starts the
successor run with the trigger in hand. An uncertain Transfer is settled by
replaying the identical request until the answer is definite (A waits for
that at most TRANSFER_SETTLE_SECONDS; the rest happens in the background):
every refusal is final (the fence and the snapshot revision never come
back, the inbox head only grows), and the outcome is recorded under the
handoff id, so a replay of an applied transfer returns it.

Doing prepare, transfer and activation in the target's one call keeps the
upgrade turn short: two hops fewer than separate prepare/activate calls, and
the successor does not wait for its inbox stream to see the trigger.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from google.protobuf.message import DecodeError

from baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton.owner.v1 import owner_pb2 as owner_pb
from baton.session.v1 import session_pb2 as s
from services.common import failpoints, ids, metrics, retry
from services.common.clients import (
    AnchorClient,
    HandoffAccepted,
    HooksClient,
    LoadedSession,
    Moved,
)
from services.common.errors import (
    Aborted,
    AlreadyExists,
    BatonError,
    DeadlineExceeded,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    NotFound,
    Reason,
    Unavailable,
)
from services.common.inflight import InFlight
from services.common.permits import PermitSigner, grant_for
from services.common.tasks import Background
from services.owner.agent import AgentCatalog
from services.owner.checkpoint import Checkpoint
from services.owner.handles import Handles
from services.owner.peers import Peers, place

log = structlog.get_logger("baton.owner.handoff")

ACCEPT_CALL_SECONDS = 5.0
TRANSFER_SETTLE_SECONDS = 3.0  # well inside ACCEPT_CALL_SECONDS
TRANSFER_ATTEMPT_SECONDS = 1.0
INLINE_CHECKPOINT_BYTES = 1024 * 1024  # larger checkpoints are loaded from anchor

# Refusals: final answers; nothing was written.
REFUSALS = (Aborted, AlreadyExists, FailedPrecondition, NotFound, InvalidArgument)

Launch = Callable[
    [s.Fence, s.SessionSnapshot, int, Sequence[s.InboxEntry], str, Sequence[s.ChatMessage]], None
]


@dataclass(frozen=True)
class HandoffOffer:
    """A handoff the old owner offers this one (AcceptHandoff, decoded by
    the servicer): a missing message field is None, checked by `accept`."""

    handoff_id: str
    fence: s.Fence | None
    deployment_id: str
    from_owner: s.OwnerIdentity | None
    snapshot_revision: int
    trigger: s.InboxEntry | None
    reason: s.TransferReason.ValueType
    checkpoint: bytes = b""  # the serialized snapshot, sent along when small
    context: tuple[s.ChatMessage, ...] = ()  # with `checkpoint`: its context
    permit: s.TransferPermit | None = None  # the old owner's consent, for hooks


class HandoffBroker:
    """Hands sessions off to other deployments and accepts them from them."""

    def __init__(
        self,
        deployment_id: str,
        instance_id: str,
        hooks: HooksClient,
        anchor: AnchorClient,
        launch: Launch,
        *,
        readable_formats: frozenset[int],
        catalog: AgentCatalog | None = None,
    ) -> None:
        self.deployment_id = deployment_id
        self.catalog = catalog
        self.instance_id = instance_id
        self.hooks = hooks
        self.anchor = anchor
        self.readable_formats = readable_formats
        self.accepting: dict[str, str] = {}  # handoff id -> session id, while in flight
        # Session id -> transfers to this instance in flight (the transfer may
        # have moved the ownership index here before the run is launched).
        self.transferring = InFlight()
        # Why the last attempt to move a session was refused (for drain reports).
        self.last_refusal: dict[str, tuple[str, str]] = {}
        self._launch = launch
        self._peers = Peers(hooks, call_seconds=ACCEPT_CALL_SECONDS)
        self._background = Background()
        self._permits = PermitSigner(hooks.security)
        self._log = log.bind(deployment_id=deployment_id, instance_id=instance_id)

    async def close(self) -> None:
        await self._background.cancel_all()
        await self._peers.close()

    # -- the old owner ------------------------------------------------------

    async def hand_off(self, checkpoint: Checkpoint, entry: s.InboxEntry) -> bool:
        """Try to move the checkpoint's session to the deployment that
        accepted `entry`. True: the session moved and the run must end.
        False: it did not, nothing of the attempt is left, and the run
        processes `entry`. Raises Fenced when the run turns out not to own
        the session."""
        target = entry.command.delivery.accepted_deployment_id
        return await self._move(checkpoint, target, entry)

    async def drain(self, checkpoint: Checkpoint, target: str) -> bool:
        """An operator's drain: move the idle session (nothing unprocessed in
        its inbox) to `target` through the same handoff, with no trigger.
        True: it moved; False: refused (the reason is logged and kept in
        `last_refusal`), nothing of the attempt is left. Raises Fenced."""
        return await self._move(checkpoint, target, None)

    async def _move(self, checkpoint: Checkpoint, target: str, entry: s.InboxEntry | None) -> bool:
        fence = checkpoint.fence
        revision = checkpoint.revision
        handoff_id = ids.new_handoff_id()
        bound = self._log.bind(
            session_id=fence.session_id,
            run_id=fence.owner_run_id,
            handoff_id=handoff_id,
            to_deployment_id=target,
            inbox_seq=entry.seq if entry is not None else None,
            reason="trigger" if entry is not None else "drain",
        )
        self.last_refusal.pop(fence.session_id, None)
        why = "trigger" if entry is not None else "drain"
        if revision is None:
            bound.info("handoff skipped: checkpoint revision unknown")
            metrics.HANDOFFS.labels(why, "skipped").inc()
            return False
        started = time.monotonic()
        try:
            instances = await self._peers.instances(target)
        except BatonError as exc:
            bound.info("handoff skipped: registry lookup failed", reason=exc.reason)
            metrics.HANDOFFS.labels(why, "skipped").inc()
            return False
        if not instances:
            bound.info("handoff skipped: no live instance of the target deployment")
            metrics.HANDOFFS.labels(why, "skipped").inc()
            self.last_refusal[fence.session_id] = (
                Reason.UPSTREAM_UNAVAILABLE,
                f"no live instance of deployment {target}",
            )
            return False
        chosen = place(fence.session_id, instances)
        bound = bound.bind(target_instance_id=chosen.instance_id)
        request = owner_pb.AcceptHandoffRequest(
            handoff_id=handoff_id,
            fence=fence,
            deployment_id=target,
            from_owner=s.OwnerIdentity(
                owner_run_id=fence.owner_run_id,
                deployment_id=self.deployment_id,
                instance_id=self.instance_id,
            ),
            snapshot_revision=revision,
            trigger=entry,
            reason=s.TRANSFER_REASON_TRIGGER if entry is not None else s.TRANSFER_REASON_DRAIN,
        )
        # This owner's consent, which hooks requires of the target's Transfer.
        permit = self._permits.sign(grant_for(fence, handoff_id, target, revision, request.reason))
        if permit is not None:
            request.permit.CopyFrom(permit)
        if len(checkpoint.snapshot) + checkpoint.context_bytes <= INLINE_CHECKPOINT_BYTES:
            # Small (the context is bounded by the agent's budget): sent along,
            # which spares the target a load from anchor.
            request.checkpoint = checkpoint.snapshot
            request.context.extend(checkpoint.context)
        await failpoints.hit("handoff.before_accept")
        asked = time.monotonic()
        try:
            accepted = await self._peers.client(chosen.address).accept_handoff(request)
            await failpoints.hit("handoff.accept_response")
        except Fenced:
            raise
        except REFUSALS as exc:
            metrics.HANDOFF_SECONDS.observe(time.monotonic() - asked)
            metrics.HANDOFFS.labels(why, "refused").inc()
            bound.info(
                "handoff refused; processing here" if entry is not None else "drain refused",
                reason=exc.reason,
                error=exc.message,
            )
            self.last_refusal[fence.session_id] = (exc.reason, exc.message)
            return False
        except BatonError as exc:
            metrics.HANDOFF_SECONDS.observe(time.monotonic() - asked)
            metrics.HANDOFFS.labels(why, "uncertain").inc()
            self._peers.forget(target)
            bound.warning("handoff outcome uncertain; settling it", reason=exc.reason)
            return await self._settle(checkpoint, bound)
        metrics.HANDOFF_SECONDS.observe(time.monotonic() - asked)
        metrics.HANDOFFS.labels(why, "moved").inc()
        bound.info(
            "session handed off",
            epoch=accepted.fence.epoch,
            successor_run_id=accepted.successor.owner_run_id,
            took_ms=round((time.monotonic() - started) * 1000, 2),
        )
        return True

    async def _settle(self, checkpoint: Checkpoint, bound: structlog.BoundLogger) -> bool:
        """Commit the unchanged snapshot, fenced: success means the session
        did not move and cannot move on this attempt (the checkpoint revision
        is gone); FENCED means it moved. Anything else settles nothing (the
        transfer may still land), so keep trying: the trigger waits."""
        backoff = retry.HANDOFF_CHECKPOINT.backoff()
        while True:
            try:
                await checkpoint.settle()
            except Fenced:
                bound.info("handoff settled: the session moved")
                return True
            except BatonError as exc:
                bound.warning("settling commit failed; again", reason=exc.reason)
                await backoff.wait()
                continue
            bound.info("handoff settled: the session stays; processing here")
            return False

    # -- the new owner --------------------------------------------------------

    async def accept(self, offer: HandoffOffer) -> HandoffAccepted:
        """Prepare, transfer, start; see the module doc. Shielded: a caller
        that goes away (the old owner died, its deadline passed) must not
        cancel a transfer in flight or the start of a transferred session."""
        task = self._background.spawn(self._accept(offer), outcome_optional=True)
        return await asyncio.shield(task)

    async def _accept(self, offer: HandoffOffer) -> HandoffAccepted:
        handoff_id = ids.validate_id(offer.handoff_id, "handoff_id")
        drain = offer.reason == s.TRANSFER_REASON_DRAIN
        if offer.reason not in (
            s.TRANSFER_REASON_UNSPECIFIED,
            s.TRANSFER_REASON_TRIGGER,
            s.TRANSFER_REASON_DRAIN,
        ):
            raise InvalidArgument(
                Reason.INVALID_FIELD, "a handoff moves for a trigger or a drain only"
            )
        given = {"fence": offer.fence, "from_owner": offer.from_owner, "trigger": offer.trigger}
        for name in ("fence", "from_owner", *(() if drain else ("trigger",))):
            if given[name] is None:
                raise InvalidArgument(Reason.MISSING_FIELD, f"{name} is required")
        if drain and offer.trigger is not None:
            raise InvalidArgument(Reason.INVALID_FIELD, "a drain has no trigger")
        fence, from_owner = offer.fence, offer.from_owner
        assert fence is not None and from_owner is not None  # checked just above
        sid = ids.validate_session_id(fence.session_id)
        target = ids.validate_deployment_id(offer.deployment_id)
        source = ids.validate_deployment_id(from_owner.deployment_id)
        if target != self.deployment_id:
            raise FailedPrecondition(
                Reason.WRONG_DEPLOYMENT,
                f"this owner runs deployment {self.deployment_id}, not {target}",
            )
        if source == self.deployment_id:
            raise InvalidArgument(
                Reason.INVALID_FIELD, f"session {sid} already runs on deployment {source}"
            )
        if offer.snapshot_revision <= 0:
            raise InvalidArgument(Reason.MISSING_FIELD, "snapshot_revision is required")
        bound = self._log.bind(session_id=sid, handoff_id=handoff_id, from_deployment_id=source)
        self.accepting[handoff_id] = sid
        try:
            await failpoints.hit("handoff.prepare")
            try:
                loaded = await self._load_checkpoint(sid, offer)
                snapshot, revision = loaded.snapshot, loaded.revision
                self._validate(snapshot, revision, sid, offer)
            except REFUSALS:
                # A repeat of a handoff that moved the session already finds
                # the checkpoint gone: answer with the recorded outcome.
                done = await self._recorded(sid, handoff_id)
                if done is None:
                    raise
                return done
            # The run id is derived from the handoff and this instance: a
            # repeat here replays the same transfer; a repeat on another
            # instance is refused (HANDOFF_ID_REUSED).
            successor = s.OwnerIdentity(
                owner_run_id=ids.run_id_for(f"{handoff_id}/{self.instance_id}"),
                deployment_id=self.deployment_id,
                instance_id=self.instance_id,
            )
            bound.info("handoff checkpoint validated", successor_run_id=successor.owner_run_id)
            await failpoints.hit("handoff.before_transfer")
            transfer = hooks_pb.TransferRequest(
                handoff_id=handoff_id,
                expected=fence,
                expected_owner=from_owner,
                successor=successor,
                hooks=list(snapshot.hooks),
                trigger_seq=offer.trigger.seq if offer.trigger is not None else 0,
                snapshot_revision=revision,
                reason=offer.reason or s.TRANSFER_REASON_TRIGGER,
                inbox_head=snapshot.inbox_next_seq,
                permit=offer.permit,
            )
            seed = [] if offer.trigger is None else [offer.trigger]
            # Settled in the background (replays until a definite answer) and
            # started there on success: the caller waits a bounded time only.
            settling = self._background.spawn(
                self._transfer_and_start(transfer, loaded, seed, bound),
                outcome_optional=True,
            )
            try:
                moved = await asyncio.wait_for(asyncio.shield(settling), TRANSFER_SETTLE_SECONDS)
            except TimeoutError as exc:
                bound.warning("transfer outcome still unknown; settling it in the background")
                raise Unavailable(
                    Reason.UPSTREAM_UNAVAILABLE,
                    f"the transfer of handoff {handoff_id} is not settled yet",
                ) from exc
            return HandoffAccepted(successor, moved.fence, moved.replayed)
        finally:
            self.accepting.pop(handoff_id, None)

    async def _recorded(self, session_id: str, handoff_id: str) -> HandoffAccepted | None:
        try:
            found = await self.hooks.get_transfer(session_id, handoff_id)
        except NotFound:
            return None
        return HandoffAccepted(found.successor, found.fence, replayed=True)

    async def _load_checkpoint(self, session_id: str, offer: HandoffOffer) -> LoadedSession:
        """The checkpoint the old owner sent, or else the one anchor has at the
        revision it names (the bounded snapshot and the history its context
        names, read at that snapshot's revision). Either way what crosses
        does not grow with the session's age: the context is bounded by the
        agent's budget."""
        if offer.checkpoint:
            try:
                snapshot = s.SessionSnapshot.FromString(offer.checkpoint)
            except DecodeError as exc:
                raise FailedPrecondition(
                    Reason.CHECKPOINT_UNREADABLE,
                    f"the checkpoint of session {session_id} cannot be parsed",
                ) from exc
            context = list(offer.context)
            log = snapshot.history_log
            size = sum(m.ByteSize() for m in context)
            if len(context) != log.next_index - log.context_start or size != log.context_bytes:
                raise FailedPrecondition(
                    Reason.CHECKPOINT_UNREADABLE,
                    f"the checkpoint of session {session_id} names a context of "
                    f"{log.next_index - log.context_start} entries and {log.context_bytes} "
                    f"bytes; {len(context)} entries and {size} bytes came with it",
                )
            return LoadedSession(snapshot, offer.snapshot_revision, context)
        try:
            return await self.anchor.load_session(session_id, offer.snapshot_revision)
        except BatonError as exc:
            if exc.retryable:
                raise
            raise FailedPrecondition(
                Reason.CHECKPOINT_UNREADABLE,
                f"the checkpoint of session {session_id} cannot be read: {exc.message}",
            ) from exc

    def _validate(
        self, snapshot: s.SessionSnapshot, revision: int, sid: str, offer: HandoffOffer
    ) -> None:
        if snapshot.session_id != sid:
            raise FailedPrecondition(
                Reason.CHECKPOINT_UNREADABLE,
                f"the checkpoint names session {snapshot.session_id!r}",
            )
        if snapshot.format_version not in self.readable_formats:
            raise FailedPrecondition(
                Reason.CHECKPOINT_INCOMPATIBLE,
                f"snapshot format {snapshot.format_version} is not one deployment "
                f"{self.deployment_id} reads ({sorted(self.readable_formats)})",
            )
        if revision != offer.snapshot_revision:
            raise Aborted(
                Reason.STALE_CHECKPOINT,
                f"the session committed since the checkpoint (revision {revision}, "
                f"not {offer.snapshot_revision})",
            )
        if snapshot.status != s.SESSION_STATUS_ACTIVE:
            raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {sid} is finalized")
        if offer.reason == s.TRANSFER_REASON_DRAIN:
            if snapshot.HasField("open_turn") or Handles(snapshot).busy():
                raise FailedPrecondition(
                    Reason.SESSION_NOT_IDLE,
                    f"session {sid} has an open turn or a running child at the checkpoint",
                )
            self._check_child_code(snapshot)
            return  # nothing unprocessed: the transfer compares the inbox head
        trigger = offer.trigger
        assert trigger is not None  # `_accept` requires one unless draining
        if snapshot.HasField("open_turn") or snapshot.inbox_next_seq != trigger.seq:
            raise FailedPrecondition(
                Reason.SESSION_NOT_IDLE,
                f"session {sid} is not idle at the checkpoint (open turn, or the trigger "
                f"{trigger.seq} is not its next inbox entry {snapshot.inbox_next_seq})",
            )
        if snapshot.parent.parent_session_id or Handles(snapshot).busy():
            # Parked and available handles cross (stable addresses); a running
            # child keeps the parent where it is, and a child never moves.
            raise FailedPrecondition(
                Reason.SESSION_NOT_IDLE,
                f"session {sid} is not idle at the checkpoint (a child session works for "
                "it, or it is a child session)",
            )
        if trigger.command.WhichOneof("kind") != "send":
            raise InvalidArgument(Reason.INVALID_FIELD, "only a send triggers a handoff")

    def _check_child_code(self, snapshot: s.SessionSnapshot) -> None:
        """A child session moves (by a drain or an adoption, never by an
        upgrade trigger) only to a build that has its subagent or tool."""
        if not snapshot.parent.parent_session_id or self.catalog is None:
            return
        try:
            self.catalog.agent_for(snapshot.parent)
        except LookupError as exc:
            raise FailedPrecondition(
                Reason.CHECKPOINT_INCOMPATIBLE,
                f"child session {snapshot.session_id}: {exc} (deployment {self.deployment_id})",
            ) from exc

    async def _transfer_and_start(
        self,
        request: hooks_pb.TransferRequest,
        loaded: LoadedSession,
        seed: Sequence[s.InboxEntry],
        bound: structlog.BoundLogger,
    ) -> Moved:
        """Transfer, replaying the identical request until the outcome is
        definite (a refusal is final; only these errors leave it unknown),
        then start the successor with the trigger in hand."""
        with self.transferring.hold(request.expected.session_id):
            return await self._transfer_then_start(request, loaded, seed, bound)

    async def _transfer_then_start(
        self,
        request: hooks_pb.TransferRequest,
        loaded: LoadedSession,
        seed: Sequence[s.InboxEntry],
        bound: structlog.BoundLogger,
    ) -> Moved:
        backoff = retry.TRANSFER_REPLAY.backoff()
        while True:
            try:
                moved = await self.hooks.transfer(request, deadline_s=TRANSFER_ATTEMPT_SECONDS)
                await failpoints.hit("handoff.transfer_response")
                break
            except (Unavailable, DeadlineExceeded) as exc:
                bound.warning("transfer outcome uncertain; replaying", reason=exc.reason)
            await backoff.wait()
        if moved.replayed:
            bound.info("transfer outcome settled by a replay")
        bound.info("session transferred here", run_id=moved.fence.owner_run_id)
        await failpoints.hit("handoff.after_transfer")
        self._launch(
            moved.fence,
            loaded.snapshot,
            request.snapshot_revision,
            seed,
            request.handoff_id,
            loaded.context,
        )
        return moved

    # -- adoption (issue 12: retiring a deployment strands nothing) -------------

    async def adopt(self, session_id: str) -> Moved:
        """Take over a session whose deployment has no live owner instance
        left, if its last commit left it settled: the same checkpoint checks
        and the same fenced Transfer as a handoff (reason ADOPTION: its inbox
        backlog moves with it). A session with a step in flight is not moved
        across versions: FailedPrecondition/SESSION_NOT_SETTLED, logged, and
        it waits for an owner of its own deployment."""
        sid = ids.validate_session_id(session_id)
        owner = await self.hooks.get_owner(sid)
        old = owner.owner.deployment_id
        bound = self._log.bind(session_id=sid, from_deployment_id=old)
        if old == self.deployment_id:
            raise FailedPrecondition(
                Reason.WRONG_DEPLOYMENT,
                f"session {sid} runs on this deployment; its own fleet takes it over",
            )
        live = await self.hooks.list_instances(ids.validate_deployment_id(old))
        if live:
            raise FailedPrecondition(
                Reason.INSTANCE_LIVE,
                f"deployment {old} has {len(live)} live owner instance(s); it runs session {sid}",
            )
        try:
            loaded = await self.anchor.load_session(sid)
        except BatonError as exc:
            if exc.retryable:
                raise
            raise FailedPrecondition(
                Reason.CHECKPOINT_UNREADABLE, f"session {sid} cannot be loaded: {exc.message}"
            ) from exc
        snapshot = loaded.snapshot
        if snapshot.status != s.SESSION_STATUS_ACTIVE:
            raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {sid} is finalized")
        if snapshot.format_version not in self.readable_formats:
            raise FailedPrecondition(
                Reason.CHECKPOINT_INCOMPATIBLE,
                f"snapshot format {snapshot.format_version} is not one deployment "
                f"{self.deployment_id} reads ({sorted(self.readable_formats)})",
            )
        if snapshot.HasField("open_turn"):
            bound.warning(
                "orphaned session not adopted: a step was in flight when its fleet vanished; "
                "it waits for an owner of its own deployment",
                turn_id=snapshot.open_turn.turn_id,
            )
            raise FailedPrecondition(
                Reason.SESSION_NOT_SETTLED,
                f"session {sid} was not settled when deployment {old} lost its last owner "
                f"(turn {snapshot.open_turn.turn_id} open); it waits for deployment {old}",
            )
        if Handles(snapshot).busy():
            bound.warning(
                "orphaned session not adopted: a child session was working for it; "
                "it waits for an owner of its own deployment"
            )
            raise FailedPrecondition(
                Reason.SESSION_NOT_SETTLED,
                f"session {sid} was not settled when deployment {old} lost its last owner "
                f"(a child session works for it); it waits for deployment {old}",
            )
        self._check_child_code(snapshot)
        # One handoff id per (old fence, adopting instance): a repeat here is a
        # replay; another instance's attempt races it on the fence.
        handoff_id = f"adopt_{owner.fence.epoch}_{self.instance_id}"
        successor = s.OwnerIdentity(
            owner_run_id=ids.run_id_for(f"{sid}/{handoff_id}"),
            deployment_id=self.deployment_id,
            instance_id=self.instance_id,
        )
        transfer = hooks_pb.TransferRequest(
            handoff_id=handoff_id,
            expected=owner.fence,
            expected_owner=owner.owner,
            successor=successor,
            hooks=list(snapshot.hooks),
            snapshot_revision=loaded.revision,
            reason=s.TRANSFER_REASON_ADOPTION,
        )
        bound = bound.bind(handoff_id=handoff_id, successor_run_id=successor.owner_run_id)
        moved = await self._transfer_and_start(transfer, loaded, [], bound)
        bound.info("orphaned session adopted", epoch=moved.fence.epoch, replayed=moved.replayed)
        return moved
