"""The typed client of an owner (`OwnerService`): its idempotent methods
(retried by gRPC, see `clients.base`) and one call per RPC: starting sessions,
handoffs, drains, adoption and resumes."""

from __future__ import annotations

from baton_runtime._proto.baton.owner.v1 import owner_pb2 as owner_pb
from baton_runtime._proto.baton.owner.v1 import owner_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.answers import (
    DrainBlocker,
    DrainReport,
    HandoffAccepted,
    Moved,
    StartedSession,
    Undrained,
)
from baton_runtime.common.clients.base import ServiceClient
from baton_runtime.common.clients.channels import DEFAULT_CALL_TIMEOUT
from baton_runtime.common.security.tls import Security

OWNER_SERVICE = owner_pb.DESCRIPTOR.services_by_name["OwnerService"].full_name


OWNER_IDEMPOTENT = frozenset(
    {
        # A repeat with the same session id finds the session (created=false).
        "StartSession",
        # Sets the same drain target again and answers the progress.
        "DrainSessions",
        # Stops the drain again (answers an empty target).
        "UndrainSessions",
        # One handoff id per (old fence, adopting instance): a repeat replays
        # the same transfer.
        "AdoptSession",
        # A repeat finds the session no longer stalled (resumed = false).
        "ResumeSession",
    }
)


class OwnerClient(ServiceClient):
    service = OWNER_SERVICE
    kind = "owner"
    idempotent = OWNER_IDEMPOTENT

    def __init__(
        self, target: str, timeout: float = DEFAULT_CALL_TIMEOUT, *, security: Security
    ) -> None:
        super().__init__(target, timeout, security=security)
        self.stub = owner_pb2_grpc.OwnerServiceStub(self.channel)

    async def start_session(self, request: owner_pb.StartSessionRequest) -> StartedSession:
        response = await self._unary(
            "StartSession", lambda: self.stub.StartSession(request, timeout=self.timeout)
        )
        return StartedSession(
            response.session_id,
            response.owner_run_id,
            response.created,
            response.inbox_token,
            response.first_command_appended,
        )

    async def accept_handoff(self, request: owner_pb.AcceptHandoffRequest) -> HandoffAccepted:
        response = await self._unary(
            "AcceptHandoff", lambda: self.stub.AcceptHandoff(request, timeout=self.timeout)
        )
        return HandoffAccepted(response.successor, response.fence, response.replayed)

    async def drain_sessions(self, to_deployment_id: str) -> DrainReport:
        request = owner_pb.DrainSessionsRequest(to_deployment_id=to_deployment_id)
        response = await self._unary(
            "DrainSessions", lambda: self.stub.DrainSessions(request, timeout=self.timeout)
        )
        return DrainReport(
            response.deployment_id,
            response.instance_id,
            response.to_deployment_id,
            response.moved,
            response.remaining,
            tuple(DrainBlocker(b.session_id, b.reason, b.detail) for b in response.blockers),
        )

    async def undrain_sessions(self) -> Undrained:
        """Operator: stop this instance's drain (a repeat answers an empty target)."""
        request = owner_pb.UndrainSessionsRequest()
        response = await self._unary(
            "UndrainSessions", lambda: self.stub.UndrainSessions(request, timeout=self.timeout)
        )
        return Undrained(
            response.deployment_id,
            response.instance_id,
            response.was_to_deployment_id,
            response.moved,
            response.held,
        )

    async def adopt_session(self, session_id: str) -> Moved:
        request = owner_pb.AdoptSessionRequest(session_id=session_id)
        response = await self._unary(
            "AdoptSession", lambda: self.stub.AdoptSession(request, timeout=self.timeout)
        )
        return Moved(response.fence, response.replayed)

    async def resume_session(self, session_id: str) -> tuple[bool, s.Fence]:
        """Operator: run a session stalled on this instance again (resumed,
        its fence); resumed is False when it is held here but not stalled."""
        request = owner_pb.ResumeSessionRequest(session_id=session_id)
        response = await self._unary(
            "ResumeSession", lambda: self.stub.ResumeSession(request, timeout=self.timeout)
        )
        return response.resumed, response.fence
