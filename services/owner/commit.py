"""Committing a step through anchor: the step's events, the history
entries it appended and the new snapshot as one fenced transaction, retried
with the identical request while the outcome is uncertain. Used by every
run's commits (`SessionRun._commit`) and by the host's first commits
(session.started)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton.session.v1 import session_pb2 as s
from services.common import metrics, tracing
from services.common.clients import AnchorClient
from services.common.errors import (
    BatonError,
    DeadlineExceeded,
    Fenced,
    Reason,
    ResourceExhausted,
    Unavailable,
)
from services.owner.held import RunIdentity

log = structlog.get_logger("baton.owner.session")

COMMIT_RETRY_SECONDS = 30.0
# baton_commits_total{outcome}: ok, fenced, refused (retried failures are not
# outcomes: the identical request goes again).
_COMMIT_OK = metrics.COMMITS.labels("ok")
_COMMIT_FENCED = metrics.COMMITS.labels("fenced")
_COMMIT_REFUSED = metrics.COMMITS.labels("refused")
STORE_FULL_RETRY_MAX_SECONDS = 5.0


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
    identical request (anchor recognises a replay): for COMMIT_RETRY_SECONDS,
    and while etcd is full (STORE_FULL) until an operator has made room, so
    the step's work is never lost or redone for it."""
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
    loop = asyncio.get_running_loop()
    deadline = loop.time() + COMMIT_RETRY_SECONDS
    backoff = 0.05
    while True:
        try:
            response = await anchor.commit(request)
            _COMMIT_OK.inc()
            return response.revision if expected_snapshot_revision is not None else None
        except Fenced:
            _COMMIT_FENCED.inc()
            raise
        except (Unavailable, DeadlineExceeded) as exc:
            if loop.time() > deadline:
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
            await asyncio.sleep(STORE_FULL_RETRY_MAX_SECONDS)
            continue
        except BatonError:
            _COMMIT_REFUSED.inc()  # invalid, over a limit, finalized, stale
            raise
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 1.0)
