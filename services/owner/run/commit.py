"""Committing a step through anchor: the step's events, the history
entries it appended and the new snapshot as one fenced transaction, retried
with the identical request while the outcome is uncertain (`commit_step`,
also used by the host's first commits: session.started). `RunCommits` is a
run's side of it: the last commit, what goes with the next, and a commit
that can never succeed turned into a failed turn."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence

import structlog

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import retry
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.errors import (
    BatonError,
    DeadlineExceeded,
    Fenced,
    InvalidArgument,
    Reason,
    ResourceExhausted,
    Unavailable,
)
from baton_runtime.common.observability import metrics, tracing
from baton_runtime.owner.handoff.checkpoint import Checkpoint
from baton_runtime.owner.rules.held import RunIdentity
from baton_runtime.owner.rules.turns import SessionState
from baton_runtime.owner.run.inbox_buffer import InboxBuffer
from baton_runtime.owner.run.metering import TurnMeter
from baton_runtime.owner.run.upkeep import Upkeep

log = structlog.get_logger("baton.owner.session")

# baton_commits_total{outcome}: ok, fenced, refused (retried failures are not
# outcomes: the identical request goes again).
_COMMIT_OK = metrics.COMMITS.labels("ok")
_COMMIT_FENCED = metrics.COMMITS.labels("fenced")
_COMMIT_REFUSED = metrics.COMMITS.labels("refused")


async def commit_step(
    anchor: AnchorClient,
    identity: RunIdentity,
    snapshot: s.SessionSnapshot,
    events: list[s.Event],
    close: bool = False,
    expected_snapshot_revision: int | None = None,
    history: Sequence[s.ChatMessage] = (),
    consumed_from: int | None = None,
) -> int | None:
    """Commit events + history entries + snapshot as one fenced txn; returns
    the snapshot's new revision. The txn deletes the inbox entries consumed
    since `consumed_from` (the last committed snapshot's position; None:
    every entry below the snapshot's). Transient failures are retried with the
    identical request (anchor recognises a replay): within the budget of
    `retry.COMMIT`, and while etcd is full (STORE_FULL) until an operator has
    made room, so the step's work is never lost or redone for it."""
    for offset, event in enumerate(events):
        event.seq = snapshot.next_event_seq + offset
    snapshot.next_event_seq += len(events)
    snapshot.deployment_id = identity.deployment_id
    if consumed_from is not None:  # (a snapshot rolled back to a refused commit's)
        consumed_from = min(consumed_from, snapshot.inbox_next_seq)
    if tracing.TRACING.enabled:
        # The last turn's trace, for GetSession (the process span's, see spans.py).
        snapshot.last_trace_id = tracing.current_trace_id() or snapshot.last_trace_id
    request = anchor_pb.CommitStepRequest(
        fence=identity.fence,
        events=events,
        snapshot=snapshot,
        close_stream=close,
        expected_snapshot_revision=expected_snapshot_revision,
        history=history,
        consumed_inbox_from=consumed_from,
    )
    if not tracing.TRACING.enabled:
        return await _commit(anchor, request, identity, expected_snapshot_revision)
    attributes: dict[str, str | int | bool] = {
        "baton.session_id": identity.fence.session_id,
        "baton.events": len(events),
    }
    with tracing.span("commit", **attributes):
        return await _commit(anchor, request, identity, expected_snapshot_revision)


async def _commit(
    anchor: AnchorClient,
    request: anchor_pb.CommitStepRequest,
    identity: RunIdentity,
    expected_snapshot_revision: int | None,
) -> int | None:
    backoff = retry.COMMIT.backoff()
    store_full = retry.STORE_FULL.backoff()
    while True:
        try:
            response = await anchor.commit(request)
            _COMMIT_OK.inc()
            return response.revision if expected_snapshot_revision is not None else None
        except Fenced:
            _COMMIT_FENCED.inc()
            raise
        except (Unavailable, DeadlineExceeded) as exc:
            if backoff.spent():
                raise
            log.warning("commit retry", reason=exc.reason, session_id=identity.fence.session_id)
        except ResourceExhausted as exc:
            if exc.reason != Reason.STORE_FULL:
                _COMMIT_REFUSED.inc()
                raise
            log.error(
                "commit waits: etcd is full",
                reason=exc.reason,
                session_id=identity.fence.session_id,
            )
            await store_full.wait()
            continue
        except BatonError:
            _COMMIT_REFUSED.inc()  # invalid, over a limit, finalized, stale
            raise
        await backoff.wait()


class CommitRefused(Exception):
    """A commit that can never succeed as it is (docs/failures.md)."""

    def __init__(
        self, reason: str, message: str, close: bool, events: list[s.Event], carry: list[s.Event]
    ) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.close = close
        self.events = events
        self.carry = carry


class RunCommits:
    """The commits of one run: what it last committed (the checkpoint a
    handoff carries), the events waiting for the next commit, and the upkeep
    around each commit — controls to children before it, retirement and
    reports after it."""

    def __init__(
        self,
        anchor: AnchorClient,
        identity: RunIdentity,
        state: SessionState,
        upkeep: Upkeep,
        inbox: InboxBuffer,
        log: structlog.BoundLogger,
        *,
        revision: int | None,
    ) -> None:
        self._anchor = anchor
        self._identity = identity
        self._state = state
        self._upkeep = upkeep
        self._inbox = inbox
        self._log = log
        self.revision = revision  # the last committed snapshot's mod revision, when known
        self._committed_snapshot = state.snapshot.SerializeToString()
        # The inbox position of this run's last commit: the next commit
        # deletes the entries consumed since (its first, every one below:
        # also any an older version left behind).
        self._committed_inbox: int | None = None
        self.carry: list[s.Event] = []  # events for the next commit
        self.progressed = False  # a commit of this run succeeded
        self._turns = TurnMeter()

    async def commit(
        self, events: list[s.Event], close: bool = False, *, idle_after: bool = True
    ) -> None:
        """Commit `events` with the state (fenced); raises CommitRefused for a
        commit that can never succeed."""
        state = self._state
        carry, self.carry = self.carry, []
        events[:0] = carry
        await self._upkeep.send_controls()
        if close and state.is_child:
            # Finalization is reported before the commit that closes the
            # stream (no run follows it); a repeat is deduplicated.
            await self._upkeep.deliver_reports_now()
        context = state.context
        # A commit that settles the session: a delivery arriving while it is in
        # flight arrives at an idle session (a reader may see the commit, and
        # send, before this run has the answer), so it may trigger a handoff.
        with self._inbox.idle_while(idle_after and not close and not state.turn_open):
            try:
                oversized = context.oversized_entry()
                if oversized:
                    raise InvalidArgument(Reason.HISTORY_ENTRY_TOO_LARGE, oversized)
                self.revision = await commit_step(
                    self._anchor,
                    self._identity,
                    state.snapshot,
                    events,
                    close,
                    self.revision,
                    context.appended,
                    self._committed_inbox,
                )
            except (InvalidArgument, ResourceExhausted) as exc:
                if exc.reason == Reason.STORE_FULL:
                    raise
                raise CommitRefused(exc.reason, exc.message, close, events, carry) from exc
        state.mark_committed()
        self._turns.committed(events)
        self._committed_snapshot = state.snapshot.SerializeToString()
        self._committed_inbox = state.snapshot.inbox_next_seq
        self.progressed = True
        self._upkeep.start_retire()
        self._upkeep.deliver_reports()

    @property
    def delivered_uncommitted(self) -> bool:
        """Reports delivered since the last commit, which still lists them: a
        run that stops now (parks) must commit first, or the next run sends
        them again, and a repeat after the delivery ids' window would be
        appended anew."""
        state = self._state
        outbox = {report.task_delivery_id for report in state.snapshot.parent.outbox}
        return bool(state.committed_reports - outbox)

    async def guarded(self, work: Awaitable[None]) -> None:
        """Run `work`; a commit it makes that can never succeed (too large,
        invalid) fails the turn instead (docs/failures.md)."""
        try:
            await work
        except CommitRefused as refused:
            self._log.warning(
                "commit refused; the turn fails", reason=refused.reason, error=refused.message
            )
            self.carry = refused.carry
            error = s.ErrorDetail(reason=refused.reason, message=refused.message[:500])
            events = self._state.refused(refused.events, refused.close, error)
            await self.commit(events, close=refused.close)

    def checkpoint(self) -> Checkpoint:
        """The last commit, as a handoff carries it."""
        context = self._state.context
        return Checkpoint(
            fence=self._identity.fence,
            revision=self.revision,
            snapshot=self._committed_snapshot,
            context=context.committed_messages(),
            context_bytes=context.committed_log.context_bytes,
        )

    async def decide_uncertain_handoff(self) -> bool:
        """Commit the unchanged snapshot, fenced (compared with the last
        revision): success means the session did not move and cannot move
        on this attempt (the checkpoint revision is gone); FENCED means it
        moved. Anything else decides nothing (the transfer may still land),
        so keep trying: the trigger waits."""
        backoff = retry.HANDOFF_CHECKPOINT.backoff()
        while True:
            try:
                await self.commit([], idle_after=False)
            except Fenced:
                self._log.info("handoff settled: the session moved")
                return True
            except BatonError as exc:
                self._log.warning("deciding commit failed; again", reason=exc.reason)
                await backoff.wait()
                continue
            self._log.info("handoff settled: the session stays; processing here")
            return False
