"""Per-channel budgets at the public edge: rates and open streams (pure;
the clock is injected). The sizes every service agrees on are
services/common/limits.py's.

Each channel (tenant) has its own budget of open follow streams, sends per
second and sessions created per minute. A call over a limit is refused with
RESOURCE_EXHAUSTED and RetryInfo before anything is accepted, so nothing is
lost: the gateway retries after the delay. The limits are per ingress
process; N replicas admit up to N times as much (a cluster-wide budget would
need shared state on every call).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from baton_runtime.common.errors import Reason, ResourceExhausted
from baton_runtime.common.observability import metrics


@dataclass(frozen=True)
class ChannelLimits:
    """The budget of one channel; 0 disables a limit."""

    follow_streams: int = 1000
    sends_per_second: float = 200.0
    sessions_per_minute: float = 1200.0
    # Retry delay suggested when the stream limit is hit.
    stream_retry_after: float = 1.0


@dataclass
class TokenBucket:
    """`rate` tokens per second, holding at most `burst`."""

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    updated: float = 0.0

    def take(self, now: float) -> float:
        """0.0 when a token was taken; otherwise seconds until one is due."""
        if self.tokens < 0:
            self.tokens, self.updated = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class ChannelBudget:
    """Admission of sends, creates and follow streams, per channel."""

    def __init__(self, limits: ChannelLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._sends: dict[str, TokenBucket] = {}
        self._creates: dict[str, TokenBucket] = {}
        self._streams: dict[str, int] = {}

    def _take(
        self, buckets: dict[str, TokenBucket], channel: str, per_second: float, burst: float
    ) -> float:
        """Bursts of up to one period's worth (a second of sends, a minute
        of creates), then the steady rate."""
        bucket = buckets.get(channel)
        if bucket is None:
            bucket = buckets[channel] = TokenBucket(rate=per_second, burst=max(1.0, burst))
        return bucket.take(self._clock())

    def admit_send(self, channel: str) -> None:
        rate = self.limits.sends_per_second
        if rate <= 0:
            return
        wait = self._take(self._sends, channel, rate, rate)
        if wait:
            metrics.LIMIT_REFUSALS.labels("sends_per_second").inc()
            raise ResourceExhausted(
                Reason.RATE_LIMITED,
                f"channel {channel} is over its limit of {rate:g} sends per second",
                retry_after=wait,
                limit="sends_per_second",
            )

    def admit_create(self, channel: str) -> None:
        per_minute = self.limits.sessions_per_minute
        if per_minute <= 0:
            return
        wait = self._take(self._creates, channel, per_minute / 60.0, per_minute)
        if wait:
            metrics.LIMIT_REFUSALS.labels("sessions_per_minute").inc()
            raise ResourceExhausted(
                Reason.RATE_LIMITED,
                f"channel {channel} is over its limit of {per_minute:g} new sessions per minute",
                retry_after=wait,
                limit="sessions_per_minute",
            )

    @contextlib.contextmanager
    def follow_stream(self, channel: str) -> Iterator[None]:
        """Hold one of the channel's follow-stream slots for the block."""
        cap = self.limits.follow_streams
        open_now = self._streams.get(channel, 0)
        if cap and open_now >= cap:
            metrics.LIMIT_REFUSALS.labels("follow_streams").inc()
            raise ResourceExhausted(
                Reason.TOO_MANY_STREAMS,
                f"channel {channel} has {open_now} follow streams open; the limit is {cap}",
                retry_after=self.limits.stream_retry_after,
                limit="follow_streams",
            )
        self._streams[channel] = open_now + 1
        try:
            yield
        finally:
            left = self._streams[channel] - 1
            if left:
                self._streams[channel] = left
            else:
                del self._streams[channel]

    def open_streams(self, channel: str) -> int:
        return self._streams.get(channel, 0)
