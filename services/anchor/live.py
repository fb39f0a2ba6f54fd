"""Live items of running steps on one anchor replica (docs/design.md "Live
items"): what owners publish (PublishLive), kept in memory only, handed to
the followers that asked for them.

Per session, the replica keeps the step in flight's items (`LIVE_BUFFER_*`:
then the oldest go, and a LIVE_KIND_DROPPED item says how many) so that a
follower connecting mid-step gets them from the start; the step's commit,
or a step run that replaces it, drops them. Each follower has its own
bounded queue: publishing never waits for a follower, and one that reads
too slowly loses its oldest items, then gets a drop marker.

Checked where they enter: a message over its bounds is refused whole
(INVALID_ARGUMENT, ending the stream); an item's text over its bound is cut
(LIVE_TRUNCATED); a batch of an epoch below one the replica has seen for
the session is refused (LIVE_STALE: a successor runs it), and one over the
session's rate is dropped (LIVE_RATE; followers get a drop marker).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids, limits
from baton_runtime.common.bounds import check_range, check_seq
from baton_runtime.common.errors import (
    BatonError,
    FailedPrecondition,
    InvalidArgument,
    Reason,
    ResourceExhausted,
)

# Sessions a replica keeps live items of; one idle this long with no
# follower is forgotten first.
MAX_SESSIONS = 100_000
_IDLE_SECONDS = 60.0
# The sweep runs at most this often (on a publish): it forgets sessions
# idle for _IDLE_SECONDS with no follower, and drops the buffers of any
# session idle that long (a step quiet for a minute keeps its followers,
# not its past items), so a replica holds about what a minute of steps made.
_SWEEP_SECONDS = 10.0
_MAX_ID_CHARS = 128


def check_message(request: pb.PublishLiveRequest) -> None:
    """A PublishLive message within its bounds, each step run well formed
    (INVALID_ARGUMENT otherwise: the stream ends, nothing of it is taken)."""
    if not 1 <= len(request.batches) <= limits.LIVE_MAX_BATCHES:
        raise InvalidArgument(
            Reason.INVALID_FIELD, f"batches: 1 to {limits.LIVE_MAX_BATCHES} a message"
        )
    size = request.ByteSize()
    if size > limits.LIVE_MAX_MESSAGE_BYTES:
        raise InvalidArgument(
            Reason.INVALID_FIELD,
            f"a message of {size} bytes is over {limits.LIVE_MAX_MESSAGE_BYTES}",
        )
    for batch in request.batches:
        check_step(batch.step)
        if not 1 <= len(batch.items) <= limits.LIVE_MAX_ITEMS_PER_BATCH:
            raise InvalidArgument(
                Reason.INVALID_FIELD,
                f"batches.items: 1 to {limits.LIVE_MAX_ITEMS_PER_BATCH} a batch",
            )
        for item in batch.items:
            check_seq(item.offset, "items.offset")
            check_seq(item.dropped, "items.dropped")
            if item.kind not in _KINDS:
                raise InvalidArgument(Reason.INVALID_FIELD, "items.kind: a LiveKind")
            check_range(item.tool_call_index, "items.tool_call_index", limits.MAX_EVENTS_PER_COMMIT)
            _check_short(item.tool_call_id, "items.tool_call_id")
            _check_short(item.tool_name, "items.tool_name")


_KINDS = frozenset(v for v in s.LiveKind.values() if v != s.LIVE_KIND_UNSPECIFIED)


def check_step(step: s.LiveStep) -> None:
    ids.validate_session_id(step.session_id)
    check_seq(step.base_seq, "step.base_seq")
    check_range(step.epoch, "step.epoch", 2**53, 1)
    check_range(step.step, "step.step", 2**31, 1)
    check_range(step.attempt, "step.attempt", 2**31, 1)
    ids.validate_id(step.owner_run_id, "step.owner_run_id")
    _check_short(step.turn_id, "step.turn_id")


def _check_short(value: str, field: str) -> None:
    if len(value) > _MAX_ID_CHARS or "\x00" in value:
        raise InvalidArgument(
            Reason.INVALID_FIELD, f"{field}: at most {_MAX_ID_CHARS} characters, no NUL"
        )


def same_run(a: s.LiveStep, b: s.LiveStep) -> bool:
    """Whether two steps name one step run."""
    return (
        a.base_seq == b.base_seq
        and a.epoch == b.epoch
        and a.attempt == b.attempt
        and a.step == b.step
        and a.turn_id == b.turn_id
        and a.owner_run_id == b.owner_run_id
    )


def _cut(item: s.LiveItem) -> bool:
    """Cut `item`'s text to its bound (on a character boundary); whether it was."""
    raw = item.text.encode()
    if len(raw) <= limits.LIVE_MAX_TEXT_BYTES:
        return False
    item.text = raw[: limits.LIVE_MAX_TEXT_BYTES].decode(errors="ignore")
    item.truncated = True
    return True


