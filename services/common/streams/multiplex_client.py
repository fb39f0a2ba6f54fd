"""The client half of calls multiplexed over one long-lived bidirectional
stream (the server half and the protocol are services/common/streams/multiplex.py).

`StreamedCalls`: callers await one answer each, with a deadline; a stream
that breaks fails every call in flight on it (outcome unknown, as for a
unary call that lost its answer), and the next call opens a new one. A call
past its deadline retires its stream too when nothing was answered on it
since the call was sent (a peer that stopped answering holds no later
call); one slow call on a stream that answers the others fails alone.
`Lanes` spreads calls over one such stream per replica and retries a call
whose stream broke (or that was answered UNAVAILABLE) on the next
replica's stream: only for idempotent methods.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
import structlog
from google.rpc import status_pb2

from baton_runtime.common import errors
from baton_runtime.common.observability import rpc_metrics, tracing
from baton_runtime.common.rpc.status_map import from_rpc_error, from_status_proto
from baton_runtime.common.streams.multiplex import (
    MAX_BATCH_BYTES,
    MAX_BATCH_CALLS,
    Answer,
    Coalescing,
)

log = structlog.get_logger("baton.multiplex")

# A call whose stream broke (or that was answered UNAVAILABLE): that many
# tries in all over the lanes, as gRPC's retry policy gives an idempotent
# unary call (channels.py: 4 attempts).
ATTEMPTS = 4

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class StreamBroken(errors.Unavailable):
    """The stream under a call broke before its answer: the outcome is unknown."""

    def __init__(self, message: str) -> None:
        super().__init__(errors.Reason.UPSTREAM_UNAVAILABLE, message)


class Unsupported(Exception):
    """The server does not serve the streamed method (an older build)."""


def stream_failure(exc: grpc.aio.AioRpcError, method: str) -> BaseException:
    """What the calls on a stream that ended with `exc` fail with: Unsupported
    (the server does not serve `method`), StreamBroken (UNAVAILABLE,
    CANCELLED, or any status gRPC made rather than a Baton service, such as
    a message over the size limit: the outcome is unknown, and none of the
    callers sharing the stream caused it), or the domain error it carried."""
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return Unsupported(method)
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return StreamBroken(f"{method}: the stream broke ({exc.code().name})")
    failure = from_rpc_error(exc)
    if failure.reason == errors.Reason.TRANSPORT_FAILED:
        return StreamBroken(f"{method}: the stream broke ({exc.code().name}: {failure.message})")
    return failure


@dataclass(eq=False)
class SharedStream:
    """One open stream that many callers share: its call, the event that
    wakes its writer, its writer and reader tasks, and why it broke."""

    call: Any
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    broken: BaseException | None = None


_S = TypeVar("_S", bound=SharedStream)


class SharedStreamClient(Generic[_S]):
    """The client of one long-lived stream shared by many callers (calls
    multiplexed here, follows in feed_client.py): opened at first use and
    again after it broke, each time in a context of its own (not the first
    caller's: its log bindings and span would stick to the stream's tasks),
    with a writer and a reader task; retired with the failure every caller
    on it gets. `supported` is False once the server turned out not to
    serve the method."""

    def __init__(self, open_stream: Callable[[], Any], *, target: str, method: str) -> None:
        self._open = open_stream
        self._target = target
        self._method = method
        self._stream: _S | None = None
        self._closed = False
        self.supported = True

    def _new(self, call: Any) -> _S:
        raise NotImplementedError

    async def _write(self, stream: _S) -> None:
        raise NotImplementedError

    async def _read(self, stream: _S) -> None:
        raise NotImplementedError

    def _fail_all(self, stream: _S, failure: BaseException) -> None:
        """Every caller on `stream` fails with `failure`."""
        raise NotImplementedError

    def _current(self) -> _S:
        if not self.supported:
            raise Unsupported(self._method)
        if self._closed:
            raise StreamBroken(f"{self._method}: the client closed")
        stream = self._stream
        if stream is None or stream.broken is not None:
            fresh = contextvars.Context()
            try:
                opened = fresh.run(self._open)
            except Exception as exc:  # noqa: BLE001 - e.g. the channel is closing
                raise StreamBroken(f"{self._method}: cannot open a stream ({exc!r})") from exc
            stream = self._stream = self._new(opened)
            if rpc_metrics.RPC.enabled:
                rpc_metrics.RPC.opened(self._target, self._method)
            loop = asyncio.get_running_loop()
            stream.tasks = [
                loop.create_task(self._write(stream), context=fresh.copy()),
                loop.create_task(self._read(stream), context=fresh.copy()),
            ]
        return stream

    def _ended(self, stream: _S, exc: grpc.aio.AioRpcError | None) -> None:
        """The reader saw `stream` end (by the server when `exc` is None)."""
        if exc is None:
            failure: BaseException = StreamBroken(f"{self._method}: the server ended the stream")
        else:
            failure = stream_failure(exc, self._method)
            self.supported = not isinstance(failure, Unsupported)
        self._retire(stream, failure)

    def _retire(self, stream: _S, failure: BaseException) -> None:
        """End `stream`: every caller on it fails with `failure`."""
        if stream.broken is not None:
            return
        stream.broken = failure
        if self._stream is stream:
            self._stream = None
        self._fail_all(stream, failure)
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


@dataclass(eq=False)
class _Stream(SharedStream):
    """One open stream of calls: the calls in flight on it, what waits to
    be written, and when the last answer came."""

    pending: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    outbox: list[tuple[int, Any, str]] = field(default_factory=list)
    answered_at: float = 0.0  # monotonic: when the last answer arrived


class StreamedCalls(SharedStreamClient[_Stream], Generic[_Req, _Resp]):
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
        super().__init__(open_stream, target=target, method=method)
        self._make_batch = make_batch
        self._answers_of = answers_of
        self._max_calls = max_calls
        self._max_bytes = max_bytes
        self._ids = itertools.count(1)

    async def call(self, request: _Req, timeout: float) -> _Resp:  # noqa: ASYNC109 - a per-call deadline
        """The answer to `request` (a refusal raises the domain error the
        unary method would). A stream that broke under it raises
        StreamBroken (the outcome is unknown: `Lanes` retries); past
        `timeout`, DeadlineExceeded, and the stream is retired unless it
        answered another call meanwhile."""
        stream = self._current()
        call_id = next(self._ids)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        stream.pending[call_id] = answer
        stream.outbox.append((call_id, request, tracing.current_traceparent()))
        stream.wake.set()
        sent_at = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                response: _Resp = await asyncio.shield(answer)
                return response
        except TimeoutError:
            answer.cancel()
            if stream.answered_at < sent_at:
                # A peer that stopped answering must not hold the calls after
                # this one: the next call opens a new stream. (One that
                # answered others meanwhile is alive: only this call was slow,
                # and the calls beside it keep their stream.)
                self._retire(stream, StreamBroken(f"{self._method}: no answer in {timeout:.1f}s"))
            raise errors.DeadlineExceeded(
                errors.Reason.TIMEOUT, f"{self._method}: no answer in {timeout:.1f}s"
            ) from None
        finally:
            stream.pending.pop(call_id, None)
            if answer.done() and not answer.cancelled():
                answer.exception()  # retrieved, also when the caller was cancelled first

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
                while stream.outbox:
                    batch = self._take(stream.outbox)
                    await stream.call.write(self._make_batch(batch))
                    coalescing.sent()
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
                stream.answered_at = time.monotonic()
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
        except grpc.aio.AioRpcError as exc:
            self._ended(stream, exc)
            return
        self._ended(stream, None)

    def _fail_all(self, stream: _Stream, failure: BaseException) -> None:
        for answer in stream.pending.values():
            if not answer.done():
                answer.set_exception(failure)


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
