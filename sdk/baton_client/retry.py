"""One retry policy: which failures are retried, how long to wait, and when
to give up.

A call is retried only when its failure is `retryable` (baton_client.errors)
and only when repeating it cannot double anything: reads always, a create with
its request id, a send or control with its delivery id (the clients fill both
in when the caller gives none, so every mutating call is safe to repeat).

Waits grow exponentially with full jitter (AWS's "Exponential Backoff And
Jitter"), never shorter than the server's `retry_after`, and stop at the
first of: `max_attempts`, the call's time `budget`, or an empty client-wide
`RetryBudget` (not for followers, whose reconnects are bounded by
their own policy): a client against a failing Baton retries at a bounded
rate, so it does not multiply the load it is failing under.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from baton_client.errors import BatonError


@dataclass(frozen=True)
class RetryPolicy:
    """How a failed call is retried. `RetryPolicy(max_attempts=1)` never retries."""

    #: Attempts per call, the first included.
    max_attempts: int = 8
    #: The first wait's ceiling, in seconds.
    initial_backoff: float = 0.2
    #: No wait is longer than this.
    max_backoff: float = 5.0
    multiplier: float = 2.0
    #: Seconds from a call's first attempt after which it is not retried
    #: (a follower counts from its last progress).
    budget: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_backoff < 0 or self.max_backoff < self.initial_backoff:
            raise ValueError("need 0 <= initial_backoff <= max_backoff")
        if self.multiplier < 1 or self.budget < 0:
            raise ValueError("need multiplier >= 1 and budget >= 0")

    def backoff(self, retry: int, rng: Callable[[], float] = random.random) -> float:
        """The wait before retry number `retry` (1 = the first retry)."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        return ceiling * rng()


@dataclass
class RetryBudget:
    """Client-wide retry tokens (as Finagle's RetryBudget): each retry spends
    one; tokens come back at `per_second` and with `ratio` of one per
    success, up to `capacity` (the bucket starts full). One caller riding
    out an ingress restart never runs dry; a thousand failing calls at once
    retry at about `per_second`, not a thousand times over."""

    capacity: float = 20.0
    per_second: float = 5.0
    ratio: float = 0.2
    clock: Callable[[], float] = time.monotonic
    _tokens: float = field(init=False)
    _at: float = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._tokens = self.capacity
        self._at = self.clock()

    def _refill(self, extra: float = 0.0) -> None:
        now = self.clock()
        gained = (now - self._at) * self.per_second + extra
        self._tokens = min(self.capacity, self._tokens + gained)
        self._at = now

    def spend(self) -> bool:
        """Take a token for a retry; False when there is none left."""
        with self._lock:
            self._refill()
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True

    def earn(self) -> None:
        with self._lock:
            self._refill(self.ratio)


class Attempts:
    """The retry decisions of one call (or one follower since its last
    progress), shared by the sync and the asyncio clients."""

    def __init__(
        self,
        policy: RetryPolicy,
        budget: RetryBudget | None,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._policy = policy
        self._budget = budget
        self._clock = clock
        self._rng = rng
        self._started = clock()
        self._failures = 0

    def remaining(self) -> float:
        """Seconds left of the call's time budget."""
        return max(0.0, self._policy.budget - (self._clock() - self._started))

    def progressed(self) -> None:
        """The call made progress (a follower got events): start afresh."""
        self._started = self._clock()
        self._failures = 0
        self.succeeded()

    def succeeded(self) -> None:
        if self._budget is not None:
            self._budget.earn()

    def next_wait(self, error: BatonError) -> float | None:
        """Seconds to wait before retrying after `error`; None: give up."""
        self._failures += 1
        if not error.retryable or self._failures >= self._policy.max_attempts:
            return None
        wait = max(self._policy.backoff(self._failures, self._rng), error.retry_after or 0.0)
        if wait >= self.remaining():
            return None
        if self._budget is not None and not self._budget.spend():
            return None
        return wait