def dropped_item(step: s.LiveStep, offset: int, count: int) -> s.LiveBatch:
    """The marker of `count` items of `step` dropped from `offset` on."""
    item = s.LiveItem(offset=offset, kind=s.LIVE_KIND_DROPPED, dropped=count)
    return s.LiveBatch(step=step, items=[item])


class LiveFollower:
    """One follower's queue of live items: bounded in bytes, the oldest
    dropped (then a marker comes first)."""

    def __init__(self, hub: LiveHub, session_id: str, limit: int) -> None:
        self._hub = hub
        self.session_id = session_id
        self._limit = limit
        self._queue: deque[tuple[int, s.LiveBatch]] = deque()
        self._bytes = 0
        # (step run, first offset, count) of the items dropped and not told yet.
        self._dropped: tuple[s.LiveStep, int, int] | None = None
        self.ready = asyncio.Event()

    def put(self, batch: s.LiveBatch) -> None:
        size = batch.ByteSize()
        self._queue.append((size, batch))
        self._bytes += size
        while self._bytes > self._limit and len(self._queue) > 1:
            old_size, old = self._queue.popleft()
            self._bytes -= old_size
            self.drop(old.step, old.items[0].offset, len(old.items))
        self.ready.set()

    def drop(self, step: s.LiveStep, offset: int, count: int) -> None:
        """`count` items of `step` from `offset` will never reach this follower."""
        if self._dropped is not None and same_run(self._dropped[0], step):
            first, total = self._dropped[1], self._dropped[2] + count
            self._dropped = (step, min(first, offset), total)
        else:
            self._dropped = (step, offset, count)
        self.ready.set()

    def take(self) -> list[s.LiveBatch]:
        """Everything waiting (a drop marker first), consecutive batches of
        one step run merged; empty when nothing waits."""
        out: list[s.LiveBatch] = []
        if self._dropped is not None:
            out.append(dropped_item(*self._dropped))
            self._dropped = None
        merged: s.LiveBatch | None = None  # out[-1], when it is this follower's own copy
        while self._queue:
            _, batch = self._queue.popleft()
            if out and same_run(out[-1].step, batch.step):
                # Every follower of the session holds the same batch objects:
                # merge into a copy of this follower's own, never into them.
                if merged is None:
                    merged = s.LiveBatch()
                    merged.CopyFrom(out[-1])
                    out[-1] = merged
                merged.items.extend(batch.items)
            else:
                out.append(batch)
                merged = None
        self._bytes = 0
        self.ready.clear()
        return out

    def close(self) -> None:
        self._hub.unsubscribe(self)


class _Session:
    """One session's live state on this replica."""

    def __init__(self, now: float) -> None:
        self.epoch = 0
        self.step: s.LiveStep | None = None
        self.items: deque[s.LiveItem] = deque()
        self.bytes = 0
        self.dropped: tuple[int, int] | None = None  # (first offset, count) dropped here
        self.followers: set[LiveFollower] = set()
        self.touched = now
        self.tokens = float(2 * limits.LIVE_BATCHES_PER_SECOND)

    def refill(self, now: float) -> None:
        rate = limits.LIVE_BATCHES_PER_SECOND
        self.tokens = min(2.0 * rate, self.tokens + (now - self.touched) * rate)
        self.touched = now

    def keep(self, batch: s.LiveBatch) -> None:
        """Keep `batch` as the step in flight's (a new step run replaces the last)."""
        if self.step is None or not same_run(self.step, batch.step):
            self.step = batch.step
            self.items.clear()
            self.bytes = 0
            self.dropped = None
        for item in batch.items:
            self.items.append(item)
            self.bytes += item.ByteSize()
        while self.items and (
            len(self.items) > limits.LIVE_BUFFER_ITEMS or self.bytes > limits.LIVE_BUFFER_BYTES
        ):
            old = self.items.popleft()
            self.bytes -= old.ByteSize()
            first, count = self.dropped or (old.offset, 0)
            self.dropped = (first, count + 1)

    def buffered(self) -> list[s.LiveBatch]:
        if self.step is None:
            return []
        out = []
        if self.dropped is not None:
            out.append(dropped_item(self.step, *self.dropped))
        if self.items:
            out.append(s.LiveBatch(step=self.step, items=list(self.items)))
        return out

    def supersede(self, head: int) -> None:
        """A commit moved the stream's head to `head`."""
        if self.step is not None and self.step.base_seq < head:
            self.forget_items()

    def forget_items(self) -> None:
        self.step = None
        self.items.clear()
        self.bytes = 0
        self.dropped = None


