"""HookRegistryService: translates between protos and the registry."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from baton.hooks.v1 import hooks_pb2 as pb
from baton.hooks.v1 import hooks_pb2_grpc
from services.common import ids
from services.common.errors import InvalidArgument, Reason
from services.hooks.registry import HookRegistry


def _require_fence(fence: object, present: bool) -> None:
    if not present:
        raise InvalidArgument(Reason.MISSING_FIELD, "fence is required")


class HookRegistryServicer(hooks_pb2_grpc.HookRegistryServiceServicer):
    def __init__(self, registry: HookRegistry) -> None:
        self._registry = registry

    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        if not request.HasField("owner"):
            raise InvalidArgument(Reason.MISSING_FIELD, "owner is required")
        fence, hooks = await self._registry.create_session(
            request.session_id, request.owner, request.channel, list(request.aliases)
        )
        return pb.CreateSessionResponse(
            fence=fence, inbox_token=ids.inbox_token(request.session_id), hooks=hooks
        )

    async def ClaimHooks(
        self, request: pb.ClaimHooksRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClaimHooksResponse:
        _require_fence(request.fence, request.HasField("fence"))
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        hooks = await self._registry.claim(request.fence, list(request.tokens))
        return pb.ClaimHooksResponse(hooks=hooks)

    async def ResumeHook(
        self, request: pb.ResumeHookRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResumeHookResponse:
        if not request.HasField("command"):
            raise InvalidArgument(Reason.MISSING_FIELD, "command is required")
        receipt = await self._registry.resume(request.token, request.command, request.channel)
        structlog.contextvars.bind_contextvars(session_id=receipt.session_id, seq=receipt.seq)
        return pb.ResumeHookResponse(receipt=receipt)

    async def LookupHook(
        self, request: pb.LookupHookRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupHookResponse:
        record = await self._registry.lookup(request.token, request.channel)
        return pb.LookupHookResponse(session_id=record.session_id, channel=record.channel)

    async def DisposeHooks(
        self, request: pb.DisposeHooksRequest, context: grpc.aio.ServicerContext
    ) -> pb.DisposeHooksResponse:
        _require_fence(request.fence, request.HasField("fence"))
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        hooks = await self._registry.dispose(request.fence, list(request.tokens))
        return pb.DisposeHooksResponse(hooks=hooks)

    async def StreamInbox(
        self, request: pb.StreamInboxRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamInboxResponse]:
        _require_fence(request.fence, request.HasField("fence"))
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        async for entries in self._registry.stream_inbox(request.fence, request.from_seq):
            yield pb.StreamInboxResponse(entries=entries)
