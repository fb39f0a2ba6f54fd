"""Parked sessions and bells (docs/design.md §5): what an owner instance keeps of
a session it parked — its fence and consumed inbox position, no snapshot,
no stream — and when it wakes it.

A bell (one WatchBells stream per instance, see services/owner/host/fleet.py)
whose inbox head is beyond the consumed position wakes a parked session; a
bell that rings while the session is busy here (its run is parking, it is
loading or being taken over) is remembered and honoured when it lands in
`parked`. A parked session with a lifetime deadline is woken at it, so the
timeout fires while parked. Waking hands the session to the host's
activation (`Activator`), which unparks it, loads its snapshot and runs it
again with the same fence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s


@dataclass(slots=True)
class ParkedSession:
    """All a parked session costs: its fence and consumed inbox position."""

    run_id: str
    epoch: int
    inbox_next_seq: int
    deadline: float = 0.0  # the session-lifetime deadline (unix seconds); 0 = none


class Activator(Protocol):
    """The one thing parking needs of its host (`OwnerHost`): to run a woken
    session again. A protocol rather than a value because a deadline timer
    wakes a session long after the call that parked it returned."""

    def start_activation(
        self, fence: s.Fence, *, unpark: bool = False, delay: float = 0.0
    ) -> None: ...


class Parking:
    """The parked sessions of one owner instance, their bells and deadlines."""

    def __init__(
        self,
        activator: Activator,
        log: structlog.BoundLogger,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._activator = activator
        self._log = log
        self._clock = clock
        self.parked: dict[str, ParkedSession] = {}
        self.bells: dict[str, int] = {}  # bells rung while the session was busy here
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.stopped = False
        self.parks = 0  # sessions parked here so far (services/owner/host/heap.py trims after)

    def stop(self) -> None:
        """Forget every parked session (the instance stops)."""
        self.stopped = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self.parked.clear()
        self.bells.clear()

    def hold(self, session_id: str, parked: ParkedSession, newer_epoch: int = 0) -> None:
        """Keep a session parked; wake it at once if a bell already rang, and
        at its lifetime deadline (so the timeout fires while parked).

        Never over a newer fence (`newer_epoch`: that of a run of the session
        here): a run that parks after this instance took the session over
        again (a later epoch, running or parked) parks a fence that is
        already dead, and holding it would hide the live one (its bells would
        wake the dead fence, which is refused, and nothing would run the
        session again)."""
        held = self.parked.get(session_id)
        if newer_epoch > parked.epoch or (held is not None and held.epoch > parked.epoch):
            self._log.info("stale park ignored", session_id=session_id, epoch=parked.epoch)
            return
        self.unhold(session_id)
        self.parked[session_id] = parked
        self.parks += 1
        if parked.deadline:
            delay = max(0.0, parked.deadline - self._clock())
            self._timers[session_id] = asyncio.get_running_loop().call_later(
                delay, self.wake, session_id
            )
        if self.bells.pop(session_id, -1) > parked.inbox_next_seq:
            self.wake(session_id)

    def ring(self, session_id: str, inbox_head: int, *, busy: bool) -> None:
        """A bell: the session's inbox reached `inbox_head`. Duplicate and
        stale bells (at or below the consumed position) are ignored; `busy`:
        the session is running, loading or being taken over here."""
        parked = self.parked.get(session_id)
        if parked is not None:
            if inbox_head > parked.inbox_next_seq:
                self.wake(session_id)
            return
        if busy:
            # Rung while the run parks (or the session is being loaded):
            # re-checked when it lands in `parked`.
            if inbox_head > self.bells.get(session_id, -1):
                self.bells[session_id] = inbox_head

    def unhold(self, session_id: str) -> ParkedSession | None:
        """Forget a parked session and its deadline timer."""
        parked = self.parked.pop(session_id, None)
        if parked is not None:
            timer = self._timers.pop(session_id, None)
            if timer is not None:
                timer.cancel()
        return parked

    def wake(self, session_id: str) -> None:
        parked = self.unhold(session_id)
        if parked is None or self.stopped:
            return
        fence = s.Fence(session_id=session_id, owner_run_id=parked.run_id, epoch=parked.epoch)
        self._activator.start_activation(fence, unpark=True)
