"""Ingress-driven upgrade (docs/design.md §6): the old owner's attempt.

A run that finds an eligible trigger (departure_rules.is_trigger), or an
operator's drain, asks `HandoffAttempts` to move its session:
1. it names a handoff id; the checkpoint is the run's last committed
   snapshot (its mod revision) plus the trigger's inbox seq;
2. it resolves the live instances of the exact target deployment through
   the registry (none: skip) and calls AcceptHandoff on one of them;
3. the answer is an `Attempt`: MOVED (the run must end: its fence is
   dead), STAYED (a refusal — a checkpoint the target cannot read, a later
   arrival, ... — or a skip: nothing was written and the run processes the
   trigger itself), or UNCERTAIN (the call timed out, the target died). An
   uncertain attempt is decided by the run with a fenced commit of its
   unchanged snapshot (`SessionRun._settle_uncertain`): if that
   commit succeeds, no transfer happened before it and none can happen
   after it (the transfer compares the snapshot revision), so the run
   processes the trigger; if it is FENCED, the session moved.

The new owner's side is acceptance.py; adopting a stranded session,
adoption.py; the checks both make of a checkpoint, checkpoint.py.
"""

from __future__ import annotations

import enum
import time

import structlog

from baton_runtime._proto.baton.owner.v1 import owner_pb2 as owner_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import failpoints, ids
from baton_runtime.common.clients.answers import OwnerInstance
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import (
    Aborted,
    AlreadyExists,
    BatonError,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    NotFound,
    Reason,
)
from baton_runtime.common.observability import metrics
from baton_runtime.common.security.permits import PermitSigner, grant_for
from baton_runtime.owner.handoff.checkpoint import Checkpoint
from baton_runtime.owner.handoff.peers import Peers, place

log = structlog.get_logger("baton.owner.handoff")

ACCEPT_CALL_SECONDS = 5.0
INLINE_CHECKPOINT_BYTES = 1024 * 1024  # larger checkpoints are loaded from anchor

# Refusals: final answers; nothing was written.
REFUSALS = (Aborted, AlreadyExists, FailedPrecondition, NotFound, InvalidArgument)


class Attempt(enum.Enum):
    """What an attempt to move a session came to."""

    MOVED = "moved"  # the session moved: the run must end
    STAYED = "stayed"  # refused or skipped: nothing of it is left
    UNCERTAIN = "uncertain"  # unknown: the run decides it with a fenced commit


