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
ended with. `StreamedCalls` is the client half: callers await one answer
each, with a deadline; a stream that breaks fails every call in flight on it
(outcome unknown, as for a unary call that lost its answer), and the next
call opens a new one; `Lanes` spreads calls over one such stream per
replica and retries there. A call past its deadline retires its stream too (a
peer that stopped answering holds no later call), and the next call opens a
new stream, which round-robin puts on the next replica.

Only for idempotent methods: `Lanes` retries a call whose stream broke (or
that was answered UNAVAILABLE) on the next replica's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
import structlog
from google.rpc import status_pb2

from baton_runtime.common import errors, rpc_metrics, tracing
from baton_runtime.common.grpc_errors import (
    from_rpc_error,
    from_status_proto,
    status_code,
    status_proto,
)

log = structlog.get_logger("baton.multiplex")

MAX_BATCH_CALLS = 256
MAX_IN_FLIGHT = 256
# A batch's requests stop growing past this many bytes (one bigger request
# goes alone): well under every server's 4 MiB receive limit.
MAX_BATCH_BYTES = 1024 * 1024
# A call whose stream broke (or that was answered UNAVAILABLE): that many
# tries in all over the lanes, as gRPC's retry policy gives an idempotent
# unary call (channels.py: 4 attempts).
ATTEMPTS = 4

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

# (call id, the answer or None, the serialized google.rpc.Status or b"")
Answer = tuple[int, Any, bytes]


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
    # (the caller closes this generator when the client goes away: its
    # finally cancels the calls in flight)
    try:
        while True:
            ready = await served.next_answers(reader)
            if ready is None:
                break
            yield answers(ready)
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

    async def next_answers(self, reader: asyncio.Future[None]) -> list[Answer] | None:
        """The answers ready now (waiting for one); None once the reader is
        done and every call is answered."""
        while not self._ready:
            if reader.done() and not self._running:
                return None
            self._wake.clear()
            # Set by each answer and by the reader's end.
            await self._wake.wait()
        ready, self._ready = self._ready, []
        return ready

    async def cancel(self) -> None:
        for task in self._running.values():
            task.cancel()
        if self._running:
            await asyncio.wait(list(self._running.values()))


# -- the client half ------------------------------------------------------------------


class StreamBroken(errors.Unavailable):
    """The stream under a call broke before its answer: the outcome is unknown."""

    def __init__(self, message: str) -> None:
        super().__init__(errors.Reason.UPSTREAM_UNAVAILABLE, message)


class Unsupported(Exception):
    """The server does not serve the streamed method (an older build)."""


