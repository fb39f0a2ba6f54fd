"""How every loop that retries waits: one policy per kind of retry, in one
table.

A `RetryPolicy` is exponential backoff with jitter: the wait before the
n-th retry is `first * multiplier ** (n - 1)`, capped at `cap`, then
shortened by up to `jitter` of itself (so survivors that failed together do
not come back together, and no wait is ever longer than the cap). A policy
may carry a time budget (`budget_seconds`): past it, `Backoff.spent()` says
so and the caller gives up with the error in hand.

What to retry stays with each caller (the errors' own `retryable`, a
reason it knows); how long to wait, how fast to grow and for how long to
try are here. The table below is every such choice Baton makes; a new loop
takes a row or adds one.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff with jitter between `first` and `cap`, optionally within a budget."""

    name: str
    first: float
    """The wait before the first retry (seconds)."""
    cap: float
    """No wait is longer."""
    multiplier: float = 2.0
    jitter: float = 0.2
    """Each wait is shortened by a random fraction of itself, at most this."""
    budget_seconds: float | None = None
    """Give up after this long (`Backoff.spent`); None: retry until told otherwise."""

    def __post_init__(self) -> None:
        if self.first <= 0 or self.cap < self.first:
            raise ValueError(f"retry policy {self.name}: need 0 < first <= cap")
        if self.multiplier < 1:
            raise ValueError(f"retry policy {self.name}: multiplier must be >= 1")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"retry policy {self.name}: jitter must be in [0, 1)")
        if self.budget_seconds is not None and self.budget_seconds <= 0:
            raise ValueError(f"retry policy {self.name}: budget_seconds must be positive")

    def delay(self, retry: int, *, first: float | None = None) -> float:
        """The un-jittered wait before retry number `retry` (1 = the first).
        `first` replaces the policy's first wait for one loop (a restart
        that already waited longer): taken as it is, the later ones capped."""
        if retry < 1:
            raise ValueError("retry counts from 1")
        start = self.first if first is None else first
        if retry == 1:
            return start
        # Exponent bounded: past the cap the value no longer matters.
        return min(start * self.multiplier ** min(retry - 1, 64), self.cap)

    def jittered(self, delay: float, rng: Callable[[], float] = random.random) -> float:
        """`delay` shortened by up to `jitter` of itself."""
        return delay * (1.0 - self.jitter * rng())

    def backoff(
        self,
        *,
        first: float | None = None,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ) -> Backoff:
        """The state of one retry loop under this policy, starting now."""
        return Backoff(self, first=first, rng=rng, clock=clock)


class Backoff:
    """One retry loop: how long to wait next, and whether its budget is spent.

    `wait()` sleeps the next delay; `reset()` after a success brings the
    next wait back to the first (for loops that run for ever, such as a
    stream that reconnects)."""

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        first: float | None = None,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self._first = first
        self._rng = rng
        self._clock = clock
        self._started = clock()
        self.retries = 0

    def next_delay(self) -> float:
        """The wait before the next retry (jittered), counting that retry."""
        self.retries += 1
        delay = self.policy.delay(self.retries, first=self._first)
        return self.policy.jittered(delay, self._rng)

    async def wait(self) -> None:
        await asyncio.sleep(self.next_delay())

    def reset(self) -> None:
        """A success: the next wait is the first again, the budget starts over."""
        self.retries = 0
        self._started = self._clock()

    def spent(self) -> bool:
        """Whether the policy's time budget is used up (never, without one)."""
        budget = self.policy.budget_seconds
        return budget is not None and self._clock() - self._started > budget


# -- the table: every retry Baton makes ------------------------------------------

COMMIT = RetryPolicy("commit", first=0.05, cap=1.0, budget_seconds=30.0)
"""A step's commit through anchor, replayed while its outcome is uncertain."""

STORE_FULL = RetryPolicy("store_full", first=5.0, cap=5.0)
"""A commit while etcd is full: until an operator has made room."""

HANDOFF_CHECKPOINT = RetryPolicy("handoff_checkpoint", first=0.1, cap=2.0)
"""The old owner's fenced commit that decides an uncertain handoff."""

TRANSFER_REPLAY = RetryPolicy("transfer_replay", first=0.05, cap=1.0)
"""The new owner replaying an uncertain Transfer until its answer is definite."""

DELIVERY = RetryPolicy("delivery", first=0.05, cap=2.0)
"""An inbox append for a child or a parent (work, controls, reports)."""

INBOX_STREAM = RetryPolicy("inbox_stream", first=0.05, cap=2.0)
"""A run's inbox stream reconnecting."""

TIMEOUT_DELIVERY = RetryPolicy("timeout_delivery", first=0.1, cap=2.0)
"""A run's lifetime timer appending its timeout command."""

FLEET = RetryPolicy("fleet", first=0.1, cap=2.0)
"""An owner instance registering, its instance and bell streams reconnecting,
its takeover listings and rounds."""

ACTIVATION = RetryPolicy("activation", first=0.2, cap=5.0)
"""Loading a session to run it (wake, takeover, restart)."""

TAKEOVER = RetryPolicy("takeover", first=0.2, cap=5.0)
"""Taking over a session of a dead instance."""

RESTART_TRANSIENT = RetryPolicy("restart_transient", first=0.2, cap=5.0)
"""Restarting a run that failed for a transient reason (never counted)."""

RESTART_FAILED = RetryPolicy("restart_failed", first=0.2, cap=30.0)
"""Restarting a run that failed deterministically (counted by the restart budget)."""

ETCD_WATCH = RetryPolicy("etcd_watch", first=0.2, cap=2.0)
"""An etcd watch resuming after its stream died."""

SEALING = RetryPolicy("sealing", first=0.5, cap=10.0)
"""Anchor's sealing of logs into the object store while the store fails."""

POLICIES: dict[str, RetryPolicy] = {
    p.name: p
    for p in (
        COMMIT,
        STORE_FULL,
        HANDOFF_CHECKPOINT,
        TRANSFER_REPLAY,
        DELIVERY,
        INBOX_STREAM,
        TIMEOUT_DELIVERY,
        FLEET,
        ACTIVATION,
        TAKEOVER,
        RESTART_TRANSIENT,
        RESTART_FAILED,
        ETCD_WATCH,
        SEALING,
    )
}
