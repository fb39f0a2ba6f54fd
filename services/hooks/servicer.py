"""HookRegistryService, thin: each RPC checks its request (required fields,
the caller's deployment, consent beyond its role: services/hooks/consent.py),
calls one room (services/hooks/rooms.py) and maps domain values to its reply
(services/hooks/replies.py). Errors are domain values, mapped to gRPC status
by the one table (services/common/rpc/status_map.py, in the interceptor)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import structlog

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as pb
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.bounds import MAX_TIMESTAMP_SECONDS, check_range, check_seq
from baton_runtime.common.errors import InvalidArgument, Reason
from baton_runtime.common.etcd.keys import AgentLabel
from baton_runtime.common.rpc.interceptor import Context
from baton_runtime.common.security import identity
from baton_runtime.common.security.identity import Role
from baton_runtime.common.streams import feeds, multiplex
from baton_runtime.hooks.claims import NewSession
from baton_runtime.hooks.replies import (
    channel_sessions_reply,
    deployment_info,
    describe_reply,
    instance_info,
    owned_page_reply,
    owner_fence,
    owner_identity,
)
from baton_runtime.hooks.rooms import HookRooms
from baton_runtime.hooks.transfer import TransferRequest

RESUME_HOOK = f"/{pb.DESCRIPTOR.services_by_name['HookRegistryService'].full_name}/ResumeHook"
_RESUME_ANSWERS = multiplex.answers_message(pb.ResumeHooksResponse, pb.ResumeHookAnswer)
STREAM_INBOX = RESUME_HOOK.replace("/ResumeHook", "/StreamInbox")


def _inbox_items(ready: list[feeds.Item]) -> pb.FollowInboxesResponse:
    return pb.FollowInboxesResponse(
        items=[pb.InboxFeedItem(follow_id=i, entries=p or (), end=e) for i, p, e in ready]
    )


def _require_fence(fence: s.Fence, present: bool) -> None:
    if not present:
        raise InvalidArgument(Reason.MISSING_FIELD, "fence is required")
    check_seq(fence.epoch, "fence.epoch")


def _bind_fence(fence: s.Fence) -> None:
    structlog.contextvars.bind_contextvars(session_id=fence.session_id, run_id=fence.owner_run_id)


def _tenant_channel(channel: str) -> str:
    """The channel a call addresses tokens as. Only internal callers (owners,
    or anyone in plaintext mode) may leave it empty, which addresses every
    channel; an ingress always names the tenant it authenticated."""
    if not channel and not identity.current().internal:
        raise InvalidArgument(Reason.MISSING_FIELD, "channel is required")
    return channel


def _transfer_request(request: pb.TransferRequest) -> TransferRequest:
    """The call as the transfer room takes it (None: a message left out)."""
    return TransferRequest(
        handoff_id=request.handoff_id,
        expected=request.expected if request.HasField("expected") else None,
        expected_owner=request.expected_owner if request.HasField("expected_owner") else None,
        successor=request.successor if request.HasField("successor") else None,
        hooks=tuple(request.hooks),
        trigger_seq=request.trigger_seq,
        snapshot_revision=request.snapshot_revision,
        reason=request.reason,
        inbox_head=request.inbox_head,
        permit=request.permit,
    )


class HookRegistryServicer(hooks_pb2_grpc.HookRegistryServiceServicer):
    """Role checks are the interceptor's (baton_runtime.common.security.access); here,
    owners are held to their own deployment: they create, register, list,
    take over and transfer (as successor) only within it, and fenced calls
    must name a session of it (`DeploymentScope`)."""

    def __init__(self, rooms: HookRooms) -> None:
        self._rooms = rooms

    async def _fenced(self, fence: s.Fence, present: bool) -> None:
        """The fence is given and of the caller's deployment; logged with it."""
        _require_fence(fence, present)
        await self._rooms.scope.check(identity.current(), fence)
        _bind_fence(fence)

    async def Transfer(self, request: pb.TransferRequest, context: Context) -> pb.TransferResponse:
        structlog.contextvars.bind_contextvars(
            session_id=request.expected.session_id,
            run_id=request.expected.owner_run_id,
            handoff_id=request.handoff_id,
        )
        done = await self._rooms.transfers.transfer(_transfer_request(request), identity.current())
        return pb.TransferResponse(fence=done.outcome.fence, replayed=done.replayed)

    async def GetTransfer(
        self, request: pb.GetTransferRequest, context: Context
    ) -> pb.GetTransferResponse:
        structlog.contextvars.bind_contextvars(
            session_id=request.session_id, handoff_id=request.handoff_id
        )
        if request.session_id:
            outcome = await self._rooms.transfers.get(request.session_id, request.handoff_id)
        else:  # by the handoff id alone (the handoff index)
            outcome = await self._rooms.transfers.find(request.handoff_id)
        return pb.GetTransferResponse(
            fence=outcome.fence,
            successor=outcome.successor,
            trigger_seq=outcome.trigger_seq,
            reason=outcome.reason,
        )

    async def GetOwner(self, request: pb.GetOwnerRequest, context: Context) -> pb.GetOwnerResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        record, head = await self._rooms.transfers.owner(request.session_id)
        return pb.GetOwnerResponse(
            fence=owner_fence(request.session_id, record),
            owner=owner_identity(record),
            parked=record.parked,
            inbox_head=head,
        )

    async def DescribeSession(
        self, request: pb.DescribeSessionRequest, context: Context
    ) -> pb.DescribeSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        channel = _tenant_channel(request.channel)
        record = await self._rooms.directory.describe(
            request.session_id, channel, request.consumed_seq
        )
        return describe_reply(record)

    async def ListChannelSessions(
        self, request: pb.ListChannelSessionsRequest, context: Context
    ) -> pb.ListChannelSessionsResponse:
        if not _tenant_channel(request.channel):  # an operator's listing across channels
            every = await self._rooms.directory.list_all_channels(
                request.after_channel, request.after_session_id, request.limit
            )
            return channel_sessions_reply(every.sessions, every.more)
        if request.after_channel:
            raise InvalidArgument(
                Reason.INVALID_FIELD, "after_channel goes with an empty channel only"
            )
        page = await self._rooms.directory.list_channel(
            request.channel, request.after_session_id, request.limit
        )
        sessions = [(request.channel, sid, ms) for sid, ms in page.sessions]
        return channel_sessions_reply(sessions, page.more)

    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Context
    ) -> pb.CreateSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        if not request.HasField("owner"):
            raise InvalidArgument(Reason.MISSING_FIELD, "owner is required")
        identity.current().require_deployment(request.owner.deployment_id, "the owner")
        new = NewSession(
            request.session_id,
            request.owner,
            request.channel,
            tuple(request.aliases),
            request.parent if request.HasField("parent") else None,
            request.first_command if request.HasField("first_command") else None,
        )
        fence, hooks, first = await self._rooms.claims.create_session(new)
        return pb.CreateSessionResponse(
            fence=fence,
            inbox_token=ids.inbox_token(request.session_id),
            hooks=hooks,
            first_entry=first,
        )

    async def ClaimHooks(
        self, request: pb.ClaimHooksRequest, context: Context
    ) -> pb.ClaimHooksResponse:
        await self._fenced(request.fence, request.HasField("fence"))
        hooks = await self._rooms.claims.claim(request.fence, list(request.tokens))
        return pb.ClaimHooksResponse(hooks=hooks)

    async def ResumeHook(
        self, request: pb.ResumeHookRequest, context: Context
    ) -> pb.ResumeHookResponse:
        if not request.HasField("command"):
            raise InvalidArgument(Reason.MISSING_FIELD, "command is required")
        channel = _tenant_channel(request.channel)
        caller = identity.current()
        if caller.verified and caller.role is Role.OWNER:
            await self._rooms.consent.check_delivery(caller, request.token, request.command)
        receipt = await self._rooms.inbox.append(request.token, request.command, channel)
        structlog.contextvars.bind_contextvars(session_id=receipt.session_id, seq=receipt.seq)
        return pb.ResumeHookResponse(receipt=receipt)

    def ResumeHooks(
        self, request_iterator: AsyncIterator[pb.ResumeHooksRequest], context: Context
    ) -> AsyncIterator[pb.ResumeHooksResponse]:
        """ResumeHook's appends multiplexed (services/common/streams/multiplex.py):
        each one checked and appended exactly as ResumeHook does it."""
        return multiplex.serve_unary(
            request_iterator, self.ResumeHook, context, _RESUME_ANSWERS, method=RESUME_HOOK
        )

    async def LookupHook(
        self, request: pb.LookupHookRequest, context: Context
    ) -> pb.LookupHookResponse:
        record = await self._rooms.tokens.lookup(request.token, _tenant_channel(request.channel))
        response = pb.LookupHookResponse(session_id=record.session_id, channel=record.channel)
        if record.parent:
            response.parent.ParseFromString(record.parent)
        return response

    async def DisposeHooks(
        self, request: pb.DisposeHooksRequest, context: Context
    ) -> pb.DisposeHooksResponse:
        await self._fenced(request.fence, request.HasField("fence"))
        hooks = await self._rooms.claims.dispose(request.fence, list(request.tokens))
        return pb.DisposeHooksResponse(hooks=hooks)

    async def StreamInbox(
        self, request: pb.StreamInboxRequest, context: Context
    ) -> AsyncIterator[pb.StreamInboxResponse]:
        async for entries in self._inbox_pages(request):
            yield pb.StreamInboxResponse(entries=entries)

    async def _inbox_pages(
        self, request: pb.StreamInboxRequest
    ) -> AsyncIterator[list[s.InboxEntry]]:
        _require_fence(request.fence, request.HasField("fence"))
        # The scope is checked by the stream's first read (no read of its own).
        scope = self._rooms.scope.pending(identity.current(), request.fence)
        _bind_fence(request.fence)
        check_seq(request.from_seq, "from_seq")
        async for entries in self._rooms.inbox.stream(request.fence, request.from_seq, scope):
            yield entries

    def FollowInboxes(
        self, request_iterator: AsyncIterator[pb.FollowInboxesRequest], context: Context
    ) -> AsyncIterator[pb.FollowInboxesResponse]:
        """StreamInbox multiplexed (common/streams/feeds.py): each follow as it serves one."""
        return feeds.serve_follows(
            request_iterator, self._inbox_pages, _inbox_items, method=STREAM_INBOX
        )

    # -- owner instances, takeover, parking --------------------------------------

    async def RegisterInstance(
        self, request: pb.RegisterInstanceRequest, context: Context
    ) -> pb.RegisterInstanceResponse:
        structlog.contextvars.bind_contextvars(
            deployment_id=request.deployment_id, instance_id=request.instance_id
        )
        identity.current().require_deployment(request.deployment_id, "the instance")
        agent = AgentLabel(request.agent.spec, request.agent.name, request.agent.version)
        lease_id, ttl = await self._rooms.instances.register(
            request.deployment_id, request.instance_id, request.ttl_seconds, request.address, agent
        )
        return pb.RegisterInstanceResponse(lease_id=lease_id, ttl_seconds=ttl)

    async def KeepAliveInstance(
        self, request: pb.KeepAliveInstanceRequest, context: Context
    ) -> pb.KeepAliveInstanceResponse:
        ttl = await self._rooms.instances.keep_alive(request.lease_id)
        return pb.KeepAliveInstanceResponse(ttl_seconds=ttl)

    async def DeregisterInstance(
        self, request: pb.DeregisterInstanceRequest, context: Context
    ) -> pb.DeregisterInstanceResponse:
        await self._rooms.instances.deregister(request.lease_id)
        return pb.DeregisterInstanceResponse()

    async def SetInstanceDrain(
        self, request: pb.SetInstanceDrainRequest, context: Context
    ) -> pb.SetInstanceDrainResponse:
        structlog.contextvars.bind_contextvars(
            deployment_id=request.deployment_id, instance_id=request.instance_id
        )
        identity.current().require_deployment(request.deployment_id, "the instance")
        await self._rooms.instances.set_drain(
            request.deployment_id, request.instance_id, request.lease_id, request.to_deployment_id
        )
        return pb.SetInstanceDrainResponse()

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: Context
    ) -> pb.ListInstancesResponse:
        records = await self._rooms.instances.live(request.deployment_id)
        return pb.ListInstancesResponse(instances=[instance_info(r) for r in records])

    async def WatchInstances(
        self, request: pb.WatchInstancesRequest, context: Context
    ) -> AsyncIterator[pb.WatchInstancesResponse]:
        structlog.contextvars.bind_contextvars(deployment_id=request.deployment_id)
        identity.current().require_deployment(request.deployment_id, "the deployment")
        async for change in self._rooms.instances.watch(request.deployment_id):
            yield pb.WatchInstancesResponse(
                instances=[instance_info(r) for r in change.live],
                dead_instance_ids=change.dead,
            )

    async def ListInstanceSessions(
        self, request: pb.ListInstanceSessionsRequest, context: Context
    ) -> pb.ListInstanceSessionsResponse:
        structlog.contextvars.bind_contextvars(
            deployment_id=request.deployment_id, instance_id=request.instance_id
        )
        identity.current().require_deployment(request.deployment_id, "the instance")
        page = await self._rooms.listing.page(
            request.deployment_id,
            request.instance_id,
            request.page_token,
            request.page_size,
            index_only=request.index_only,
        )
        return owned_page_reply(page)

    async def TakeOverSession(
        self, request: pb.TakeOverSessionRequest, context: Context
    ) -> pb.TakeOverSessionResponse:
        _require_fence(request.expected, request.HasField("expected"))
        if not request.HasField("successor"):
            raise InvalidArgument(Reason.MISSING_FIELD, "successor is required")
        identity.current().require_deployment(request.successor.deployment_id, "the successor")
        structlog.contextvars.bind_contextvars(
            session_id=request.expected.session_id, run_id=request.successor.owner_run_id
        )
        taken = await self._rooms.ownership.take_over(
            request.expected, request.expected_instance_id, request.successor
        )
        response = pb.TakeOverSessionResponse(
            fence=taken.fence, parked=taken.parked, inbox_head=taken.inbox_head
        )
        if taken.timeout_deadline:
            response.timeout_deadline.FromSeconds(taken.timeout_deadline)
        return response

    async def SetParked(
        self, request: pb.SetParkedRequest, context: Context
    ) -> pb.SetParkedResponse:
        await self._fenced(request.fence, request.HasField("fence"))
        check_seq(request.inbox_next_seq, "inbox_next_seq")
        deadline = check_range(
            request.timeout_deadline.seconds, "timeout_deadline", MAX_TIMESTAMP_SECONDS
        )
        head = await self._rooms.ownership.set_parked(
            request.fence, request.parked, request.inbox_next_seq, deadline
        )
        return pb.SetParkedResponse(inbox_head=head)

    async def WatchBells(
        self, request: pb.WatchBellsRequest, context: Context
    ) -> AsyncIterator[pb.WatchBellsResponse]:
        structlog.contextvars.bind_contextvars(instance_id=request.instance_id)
        async for bells in self._rooms.instances.watch_bells(request.instance_id):
            yield pb.WatchBellsResponse(
                bells=[pb.Bell(session_id=b.session_id, inbox_head=b.inbox_head) for b in bells]
            )

    async def ListDeployments(
        self, request: pb.ListDeploymentsRequest, context: Context
    ) -> pb.ListDeploymentsResponse:
        fleets = await self._rooms.fleet_views.list_all()
        return pb.ListDeploymentsResponse(deployments=[deployment_info(f) for f in fleets])

    async def DescribeDeployment(
        self, request: pb.DescribeDeploymentRequest, context: Context
    ) -> pb.DescribeDeploymentResponse:
        structlog.contextvars.bind_contextvars(deployment_id=request.deployment_id)
        fleet = await self._rooms.fleet_views.describe(request.deployment_id)
        return pb.DescribeDeploymentResponse(deployment=deployment_info(fleet))
