"""Committing a step through anchor: the step's events, the history
entries it appended and the new snapshot as one fenced transaction, retried
with the identical request while the outcome is uncertain (`commit_step`,
also used by the host's first commits: session.started). `RunCommits` is a
run's side of it: the last commit, what goes with the next, and a commit
that can never succeed (`CommitRefused`: the shell fails the turn)."""

from __future__ import annotations

import time
from collections.abc import Sequence

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
from baton_runtime.owner.rules.held import RunIdentity, SessionState
from baton_runtime.owner.rules.stamping import stamp
from baton_runtime.owner.run.metering import TurnMeter

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
    """Commit events + history entries + snapshot as one fenced txn, stamped
    first (rules/stamping.py: seqs, stamps); returns the snapshot's new
    revision. The txn deletes the inbox entries consumed since
    `consumed_from` (the last committed snapshot's position; None: every
    entry below the snapshot's). Transient failures are retried with the
    identical request (anchor recognises a replay): within the budget of
    `retry.COMMIT`, and while etcd is full (STORE_FULL) until an operator has
    made room, so the step's work is never lost or redone for it."""
    consumed_from = stamp(
        snapshot,
        events,
        deployment_id=identity.deployment_id,
        now=time.time(),
        # The last turn's trace, for GetSession (the process span's, see spans.py).
        trace_id=tracing.current_trace_id(),
        consumed_from=consumed_from,
    )
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
    handoff carries) and the events waiting for the next commit. The shell
    (session.py) calls the upkeep around each commit, and turns a refused
    one into a failed turn."""

    def __init__(
        self,
        anchor: AnchorClient,
        identity: RunIdentity,
        state: SessionState,
        *,
        revision: int | None,
    ) -> None:
        self._anchor = anchor
        self._identity = identity
        self._state = state
        self.revision = revision  # the last committed snapshot's mod revision, when known
        self._committed_snapshot = state.snapshot.SerializeToString()
        # The inbox position of this run's last commit: the next commit
        # deletes the entries consumed since (its first, every one below:
        # also any an older version left behind).
        self._committed_inbox: int | None = None
        self.carry: list[s.Event] = []  # events for the next commit
        self.progressed = False  # a commit of this run succeeded
        self._turns = TurnMeter()

    async def commit(self, events: list[s.Event], close: bool = False) -> None:
        """Commit the carried events, `events` and the state (fenced); raises
        CommitRefused for a commit that can never succeed."""
        state = self._state
        carry, self.carry = self.carry, []
        events[:0] = carry
        context = state.context
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
