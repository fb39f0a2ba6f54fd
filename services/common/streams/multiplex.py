"""Calls multiplexed over one long-lived bidirectional stream (issue 21):
many callers' requests, of any sessions, ride one stream between two
long-lived peers, batched when several are ready together, each answered by
its call id. A message pair on an open stream costs about a third of a unary
call's CPU in grpc.aio (no new HTTP/2 stream, headers, interceptor chain or
handler task per call), and a batch shares one message's cost among its
calls.

`serve_calls` is the server half: it runs each call of a batch as the unary
method would (concurrently, at most `max_in_flight` on a stream: then it
stops reading, and gRPC's flow control holds the client back), and answers
each by id, a refusal as the google.rpc.Status the unary method would have
ended with. The client half (`StreamedCalls`, `Lanes`) is
services/common/streams/multiplex_client.py.

Only for idempotent methods: `Lanes` retries a call whose stream broke (or
that was answered UNAVAILABLE) on the next replica's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import structlog

from baton_runtime.common import errors
from baton_runtime.common.observability import rpc_metrics, tracing
from baton_runtime.common.rpc.status_map import (
    status_code,
    status_proto,
)

log = structlog.get_logger("baton.multiplex")

MAX_BATCH_CALLS = 256
MAX_IN_FLIGHT = 256
# A batch's requests stop growing past this many bytes (one bigger request
# goes alone): well under every server's 4 MiB receive limit.
MAX_BATCH_BYTES = 1024 * 1024
# (call id, the answer or None, the serialized google.rpc.Status or b"")
Answer = tuple[int, Any, bytes]
# A stream's writer that sent a message less than this long ago is busy.
BUSY_WITHIN_S = 0.002


class Coalescing:
    """When a stream's writer sends: at once after idleness; while busy (a
    message went out less than BUSY_WITHIN_S ago), only after the event
    loop ran the callbacks ready now, so that what they queue (other
    sessions' calls, answers or pages) joins the message. The wait is one
    turn of the loop, never a timer."""

    __slots__ = ("_sent_at",)

    def __init__(self) -> None:
        self._sent_at = 0.0

    async def gather(self) -> None:
        """Before taking what a message carries."""
        if time.monotonic() - self._sent_at < BUSY_WITHIN_S:
            await asyncio.sleep(0)

    def sent(self) -> None:
        self._sent_at = time.monotonic()


# -- the server half ------------------------------------------------------------------


async def serve_calls(
    batches: AsyncIterator[Any],
    calls_of: Callable[[Any], Sequence[Any]],
    handle: Callable[[Any], Awaitable[Any]],
    answers: Callable[[list[Answer]], Any],
    *,
    method: str,
    max_calls: int = MAX_BATCH_CALLS,
    max_in_flight: int = MAX_IN_FLIGHT,
) -> AsyncGenerator[Any, None]:
    """Serve one stream: each call of each batch (`calls_of(batch)`: items
    with `call_id`, `request` and `traceparent`) run by `handle` as `method`
    would run it; the answers ready together go back as one message
    (`answers`). Ends when the client half-closes and every call is answered;
    a batch that breaks the bounds ends it with INVALID_ARGUMENT."""
    served = _ServedCalls(handle, method, max_in_flight)
    reader = asyncio.ensure_future(served.read(batches, calls_of, max_calls))
    coalescing = Coalescing()
    # (the caller closes this generator when the client goes away: its
    # finally cancels the calls in flight)
    try:
        while True:
            ready = await served.next_answers(reader, coalescing)
            if ready is None:
                break
            yield answers(ready)
            coalescing.sent()
        reader.result()  # a refused batch ends the stream with its status
    finally:
        reader.cancel()
        await served.cancel()


async def serve_unary(
    batches: AsyncIterator[Any],
    unary: Callable[[Any, Any], Awaitable[Any]],
    context: Any,
    answers: Callable[[list[Answer]], Any],
    *,
    method: str,
) -> AsyncGenerator[Any, None]:
    """A servicer's multiplexed method: each call of each batch run by the
    servicer's own `unary` method (`method`) with the stream's context (the
    caller admitted at the stream's opening), answered by `answers` messages;
    the calls in flight are cancelled when the stream ends."""

    async def handle(request: Any) -> Any:
        return await unary(request, context)

    served = serve_calls(batches, checked_calls, handle, answers, method=method)
    async with contextlib.aclosing(served) as ready:
        async for message in ready:
            yield message


def checked_calls(batch: Any) -> Sequence[Any]:
    """A batch's calls (`calls`, each with `call_id`, `request` and
    `traceparent`), their trace contexts checked."""
    for call in batch.calls:
        if call.traceparent:
            tracing.check_traceparent(call.traceparent, "calls.traceparent")
    calls: Sequence[Any] = batch.calls
    return calls


def answers_message(cls: type[Any], answer: type[Any]) -> Callable[[list[Answer]], Any]:
    """The maker of a `cls` message (`answers`: `answer`s with `call_id`,
    `response` and `status`) from ready answers."""

    def make(ready: list[Answer]) -> Any:
        return cls(answers=[answer(call_id=i, response=r, status=s) for i, r, s in ready])

    return make


class _ServedCalls:
    """One stream's calls in flight and the answers not sent yet."""

    def __init__(self, handle: Callable[[Any], Awaitable[Any]], method: str, limit: int) -> None:
        self._handle = handle
        self._method = method
        self._slots = asyncio.Semaphore(limit)
        self._running: dict[int, asyncio.Task[None]] = {}
        self._ready: list[Answer] = []
        self._wake = asyncio.Event()

    async def read(
        self, batches: AsyncIterator[Any], calls_of: Callable[[Any], Sequence[Any]], limit: int
    ) -> None:
        try:
            async for batch in batches:
                calls = calls_of(batch)
                if not 1 <= len(calls) <= limit:
                    raise errors.InvalidArgument(
                        errors.Reason.INVALID_FIELD,
                        f"calls: a batch carries 1 to {limit} calls, not {len(calls)}",
                    )
                for call in calls:
                    await self._slots.acquire()
                    self._start(call)
        finally:
            self._wake.set()

    def _start(self, call: Any) -> None:
        call_id = call.call_id
        if call_id <= 0 or call_id in self._running:
            self._slots.release()
            refusal = errors.InvalidArgument(
                errors.Reason.INVALID_FIELD,
                "call_id: must be 1 or more and not in flight on this stream",
            )
            self._answer((call_id, None, status_proto(refusal).SerializeToString()))
            return
        self._running[call_id] = asyncio.ensure_future(self._run(call))

    async def _run(self, call: Any) -> None:
        start = time.perf_counter()
        span = (
            tracing.start_server_span(self._method, [("traceparent", call.traceparent)])
            if tracing.TRACING.enabled and call.traceparent
            else None
        )
        code, reason = "OK", ""
        try:
            answer: Answer = (call.call_id, await self._handle(call.request), b"")
        except errors.BatonError as exc:
            code, reason = status_code(exc).name, exc.reason
            answer = (call.call_id, None, status_proto(exc).SerializeToString())
        except Exception:  # noqa: BLE001 - the boundary: anything unmapped is INTERNAL
            log.exception("unhandled error", rpc=self._method)
            code, reason = "INTERNAL", errors.Reason.INTERNAL
            internal = errors.Internal(errors.Reason.INTERNAL, "internal error")
            answer = (call.call_id, None, status_proto(internal).SerializeToString())
        finally:
            self._running.pop(call.call_id, None)
            self._slots.release()
        if rpc_metrics.RPC.enabled:
            rpc_metrics.RPC.served(self._method, code, time.perf_counter() - start)
        if span is not None:
            tracing.end_server_span(span, code, reason)
        self._answer(answer)

    def _answer(self, answer: Answer) -> None:
        self._ready.append(answer)
        self._wake.set()

    async def next_answers(
        self, reader: asyncio.Future[None], coalescing: Coalescing
    ) -> list[Answer] | None:
        """The answers ready now (waiting for one, then `coalescing`); None
        once the reader is done and every call is answered."""
        while not self._ready:
            if reader.done() and not self._running:
                return None
            self._wake.clear()
            # Set by each answer and by the reader's end.
            await self._wake.wait()
        await coalescing.gather()
        ready, self._ready = self._ready, []
        return ready

    async def cancel(self) -> None:
        for task in self._running.values():
            task.cancel()
        if self._running:
            await asyncio.wait(list(self._running.values()))
