"""An operator's drain of one owner instance (issue 12): every session held
here moves to the target deployment through the ordinary handoff — running
ones the next time they are idle (each run's departures, departures.py),
parked ones after waking them, DRAIN_CONCURRENCY at a time — and the
progress report of DrainSessions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from typing import Protocol

import structlog

from baton_runtime.common import ids
from baton_runtime.common.clients.answers import DrainBlocker, DrainReport
from baton_runtime.common.errors import InvalidArgument, Reason
from baton_runtime.common.tasks import Background
from baton_runtime.owner.host.parking import Parking

DRAIN_CONCURRENCY = 32  # parked sessions woken at once for a drain
DRAIN_REPORT_BLOCKERS = 50


class RunView(Protocol):
    """What a drain report reads of a running session (a `SessionRun`)."""

    @property
    def pending(self) -> int: ...

    def busy_with(self) -> str:
        """Why the run is not idle ("" when it is)."""
        ...


class Drains:
    """The drain target of one owner instance and the waking of its parked sessions."""

    def __init__(
        self, deployment_id: str, instance_id: str, parking: Parking, log: structlog.BoundLogger
    ) -> None:
        self.deployment_id = deployment_id
        self.instance_id = instance_id
        self.target = ""  # an operator's drain target ("" = not draining)
        self.moved = 0  # sessions moved to it
        self._parking = parking
        self._log = log
        self._slots = asyncio.Semaphore(DRAIN_CONCURRENCY)
        self._waking: set[str] = set()
        self._pump: asyncio.Task[None] | None = None
        self._background = Background()
        self._stopped = False

    async def stop(self) -> None:
        self._stopped = True
        await self._background.cancel_all()

    def start(self, to_deployment_id: str, held: int) -> None:
        """Drain to `to_deployment_id` (a repeat of the same drain changes nothing)."""
        target = ids.validate_deployment_id(to_deployment_id)
        if target == self.deployment_id:
            raise InvalidArgument(
                Reason.INVALID_FIELD, f"deployment {target} cannot be drained to itself"
            )
        if target != self.target:
            self._log.info("drain started", to_deployment_id=target, sessions=held)
            self.target = target
            self.moved = 0

    def cancel(self) -> tuple[str, int]:
        """Stop draining (an operator's undrain): the target it had ("" =
        none) and how many sessions moved to it. The parked sessions are
        left parked; the ones woken for the drain run here."""
        target, moved = self.target, self.moved
        if target:
            self._log.info("drain stopped", to_deployment_id=target, moved=moved)
        self.target = ""
        self.moved = 0
        return target, moved

    def pump(self) -> None:
        """Wake the parked sessions for the drain (in the background)."""
        if self._pump is None or self._pump.done():
            self._pump = self._background.spawn(self._wake_parked(), fresh_context=True)

    async def _wake_parked(self) -> None:
        """A bounded number at a time: each slot is freed when its run ends
        (moved, or anything else)."""
        parked = self._parking.parked
        while self.target and not self._stopped:
            waiting = [sid for sid in parked if sid not in self._waking]
            if not waiting:
                return
            await self._slots.acquire()
            sid = waiting[0]
            if sid not in parked or self._stopped:
                self._slots.release()
                continue
            self._waking.add(sid)
            self._parking.wake(sid)

    def slot_done(self, session_id: str) -> None:
        if session_id in self._waking:
            self._waking.discard(session_id)
            self._slots.release()

    def report(
        self,
        runs: Mapping[str, RunView],
        loading: Collection[str],
        parked: Collection[str],
        stalled: Collection[str],
        last_refusal: Mapping[str, tuple[str, str]],
        held: int,
    ) -> DrainReport:
        """Where the drain stands, and what holds the first sessions back."""
        blockers: list[DrainBlocker] = []

        def blocked(sid: str, reason: str, detail: str) -> None:
            if len(blockers) < DRAIN_REPORT_BLOCKERS:
                blockers.append(DrainBlocker(sid, reason, detail))

        for sid, run in runs.items():
            refusal = last_refusal.get(sid)
            busy = run.busy_with()
            if busy:
                blocked(sid, Reason.SESSION_BUSY, busy)
            elif run.pending:
                blocked(sid, Reason.SESSION_BUSY, f"{run.pending} command(s) to process first")
            elif refusal is not None:
                blocked(sid, refusal[0], refusal[1])
            else:
                blocked(sid, Reason.SESSION_BUSY, "moving")
        for sid in loading:
            blocked(sid, Reason.WAKING, "loading")
        for sid in parked:
            blocked(sid, Reason.WAKING, "parked; woken for the drain")
        for sid in stalled:
            blocked(sid, Reason.STALLED, "the restart budget is spent (session.stalled)")
        return DrainReport(
            deployment_id=self.deployment_id,
            instance_id=self.instance_id,
            to_deployment_id=self.target,
            moved=self.moved,
            remaining=held,
            blockers=tuple(blockers),
        )
