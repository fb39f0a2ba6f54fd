"""OwnerService: translates between protos and the owner host."""

from __future__ import annotations

import grpc
import structlog

from baton.owner.v1 import owner_pb2 as pb
from baton.owner.v1 import owner_pb2_grpc
from services.common import ids
from services.owner.host import OwnerHost


class OwnerServicer(owner_pb2_grpc.OwnerServiceServicer):
    def __init__(self, host: OwnerHost) -> None:
        self._host = host

    async def StartSession(
        self, request: pb.StartSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
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
        return await self._host.adopt_orphan(request.session_id)
