"""Consent beyond a caller's role: who may move a session (a transfer needs
the session's own deployment's signed permit) and what an owner may deliver
by inbox token. Checked by the servicer before anything is written; the
deployments come from the owner records (services/hooks/sessions.py's
cache, read again before refusing).
"""

from __future__ import annotations

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import PermissionDenied, Reason
from baton_runtime.common.etcd.scope import DeploymentScope
from baton_runtime.common.ids import brief
from baton_runtime.common.security.identity import Caller
from baton_runtime.common.security.permits import PermitVerifier, grant_for
from baton_runtime.hooks.sessions import SessionCache
from baton_runtime.hooks.tokens import TokenIndex
from baton_runtime.hooks.transfer import TransferPlan


class Consent:
    """The transfer permit check and an owner's delivery check."""

    def __init__(
        self,
        tokens: TokenIndex,
        sessions: SessionCache,
        scope: DeploymentScope,
        permits: PermitVerifier,
    ) -> None:
        self._tokens = tokens
        self._sessions = sessions
        self._scope = scope
        self._permits = permits

    async def check_transfer(self, plan: TransferPlan, permit: s.TransferPermit) -> None:
        """A transfer moves a session of the deployment `expected_owner`
        names (checked against the owner record while the fence is current;
        a fence that is not current is refused by the transfer itself). A
        trigger or a drain needs that deployment's signed consent
        (services/common/security/permits.py); an adoption's own compare is that the
        deployment has no live instance."""
        current = await self._scope.deployment_of(plan.expected)
        owner_deployment = plan.expected_owner.deployment_id
        if current is not None and current != owner_deployment:
            raise PermissionDenied(
                Reason.TRANSFER_NOT_PERMITTED,
                f"transfer not permitted: session {plan.expected.session_id} runs on "
                f"another deployment than expected_owner names ({owner_deployment})",
            )
        if not self._permits.required or plan.reason not in (
            s.TRANSFER_REASON_TRIGGER,
            s.TRANSFER_REASON_DRAIN,
        ):
            return
        grant = grant_for(
            plan.expected,
            plan.handoff_id,
            plan.successor.deployment_id,
            plan.snapshot_revision,
            plan.reason,
        )
        signer = self._permits.signer(permit, grant)
        if signer.deployment_id != owner_deployment:
            raise PermissionDenied(
                Reason.TRANSFER_NOT_PERMITTED,
                f"transfer not permitted: its permit is signed by an owner of deployment "
                f"{signer.deployment_id}, not of the session's ({owner_deployment})",
            )

    async def check_delivery(self, caller: Caller, token: str, command: s.Command) -> None:
        """An owner (whatever `channel` it names) delivers only what owners
        deliver, by inbox token: to a session of its own deployment (e.g. a
        timeout), to a child whose parent runs on its deployment (work,
        cancel, reset), or a child's `task_result` to that child's own parent
        from the child's deployment. Anything else is PERMISSION_DENIED/
        DELIVERY_NOT_ALLOWED before anything is written. Deployments come
        from the owner records (cached; read again before refusing, as a
        session may have moved since)."""
        namespace, raw = ids.split_token(token)
        if namespace != ids.INBOX_NAMESPACE:
            raise PermissionDenied(
                Reason.DELIVERY_NOT_ALLOWED,
                "an owner delivers by inbox token (session:<id>) only, or names the channel",
            )
        senders = await self._senders(raw, command)
        for fresh in (False, True):
            for sid in senders:
                if await self._sessions.deployment_of(sid, fresh=fresh) == caller.deployment_id:
                    return
        raise PermissionDenied(
            Reason.DELIVERY_NOT_ALLOWED,
            f"an owner of deployment {caller.deployment_id} may not deliver this to session "
            f"{raw}: neither it nor its parent (or the reporting child) runs there",
        )

    async def _senders(self, session_id: str, command: s.Command) -> tuple[str, ...]:
        """The sessions whose owners may deliver `command` to `session_id`:
        a report's child and its parent (the child's link checked), else the
        session and its parent, if any."""
        if command.WhichOneof("kind") != "task_result":
            link = await self._tokens.parent_of(session_id)
            return (session_id, link.parent_session_id) if link is not None else (session_id,)
        report = command.task_result
        child = ids.validate_session_id(report.child_session_id)
        link = await self._tokens.parent_of(child)
        if (
            report.parent_session_id != session_id
            or link is None
            or link.parent_session_id != session_id
        ):
            raise PermissionDenied(
                Reason.DELIVERY_NOT_ALLOWED,
                f"session {brief(child)} is not a child of session {session_id}",
            )
        return (child, session_id)
