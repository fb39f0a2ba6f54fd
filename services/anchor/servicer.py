"""AnchorService: translates between protos and the journal."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence

import structlog

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as pb
from baton_runtime._proto.baton.anchor.v1 import anchor_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.journal import Journal, LoadedSnapshot
from baton_runtime.common.bounds import check_seq
from baton_runtime.common.errors import InvalidArgument, Reason
from baton_runtime.common.etcd.scope import DeploymentScope
from baton_runtime.common.observability.tracing import check_trace_id
from baton_runtime.common.rpc.interceptor import Context
from baton_runtime.common.security import identity
from baton_runtime.common.streams import feeds, multiplex

_LOAD_MESSAGE_BYTES = 2 * 1024 * 1024


def _chunks(items: Sequence[bytes], limit: int) -> Iterator[Sequence[bytes]]:
    """Consecutive runs of `items` of at most `limit` bytes (at least one item)."""
    start, size = 0, 0
    for index, raw in enumerate(items):
        if index > start and size + len(raw) > limit:
            yield items[start:index]
            start, size = index, 0
        size += len(raw)
    if start < len(items):
        yield items[start:]


COMMIT_STEP = f"/{pb.DESCRIPTOR.services_by_name['AnchorService'].full_name}/CommitStep"


_COMMIT_ANSWERS = multiplex.answers_message(pb.CommitStepsResponse, pb.CommitStepAnswer)
READ_EVENTS = COMMIT_STEP.replace("/CommitStep", "/ReadEvents")


def _event_items(ready: list[feeds.Item]) -> pb.FollowEventsResponse:
    return pb.FollowEventsResponse(
        items=[pb.EventFeedItem(follow_id=i, events=p or (), end=e) for i, p, e in ready]
    )


class AnchorServicer(anchor_pb2_grpc.AnchorServiceServicer):
    """Role checks are the interceptor's; an owner commits to, and retires
    history of, only sessions of its own deployment (`DeploymentScope`)."""

    def __init__(self, journal: Journal, scope: DeploymentScope) -> None:
        self._journal = journal
        self._scope = scope

    async def CommitStep(
        self, request: pb.CommitStepRequest, context: Context
    ) -> pb.CommitStepResponse:
        if not request.HasField("fence") or not request.HasField("snapshot"):
            raise InvalidArgument(Reason.MISSING_FIELD, "fence and snapshot are required")
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        check_seq(request.fence.epoch, "fence.epoch")
        if request.HasField("expected_snapshot_revision"):
            check_seq(request.expected_snapshot_revision, "expected_snapshot_revision")
        if request.HasField("consumed_inbox_from"):
            check_seq(request.consumed_inbox_from, "consumed_inbox_from")
        check_trace_id(request.snapshot.last_trace_id, "snapshot.last_trace_id")
        # The scope is checked inside the commit's own txn (no read first).
        scope = self._scope.pending(identity.current(), request.fence)
        revision, replayed = await self._journal.commit(
            request.fence,
            request.events,
            request.snapshot,
            request.close_stream,
            request.expected_snapshot_revision
            if request.HasField("expected_snapshot_revision")
            else None,
            request.history,
            request.consumed_inbox_from if request.HasField("consumed_inbox_from") else None,
            scope=scope,
        )
        return pb.CommitStepResponse(revision=revision, replayed=replayed)

    def CommitSteps(
        self, request_iterator: AsyncIterator[pb.CommitStepsRequest], context: Context
    ) -> AsyncIterator[pb.CommitStepsResponse]:
        """CommitStep's commits multiplexed (services/common/streams/multiplex.py):
        each one checked and committed exactly as CommitStep does it."""
        return multiplex.serve_unary(
            request_iterator, self.CommitStep, context, _COMMIT_ANSWERS, method=COMMIT_STEP
        )

    async def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: Context
    ) -> pb.GetSnapshotResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        snapshot, revision, horizon = await self._journal.snapshot_and_horizon(request.session_id)
        return pb.GetSnapshotResponse(snapshot=snapshot, revision=revision, earliest_seq=horizon)

    async def ReadEvents(
        self, request: pb.ReadEventsRequest, context: Context
    ) -> AsyncIterator[pb.ReadEventsResponse]:
        async for events in self._event_pages(request):
            yield pb.ReadEventsResponse(events=events)

    async def _event_pages(self, request: pb.ReadEventsRequest) -> AsyncIterator[list[s.Event]]:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        check_seq(request.start_seq, "start_seq")
        async for events in self._journal.events.read(
            request.session_id, request.start_seq, request.follow
        ):
            yield events

    def FollowEvents(
        self, request_iterator: AsyncIterator[pb.FollowEventsRequest], context: Context
    ) -> AsyncIterator[pb.FollowEventsResponse]:
        """ReadEvents' streams multiplexed (services/common/streams/feeds.py): each
        follow served exactly as ReadEvents serves it."""
        return feeds.serve_follows(
            request_iterator, self._event_pages, _event_items, method=READ_EVENTS
        )

    async def LoadSession(
        self, request: pb.LoadSessionRequest, context: Context
    ) -> AsyncIterator[pb.LoadSessionResponse]:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        expected = (
            check_seq(request.expected_snapshot_revision, "expected_snapshot_revision")
            if request.HasField("expected_snapshot_revision")
            else None
        )
        async for part in self._journal.load(request.session_id, expected):
            if isinstance(part, LoadedSnapshot):
                yield pb.LoadSessionResponse(snapshot=part.snapshot, revision=part.revision)
            else:
                for chunk in _chunks(part, _LOAD_MESSAGE_BYTES):
                    yield pb.LoadSessionResponse(
                        history=[s.ChatMessage.FromString(raw) for raw in chunk]
                    )

    async def RetireHistory(
        self, request: pb.RetireHistoryRequest, context: Context
    ) -> pb.RetireHistoryResponse:
        if not request.HasField("fence"):
            raise InvalidArgument(Reason.MISSING_FIELD, "fence is required")
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        check_seq(request.fence.epoch, "fence.epoch")
        check_seq(request.below_index, "below_index")
        check_seq(request.from_index, "from_index")
        await self._scope.check(identity.current(), request.fence)
        deleted = await self._journal.retire_history(
            request.fence, request.below_index, request.from_index
        )
        return pb.RetireHistoryResponse(retired_below=request.below_index, deleted=deleted)
