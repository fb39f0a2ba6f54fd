"""Adoption (issue 12: retiring a deployment strands nothing): taking over a
session whose deployment has no live owner instance left, if its last
commit left it settled. The same checkpoint checks (checkpoint.py) and the
same fenced Transfer (`HandoffAcceptance.transfer`, driven by the host) as
a handoff, with reason ADOPTION: its inbox backlog moves with it.
"""

from __future__ import annotations

import structlog

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.answers import LoadedSession
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError, FailedPrecondition, Reason
from baton_runtime.owner.handoff.checkpoint import Arrival, CheckpointRules
from baton_runtime.owner.rules.handles import Handles

log = structlog.get_logger("baton.owner.handoff")


class Adoption:
    """Prepares adoptions of stranded sessions by this instance."""

    def __init__(
        self, instance_id: str, hooks: HooksClient, anchor: AnchorClient, rules: CheckpointRules
    ) -> None:
        self.deployment_id = rules.deployment_id
        self.instance_id = instance_id
        self._hooks = hooks
        self._anchor = anchor
        self._rules = rules
        self._log = log.bind(deployment_id=self.deployment_id, instance_id=instance_id)

    async def prepare(self, session_id: str) -> Arrival:
        """The Transfer that adopts the session. A session with a step in
        flight is not moved across versions: FailedPrecondition/
        SESSION_NOT_SETTLED, logged, and it waits for an owner of its own
        deployment."""
        sid = ids.validate_session_id(session_id)
        owner = await self._hooks.get_owner(sid)
        old = owner.owner.deployment_id
        bound = self._log.bind(session_id=sid, from_deployment_id=old)
        if old == self.deployment_id:
            raise FailedPrecondition(
                Reason.WRONG_DEPLOYMENT,
                f"session {sid} runs on this deployment; its own fleet takes it over",
            )
        await self._check_gone(sid, old)
        loaded = await self._load(sid)
        snapshot = loaded.snapshot
        self._rules.check_active(snapshot, sid)
        self._rules.check_format(snapshot)
        self._check_settled(snapshot, sid, old, bound)
        self._rules.check_child_code(snapshot)
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
        return Arrival(transfer, loaded)

    async def _check_gone(self, sid: str, old: str) -> None:
        """Adopted only once deployment `old` has no live instance left."""
        live = await self._hooks.list_instances(ids.validate_deployment_id(old))
        if live:
            raise FailedPrecondition(
                Reason.INSTANCE_LIVE,
                f"deployment {old} has {len(live)} live owner instance(s); it runs session {sid}",
            )

    async def _load(self, sid: str) -> LoadedSession:
        """The session's last snapshot; one that cannot be read (for good)
        is refused as CHECKPOINT_UNREADABLE."""
        try:
            return await self._anchor.load_session(sid)
        except BatonError as exc:
            if exc.retryable:
                raise
            raise FailedPrecondition(
                Reason.CHECKPOINT_UNREADABLE, f"session {sid} cannot be loaded: {exc.message}"
            ) from exc

    def _check_settled(
        self, snapshot: s.SessionSnapshot, sid: str, old: str, bound: structlog.BoundLogger
    ) -> None:
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
