"""OwnerService: translates between protos and the owner host."""

from __future__ import annotations

import grpc
import structlog

from baton.owner.v1 import owner_pb2 as pb
from baton.owner.v1 import owner_pb2_grpc
from services.common import ids
from services.common.errors import InvalidArgument, Reason
from services.owner.host import OwnerHost


class OwnerServicer(owner_pb2_grpc.OwnerServiceServicer):
    def __init__(self, host: OwnerHost) -> None:
        self._host = host

    async def StartSession(
        self, request: pb.StartSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
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

    async def PrepareHandoff(
        self, request: pb.PrepareHandoffRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrepareHandoffResponse:
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id,
            handoff_id=request.handoff_id,
            from_deployment_id=request.from_deployment_id,
        )
        successor = await self._host.prepare_handoff(request)
        return pb.PrepareHandoffResponse(successor=successor)

    async def ActivateHandoff(
        self, request: pb.ActivateHandoffRequest, context: grpc.aio.ServicerContext
    ) -> pb.ActivateHandoffResponse:
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id,
            run_id=request.fence.owner_run_id,
            handoff_id=request.handoff_id,
        )
        if not request.HasField("fence"):
            raise InvalidArgument(Reason.MISSING_FIELD, "fence is required")
        await self._host.handoffs.activate(request.handoff_id, request.fence)
        return pb.ActivateHandoffResponse()

    async def ReleaseHandoff(
        self, request: pb.ReleaseHandoffRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseHandoffResponse:
        structlog.contextvars.bind_contextvars(
            session_id=request.session_id, handoff_id=request.handoff_id
        )
        ids.validate_id(request.handoff_id, "handoff_id")
        self._host.handoffs.release(request.handoff_id)
        return pb.ReleaseHandoffResponse()
