"""Server streams multiplexed over one long-lived bidirectional stream
(issue 21): a peer's follows of many sessions (an owner instance's inbox
streams) ride one stream, their pages batched when several are ready
together, each tagged with its follow id. A message on an open stream costs
about half a unary call's CPU in grpc.aio, and opening a follow costs one
message instead of a new HTTP/2 stream, its headers, the interceptor chain
and a handler task.

`serve_follows` is the server half: each follow is served by `open` as the
server-streaming method would serve it (in a task of its own, in the
stream's context: the caller admitted at the stream's opening), and ends
with the status that method would have ended with, as the follow's last
item. Flow control is per follow: a follow has at most its window of pages
sent (or ready to be) and not granted back by the client, which grants as
its reader takes them, so a reader that stops reading holds back its own
follow, and no other, and the two sides together hold at most a window of
pages for it. A follow's open and stop apply in the order the client meant,
however they are batched: the client writes a stop only after its follow's
open, and the server applies a stop in the same message as its open after
that open. The client half is services/common/streams/feed_client.py.

A follow's failure ends that follow alone, never the stream: the pages
are bounded in bytes by their producers (services/common/streams/pages.py), a
message batches them up to MAX_MESSAGE_BYTES, and a page that could still
not be sent (over MAX_SENDABLE_PAGE_BYTES, far above what a producer
makes) ends its follow with INTERNAL instead of failing the stream and
every follow on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import structlog
from google.rpc import status_pb2

from baton_runtime.common import errors, limits
from baton_runtime.common.observability import rpc_metrics, tracing
from baton_runtime.common.rpc import server as grpc_server
from baton_runtime.common.rpc.status_map import status_code, status_proto
from baton_runtime.common.streams.multiplex import Coalescing
from baton_runtime.common.streams.pages import ENTRY_FRAMING

log = structlog.get_logger("baton.feeds")

# Follows opened and stopped by one message, in all.
MAX_REQUEST_ITEMS = 256
# Follows open at once on one stream (an owner instance's live sessions).
MAX_FOLLOWS = 100_000
# A follow's window (pages sent or ready and not granted back), and the one
# a follow that names none gets.
MAX_WINDOW = 1024
DEFAULT_WINDOW = 16
# A message's items stop growing past this many bytes (one bigger item goes
# alone): with pages of at most limits.MAX_PAGE_BYTES, a message stays far
# below gRPC's 4 MiB limit (grpc_server.MAX_MESSAGE_BYTES).
MAX_MESSAGE_BYTES = limits.MAX_PAGE_BYTES
# A page over this could not be sent, even alone in its message: it ends its
# follow (never made by the producers, whose pages stay within MAX_PAGE_BYTES).
MAX_SENDABLE_PAGE_BYTES = grpc_server.MAX_MESSAGE_BYTES - 64 * 1024
# What an item costs in its message beyond its page and end: its tag and
# length, the follow id's and the end's (generously).
_ITEM_FRAMING = 32
# (follow id, the page or None, the serialized google.rpc.Status ending it or b"")
Item = tuple[int, Any, bytes]
# A follow that ended as its stream would have ended with OK (a status of
# code 0 serializes to nothing: the message makes the end visible).
_OK_END: bytes = status_pb2.Status(code=0, message="end of stream").SerializeToString()


def page_bytes(page: Any) -> int:
    """What a page's entries (messages) cost in a message."""
    return sum(entry.ByteSize() + ENTRY_FRAMING for entry in page)


def _end_of(exc: errors.BatonError | None) -> bytes:
    """The serialized google.rpc.Status a follow ends with (OK for None)."""
    if exc is None:
        return _OK_END
    end: bytes = status_proto(exc).SerializeToString()
    return end


