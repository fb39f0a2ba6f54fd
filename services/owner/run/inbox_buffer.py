"""A run's side of its session's inbox (docs/design.md §3): the entries read and
not processed yet, in seq order, from a server stream from hooks that stays
open while a step runs.

The buffer reports what arrives and decides nothing: the shell (session.py)
waits for arrivals (`arrival`), takes what the rules say it takes
(admission.take), aborts a step that a pushed command may abort, and asks the
departure rules whether a delivery triggers a handoff. For that, the buffer
notes one fact the moment an entry arrives: whether the run was idle then
with nothing pending (`idle_arrival`).
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
from baton_runtime.owner.rules.held import InboxPosition
from baton_runtime.owner.run.spans import RunSpans  # tracing


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
        position: InboxPosition,
        log: structlog.BoundLogger,
        *,
        from_seq: int,
        seed: Sequence[s.InboxEntry] = (),
        spans: RunSpans,  # tracing
    ) -> None:
        """`from_seq`: the inbox position the run starts at; `seed`: entries
        already read (a handoff's trigger, a child's first work), ahead of
        the stream; `position`: what is consumed (a predecessor may have
        consumed entries ahead of `from_seq`: they are skipped)."""
        self._hooks = hooks
        self._spans = spans  # tracing
        for entry in seed:
            spans.arrived(entry)  # tracing
        self._fence = fence
        self._position = position
        self._log = log
        self.pending: collections.deque[s.InboxEntry] = collections.deque(seed)
        self._next_seq = max(from_seq, seed[-1].seq + 1 if seed else 0)
        self._arrived = asyncio.Event()
        self._closed: InboxClosed | None = None
        self._idle = False  # the run said it is idle (`idle_while`)
        # The seq of the last entry that arrived while the run was idle with
        # nothing pending (-1: none yet): the run asks the departure rules
        # whether it triggers a handoff when it takes it.
        self.idle_arrival = -1

    @property
    def next_seq(self) -> int:
        """The seq the next entry to arrive will have."""
        return self._next_seq

    def wake(self) -> None:
        """Make a waiting `arrival` return (a drain was requested)."""
        self._arrived.set()

    def raise_if_closed(self) -> None:
        """Raises InboxClosed once the stream ended for good."""
        if self._closed is not None:
            raise self._closed

    async def arrival(self, within: float | None = None) -> bool:
        """Wait until something arrives (or `wake`, or the stream ends), at
        most `within` seconds (None: no bound); False when the time ran out
        first. Raises InboxClosed when the stream had ended already."""
        self.raise_if_closed()
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), within)
        except TimeoutError:
            return False
        return True

    @contextlib.contextmanager
    def idle_while(self, idle: bool) -> Iterator[None]:
        """While the body runs, an entry arriving with nothing pending is
        noted as an idle arrival (when `idle`)."""
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
        if self._position.consumed(entry.seq):
            return  # consumed ahead of the position, by a predecessor
        self._spans.arrived(entry)  # tracing
        if self._idle and not self.pending:
            self.idle_arrival = entry.seq
        self.pending.append(entry)
