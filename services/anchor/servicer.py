"""AnchorService: translates between protos and the journal."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from baton.anchor.v1 import anchor_pb2 as pb
from baton.anchor.v1 import anchor_pb2_grpc
from services.anchor.journal import Journal
from services.common.errors import InvalidArgument, Reason


class AnchorServicer(anchor_pb2_grpc.AnchorServiceServicer):
    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    async def CommitStep(
        self, request: pb.CommitStepRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitStepResponse:
        if not request.HasField("fence") or not request.HasField("snapshot"):
            raise InvalidArgument(Reason.MISSING_FIELD, "fence and snapshot are required")
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        revision, replayed = await self._journal.commit(
            request.fence,
            request.events,
            request.snapshot,
            request.close_stream,
            request.expected_snapshot_revision
            if request.HasField("expected_snapshot_revision")
            else None,
        )
        return pb.CommitStepResponse(revision=revision, replayed=replayed)

    async def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetSnapshotResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        snapshot, revision = await self._journal.snapshot(request.session_id)
        return pb.GetSnapshotResponse(snapshot=snapshot, revision=revision)

    async def ReadEvents(
        self, request: pb.ReadEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ReadEventsResponse]:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        async for events in self._journal.read(
            request.session_id, request.start_seq, request.follow
        ):
            yield pb.ReadEventsResponse(events=events)
