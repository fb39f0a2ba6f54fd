"""The typed client of anchor (`AnchorService`): its idempotent methods
(retried by gRPC, see `clients.base`) and one call per RPC: commits, snapshots,
session loads, history retirement and event reads."""

from __future__ import annotations

from collections.abc import AsyncIterator

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.anchor.v1 import anchor_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.answers import Committed, LoadedSession
from baton_runtime.common.clients.base import ServiceClient
from baton_runtime.common.clients.channels import DEFAULT_CALL_TIMEOUT
from baton_runtime.common.clients.live import LivePublisher
from baton_runtime.common.errors import Reason, Unavailable
from baton_runtime.common.security.tls import Security
from baton_runtime.common.streams.multiplex_client import Lanes

ANCHOR_SERVICE = anchor_pb.DESCRIPTOR.services_by_name["AnchorService"].full_name


ANCHOR_IDEMPOTENT = frozenset(
    {
        "GetSnapshot",
        "LoadSession",
        "ReadEvents",
        # A retried commit whose first attempt applied is recognised
        # (byte-identical snapshot and first event) and reported as replayed.
        "CommitStep",
        # Deletes the fenced session's entries in a range: a repeat finds
        # fewer (or none) left to delete.
        "RetireHistory",
    }
)


def _events_page(response: anchor_pb.ReadEventsResponse | anchor_pb.EventFeedItem) -> list[s.Event]:
    return list(response.events)


def _live_page(
    response: anchor_pb.ReadEventsResponse | anchor_pb.EventFeedItem,
) -> list[s.Event] | s.LiveBatch:
    """A page of a read with live items: its events, or its LiveBatch."""
    if response.HasField("live"):
        return response.live
    return list(response.events)


def _load_part(response: anchor_pb.LoadSessionResponse) -> anchor_pb.LoadSessionResponse:
    return response


class AnchorClient(ServiceClient):
    service = ANCHOR_SERVICE
    kind = "anchor"
    idempotent = ANCHOR_IDEMPOTENT

    def __init__(
        self,
        target: str,
        timeout: float = DEFAULT_CALL_TIMEOUT,
        *,
        security: Security,
        multiplexed: bool = True,
        event_feed: bool = True,
        max_in_flight: int = 0,
    ) -> None:
        super().__init__(target, timeout, security=security, max_in_flight=max_in_flight)
        self.stub = anchor_pb2_grpc.AnchorServiceStub(self.channel)
        # Event reads ride one FollowEvents stream (`event_feed`).
        self._reads = self._followed(
            "FollowEvents",
            "ReadEvents",
            anchor_pb.FollowEventsRequest,
            anchor_pb.EventFollow,
            anchor_pb.EventFeedGrant,
            anchor_pb.FollowEventsResponse,
        )
        self._reads.supported = event_feed
        # Commits ride one CommitSteps stream per replica (`_multiplexed`),
        # each commit on the next lane; `multiplexed=False` (or anchors that
        # do not serve CommitSteps) commits with one unary CommitStep each.
        self._commits: Lanes[anchor_pb.CommitStepRequest, anchor_pb.CommitStepResponse] = (
            self._multiplexed(
                "CommitSteps",
                anchor_pb.CommitStepsRequest,
                anchor_pb.CommitStepCall,
                anchor_pb.CommitStepsResponse,
            )
            if multiplexed
            else Lanes([])
        )
        # Live items go to every replica (services/common/clients/live.py).
        self.live = LivePublisher(target, security)

    async def close(self) -> None:
        await self.live.close()
        await super().close()

    def publish_live(self, batch: s.LiveBatch) -> None:
        """Send a running step's live items to every anchor replica (never waits)."""
        self.live.publish(batch)

    async def commit(self, request: anchor_pb.CommitStepRequest) -> Committed:
        response = await self._multiplexed_or_unary(
            self._commits,
            request,
            lambda: self._unary(
                "CommitStep", lambda: self.stub.CommitStep(request, timeout=self.timeout)
            ),
        )
        return Committed(response.revision, response.replayed)

    async def snapshot(self, session_id: str) -> s.SessionSnapshot:
        return (await self.snapshot_with_revision(session_id))[0]

    async def snapshot_with_revision(self, session_id: str) -> tuple[s.SessionSnapshot, int]:
        """The snapshot and its key's mod revision (the next commit's expected one)."""
        request = anchor_pb.GetSnapshotRequest(session_id=session_id)
        response = await self._unary(
            "GetSnapshot", lambda: self.stub.GetSnapshot(request, timeout=self.timeout)
        )
        return response.snapshot, response.revision

    async def snapshot_and_horizon(self, session_id: str) -> tuple[s.SessionSnapshot, int]:
        """The snapshot and the stream's retention horizon (the earliest seq
        kept), read together."""
        request = anchor_pb.GetSnapshotRequest(session_id=session_id)
        response = await self._unary(
            "GetSnapshot", lambda: self.stub.GetSnapshot(request, timeout=self.timeout)
        )
        return response.snapshot, response.earliest_seq

    async def load_session(
        self, session_id: str, expected_revision: int | None = None
    ) -> LoadedSession:
        """The last committed snapshot, its revision and the history entries
        of its context (read at the snapshot's revision). With
        `expected_revision`, ABORTED/STALE_CHECKPOINT unless the snapshot is
        still at that revision."""
        request = anchor_pb.LoadSessionRequest(
            session_id=session_id, expected_snapshot_revision=expected_revision
        )
        loaded: LoadedSession | None = None
        async with self._slot("LoadSession"):
            call = self.stub.LoadSession(request, timeout=self.timeout * 3)
            async for part in self._stream("LoadSession", call, _load_part):
                if loaded is None:
                    loaded = LoadedSession(part.snapshot, part.revision, [])
                else:
                    loaded.context.extend(part.history)
        if loaded is None:
            raise Unavailable(Reason.UPSTREAM_UNAVAILABLE, "LoadSession ended without a snapshot")
        return loaded

    async def retire_history(self, fence: s.Fence, below_index: int, from_index: int) -> int:
        """Delete history entries below `below_index`; returns how many."""
        request = anchor_pb.RetireHistoryRequest(
            fence=fence, below_index=below_index, from_index=from_index
        )
        response = await self._unary(
            "RetireHistory", lambda: self.stub.RetireHistory(request, timeout=self.timeout * 3)
        )
        return response.deleted

    def read_events(
        self, session_id: str, start_seq: int = 0, follow: bool = False
    ) -> AsyncIterator[list[s.Event]]:
        """The session's events from `start_seq`, a page at a time; with
        `follow`, new ones as they are committed. A follow on this process'
        FollowEvents stream (`event_feed`), or a ReadEvents call of its own."""
        request = anchor_pb.ReadEventsRequest(
            session_id=session_id, start_seq=start_seq, follow=follow
        )
        return self._followed_or_streamed(
            self._reads, request, "ReadEvents", self.stub.ReadEvents, _events_page
        )

    def follow_events_live(
        self, session_id: str, start_seq: int = 0
    ) -> AsyncIterator[list[s.Event] | s.LiveBatch]:
        """A following read with the session's live items among its pages
        (docs/design.md "Live items"): each page a list of events, or one
        LiveBatch."""
        request = anchor_pb.ReadEventsRequest(
            session_id=session_id, start_seq=start_seq, follow=True, live=True
        )
        return self._followed_or_streamed(
            self._reads, request, "ReadEvents", self.stub.ReadEvents, _live_page
        )
