"""What every typed client between Baton services shares
(`clients.hooks`, `clients.anchor`, `clients.owner`): every call has a
deadline, and a failed call raises the domain error it carried (see
`status_map`).

Each client balances over every replica its target names and lets gRPC
retry the methods its service lists as idempotent (`channels.open_channel`).
A method is on the list when running it twice has the effect of running it
once: reads, and writes the server deduplicates by an id in the request
(a delivery id, a handoff id, the fence of a replayed commit). Left off:
RegisterInstance (each call grants a new lease) and AcceptHandoff (the old
owner settles an uncertain handoff itself, and a replay on another instance
would be refused as a reused handoff id after the first one moved the
session).

Calls answer with domain values (`clients.answers`); a stream yields one
value per message the server sends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.call_slots import CallSlots
from baton_runtime.common.clients.channels import DEFAULT_CALL_TIMEOUT, open_channel
from baton_runtime.common.observability import rpc_metrics, tracing
from baton_runtime.common.rpc.status_map import from_rpc_error
from baton_runtime.common.security.tls import Security
from baton_runtime.common.streams.feed_client import FeedItem, FollowedStreams
from baton_runtime.common.streams.multiplex import Answer
from baton_runtime.common.streams.multiplex_client import Lanes, StreamedCalls, Unsupported

# Lanes of a multiplexed method: one per address, at most this many.
MAX_LANES = 4

_T = TypeVar("_T")
_R = TypeVar("_R")


def traced(command: s.Command) -> s.Command:
    """`command` with the current span's trace context in its delivery
    metadata, when tracing is on and it has none yet (a copy; `command`
    itself is left as it is)."""
    if not tracing.TRACING.enabled or command.delivery.traceparent:
        return command
    traceparent = tracing.current_traceparent()
    if not traceparent:
        return command
    stamped = s.Command()
    stamped.CopyFrom(command)
    stamped.delivery.traceparent = traceparent
    return stamped


class ServiceClient:
    """`target`: one address, several comma-separated, or a `dns:///` name
    (see `channels.grpc_target`); `security`: this process's identity, which
    the server checks against its roles."""

    service = ""
    # The `target` label of `baton_rpc_client_handled_total`: the kind of
    # service, never an address (owner peers are many).
    kind = ""
    idempotent: frozenset[str] = frozenset()
    # Methods a `max_in_flight` bound never holds back (call_slots.py).
    unlimited: frozenset[str] = frozenset()

    def __init__(
        self,
        target: str,
        timeout: float = DEFAULT_CALL_TIMEOUT,
        *,
        security: Security,
        max_in_flight: int = 0,
    ) -> None:
        """`max_in_flight`: at most that many calls in flight at once (the
        rest wait here, unsent: `CallSlots`); 0, no bound."""
        self.target = target
        self.security = security
        self.channel = open_channel(target, security, self.service, self.idempotent)
        self.timeout = timeout
        self.slots = CallSlots(max_in_flight, self.kind) if max_in_flight else None
        self._lanes: list[Lanes[Any, Any]] = []
        self._lane_channels: list[grpc.aio.Channel] = []
        self._feeds: list[FollowedStreams[Any, Any]] = []

    async def close(self) -> None:
        for feed in self._feeds:
            await feed.close()
        for lanes in self._lanes:
            await lanes.close()
        for channel in self._lane_channels:
            await channel.close()
        await self.channel.close()

    def _multiplexed(
        self, method: str, batch: type[Any], call: type[Any], answers: type[Any]
    ) -> Lanes[Any, Any]:
        """Calls of `method`, a stream of batched calls (`batch` messages of
        `call`s, answered by `answers` messages: services/common/streams/multiplex.py),
        over one lane per replica the target lists, each lane's stream on its
        own channel to one address (a `dns:///` name: two lanes on the
        balanced channel; one address: one lane)."""
        path = f"/{self.service}/{method}"
        addresses = [a.strip() for a in self.target.split(",") if a.strip()]
        if self.target.startswith("dns:"):
            channels = [self.channel, self.channel]
        elif len(addresses) < 2:
            channels = [self.channel]
        else:
            channels = [
                open_channel(address, self.security, self.service, self.idempotent)
                for address in addresses[:MAX_LANES]
            ]
            self._lane_channels += channels

        def make_batch(calls: list[tuple[int, Any, str]]) -> Any:
            return batch(calls=[call(call_id=i, request=r, traceparent=t) for i, r, t in calls])

        def answers_of(message: Any) -> list[Answer]:
            return [
                (a.call_id, a.response if not a.status else None, a.status) for a in message.answers
            ]

        lanes: Lanes[Any, Any] = Lanes(
            [
                StreamedCalls(
                    channel.stream_stream(
                        path,
                        request_serializer=batch.SerializeToString,
                        response_deserializer=answers.FromString,
                    ),
                    make_batch,
                    answers_of,
                    target=self.kind,
                    method=path,
                )
                for channel in channels
            ]
        )
        self._lanes.append(lanes)
        return lanes

    def _followed(
        self,
        method: str,
        single: str,
        request: type[Any],
        follow: type[Any],
        grant: type[Any],
        response: type[Any],
    ) -> FollowedStreams[Any, Any]:
        """Follows of the server-streaming method `single` multiplexed over `method`, a
        stream of `request` messages (`follow`s to open, ids to stop,
        `grant`s of pages), answered by `response` messages of items
        (services/common/streams/feeds.py), on the service's channel (one stream: to
        one replica at a time)."""
        path = f"/{self.service}/{method}"

        def make_request(
            opens: list[tuple[int, Any, int, str]], stops: list[int], grants: list[tuple[int, int]]
        ) -> Any:
            return request(
                follows=[
                    follow(follow_id=i, request=r, window=w, traceparent=tp)
                    for i, r, w, tp in opens
                ],
                stop_ids=stops,
                grants=[grant(follow_id=i, pages=n) for i, n in grants],
            )

        def items_of(message: Any) -> list[FeedItem]:
            return [(i.follow_id, i, i.end) for i in message.items]

        feed: FollowedStreams[Any, Any] = FollowedStreams(
            self.channel.stream_stream(
                path,
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            ),
            make_request,
            items_of,
            target=self.kind,
            method=path,
            follow_method=f"/{self.service}/{single}",
        )
        self._feeds.append(feed)
        return feed

    async def _followed_or_streamed(
        self,
        feed: FollowedStreams[Any, Any],
        request: Any,
        method: str,
        single: Callable[[Any], grpc.aio.UnaryStreamCall[Any, Any]],
        convert: Callable[[Any], _T],
    ) -> AsyncIterator[_T]:
        """The pages of `request` (each as `convert` makes it) as a follow on
        `feed`; by `single` (the stub's single-stream `method`) when the
        feed is off, or when the server turns out not to serve it (an older
        build: single calls from then on)."""
        if feed.supported:
            try:
                async for item in feed.follow(request):
                    yield convert(item)
                return
            except Unsupported:
                pass  # (before any page: UNIMPLEMENTED ends the stream at once)
        async for page in self._stream(method, single(request), convert):
            yield page

    def _done(self, method: str, code: str) -> None:
        if rpc_metrics.RPC.enabled:
            rpc_metrics.RPC.called(self.kind, f"/{self.service}/{method}", code)

    async def _multiplexed_or_unary(
        self, lanes: Lanes[Any, _T], request: Any, unary: Callable[[], Awaitable[_T]]
    ) -> _T:
        """`request` on its multiplexed `lanes`; by `unary` (a call of the
        unary method, through `_unary`) when there are none, or when the
        servers turn out not to serve the streamed method (an older build:
        unary from then on)."""
        if lanes:
            try:
                async with self._slot(""):
                    return await lanes.call(request, self.timeout)
            except Unsupported:
                pass
        return await unary()

    def _slot(self, method: str) -> contextlib.AbstractAsyncContextManager[None]:
        """A slot of the in-flight bound for a call of `method` (none needed
        without a bound, or for an `unlimited` method)."""
        if self.slots is None or method in self.unlimited:
            return contextlib.nullcontext()
        return self.slots.held()

    async def _unary(self, method: str, start: Callable[[], Awaitable[_T]]) -> _T:
        """The answer of the call `start` makes (of the stub's `method`: it
        is made once a slot is free, so its deadline starts then); a failure
        raises the domain error it carried. Counted when metrics are served."""
        async with self._slot(method):
            return await self._answer(method, start())

    async def _answer(self, method: str, call: Awaitable[_T]) -> _T:
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            self._done(method, exc.code().name)
            raise from_rpc_error(exc) from exc
        except asyncio.CancelledError:
            self._done(method, "CANCELLED")
            raise
        self._done(method, "OK")
        return response

    async def _stream(
        self, method: str, call: grpc.aio.UnaryStreamCall[Any, _R], convert: Callable[[_R], _T]
    ) -> AsyncIterator[_T]:
        """The messages of `call` (the stub's `method`), each as `convert`
        makes it; the call is cancelled when the iteration ends (or the
        iterator is closed). Counted when metrics are served: OK at its end,
        CANCELLED when the caller stopped reading first."""
        code = "CANCELLED"
        meter, path = rpc_metrics.RPC, f"/{self.service}/{method}"
        if meter.enabled:
            meter.opened(self.kind, path)
        try:
            async for item in call:
                if meter.enabled:
                    meter.received(self.kind, path)
                yield convert(item)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            raise from_rpc_error(exc) from exc
        finally:
            call.cancel()
            self._done(method, code)