async def serve_follows(
    requests: AsyncIterator[Any],
    open_follow: Callable[[Any], AsyncIterator[Any]],
    message: Callable[[list[Item]], Any],
    *,
    method: str,
    max_follows: int = MAX_FOLLOWS,
) -> AsyncGenerator[Any, None]:
    """Serve one stream: each request's `follows` (with `follow_id`,
    `request`, `window` and `traceparent`) opened by `open_follow(request)` (the pages of
    one follow, each a list of messages), its `stop_ids` stopped, its
    `grants` (`follow_id`, `pages`) added to their follows' windows; the
    items ready together go back as one message (`message`). Ends when the
    client half-closes and every follow has ended; a request that breaks the
    bounds ends it with INVALID_ARGUMENT. A stop applies after its follow's
    open: one in the same request as the open ends the follow."""
    feed = _Feed(open_follow, method, max_follows)
    reader = asyncio.ensure_future(feed.read(requests))
    coalescing = Coalescing()
    try:
        while True:
            ready = await feed.next_items(reader, coalescing)
            if ready is None:
                break
            yield message(ready)
            coalescing.sent()
        reader.result()  # a refused request ends the stream with its status
    finally:
        reader.cancel()
        await feed.cancel()


def _check_request(request: Any) -> None:
    """A request carries 1 to MAX_REQUEST_ITEMS follows, stops and grants in
    all, each grant of 1 to MAX_WINDOW pages."""
    count = len(request.follows) + len(request.stop_ids) + len(request.grants)
    if not 1 <= count <= MAX_REQUEST_ITEMS:
        raise errors.InvalidArgument(
            errors.Reason.INVALID_FIELD,
            f"follows, stop_ids, grants: a message carries 1 to {MAX_REQUEST_ITEMS} in all,"
            f" not {count}",
        )
    for follow in request.follows:
        if follow.traceparent:
            tracing.check_traceparent(follow.traceparent, "follows.traceparent")
    for grant in request.grants:
        if not 1 <= grant.pages <= MAX_WINDOW:
            raise errors.InvalidArgument(
                errors.Reason.INVALID_FIELD, f"grants.pages: 1 to {MAX_WINDOW}"
            )


class _Follow:
    """One follow being served: its task, and the pages it may still send
    (its window, less what was not granted back)."""

    __slots__ = ("task", "credit", "granted")

    def __init__(self, window: int) -> None:
        self.task: asyncio.Task[None] | None = None
        self.credit = window
        self.granted = asyncio.Event()

    async def window_open(self) -> None:
        """Wait until the window has room for a page."""
        while self.credit <= 0:
            self.granted.clear()
            await self.granted.wait()

    def grant(self, pages: int) -> None:
        self.credit += pages
        self.granted.set()


