"""Ingress-driven upgrade (docs/design.md §6): the new owner's acceptance.

The new owner (B), in one call (AcceptHandoff, driven by
`OwnerHost.accept_handoff`): `offer` prepares a candidate — the agent is
this build's code; the checkpoint (the bounded snapshot A committed and the
history entries of its context: sent by A when small, else loaded from
anchor at the revision A names) must be readable, in a snapshot format this
build reads, idle, still the latest commit, with the trigger as its next
inbox entry — and hands the host an `Arrival`. The host calls `transfer`
(Transfer on hooks: one etcd txn: fence, exact claim set, trigger is the
inbox head, snapshot revision, unused handoff id) and starts the successor
run with the trigger in hand. An uncertain Transfer is settled by replaying
the identical request until the answer is definite (A waits for that at
most TRANSFER_ANSWER_SECONDS; the rest happens in the background): every
refusal is final (the fence and the snapshot revision never come back, the
inbox head only grows), and the outcome is recorded under the handoff id,
so a replay of an applied transfer returns it.

Doing prepare, transfer and activation in the target's one call keeps the
upgrade turn short: two hops fewer than separate prepare/activate calls, and
the successor does not wait for its inbox stream to see the trigger.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from google.protobuf.message import DecodeError

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import failpoints, ids, retry
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.answers import HandoffAccepted, LoadedSession, Moved
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import (
    Aborted,
    BatonError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
    Unavailable,
)
from baton_runtime.owner.handoff.attempt import REFUSALS
from baton_runtime.owner.handoff.checkpoint import Arrival, CheckpointRules
from baton_runtime.owner.rules.handles import Handles

log = structlog.get_logger("baton.owner.handoff")

TRANSFER_ANSWER_SECONDS = 3.0  # well inside the old owner's ACCEPT_CALL_SECONDS
TRANSFER_ATTEMPT_SECONDS = 1.0


@dataclass(frozen=True)
class HandoffOffer:
    """A handoff the old owner offers this one (AcceptHandoff, decoded by
    the servicer): a missing message field is None, checked by `offer`."""

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


class HandoffAcceptance:
    """Accepts sessions handed off to this instance by other deployments."""

    def __init__(
        self,
        instance_id: str,
        hooks: HooksClient,
        anchor: AnchorClient,
        rules: CheckpointRules,
    ) -> None:
        self.deployment_id = rules.deployment_id
        self.instance_id = instance_id
        self.hooks = hooks
        self.anchor = anchor
        self.rules = rules
        self.accepting: dict[str, str] = {}  # handoff id -> session id, while in flight
        self._log = log.bind(deployment_id=self.deployment_id, instance_id=instance_id)

    @contextlib.asynccontextmanager
    async def offer(self, offer: HandoffOffer) -> AsyncIterator[Arrival | HandoffAccepted]:
        """Check the offer and its checkpoint; the body gets the Arrival to
        transfer, or the recorded outcome of a handoff that moved the session
        already (a repeat). The handoff is `accepting` while the body runs."""
        handoff_id, sid = self.check_offer(offer)
        fence, from_owner = offer.fence, offer.from_owner
        assert fence is not None and from_owner is not None  # checked by check_offer
        self.accepting[handoff_id] = sid
        try:
            await failpoints.hit("handoff.prepare")
            loaded = await self._checkpoint_or_outcome(sid, handoff_id, offer)
            if isinstance(loaded, HandoffAccepted):
                yield loaded
                return
            # The run id is derived from the handoff and this instance: a
            # repeat here replays the same transfer; a repeat on another
            # instance is refused (HANDOFF_ID_REUSED).
            successor = s.OwnerIdentity(
                owner_run_id=ids.run_id_for(f"{handoff_id}/{self.instance_id}"),
                deployment_id=self.deployment_id,
                instance_id=self.instance_id,
            )
            self._log.info(
                "handoff checkpoint validated",
                session_id=sid,
                handoff_id=handoff_id,
                from_deployment_id=from_owner.deployment_id,
                successor_run_id=successor.owner_run_id,
            )
            await failpoints.hit("handoff.before_transfer")
            seed = () if offer.trigger is None else (offer.trigger,)
            yield Arrival(_transfer_request(offer, loaded, successor), loaded, seed)
        finally:
            self.accepting.pop(handoff_id, None)

    async def _checkpoint_or_outcome(
        self, sid: str, handoff_id: str, offer: HandoffOffer
    ) -> LoadedSession | HandoffAccepted:
        """The offered checkpoint, validated; or, for a repeat of a handoff
        that moved the session already (its checkpoint is gone), the
        recorded outcome."""
        try:
            loaded = await self._load_checkpoint(sid, offer)
            self._validate(loaded.snapshot, loaded.revision, sid, offer)
        except REFUSALS:
            done = await self._recorded(sid, handoff_id)
            if done is None:
                raise
            return done
        return loaded

    def check_offer(self, offer: HandoffOffer) -> tuple[str, str]:
        """The offer's own fields, before anything is read: (handoff id, session id)."""
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
        return handoff_id, sid

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
            history = snapshot.history_log
            size = sum(m.ByteSize() for m in context)
            named = history.next_index - history.context_start
            if len(context) != named or size != history.context_bytes:
                raise FailedPrecondition(
                    Reason.CHECKPOINT_UNREADABLE,
                    f"the checkpoint of session {session_id} names a context of "
                    f"{named} entries and {history.context_bytes} "
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
        self.rules.check_session(snapshot, sid)
        self.rules.check_format(snapshot)
        if revision != offer.snapshot_revision:
            raise Aborted(
                Reason.STALE_CHECKPOINT,
                f"the session committed since the checkpoint (revision {revision}, "
                f"not {offer.snapshot_revision})",
            )
        self.rules.check_active(snapshot, sid)
        if offer.reason == s.TRANSFER_REASON_DRAIN:
            if snapshot.HasField("open_turn") or Handles(snapshot).busy():
                raise FailedPrecondition(
                    Reason.SESSION_NOT_IDLE,
                    f"session {sid} has an open turn or a running child at the checkpoint",
                )
            self.rules.check_child_code(snapshot)
            return  # nothing unprocessed: the transfer compares the inbox head
        trigger = offer.trigger
        assert trigger is not None  # `check_offer` requires one unless draining
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

    async def transfer(self, arrival: Arrival) -> Moved:
        """Transfer, replaying the identical request until the outcome is
        definite (a refusal is final; only these errors leave it unknown).
        Used for handoffs and adoptions alike."""
        request = arrival.transfer
        bound = self._log.bind(session_id=arrival.session_id, handoff_id=request.handoff_id)
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
        return moved


def _transfer_request(
    offer: HandoffOffer, loaded: LoadedSession, successor: s.OwnerIdentity
) -> hooks_pb.TransferRequest:
    """The Transfer that moves the session to `successor`: the fence and
    owner the offer names, the checkpoint's claim set, inbox head and
    revision, the trigger as the inbox head."""
    return hooks_pb.TransferRequest(
        handoff_id=offer.handoff_id,
        expected=offer.fence,
        expected_owner=offer.from_owner,
        successor=successor,
        hooks=list(loaded.snapshot.hooks),
        trigger_seq=offer.trigger.seq if offer.trigger is not None else 0,
        snapshot_revision=loaded.revision,
        reason=offer.reason or s.TRANSFER_REASON_TRIGGER,
        inbox_head=loaded.snapshot.inbox_next_seq,
        permit=offer.permit,
    )
