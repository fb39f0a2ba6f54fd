"""IngressService: translates between protos and the edge."""

from __future__ import annotations

from collections.abc import AsyncIterator

import structlog

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.bounds import check_seq
from baton_runtime.common.rpc.interceptor import Context
from baton_runtime.ingress.edge import Edge
from baton_runtime.ingress.introspection import SessionViews


class IngressServicer(ingress_pb2_grpc.IngressServiceServicer):
    def __init__(self, edge: Edge, views: SessionViews) -> None:
        self._edge = edge
        self._views = views

    def _channel(self, context: Context) -> str:
        channel = self._edge.authenticate(context.invocation_metadata())
        structlog.contextvars.bind_contextvars(channel=channel)
        return channel

    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Context
    ) -> pb.CreateSessionResponse:
        channel = self._channel(context)
        session_id, created = await self._edge.create_session(
            channel,
            request.request_id,
            list(request.aliases),
            timeout_seconds=request.timeout_seconds,
            token_budget=request.token_budget,
        )
        structlog.contextvars.bind_contextvars(session_id=session_id)
        return pb.CreateSessionResponse(
            session_id=session_id, created=created, deployment_id=self._edge.deployment_id
        )

    async def SendMessage(
        self, request: pb.SendMessageRequest, context: Context
    ) -> pb.SendMessageResponse:
        channel = self._channel(context)
        token = self._edge.target_token(channel, request.session_id, request.alias)
        command = self._edge.build_send(
            channel,
            request.text,
            request.input_responses,
            request.turn_policy,
            request.delivery_id,
            request.caller,
            request.labels,
        )
        receipt = await self._edge.send(channel, token, command)
        structlog.contextvars.bind_contextvars(session_id=receipt.session_id, seq=receipt.seq)
        return pb.SendMessageResponse(
            receipt=receipt,
            delivery_id=command.delivery.delivery_id,
            accepted_deployment_id=command.delivery.accepted_deployment_id,
        )

    async def SendControl(
        self, request: pb.SendControlRequest, context: Context
    ) -> pb.SendControlResponse:
        channel = self._channel(context)
        token = self._edge.target_token(channel, request.session_id, request.alias)
        command = self._edge.build_control(
            channel,
            request.kind,
            request.delivery_id,
            request.caller,
            request.reason,
            request.attempt_id,
            request.granted,
        )
        receipt = await self._edge.send(channel, token, command)
        structlog.contextvars.bind_contextvars(session_id=receipt.session_id, seq=receipt.seq)
        return pb.SendControlResponse(receipt=receipt, delivery_id=command.delivery.delivery_id)

    async def StreamEvents(
        self, request: pb.StreamEventsRequest, context: Context
    ) -> AsyncIterator[pb.StreamEventsResponse]:
        channel = self._channel(context)
        check_seq(request.start_seq, "start_seq")  # validated before any lookup
        session_id = await self._edge.resolve_session(channel, request.session_id, request.alias)
        structlog.contextvars.bind_contextvars(session_id=session_id)
        async for page in self._edge.stream(
            channel, session_id, request.start_seq, request.follow, request.live
        ):
            if isinstance(page, s.LiveBatch):
                yield pb.StreamEventsResponse(live=page)
            else:
                yield pb.StreamEventsResponse(events=page)

    async def GetSession(
        self, request: pb.GetSessionRequest, context: Context
    ) -> pb.GetSessionResponse:
        channel = self._channel(context)
        session_id = await self._edge.addressed_session(channel, request.session_id, request.alias)
        structlog.contextvars.bind_contextvars(session_id=session_id)
        return pb.GetSessionResponse(session=await self._views.get(channel, session_id))

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Context
    ) -> pb.ListSessionsResponse:
        channel = self._channel(context)
        sessions, token = await self._views.list(
            channel, request.page_size, request.page_token, request.filter, request.order_by
        )
        return pb.ListSessionsResponse(sessions=sessions, next_page_token=token)