class _Feed:
    """One stream's follows and the items not sent yet."""

    def __init__(
        self, open_follow: Callable[[Any], AsyncIterator[Any]], method: str, limit: int
    ) -> None:
        self._open = open_follow
        self._method = method
        self._limit = limit
        self._follows: dict[int, _Follow] = {}
        self._ready: list[Item] = []
        self._sizes: list[int] = []  # each ready item's bytes in a message
        self._wake = asyncio.Event()

    async def read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                _check_request(request)
                # Each stop applies after its follow's open. The stops of
                # follows open before this message go first (they make room
                # under the limit for its opens); a stop of a follow this
                # message opens ends it once opened, never before (it would
                # be ignored, and the follow left open for nobody).
                after_opens = [i for i in request.stop_ids if not self._stop(i)]
                for follow in request.follows:
                    self._start(follow)
                for grant in request.grants:
                    follow = self._follows.get(grant.follow_id)
                    if follow is not None:
                        follow.grant(grant.pages)
                for follow_id in after_opens:
                    self._stop(follow_id)
        finally:
            self._wake.set()

    def _start(self, opened: Any) -> None:
        follow_id, window = opened.follow_id, opened.window
        refusal: errors.BatonError | None = None
        if follow_id <= 0 or follow_id in self._follows:
            refusal = errors.InvalidArgument(
                errors.Reason.INVALID_FIELD,
                "follow_id: must be 1 or more and not open on this stream",
            )
        elif window > MAX_WINDOW:
            refusal = errors.InvalidArgument(
                errors.Reason.INVALID_FIELD, f"window: 1 to {MAX_WINDOW} (0: {DEFAULT_WINDOW})"
            )
        elif len(self._follows) >= self._limit:
            refusal = errors.ResourceExhausted(
                errors.Reason.TOO_MANY_STREAMS,
                f"a stream serves at most {self._limit} follows at once",
            )
        if refusal is not None:
            self._put((follow_id, None, _end_of(refusal)))
            return
        follow = self._follows[follow_id] = _Follow(window or DEFAULT_WINDOW)
        follow.task = asyncio.ensure_future(
            self._run(follow_id, follow, opened.request, opened.traceparent)
        )

    def _stop(self, follow_id: int) -> bool:
        """Stop the follow `follow_id`; False when it is not open."""
        follow = self._follows.pop(follow_id, None)
        if follow is None:
            return False
        if follow.task is not None:
            follow.task.cancel()
        return True

    async def _run(self, follow_id: int, follow: _Follow, request: Any, traceparent: str) -> None:
        start = time.perf_counter()
        span = (
            tracing.start_server_span(self._method, [("traceparent", traceparent)])
            if tracing.TRACING.enabled and traceparent
            else None
        )
        code, reason = "OK", ""
        end: bytes
        try:
            async for page in self._open(request):
                size = page_bytes(page)
                if size > MAX_SENDABLE_PAGE_BYTES:
                    raise _unsendable(self._method, size)
                await follow.window_open()
                follow.credit -= 1
                self._put((follow_id, page, b""), size)
            end = _end_of(None)
        except asyncio.CancelledError:
            code = "CANCELLED"  # stopped by the client, or the stream ended
            raise
        except errors.BatonError as exc:
            code, reason = status_code(exc).name, exc.reason
            end = _end_of(exc)
        except Exception:  # noqa: BLE001 - the boundary: anything unmapped is INTERNAL
            log.exception("unhandled error", rpc=self._method)
            code, reason = "INTERNAL", errors.Reason.INTERNAL
            end = _end_of(errors.Internal(errors.Reason.INTERNAL, "internal error"))
        finally:
            if rpc_metrics.RPC.enabled:
                rpc_metrics.RPC.served(self._method, code, time.perf_counter() - start)
            if span is not None:
                tracing.end_server_span(span, code, reason)
        if self._follows.get(follow_id) is follow:
            del self._follows[follow_id]
            self._put((follow_id, None, end))

    def _put(self, item: Item, page_size: int = 0) -> None:
        """Queue `item` (its page of `page_size` bytes) to be sent."""
        self._ready.append(item)
        self._sizes.append(page_size + len(item[2]) + _ITEM_FRAMING)
        self._wake.set()

    async def next_items(
        self, reader: asyncio.Future[None], coalescing: Coalescing
    ) -> list[Item] | None:
        """The items ready now, up to MAX_MESSAGE_BYTES (waiting for one,
        then `coalescing`); None once the reader is done and every follow
        has ended."""
        while not self._ready:
            if reader.done() and (not self._follows or reader.exception() is not None):
                return None
            self._wake.clear()
            # Set by each item and by the reader's end.
            await self._wake.wait()
        await coalescing.gather()
        size, count = 0, 0
        for item_size in self._sizes:
            size += item_size
            if count and size > MAX_MESSAGE_BYTES:
                break
            count += 1
        ready = self._ready[:count]
        del self._ready[:count], self._sizes[:count]
        return ready

    async def cancel(self) -> None:
        tasks = [f.task for f in self._follows.values() if f.task is not None]
        self._follows.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def _unsendable(method: str, size: int) -> errors.Internal:
    """A page too large for any message: a producer broke its bound."""
    log.error("page over the message limit; its follow ends", rpc=method, page_bytes=size)
    limit = MAX_SENDABLE_PAGE_BYTES
    return errors.Internal(errors.Reason.INTERNAL, f"a page of {size} bytes is over {limit}")
