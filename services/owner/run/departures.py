"""A run's departures (docs/design.md §6, issue 12), the I/O: handing the
session off to the deployment that accepted a trigger, an operator's drain,
parking it. When each is due the shell (session.py) asks departure_rules.py;
the attempt itself is `HandoffAttempts`' (handoff/attempt.py), which answers
with an `Attempt`: moved, stayed (nothing of it is left), or uncertain (the
run decides it with a fenced commit, `SessionRun._settle_uncertain`).
An attempt that fails retryably fails the run, which starts again from its
last commit.
"""

from __future__ import annotations

import time

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import Aborted, BatonError, Fenced
from baton_runtime.owner.handoff.attempt import Attempt, HandoffAttempts
from baton_runtime.owner.handoff.checkpoint import Checkpoint
from baton_runtime.owner.rules.held import SessionState
from baton_runtime.owner.run.snapshots import lifetime_deadline

DRAIN_RETRY_SECONDS = 2.0


class Departures:
    """Handoff, drain and park attempts of one run."""

    def __init__(
        self,
        state: SessionState,
        hooks: HooksClient,
        log: structlog.BoundLogger,
        *,
        attempts: HandoffAttempts | None,
        drain_to: str,
    ) -> None:
        self._state = state
        self._hooks = hooks
        self._log = log
        self._attempts = attempts  # None: this run never moves its session
        self.drain_to = drain_to  # an operator's drain target ("" = none)
        self._drain_after = 0.0  # monotonic time of the next drain attempt

    # -- drain ---------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """An operator's drain target is set, and this run can move its session."""
        return bool(self.drain_to) and self._attempts is not None

    @property
    def drain_due_at(self) -> float:
        """When the next drain attempt may be made (monotonic seconds)."""
        return self._drain_after

    def request_drain(self, target: str) -> None:
        """The session moves to `target` the next time it is idle."""
        self.drain_to = target
        self._drain_after = 0.0

    async def try_drain(self, checkpoint: Checkpoint) -> Attempt:
        assert self._attempts is not None
        self._drain_after = time.monotonic() + DRAIN_RETRY_SECONDS
        try:
            return await self._attempts.drain(checkpoint, self.drain_to)
        except Fenced:
            raise
        except BatonError as exc:
            self._log.warning("drain attempt failed", reason=exc.reason, error=exc.message)
            if exc.retryable:
                raise  # outcome unknown: run again from the snapshot
            return Attempt.STAYED

    # -- handoff -------------------------------------------------------------------------

    @property
    def can_move(self) -> bool:
        """This run may hand its session off (handoff attempts are set up)."""
        return self._attempts is not None

    async def try_hand_off(self, checkpoint: Checkpoint, entry: s.InboxEntry) -> Attempt:
        """The trigger is the only unprocessed command: try to move the
        session. STAYED (skipped or failed) leaves nothing behind; the
        delivery is then processed here and the signal forgotten."""
        assert self._attempts is not None
        try:
            return await self._attempts.hand_off(checkpoint, entry)
        except Fenced:
            raise
        except BatonError as exc:
            self._log.warning(
                "handoff failed",
                reason=exc.reason,
                error=exc.message,
                inbox_seq=entry.seq,
                to_deployment_id=entry.command.delivery.accepted_deployment_id,
            )
            if exc.retryable:
                raise  # outcome unknown: run again from the snapshot
            return Attempt.STAYED

    # -- parking -------------------------------------------------------------------------

    async def park(self, fence: s.Fence) -> bool:
        """Park the idle session at its consumed inbox position, with its
        lifetime deadline (hooks keeps both in the owner record: whoever
        takes the parked session over wakes it then); False when something
        arrived first (the stream will deliver it)."""
        snapshot = self._state.snapshot
        inbox_next_seq = snapshot.inbox_next_seq
        try:
            await self._hooks.set_parked(fence, True, inbox_next_seq, lifetime_deadline(snapshot))
        except Aborted:
            return False
        self._log.debug("parked", inbox_next_seq=inbox_next_seq)
        return True