@dataclass(eq=False)
class _Stream:
    """One open stream: its call, the calls in flight on it, what waits to
    be written, and its writer and reader."""

    call: Any
    pending: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    outbox: list[tuple[int, Any, str]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    broken: BaseException | None = None


class StreamedCalls(Generic[_Req, _Resp]):
    """The client half: `call(request)` sends one request on the current
    stream (opening one when there is none) and awaits its answer."""

    def __init__(
        self,
        open_stream: Callable[[], Any],
        make_batch: Callable[[list[tuple[int, _Req, str]]], Any],
        answers_of: Callable[[Any], Iterable[Answer]],
        *,
        target: str,
        method: str,
        max_calls: int = MAX_BATCH_CALLS,
        max_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        self._open = open_stream
        self._make_batch = make_batch
        self._answers_of = answers_of
        self._target = target
        self._method = method
        self._max_calls = max_calls
        self._max_bytes = max_bytes
        self._ids = itertools.count(1)
        self._stream: _Stream | None = None
        self._closed = False
        self.supported = True

    async def call(self, request: _Req, timeout: float) -> _Resp:  # noqa: ASYNC109 - a per-call deadline
        """The answer to `request` (a refusal raises the domain error the
        unary method would). A stream that broke under it raises
        StreamBroken (the outcome is unknown: `Lanes` retries); past
        `timeout`, DeadlineExceeded, and the stream is retired."""
        stream = self._current()
        call_id = next(self._ids)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        stream.pending[call_id] = answer
        stream.outbox.append((call_id, request, tracing.current_traceparent()))
        stream.wake.set()
        try:
            async with asyncio.timeout(timeout):
                response: _Resp = await asyncio.shield(answer)
                return response
        except TimeoutError:
            # A peer that stopped answering must not hold the calls after
            # this one: the next call opens a new stream.
            answer.cancel()
            self._retire(stream, StreamBroken(f"{self._method}: no answer in {timeout:.1f}s"))
            raise errors.DeadlineExceeded(
                errors.Reason.TIMEOUT, f"{self._method}: no answer in {timeout:.1f}s"
            ) from None
        finally:
            stream.pending.pop(call_id, None)
            if answer.done() and not answer.cancelled():
                answer.exception()  # retrieved, also when the caller was cancelled first

    def _current(self) -> _Stream:
        if not self.supported:
            raise Unsupported(self._method)
        if self._closed:
            raise StreamBroken(f"{self._method}: the client closed")
        stream = self._stream
        if stream is None or stream.broken is not None:
            # The stream and its tasks serve every caller: they start in a
            # context of their own, not the first caller's (its log bindings
            # and span would stick to them).
            fresh = contextvars.Context()
            try:
                opened = fresh.run(self._open)
            except Exception as exc:  # noqa: BLE001 - e.g. the channel is closing
                raise StreamBroken(f"{self._method}: cannot open a stream ({exc!r})") from exc
            stream = self._stream = _Stream(opened)
            if rpc_metrics.RPC.enabled:
                rpc_metrics.RPC.opened(self._target, self._method)
            loop = asyncio.get_running_loop()
            stream.tasks = [
                loop.create_task(self._write(stream), context=fresh.copy()),
                loop.create_task(self._read(stream), context=fresh.copy()),
            ]
        return stream

    async def _write(self, stream: _Stream) -> None:
        meter = rpc_metrics.RPC
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                while stream.outbox:
                    batch = self._take(stream.outbox)
                    await stream.call.write(self._make_batch(batch))
                    if meter.enabled:
                        meter.sent_on_stream(self._target, self._method)
        except Exception as exc:  # noqa: BLE001 - any failed write ends the stream
            self._retire(stream, StreamBroken(f"{self._method}: the stream broke ({exc!r})"))

    def _take(self, outbox: list[tuple[int, _Req, str]]) -> list[tuple[int, _Req, str]]:
        """The next batch: up to max_calls requests and max_bytes (at least one)."""
        if len(outbox) == 1:
            return [outbox.pop()]  # the common case: no sizes to add up
        size = 0
        count = 0
        for _, request, _ in outbox:
            size += request.ByteSize()  # type: ignore[attr-defined]
            if count and (count >= self._max_calls or size > self._max_bytes):
                break
            count += 1
        batch = outbox[:count]
        del outbox[:count]
        return batch

    async def _read(self, stream: _Stream) -> None:
        meter = rpc_metrics.RPC
        try:
            while True:
                message = await stream.call.read()
                if message is grpc.aio.EOF:
                    break
                if meter.enabled:
                    meter.received(self._target, self._method)
                for call_id, response, status in self._answers_of(message):
                    answer = stream.pending.get(call_id)
                    if answer is None or answer.done():
                        continue  # past its deadline
                    if status:
                        answer.set_exception(
                            from_status_proto(status_pb2.Status.FromString(status))
                        )
                    else:
                        answer.set_result(response)
            failure: BaseException = StreamBroken(f"{self._method}: the server ended the stream")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                failure = Unsupported(self._method)
            elif exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                failure = StreamBroken(f"{self._method}: the stream broke ({exc.code().name})")
            else:
                failure = from_rpc_error(exc)
        self._retire(stream, failure)

    def _retire(self, stream: _Stream, failure: BaseException) -> None:
        """End `stream`: every call in flight on it fails with `failure`."""
        if stream.broken is not None:
            return
        stream.broken = failure
        if self._stream is stream:
            self._stream = None
        for answer in stream.pending.values():
            if not answer.done():
                answer.set_exception(failure)
        stream.call.cancel()
        for task in stream.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def close(self) -> None:
        self._closed = True
        stream = self._stream
        if stream is not None:
            self._retire(stream, StreamBroken(f"{self._method}: the client closed"))
            await asyncio.gather(*stream.tasks, return_exceptions=True)


class Lanes(Generic[_Req, _Resp]):
    """Calls spread over several `StreamedCalls` (one per replica: each lane's
    stream is opened on its own channel to one address), the next lane for
    each call. A lane whose stream broke, or that answered UNAVAILABLE, is
    passed over for `LANE_PAUSE` seconds and the call tries the next one, up
    to ATTEMPTS tries in all within its deadline (the one retry loop of
    multiplexed calls); a lane whose server does not serve the method is
    dropped (`Unsupported` once none is left)."""

    LANE_PAUSE = 1.0

    def __init__(self, lanes: list[StreamedCalls[_Req, _Resp]]) -> None:
        self._lanes = lanes
        self._down_until = [0.0] * len(lanes)
        self._next = 0

    def __bool__(self) -> bool:
        return bool(self._lanes)

    def _pick(self) -> int:
        now = time.monotonic()
        count = len(self._lanes)
        for step in range(count):
            index = (self._next + step) % count
            if self._down_until[index] <= now:
                break
        else:
            index = self._next % count  # every lane paused: try the next anyway
        self._next = index + 1
        return index

    async def call(self, request: _Req, timeout: float) -> _Resp:  # noqa: ASYNC109
        deadline = time.monotonic() + timeout
        for attempt in range(ATTEMPTS):
            if not self._lanes:
                raise Unsupported("no lane serves the method")
            index = self._pick()
            lane = self._lanes[index]
            try:
                return await lane.call(request, max(0.0, deadline - time.monotonic()))
            except Unsupported:
                del self._lanes[index], self._down_until[index]
                continue
            except (errors.Unavailable, errors.DeadlineExceeded):
                # A broken stream, or an answer of UNAVAILABLE (the replica
                # could not finish the call, e.g. its etcd is unreachable):
                # as gRPC's retry policy retries an idempotent unary call,
                # the next lane tries it.
                self._down_until[index] = time.monotonic() + self.LANE_PAUSE
                if attempt == ATTEMPTS - 1 or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(min(0.05 * 2**attempt, max(0.0, deadline - time.monotonic())))
        raise StreamBroken("every attempt found its stream broken")

    async def close(self) -> None:
        for lane in self._lanes:
            await lane.close()
