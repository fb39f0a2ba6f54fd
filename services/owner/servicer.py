"""OwnerService: translates between protos and the owner host."""

from __future__ import annotations

import grpc
import structlog

from baton.owner.v1 import owner_pb2 as pb
from baton.owner.v1 import owner_pb2_grpc
from services.common import identity, ids
from services.common.bounds import check_session_settings
from services.common.errors import PermissionDenied, Reason
from services.common.identity import Role
from services.owner.host import OwnerHost


class OwnerServicer(owner_pb2_grpc.OwnerServiceServicer):
    """Role checks are the interceptor's. Sessions start here, and orphans are
    adopted here, only at the request of this deployment's own ingress (child
    sessions: of this deployment's own owners); a handoff comes from the
    owner its request names as the current one; a drain is an operator's."""

    def __init__(self, host: OwnerHost) -> None:
        self._host = host

    async def StartSession(
        self, request: pb.StartSessionRequest, context: grpc.aio.ServicerContext
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
        if request.HasField("parent"):
            run_id, created, appended = await self._host.start_child(request)
            return pb.StartSessionResponse(
                session_id=request.session_id,
                owner_run_id=run_id,
                created=created,
                inbox_token=ids.inbox_token(request.session_id),
                first_command_appended=appended,
            )
        run_id, created, inbox = await self._host.start_session(
            request.session_id,
            request.deployment_id,
            request.channel,
            list(request.aliases),
            timeout_seconds=request.timeout_seconds,
            token_budget=request.token_budget,
        )
        return pb.StartSessionResponse(
            session_id=request.session_id, owner_run_id=run_id, created=created, inbox_token=inbox
        )

    async def AcceptHandoff(
        self, request: pb.AcceptHandoffRequest, context: grpc.aio.ServicerContext
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
        return await self._host.accept_handoff(request)

    async def DrainSessions(
        self, request: pb.DrainSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainSessionsResponse:
        structlog.contextvars.bind_contextvars(to_deployment_id=request.to_deployment_id)
        return self._host.drain(request.to_deployment_id)

    async def AdoptSession(
        self, request: pb.AdoptSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdoptSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        # Only this deployment's own ingress asks it to adopt.
        identity.current().require_deployment(self._host.deployment_id, "this owner")
        return await self._host.adopt_orphan(request.session_id)
