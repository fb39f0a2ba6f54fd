"""A run's side of its session's inbox (docs/design.md §3): the entries read and
not processed yet, in seq order, from a server stream from hooks that stays
open while a step runs.

Two things happen the moment an entry arrives, before it is buffered or
applied: a cancel, reset or own timeout aborts the running step (when
everything ahead of it can join the turn), and a delivery arriving while
the run is idle is checked once as a handoff trigger (departure_rules.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator, Sequence

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import retry
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError, Fenced
from baton_runtime.owner.rules.turns import SessionState
from baton_runtime.owner.run.departures import Departures
from baton_runtime.owner.run.spans import RunSpans  # tracing
from baton_runtime.owner.run.step import StepRunner


class InboxClosed(Exception):
    """The inbox stream ended for good: the run is fenced, or the stream
    failed with `failure` (which the restart budget judges)."""

    def __init__(self, fenced: bool, failure: BatonError | None = None) -> None:
        super().__init__("fenced" if fenced else f"inbox stream failed: {failure}")
        self.fenced = fenced
        self.failure = failure


class InboxBuffer:
    """The inbox entries one run has read and not processed yet."""

    def __init__(
        self,
        hooks: HooksClient,
        fence: s.Fence,
        state: SessionState,
        departures: Departures,
        step: StepRunner,
        log: structlog.BoundLogger,
        *,
        seed: Sequence[s.InboxEntry] = (),
        revision_known: bool,
        spans: RunSpans,  # tracing
    ) -> None:
        self._hooks = hooks
        self._spans = spans  # tracing
        for entry in seed:
            spans.arrived(entry)  # tracing
        self._fence = fence
        self._state = state
        self._departures = departures
        self._step = step
        self._log = log
        self._revision_known = revision_known  # handoff eligibility needs the revision
        # `seed`: entries already read (a handoff's trigger), ahead of the stream.
        self.pending: collections.deque[s.InboxEntry] = collections.deque(seed)
        self._next_seq = max(state.snapshot.inbox_next_seq, seed[-1].seq + 1 if seed else 0)
        self._arrived = asyncio.Event()
        self._closed: InboxClosed | None = None
        self._idle = False  # waiting for a command with nothing pending and no open turn
        self.trigger_seq = -1  # the delivery found eligible for a handoff at arrival

    def oldest_accepted(self) -> float | None:
        """When the oldest entry read and not processed yet was accepted
        (epoch seconds), or None. Entries set aside while the turn waits for
        the user or a child (a queued message, `next_to_take`) wait for that,
        not for the run: they do not count."""
        index = self._state.next_to_take(self.pending)
        if index is None or not self.pending[index].HasField("accepted_at"):
            return None
        accepted = self.pending[index].accepted_at
        return accepted.seconds + accepted.nanos / 1e9

    def wake(self) -> None:
        """Make a waiting `take` look again (a drain was requested)."""
        self._arrived.set()

    async def take(self, idle_s: float | None) -> s.InboxEntry | None:
        """The next inbox entry the rules take (`SessionState.take`: the
        first, unless the turn waits and a queued message waits for it to
        end); None after `idle_s` with nothing to take (park), or when a
        drain attempt is due. Raises InboxClosed."""
        with self.idle_while(not self._state.turn_open):
            while (entry := self._state.take(self.pending)) is None:
                if self._closed is not None:
                    raise self._closed
                if self._drain_due():
                    return None
                self._arrived.clear()
                wait = idle_s
                retry_in = self._departures.drain_wait(len(self.pending))
                if retry_in is not None:
                    wait = retry_in if wait is None else min(wait, retry_in)
                try:
                    await asyncio.wait_for(self._arrived.wait(), wait)
                except TimeoutError:
                    if not self._drain_due():
                        return None
            return entry

    def _drain_due(self) -> bool:
        return self._departures.drain_due(len(self.pending))

    @contextlib.contextmanager
    def idle_while(self, idle: bool) -> Iterator[None]:
        """While the body runs, a delivery arriving with nothing pending is
        evaluated as a handoff trigger (when `idle`)."""
        self._idle = idle
        try:
            yield
        finally:
            self._idle = False

    async def read(self) -> None:
        """Buffer the inbox in seq order; reconnect on transient errors."""
        backoff = retry.INBOX_STREAM.backoff()
        while True:
            try:
                async for page in self._hooks.stream_inbox(self._fence, self._next_seq):
                    for entry in page:
                        if entry.seq >= self._next_seq:
                            self._arrive(entry)
                    self._arrived.set()
                    backoff.reset()
            except Fenced:
                self._close(fenced=True)
                return
            except BatonError as exc:
                if not exc.retryable:
                    self._log.error("inbox stream failed", reason=exc.reason, error=exc.message)
                    self._close(fenced=False, failure=exc)
                    return
                self._log.warning("inbox stream interrupted; reconnecting", reason=exc.reason)
            await backoff.wait()

    def _close(self, *, fenced: bool, failure: BatonError | None = None) -> None:
        self._closed = InboxClosed(fenced, failure)
        self._arrived.set()

    def offer(self, entry: s.InboxEntry) -> None:
        """An entry appended to this session's inbox by this process (a
        child's work or report): taken now when it is the next one, instead
        of a hop later from the inbox stream, which then skips it."""
        if entry.seq == self._next_seq and self._closed is None:
            self._arrive(entry)
            self._arrived.set()

    def _arrive(self, entry: s.InboxEntry) -> None:
        self._next_seq = entry.seq + 1
        if self._state.consumed(entry.seq):
            return  # consumed ahead of the position, by a predecessor
        self._spans.arrived(entry)  # tracing
        if (
            self._idle
            and not self.pending
            and self._departures.is_trigger(entry, revision_known=self._revision_known)
        ):
            self.trigger_seq = entry.seq
        self.pending.append(entry)
        self._push(entry)

    def _push(self, entry: s.InboxEntry) -> None:
        """Cancel, reset and an own timeout abort the running step at once,
        when every command before them can be admitted into the turn."""
        if self._step.running and self._state.aborts_step(entry, list(self.pending)[:-1]):
            self._step.abort()