class LiveHub:
    """The live items of one anchor replica's sessions."""

    def __init__(
        self,
        follower_bytes: int = limits.LIVE_FOLLOWER_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions: dict[str, _Session] = {}
        self._follower_bytes = follower_bytes
        self._clock = clock
        self._swept = clock()

    def publish(self, batch: s.LiveBatch) -> BatonError | None:
        """Take one checked batch (`check_message`); what to tell its owner
        (a refusal, or the cut of items over their bound), or None."""
        step = batch.step
        now = self._clock()
        if now - self._swept > _SWEEP_SECONDS:
            self._sweep(now)
        session = self._session(step.session_id, now)
        if session is None:
            return ResourceExhausted(
                Reason.LIVE_RATE, f"this anchor keeps live items of {MAX_SESSIONS} sessions"
            )
        if step.epoch < session.epoch:
            return FailedPrecondition(
                Reason.LIVE_STALE,
                f"epoch {step.epoch} is below {session.epoch}: a newer run publishes",
            )
        session.refill(now)
        if session.tokens < 1.0:
            for follower in session.followers:
                follower.drop(step, batch.items[0].offset, len(batch.items))
            return ResourceExhausted(
                Reason.LIVE_RATE,
                f"over {limits.LIVE_BATCHES_PER_SECOND} batches a second; dropped",
                retry_after=1.0 / limits.LIVE_BATCHES_PER_SECOND,
            )
        session.tokens -= 1.0
        session.epoch = step.epoch
        cut = sum(_cut(item) for item in batch.items)
        session.keep(batch)
        for follower in session.followers:
            follower.put(batch)
        if cut:
            return InvalidArgument(
                Reason.LIVE_TRUNCATED,
                f"{cut} item(s) over {limits.LIVE_MAX_TEXT_BYTES} bytes of text were cut",
            )
        return None

    def committed(self, session_id: str, head: int) -> None:
        """The session's stream head is `head` (a commit this replica served
        or saw): the items of steps below it are superseded."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.supersede(head)

    def subscribe(self, session_id: str) -> tuple[LiveFollower, list[s.LiveBatch]]:
        """A new follower of the session's live items, and the step in
        flight's items so far (the follower drops those below the head it
        reads)."""
        now = self._clock()
        session = self._session(session_id, now)
        follower = LiveFollower(self, session_id, self._follower_bytes)
        if session is None:
            return follower, []
        session.followers.add(follower)
        return follower, session.buffered()

    def unsubscribe(self, follower: LiveFollower) -> None:
        session = self._sessions.get(follower.session_id)
        if session is not None:
            session.followers.discard(follower)

    def _session(self, session_id: str, now: float) -> _Session | None:
        session = self._sessions.get(session_id)
        if session is not None:
            return session
        if len(self._sessions) >= MAX_SESSIONS:
            self._sweep(now)
            if len(self._sessions) >= MAX_SESSIONS:
                return None
        session = self._sessions[session_id] = _Session(now)
        return session

    def _sweep(self, now: float) -> None:
        """Forget sessions idle for a while with no follower; drop the
        buffers of those idle with followers."""
        self._swept = now
        idle = [
            (sid, session)
            for sid, session in self._sessions.items()
            if now - session.touched > _IDLE_SECONDS
        ]
        for sid, session in idle:
            if session.followers:
                session.forget_items()
            else:
                del self._sessions[sid]

    def sessions(self) -> int:
        return len(self._sessions)


async def with_live(
    hub: LiveHub,
    session_id: str,
    read: Callable[[Callable[[int], None]], AsyncGenerator[list[s.Event], None]],
) -> AsyncGenerator[list[s.Event] | list[s.LiveBatch], None]:
    """A following read's pages (`read(caught_up)`: it calls `caught_up`
    with its cursor when it starts following live) with the session's live
    items among them: once caught up, the step in flight's buffered items,
    then new ones as they come, each page of live items one LiveBatch
    (`[batch]`); never those of a step below the cursor (committed)."""
    follower, buffered = hub.subscribe(session_id)
    cursor = -1  # -1: not caught up yet
    caught = asyncio.Event()

    def caught_up(next_seq: int) -> None:
        nonlocal cursor
        cursor = next_seq
        caught.set()

    pages = read(caught_up)
    next_page: asyncio.Future[list[s.Event]] = asyncio.ensure_future(anext(pages))
    try:
        while True:
            waiter: asyncio.Future[Any] = asyncio.ensure_future(
                follower.ready.wait() if caught.is_set() else caught.wait()
            )
            waits: set[asyncio.Future[Any]] = {next_page, waiter}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if caught.is_set():
                # What waits now, then what came while it was sent (the drop
                # marker too): before a commit the read may have in hand,
                # which supersedes them. Twice at most: a follower of a
                # stream that never pauses still gets its commits.
                for _ in range(2):
                    live, buffered = buffered + follower.take(), []
                    for batch in live:
                        if batch.step.base_seq >= cursor:
                            yield [batch]
            if next_page.done():
                try:
                    page = next_page.result()
                except StopAsyncIteration:
                    return
                if page and caught.is_set():
                    cursor = page[-1].seq + 1
                    hub.committed(session_id, cursor)
                yield page
                next_page = asyncio.ensure_future(anext(pages))
    finally:
        follower.close()
        if not next_page.done():
            next_page.cancel()  # the read ends in its task (then aclose has nothing to do)
            await asyncio.wait([next_page])
        await pages.aclose()
