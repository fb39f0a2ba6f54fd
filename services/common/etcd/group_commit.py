"""Group commit: write transactions issued together ride one etcd request.

Up to `depth` write requests are in flight at once; a write issued while
they are waits, and when one returns, the waiting ones go together as one
request, each a nested sub-transaction with its own compares and branches
(etcd >= 3.3, design.md §10 "group commit"). A lone write never waits.

Why members stay independent:
- etcd evaluates every sub-transaction's compares against the state before
  the request and applies their branches in order, in one revision. So two
  members must not touch the same keys: a member whose keys (compares,
  reads, writes, ranges) overlap a member already in the batch, or one
  waiting before it, waits for a later request. Members of one request are
  then exactly as if each had run alone, in any order.
- One member's failed compares take its failure branch and touch no other.
- A request refused as a whole for what it is (too many operations, too
  large, a key twice: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, OUT_OF_RANGE)
  applied nothing: its members are sent again, each alone.
- A request whose outcome is unknown (timeout, connection lost) fails every
  member with that error, as the member's own request would have.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from aetcd import rpc
from grpc.aio import AioRpcError

from baton_runtime.common.observability import metrics

Send = Callable[[rpc.TxnRequest], Awaitable[rpc.TxnResponse]]
Span = tuple[bytes, bytes]  # [start, end); end b"" is the one key start

# etcd refuses a transaction of more than --max-txn-ops (default 128)
# operations at any one level; a request is also bounded in bytes
# (--max-request-bytes, 1.5 MiB by default).
MAX_MEMBERS = 64
MAX_REQUEST_BYTES = 1 << 20
# Refusals of a request as a whole that apply nothing.
_SPLIT = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
)


def spans(request: rpc.TxnRequest) -> list[Span]:
    """Every key and range a transaction compares, reads or writes,
    nested transactions included."""
    found: list[Span] = [(c.key, c.range_end) for c in request.compare]
    for op in (*request.success, *request.failure):
        kind = op.WhichOneof("request")
        if kind == "request_put":
            found.append((op.request_put.key, b""))
        elif kind == "request_range":
            found.append((op.request_range.key, op.request_range.range_end))
        elif kind == "request_delete_range":
            found.append((op.request_delete_range.key, op.request_delete_range.range_end))
        elif kind == "request_txn":
            found += spans(op.request_txn)
    return found


def _end(span: Span) -> bytes | None:
    """The exclusive end of a span; None: no end (etcd's range_end "\\0")."""
    start, end = span
    if not end:
        return start + b"\x00"
    return None if end == b"\x00" else end


def overlap(a: Span, b: Span) -> bool:
    a_end, b_end = _end(a), _end(b)
    return (a_end is None or b[0] < a_end) and (b_end is None or a[0] < b_end)


@dataclass
class _Member:
    request: rpc.TxnRequest
    size: int
    done: asyncio.Future[rpc.TxnResponse]
    keys: set[bytes] = field(init=False)  # the single keys it touches
    ranges: list[Span] = field(init=False)  # and the ranges

    def __post_init__(self) -> None:
        found = spans(self.request)
        self.keys = {start for start, end in found if not end}
        self.ranges = [span for span in found if span[1]]


class Footprint:
    """The keys and ranges of the members taken so far: single keys in a
    set and a sorted list, ranges (rare: a compare or a read over a prefix)
    in a list, so checking a member costs a lookup per key rather than a
    pass over every span taken."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.sorted: list[bytes] = []
        self.ranges: list[Span] = []

    def touches(self, member: _Member) -> bool:
        for key in member.keys:
            if key in self.keys or any(overlap((key, b""), r) for r in self.ranges):
                return True
        for span in member.ranges:
            if any(overlap(span, r) for r in self.ranges):
                return True
            end = _end(span)
            at = bisect.bisect_left(self.sorted, span[0])
            if at < len(self.sorted) and (end is None or self.sorted[at] < end):
                return True
        return False

    def add(self, member: _Member) -> None:
        for key in member.keys - self.keys:
            bisect.insort(self.sorted, key)
        self.keys |= member.keys
        self.ranges += member.ranges


class GroupCommit:
    """Write transactions, each answered with its own response (its header
    the shared request's), batched as the module doc says."""

    def __init__(
        self,
        send: Send,
        depth: int,
        *,
        wait_limit: float = 5.0,
        max_members: int = MAX_MEMBERS,
        max_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        self._send = send
        self.depth = max(depth, 1)
        # How long a write waits unsent before it fails (TimeoutError, as
        # its own request would have): a waiting write never takes more than
        # its wait and then its own request's timeout.
        self.wait_limit = wait_limit  # (the store's timeout)
        self.max_members = max(max_members, 1)
        self.max_bytes = max_bytes
        self._waiting: list[_Member] = []
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def txn(self, request: rpc.TxnRequest) -> rpc.TxnResponse:
        if self._in_flight < self.depth and not self._waiting:
            self._in_flight += 1
            try:
                return await self._send(request)
            finally:
                self._in_flight -= 1
                self._dispatch()
        loop = asyncio.get_running_loop()
        member = _Member(request, request.ByteSize(), loop.create_future())
        self._waiting.append(member)
        expiry = loop.call_later(self.wait_limit, self._expire, member)
        try:
            # A caller that leaves cancels its own answer only: once sent,
            # its request goes on for the others.
            return await member.done
        except asyncio.CancelledError:
            if member in self._waiting:  # never sent: nothing was written
                self._waiting.remove(member)
            raise
        finally:
            expiry.cancel()

    def _expire(self, member: _Member) -> None:
        """Unsent past the wait limit (etcd is slow or gone): it fails as
        its own request would have, never sent."""
        if member in self._waiting:
            self._waiting.remove(member)
            member.done.set_exception(TimeoutError("waited too long for a grouped etcd request"))

    def _dispatch(self) -> None:
        while self._waiting and self._in_flight < self.depth:
            batch = self._take()
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Member]:
        """The next request's members, in the order they were issued: each
        that fits and touches no key of one taken or passed over before it."""
        batch: list[_Member] = []
        left: list[_Member] = []
        taken, passed = Footprint(), Footprint()
        size = 0
        for member in self._waiting:
            fits = not batch or (
                len(batch) < self.max_members and size + member.size <= self.max_bytes
            )
            if fits and not taken.touches(member) and not passed.touches(member):
                batch.append(member)
                taken.add(member)
                size += member.size
            else:
                left.append(member)
                passed.add(member)
        self._waiting = left
        return batch

    async def _run(self, batch: list[_Member]) -> None:
        try:
            if len(batch) == 1:
                await self._alone(batch[0])
                return
            request = rpc.TxnRequest(success=[rpc.RequestOp(request_txn=m.request) for m in batch])
            try:
                response = await self._send(request)
            except AioRpcError as exc:
                if exc.code() not in _SPLIT:
                    _fail(batch, exc)
                    return
                await asyncio.gather(*(self._alone(m) for m in batch))
                return
            except BaseException as exc:
                _fail(batch, exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            metrics.ETCD_GROUPED_REQUESTS.inc()
            metrics.ETCD_GROUPED_TXNS.inc(len(batch))
            for member, answer in zip(batch, response.responses, strict=True):
                own = answer.response_txn
                own.header.CopyFrom(response.header)
                if not member.done.done():
                    member.done.set_result(own)
        finally:
            self._in_flight -= 1
            self._dispatch()

    async def _alone(self, member: _Member) -> None:
        try:
            response = await self._send(member.request)
        except BaseException as exc:
            _fail([member], exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not member.done.done():
            member.done.set_result(response)

    async def close(self, within: float) -> None:
        """Wait (up to `within` seconds) for the requests in flight: their
        callers are waiting."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=within)


def _fail(batch: list[_Member], exc: BaseException) -> None:
    """Each member fails as its own request would have; a request cut short
    by shutting down is an unknown outcome, like a timeout."""
    if isinstance(exc, asyncio.CancelledError):
        exc = TimeoutError("the etcd request was cancelled (shutting down)")
    for member in batch:
        if not member.done.done():
            member.done.set_exception(exc)