class HandoffAttempts:
    """Moves sessions of this instance's runs to other deployments."""

    def __init__(self, deployment_id: str, instance_id: str, hooks: HooksClient) -> None:
        self.deployment_id = deployment_id
        self.instance_id = instance_id
        # Why the last attempt to move a session was refused (for drain reports).
        self.last_refusal: dict[str, tuple[str, str]] = {}
        self._peers = Peers(hooks, call_seconds=ACCEPT_CALL_SECONDS)
        self._permits = PermitSigner(hooks.security)
        self._log = log.bind(deployment_id=deployment_id, instance_id=instance_id)

    async def close(self) -> None:
        await self._peers.close()

    async def hand_off(self, checkpoint: Checkpoint, entry: s.InboxEntry) -> Attempt:
        """Try to move the checkpoint's session to the deployment that
        accepted `entry`. Raises Fenced when the run turns out not to own
        the session."""
        target = entry.command.delivery.accepted_deployment_id
        return await self._move(checkpoint, target, entry)

    async def drain(self, checkpoint: Checkpoint, target: str) -> Attempt:
        """An operator's drain: move the idle session (nothing unprocessed in
        its inbox) to `target` through the same handoff, with no trigger. A
        refusal's reason is logged and kept in `last_refusal`. Raises Fenced."""
        return await self._move(checkpoint, target, None)

    async def _move(
        self, checkpoint: Checkpoint, target: str, entry: s.InboxEntry | None
    ) -> Attempt:
        fence = checkpoint.fence
        handoff_id = ids.new_handoff_id()
        why = "trigger" if entry is not None else "drain"
        bound = self._log.bind(
            session_id=fence.session_id,
            run_id=fence.owner_run_id,
            handoff_id=handoff_id,
            to_deployment_id=target,
            inbox_seq=entry.seq if entry is not None else None,
            reason=why,
        )
        self.last_refusal.pop(fence.session_id, None)
        started = time.monotonic()
        chosen = await self._target(checkpoint, target, bound)
        if chosen is None:
            metrics.HANDOFFS.labels(why, "skipped").inc()
            return Attempt.STAYED
        bound = bound.bind(target_instance_id=chosen.instance_id)
        request = self._request(checkpoint, target, entry, handoff_id)
        await failpoints.hit("handoff.before_accept")
        return await self._offer(chosen, request, why, started, bound)

    async def _offer(
        self,
        chosen: OwnerInstance,
        request: owner_pb.AcceptHandoffRequest,
        why: str,
        started: float,
        bound: structlog.BoundLogger,
    ) -> Attempt:
        """Offer the session to the chosen instance (AcceptHandoff): moved,
        refused (it stays; the refusal is kept for a drain's report) or
        uncertain (the run decides it)."""
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
                "handoff refused; processing here" if why == "trigger" else "drain refused",
                reason=exc.reason,
                error=exc.message,
            )
            self.last_refusal[request.fence.session_id] = (exc.reason, exc.message)
            if exc.reason == Reason.DEPLOYMENT_DRAINING:
                self._peers.forget(request.deployment_id)  # its drain is news to the cache
            return Attempt.STAYED
        except BatonError as exc:
            metrics.HANDOFF_SECONDS.observe(time.monotonic() - asked)
            metrics.HANDOFFS.labels(why, "uncertain").inc()
            self._peers.forget(request.deployment_id)
            bound.warning("handoff outcome uncertain; the run decides it", reason=exc.reason)
            return Attempt.UNCERTAIN
        metrics.HANDOFF_SECONDS.observe(time.monotonic() - asked)
        metrics.HANDOFFS.labels(why, "moved").inc()
        bound.info(
            "session handed off",
            epoch=accepted.fence.epoch,
            successor_run_id=accepted.successor.owner_run_id,
            took_ms=round((time.monotonic() - started) * 1000, 2),
        )
        return Attempt.MOVED

    async def _target(
        self, checkpoint: Checkpoint, target: str, bound: structlog.BoundLogger
    ) -> OwnerInstance | None:
        """The instance of `target` to offer the session to; None: skip
        (said in the log and in baton_handoff_skips_total)."""
        sid = checkpoint.fence.session_id
        if checkpoint.revision is None:
            return self._skip(bound, "revision_unknown", "checkpoint revision unknown")
        try:
            instances = await self._peers.instances(target)
        except BatonError as exc:
            return self._skip(bound, "registry_unavailable", "registry lookup failed", exc.reason)
        if not instances:
            self.last_refusal[sid] = (
                Reason.UPSTREAM_UNAVAILABLE,
                f"no live instance of deployment {target}",
            )
            return self._skip(
                bound, "no_live_instance", "no live instance of the target deployment"
            )
        draining = next((i.drain_to for i in instances if i.drain_to), "")
        if draining:
            # An operator retires the target: it takes no sessions. Asked
            # again next time (not cached), so an undrain takes effect as
            # soon as the registry says so.
            self._peers.forget(target)
            self.last_refusal[sid] = (
                Reason.DEPLOYMENT_DRAINING,
                f"deployment {target} is being drained to {draining}",
            )
            return self._skip(
                bound,
                "target_draining",
                "the target deployment is being drained; processing here",
                Reason.DEPLOYMENT_DRAINING,
                drain_to_deployment_id=draining,
            )
        return place(sid, instances)

    @staticmethod
    def _skip(
        bound: structlog.BoundLogger, why: str, what: str, reason: str = "", **more: str
    ) -> None:
        metrics.HANDOFF_SKIPS.labels(why).inc()
        if reason:
            bound.info(f"handoff skipped: {what}", skipped_because=reason, **more)
        else:
            bound.info(f"handoff skipped: {what}", **more)
        return None

    def _request(
        self, checkpoint: Checkpoint, target: str, entry: s.InboxEntry | None, handoff_id: str
    ) -> owner_pb.AcceptHandoffRequest:
        fence, revision = checkpoint.fence, checkpoint.revision
        assert revision is not None  # `_target` skips an unknown one
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
        return request
