"""The client half of server streams multiplexed over one long-lived
bidirectional stream (the server half and the protocol are
services/common/streams/feeds.py).

`FollowedStreams.follow(request)` is an async iterator of one follow's
pages, as the server-streaming method's call would be: it ends when the
follow ends with OK, raises the domain error it ended with otherwise, and
raises StreamBroken (UNAVAILABLE: retry) when the stream under it broke.
Closing the iterator (or cancelling its reader) stops the follow: a stop
is written only after the follow's open, and a follow closed while its open
is still queued is dropped from the queue (neither open nor stop is sent). It
buffers at most the follow's window of pages: the server sends no more
until the reader has taken half of them, and then is granted as many. The
stream opens with the first follow and is opened again by the next follow
after it broke; `Unsupported` says the server does not serve the method (an
older build: the caller falls back to the server-streaming method).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
from google.rpc import status_pb2

from baton_runtime.common.errors import BatonError
from baton_runtime.common.observability import rpc_metrics, tracing
from baton_runtime.common.rpc.status_map import from_status_proto, status_code
from baton_runtime.common.streams.feeds import DEFAULT_WINDOW, MAX_REQUEST_ITEMS
from baton_runtime.common.streams.multiplex import Coalescing
from baton_runtime.common.streams.multiplex_client import (
    SharedStream,
    SharedStreamClient,
    StreamBroken,
)

_Req = TypeVar("_Req")
_Page = TypeVar("_Page")
_T = TypeVar("_T")
# (follow id, the page or None, the serialized google.rpc.Status ending it or b"")
FeedItem = tuple[int, Any, bytes]


class _Ended:
    """A follow's queue marker: it ended with OK."""


_END = _Ended()


@dataclass(eq=False)
class _Stream(SharedStream):
    """One open stream of follows: their queues, and what waits to be
    written (opens, stops and grants)."""

    follows: dict[int, asyncio.Queue[Any]] = field(default_factory=dict)
    # Opens not written yet, by follow id, in the order they were queued.
    opens: dict[int, tuple[int, Any, int, str]] = field(default_factory=dict)
    stops: list[int] = field(default_factory=list)
    grants: list[tuple[int, int]] = field(default_factory=list)


def _take(items: list[_T], count: int) -> list[_T]:
    """The first `count` of `items`, taken off it."""
    taken = items[:count]
    del items[:count]
    return taken


def _take_opens(
    opens: dict[int, tuple[int, Any, int, str]], count: int
) -> list[tuple[int, Any, int, str]]:
    """The first `count` opens, taken off `opens`."""
    taken = list(itertools.islice(opens.values(), count))
    for follow_id, *_ in taken:
        del opens[follow_id]
    return taken


class FollowedStreams(SharedStreamClient[_Stream], Generic[_Req, _Page]):
    """The client half: follows of many sessions over one stream."""

    def __init__(
        self,
        open_stream: Callable[[], Any],
        make_request: Callable[
            [list[tuple[int, _Req, int, str]], list[int], list[tuple[int, int]]], Any
        ],
        items_of: Callable[[Any], Iterable[FeedItem]],
        *,
        target: str,
        method: str,
        follow_method: str,
    ) -> None:
        """`follow_method`: the server-streaming method a follow stands for
        (its client span's name)."""
        super().__init__(open_stream, target=target, method=method)
        self._follow_method = follow_method
        self._make_request = make_request
        self._items_of = items_of
        self._ids = itertools.count(1)

    def follows_open(self) -> int:
        """Follows open on the current stream."""
        return len(self._stream.follows) if self._stream is not None else 0

    async def follow(self, request: _Req, window: int = DEFAULT_WINDOW) -> AsyncIterator[_Page]:
        """The pages of one follow of `request`, until it ends; at most
        `window` of them buffered here."""
        stream = self._current()
        follow_id = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stream.follows[follow_id] = queue
        span, traceparent = None, ""
        if tracing.TRACING.enabled:
            span, traceparent = tracing.start_client_span(self._follow_method)
        stream.opens[follow_id] = (follow_id, request, window, traceparent)
        stream.wake.set()
        taken = 0
        code = grpc.StatusCode.CANCELLED  # unless it ends: the reader stopped
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    code = grpc.StatusCode.OK
                    return
                if isinstance(item, BaseException):
                    code = status_code(item) if isinstance(item, BatonError) else code
                    raise item
                taken += 1
                if taken >= (window + 1) // 2 and stream.broken is None:
                    stream.grants.append((follow_id, taken))
                    stream.wake.set()
                    taken = 0
                yield item
        finally:
            if stream.follows.pop(follow_id, None) is not None and stream.broken is None:
                # The reader left first: stop the follow, once its open is
                # written. One whose open is still queued is dropped from the
                # queue instead: the server never hears of it. (A stop written
                # before its open, or without it, would leave it open there.)
                if stream.opens.pop(follow_id, None) is None:
                    stream.stops.append(follow_id)
                    stream.wake.set()
            if span is not None:
                tracing.end_client_span(span, code)

    def _new(self, call: Any) -> _Stream:
        return _Stream(call)

    async def _write(self, stream: _Stream) -> None:
        meter = rpc_metrics.RPC
        coalescing = Coalescing()
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                await coalescing.gather()
                while stream.opens or stream.stops or stream.grants:
                    room = MAX_REQUEST_ITEMS
                    stops = _take(stream.stops, room)
                    grants = _take(stream.grants, room - len(stops))
                    opens = _take_opens(stream.opens, room - len(stops) - len(grants))
                    await stream.call.write(self._make_request(opens, stops, grants))
                    coalescing.sent()
                    if meter.enabled:
                        meter.sent_on_stream(self._target, self._method)
        except Exception as exc:  # noqa: BLE001 - any failed write ends the stream
            self._retire(stream, StreamBroken(f"{self._method}: the stream broke ({exc!r})"))

    async def _read(self, stream: _Stream) -> None:
        meter = rpc_metrics.RPC
        try:
            while True:
                message = await stream.call.read()
                if message is grpc.aio.EOF:
                    break
                if meter.enabled:
                    meter.received(self._target, self._method)
                for follow_id, page, end in self._items_of(message):
                    queue = stream.follows.get(follow_id)
                    if queue is None:
                        continue  # stopped by its reader
                    if end:
                        del stream.follows[follow_id]
                        status = status_pb2.Status.FromString(end)
                        queue.put_nowait(_END if status.code == 0 else from_status_proto(status))
                    else:
                        queue.put_nowait(page)
        except grpc.aio.AioRpcError as exc:
            self._ended(stream, exc)
            return
        self._ended(stream, None)

    def _fail_all(self, stream: _Stream, failure: BaseException) -> None:
        for queue in stream.follows.values():
            queue.put_nowait(failure)
        stream.follows.clear()
