"""OwnerService: translates between protos and the owner host.

Each RPC decodes its request into domain values (the stored `session_pb2`
messages pass as they are: fences, owner identities, inbox entries, parent
links), calls the host, and builds its response from the host's answer."""

from __future__ import annotations

import structlog

from baton_runtime._proto.baton.owner.v1 import owner_pb2 as pb
from baton_runtime._proto.baton.owner.v1 import owner_pb2_grpc
from baton_runtime.common.bounds import check_session_settings
from baton_runtime.common.clients.answers import StartedSession
from baton_runtime.common.errors import PermissionDenied, Reason
from baton_runtime.common.rpc.interceptor import Context
from baton_runtime.common.security import identity
from baton_runtime.common.security.identity import Role
from baton_runtime.owner.handoff.acceptance import HandoffOffer
from baton_runtime.owner.host.host import OwnerHost
from baton_runtime.owner.run.children import ChildStart


class OwnerServicer(owner_pb2_grpc.OwnerServiceServicer):
    """Role checks are the interceptor's. Sessions start here, and orphans are
    adopted here, only at the request of this deployment's own ingress (child
    sessions: of this deployment's own owners); a handoff comes from the
    owner its request names as the current one; a drain and a resume are an
    operator's."""

    def __init__(self, host: OwnerHost) -> None:
        self._host = host

    async def StartSession(
        self, request: pb.StartSessionRequest, context: Context
    ) -> pb.StartSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        caller = identity.current()
        caller.require_deployment(self._host.deployment_id, "this owner")
        if caller.verified and (caller.role is Role.OWNER) != request.HasField("parent"):
            # Owners start child sessions (with a parent link) on their own
            # deployment's instances; an ingress starts a tenant's session.
            raise PermissionDenied(
                Reason.ROLE_NOT_ALLOWED,
                "owners start child sessions (with a parent link), ingresses tenants' sessions",
            )
        # Checked before anything is written (a bad value must leave no session).
        check_session_settings(request.timeout_seconds, request.token_budget)
        started: StartedSession
        if request.HasField("parent"):
            child = ChildStart(
                session_id=request.session_id,
                deployment_id=request.deployment_id,
                channel=request.channel,
                parent=request.parent,
                first_command=request.first_command if request.HasField("first_command") else None,
                aliases=tuple(request.aliases),
            )
            started = await self._host.start_child(child)
        else:
            started = await self._host.start_session(
                request.session_id,
                request.deployment_id,
                request.channel,
                list(request.aliases),
                timeout_seconds=request.timeout_seconds,
                token_budget=request.token_budget,
            )
        return pb.StartSessionResponse(
            session_id=started.session_id,
            owner_run_id=started.owner_run_id,
            created=started.created,
            inbox_token=started.inbox_token,
            first_command_appended=started.first_command_appended,
        )

    async def AcceptHandoff(
        self, request: pb.AcceptHandoffRequest, context: Context
    ) -> pb.AcceptHandoffResponse:
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id,
            handoff_id=request.handoff_id,
            from_deployment_id=request.from_owner.deployment_id,
        )
        if request.HasField("from_owner"):  # (absent: the host refuses it)
            identity.current().require_deployment(
                request.from_owner.deployment_id, "the session's current owner"
            )
        offer = HandoffOffer(
            handoff_id=request.handoff_id,
            fence=request.fence if request.HasField("fence") else None,
            deployment_id=request.deployment_id,
            from_owner=request.from_owner if request.HasField("from_owner") else None,
            snapshot_revision=request.snapshot_revision,
            trigger=request.trigger if request.HasField("trigger") else None,
            reason=request.reason,
            checkpoint=request.checkpoint,
            context=tuple(request.context),
            permit=request.permit if request.HasField("permit") else None,
        )
        accepted = await self._host.accept_handoff(offer)
        return pb.AcceptHandoffResponse(
            successor=accepted.successor, fence=accepted.fence, replayed=accepted.replayed
        )

    async def DrainSessions(
        self, request: pb.DrainSessionsRequest, context: Context
    ) -> pb.DrainSessionsResponse:
        structlog.contextvars.bind_contextvars(to_deployment_id=request.to_deployment_id)
        report = self._host.drain(request.to_deployment_id)
        return pb.DrainSessionsResponse(
            deployment_id=report.deployment_id,
            instance_id=report.instance_id,
            to_deployment_id=report.to_deployment_id,
            moved=report.moved,
            remaining=report.remaining,
            blockers=[
                pb.DrainBlocker(session_id=b.session_id, reason=b.reason, detail=b.detail)
                for b in report.blockers
            ],
        )

    async def UndrainSessions(
        self, request: pb.UndrainSessionsRequest, context: Context
    ) -> pb.UndrainSessionsResponse:
        undrained = self._host.undrain()
        return pb.UndrainSessionsResponse(
            deployment_id=undrained.deployment_id,
            instance_id=undrained.instance_id,
            was_to_deployment_id=undrained.was_to_deployment_id,
            moved=undrained.moved,
            held=undrained.held,
        )

    async def AdoptSession(
        self, request: pb.AdoptSessionRequest, context: Context
    ) -> pb.AdoptSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        # Only this deployment's own ingress asks it to adopt.
        identity.current().require_deployment(self._host.deployment_id, "this owner")
        adopted = await self._host.adopt_orphan(request.session_id)
        return pb.AdoptSessionResponse(fence=adopted.fence, replayed=adopted.replayed)

    async def ResumeSession(
        self, request: pb.ResumeSessionRequest, context: Context
    ) -> pb.ResumeSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        fence = await self._host.resume_stalled(request.session_id)
        return pb.ResumeSessionResponse(resumed=fence is not None, fence=fence)
