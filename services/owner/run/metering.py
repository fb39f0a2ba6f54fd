"""What the owner's metrics read from its runs: turns as their commits
settle them, and, at scrape time, its sessions by state and the age of the
oldest command its runs hold unprocessed (definitions in
services/common/observability/metrics.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.observability import metrics

_OUTCOMES = {
    s.EVENT_KIND_TURN_COMPLETED: metrics.TURNS.labels("completed"),
    s.EVENT_KIND_TURN_CANCELLED: metrics.TURNS.labels("cancelled"),
    s.EVENT_KIND_TURN_FAILED: metrics.TURNS.labels("failed"),
}


def _seconds(stamp: s.Event) -> float:
    return stamp.time.seconds + stamp.time.nanos / 1e9


class TurnMeter:
    """One run's turns, counted when the commit that settles them lands
    (baton_turns_total{outcome}); the duration is observed for turns that
    started in this run (a turn recovered after a crash or moved by a
    handoff has its start elsewhere)."""

    __slots__ = ("_started",)

    def __init__(self) -> None:
        self._started: dict[str, float] = {}

    def committed(self, events: Iterable[s.Event]) -> None:
        for event in events:
            if event.kind == s.EVENT_KIND_TURN_STARTED:
                self._started[event.turn_id] = _seconds(event)
                continue
            counter = _OUTCOMES.get(event.kind)
            if counter is None:
                continue
            counter.inc()
            began = self._started.pop(event.turn_id, None)
            if began is not None:
                metrics.TURN_SECONDS.observe(max(0.0, _seconds(event) - began))


def accepted_time(entry: s.InboxEntry) -> float | None:
    """When `entry` was accepted (epoch seconds), if that is known."""
    if not entry.HasField("accepted_at"):
        return None
    return entry.accepted_at.seconds + entry.accepted_at.nanos / 1e9


def waited(entry: s.InboxEntry) -> None:
    """baton_inbox_wait_seconds: `entry`'s acceptance until now, when its
    run dispatches it (a command a turn admits at a step boundary, behind
    the one that opened it, is not observed)."""
    accepted = accepted_time(entry)
    if accepted is not None:
        metrics.INBOX_WAIT_SECONDS.observe(max(0.0, time.time() - accepted))


class HeldView(Protocol):
    """What `HeldSessions` reads from the host at each scrape (the host,
    sessions.py, is one): the one place each of these is computed."""

    def sessions_by_state(self) -> Mapping[str, Sized]:
        """The sessions held, by state (running, parked, stalled)."""
        ...

    def oldest_pending_accepted(self) -> float | None:
        """The acceptance time (epoch seconds) of the oldest command a run
        has read and not yet taken up, or None."""
        ...

    def draining(self) -> bool:
        """Whether an operator's drain target is set."""
        ...


class HeldSessions(Collector):
    """baton_sessions{state}, baton_inbox_oldest_unconsumed_seconds and
    baton_draining (1 while an operator's drain target is set), computed
    from the host's state when scraped (on the event loop that
    changes them: see metrics_endpoint.MetricsEndpoint).

    What is not read yet (a parked session's bell, a backlog behind the
    inbox page) is not seen in the oldest command's age: hooks' inbox, not
    the owner, holds those."""

    def __init__(self, held: HeldView, clock: Callable[[], float] = time.time) -> None:
        self._held = held
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        sessions = GaugeMetricFamily(
            metrics.SESSIONS,
            "Sessions this instance holds, by state: running (a run is live), parked, "
            "stalled (the restart budget is spent)",
            labels=["state"],
        )
        for state, held in self._held.sessions_by_state().items():
            sessions.add_metric([state], len(held))
        yield sessions
        oldest = self._held.oldest_pending_accepted()
        age = GaugeMetricFamily(
            metrics.INBOX_OLDEST_UNCONSUMED,
            "Age of the oldest command this instance's runs have read and not taken up "
            "(0 when none waits)",
        )
        age.add_metric([], 0.0 if oldest is None else max(0.0, self._clock() - oldest))
        yield age
        draining = GaugeMetricFamily(
            metrics.DRAINING,
            "1 while an operator's drain moves this instance's sessions to another deployment",
        )
        draining.add_metric([], 1.0 if self._held.draining() else 0.0)
        yield draining
