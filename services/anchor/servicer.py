"""AnchorService: translates between protos and the journal."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence

import structlog

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as pb
from baton_runtime._proto.baton.anchor.v1 import anchor_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor import live
from baton_runtime.anchor.journal import Journal, LoadedSnapshot
from baton_runtime.common.bounds import check_seq
from baton_runtime.common.errors import BatonError, InvalidArgument, Reason
from baton_runtime.common.etcd.scope import DeploymentScope
from baton_runtime.common.observability.tracing import check_trace_id
from baton_runtime.common.rpc.interceptor import Context
from baton_runtime.common.rpc.status_map import status_proto
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


# A page of a read: its events, or (a read that asked for live items) one
# LiveBatch.
Page = list[s.Event] | list[s.LiveBatch]


def _event_item(follow_id: int, page: Page | None, end: bytes) -> pb.EventFeedItem:
    if page and isinstance(page[0], s.LiveBatch):
        return pb.EventFeedItem(follow_id=follow_id, live=page[0], end=end)
    return pb.EventFeedItem(follow_id=follow_id, events=page or (), end=end)  # type: ignore[arg-type]


def _event_items(ready: list[feeds.Item]) -> pb.FollowEventsResponse:
    return pb.FollowEventsResponse(items=[_event_item(i, p, e) for i, p, e in ready])


def _note(step: s.LiveStep, exc: BatonError) -> pb.LiveNote:
    return pb.LiveNote(step=step, status=status_proto(exc).SerializeToString())


class AnchorServicer(anchor_pb2_grpc.AnchorServiceServicer):
    """Role checks are the interceptor's; an owner commits to, and retires
    history of, only sessions of its own deployment (`DeploymentScope`)."""

    def __init__(
        self, journal: Journal, scope: DeploymentScope, hub: live.LiveHub | None = None
    ) -> None:
        self._journal = journal
        self._scope = scope
        self._live = hub or live.LiveHub()

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
        if request.events:  # the step's live items are superseded
            self._live.committed(request.fence.session_id, request.events[-1].seq + 1)
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
        async for page in self._event_pages(request):
            if page and isinstance(page[0], s.LiveBatch):
                yield pb.ReadEventsResponse(live=page[0])
            else:
                yield pb.ReadEventsResponse(events=page)  # type: ignore[arg-type]

    async def _event_pages(self, request: pb.ReadEventsRequest) -> AsyncIterator[Page]:
        """The read's pages; with `follow` and `live`, the session's live
        items among them (services/anchor/live.py)."""
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        check_seq(request.start_seq, "start_seq")
        stream = self._journal.events
        if not (request.follow and request.live):
            async for events in stream.read(request.session_id, request.start_seq, request.follow):
                yield events
            return
        pages = live.with_live(
            self._live,
            request.session_id,
            lambda caught_up: stream.read(request.session_id, request.start_seq, True, caught_up),
        )
        async with contextlib.aclosing(pages):
            async for page in pages:
                yield page

    async def PublishLive(
        self, request_iterator: AsyncIterator[pb.PublishLiveRequest], context: Context
    ) -> AsyncIterator[pb.PublishLiveResponse]:
        """Live items from an owner, in memory (services/anchor/live.py):
        answered only with notes of what was refused or cut."""
        async for request in request_iterator:
            live.check_message(request)
            notes = []
            for batch in request.batches:
                note = self._live.publish(batch)
                if note is not None:
                    notes.append(_note(batch.step, note))
            if notes:
                yield pb.PublishLiveResponse(notes=notes)

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
