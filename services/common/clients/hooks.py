"""The typed client of hooks (`HookRegistryService`): its idempotent
methods (retried by gRPC, see `clients.base`) and one call per RPC, each
answering with the values of `clients.answers`."""

from __future__ import annotations

from collections.abc import AsyncIterator

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.bounds import MAX_LISTING_PAGE
from baton_runtime.common.clients.answers import (
    ChannelSessions,
    CreatedSession,
    HookTarget,
    InstanceChange,
    InstanceLease,
    Moved,
    OwnedSession,
    OwnerInstance,
    RecordedTransfer,
    SessionDescription,
    SessionOwner,
    TakenOver,
)
from baton_runtime.common.clients.base import ServiceClient, traced
from baton_runtime.common.clients.channels import DEFAULT_CALL_TIMEOUT
from baton_runtime.common.clients.hooks_methods import HOOKS_IDEMPOTENT, HOOKS_UNLIMITED
from baton_runtime.common.errors import Internal, Reason
from baton_runtime.common.etcd.keys import NO_AGENT, AgentLabel, Bell
from baton_runtime.common.security.tls import Security
from baton_runtime.common.streams.multiplex_client import Lanes

HOOKS_SERVICE = hooks_pb.DESCRIPTOR.services_by_name["HookRegistryService"].full_name


_InboxPage = hooks_pb.StreamInboxResponse | hooks_pb.InboxFeedItem


def _inbox_page(response: _InboxPage) -> list[s.InboxEntry]:
    return list(response.entries)


def _instance(info: hooks_pb.InstanceInfo) -> OwnerInstance:
    agent = AgentLabel(info.agent.spec, info.agent.name, info.agent.version)
    return OwnerInstance(
        info.deployment_id, info.instance_id, info.address, agent, info.drain_to_deployment_id
    )


def _instance_change(response: hooks_pb.WatchInstancesResponse) -> InstanceChange:
    return InstanceChange(
        tuple(_instance(info) for info in response.instances), tuple(response.dead_instance_ids)
    )


def _bells(response: hooks_pb.WatchBellsResponse) -> list[Bell]:
    return [Bell(bell.session_id, bell.inbox_head) for bell in response.bells]


class HooksClient(ServiceClient):
    service = HOOKS_SERVICE
    kind = "hooks"
    idempotent = HOOKS_IDEMPOTENT
    unlimited = HOOKS_UNLIMITED

    def __init__(
        self,
        target: str,
        timeout: float = DEFAULT_CALL_TIMEOUT,
        *,
        security: Security,
        multiplexed: bool = True,
        inbox_feed: bool | None = None,
        max_in_flight: int = 0,
    ) -> None:
        super().__init__(target, timeout, security=security, max_in_flight=max_in_flight)
        self.stub = hooks_pb2_grpc.HookRegistryServiceStub(self.channel)
        # Appends ride one ResumeHooks stream per replica (`_multiplexed`);
        # `multiplexed=False` (or hooks that do not serve ResumeHooks)
        # appends with one unary ResumeHook each.
        self._appends: Lanes[hooks_pb.ResumeHookRequest, hooks_pb.ResumeHookResponse] = (
            self._multiplexed(
                "ResumeHooks",
                hooks_pb.ResumeHooksRequest,
                hooks_pb.ResumeHookCall,
                hooks_pb.ResumeHooksResponse,
            )
            if multiplexed
            else Lanes([])
        )
        # Inbox streams ride one FollowInboxes stream (`inbox_feed`: as `multiplexed`).
        self._inboxes = self._followed(
            "FollowInboxes",
            "StreamInbox",
            hooks_pb.FollowInboxesRequest,
            hooks_pb.InboxFollow,
            hooks_pb.InboxFeedGrant,
            hooks_pb.FollowInboxesResponse,
        )
        self._inboxes.supported = multiplexed if inbox_feed is None else inbox_feed

    async def create_session(
        self,
        session_id: str,
        owner: s.OwnerIdentity,
        channel: str,
        aliases: list[str],
        parent: s.ParentLink | None = None,
        first_command: s.Command | None = None,
    ) -> CreatedSession:
        if first_command is not None:
            first_command = traced(first_command)
        request = hooks_pb.CreateSessionRequest(
            session_id=session_id,
            owner=owner,
            channel=channel,
            aliases=aliases,
            parent=parent,
            first_command=first_command,
        )
        response = await self._unary(
            "CreateSession", lambda: self.stub.CreateSession(request, timeout=self.timeout)
        )
        return CreatedSession(
            response.fence,
            response.inbox_token,
            tuple(response.hooks),
            response.first_entry if response.HasField("first_entry") else None,
        )

    async def append(self, token: str, command: s.Command, channel: str = "") -> s.Receipt:
        """Append `command` to the inbox `token` names. A command without a
        delivery id gets a fresh one here, so that a retry of this call
        (by gRPC, on another replica) is deduplicated, never appended twice.
        While tracing is on, the command carries the current span's context
        (the producer of the inbox entry, see `baton_runtime.common.observability.tracing`)."""
        if not command.delivery.delivery_id:
            stamped = s.Command()
            stamped.CopyFrom(command)
            stamped.delivery.delivery_id = ids.new_delivery_id()
            command = stamped
        command = traced(command)
        request = hooks_pb.ResumeHookRequest(token=token, command=command, channel=channel)
        response = await self._multiplexed_or_unary(
            self._appends,
            request,
            lambda: self._unary(
                "ResumeHook", lambda: self.stub.ResumeHook(request, timeout=self.timeout)
            ),
        )
        return response.receipt

    async def lookup(self, token: str, channel: str = "") -> HookTarget:
        request = hooks_pb.LookupHookRequest(token=token, channel=channel)
        response = await self._unary(
            "LookupHook", lambda: self.stub.LookupHook(request, timeout=self.timeout)
        )
        parent = response.parent if response.HasField("parent") else None
        return HookTarget(response.session_id, response.channel, parent)

    async def claim(self, fence: s.Fence, tokens: list[str]) -> list[str]:
        request = hooks_pb.ClaimHooksRequest(fence=fence, tokens=tokens)
        response = await self._unary(
            "ClaimHooks", lambda: self.stub.ClaimHooks(request, timeout=self.timeout)
        )
        return list(response.hooks)

    async def dispose(self, fence: s.Fence, tokens: list[str] | None = None) -> list[str]:
        request = hooks_pb.DisposeHooksRequest(fence=fence, tokens=tokens or [])
        response = await self._unary(
            "DisposeHooks", lambda: self.stub.DisposeHooks(request, timeout=self.timeout)
        )
        return list(response.hooks)

    def stream_inbox(self, fence: s.Fence, from_seq: int) -> AsyncIterator[list[s.InboxEntry]]:
        """The inbox from `from_seq` on, a page at a time: a follow on this
        process' FollowInboxes stream, or a StreamInbox call of its own."""
        request = hooks_pb.StreamInboxRequest(fence=fence, from_seq=from_seq)
        return self._followed_or_streamed(
            self._inboxes, request, "StreamInbox", self.stub.StreamInbox, _inbox_page
        )

    async def register_instance(
        self,
        deployment_id: str,
        instance_id: str,
        ttl_seconds: int,
        address: str,
        agent: AgentLabel = NO_AGENT,
    ) -> InstanceLease:
        request = hooks_pb.RegisterInstanceRequest(
            deployment_id=deployment_id,
            instance_id=instance_id,
            ttl_seconds=ttl_seconds,
            address=address,
            agent=hooks_pb.AgentInfo(spec=agent.spec, name=agent.name, version=agent.version),
        )
        response = await self._unary(
            "RegisterInstance", lambda: self.stub.RegisterInstance(request, timeout=self.timeout)
        )
        return InstanceLease(response.lease_id, response.ttl_seconds)

    async def keep_alive_instance(self, lease_id: int) -> int:
        """The lease's remaining TTL in seconds; 0 when it expired."""
        request = hooks_pb.KeepAliveInstanceRequest(lease_id=lease_id)
        response = await self._unary(
            "KeepAliveInstance", lambda: self.stub.KeepAliveInstance(request, timeout=self.timeout)
        )
        return response.ttl_seconds

    async def set_instance_drain(
        self, deployment_id: str, instance_id: str, lease_id: int, to_deployment_id: str
    ) -> None:
        """Announce in the instance's registry record the deployment its
        drain hands sessions to ("" = none)."""
        request = hooks_pb.SetInstanceDrainRequest(
            deployment_id=deployment_id,
            instance_id=instance_id,
            lease_id=lease_id,
            to_deployment_id=to_deployment_id,
        )
        await self._unary(
            "SetInstanceDrain", lambda: self.stub.SetInstanceDrain(request, timeout=self.timeout)
        )

    async def deregister_instance(self, lease_id: int) -> None:
        request = hooks_pb.DeregisterInstanceRequest(lease_id=lease_id)
        await self._unary(
            "DeregisterInstance",
            lambda: self.stub.DeregisterInstance(request, timeout=self.timeout),
        )

    async def list_instances(self, deployment_id: str) -> list[OwnerInstance]:
        request = hooks_pb.ListInstancesRequest(deployment_id=deployment_id)
        response = await self._unary(
            "ListInstances", lambda: self.stub.ListInstances(request, timeout=self.timeout)
        )
        return [_instance(info) for info in response.instances]

    def watch_instances(self, deployment_id: str) -> AsyncIterator[InstanceChange]:
        request = hooks_pb.WatchInstancesRequest(deployment_id=deployment_id)
        return self._stream("WatchInstances", self.stub.WatchInstances(request), _instance_change)

    async def list_instance_sessions(
        self, deployment_id: str, instance_id: str, *, index_only: bool = False
    ) -> list[OwnedSession]:
        """Every session of the instance (with no instance: of the
        deployment), read MAX_LISTING_PAGE index entries a page; `index_only`:
        as the index names them, with no owner record read (`parked` unread,
        `input_waiting` whether the bell rang)."""
        owned: list[OwnedSession] = []
        token = ""
        while True:
            r = hooks_pb.ListInstanceSessionsRequest(
                deployment_id=deployment_id,
                instance_id=instance_id,
                page_token=token,
                page_size=MAX_LISTING_PAGE,
                index_only=index_only,
            )
            response = await self._unary(
                "ListInstanceSessions",
                lambda r=r: self.stub.ListInstanceSessions(r, timeout=self.timeout),  # type: ignore[misc]
            )
            owned += [
                OwnedSession(o.fence, o.owner, o.parked, o.input_waiting) for o in response.sessions
            ]
            if not response.next_page_token:
                return owned
            if response.next_page_token <= token:  # never: tokens only grow
                raise Internal(Reason.INTERNAL, "ListInstanceSessions: a page token went back")
            token = response.next_page_token

    async def take_over_session(
        self, expected: s.Fence, expected_instance_id: str, successor: s.OwnerIdentity
    ) -> TakenOver:
        request = hooks_pb.TakeOverSessionRequest(
            expected=expected, expected_instance_id=expected_instance_id, successor=successor
        )
        response = await self._unary(
            "TakeOverSession", lambda: self.stub.TakeOverSession(request, timeout=self.timeout)
        )
        deadline = response.timeout_deadline.seconds if response.HasField("timeout_deadline") else 0
        return TakenOver(response.fence, response.parked, response.inbox_head, deadline)

    async def set_parked(
        self, fence: s.Fence, parked: bool, inbox_next_seq: int = 0, timeout_deadline: int = 0
    ) -> int:
        """Park (every inbox entry consumed up to `inbox_next_seq`, else
        Aborted/INBOX_NOT_DRAINED; `timeout_deadline`: the session's lifetime
        deadline, unix seconds, 0 = none) or unpark; returns the inbox head."""
        request = hooks_pb.SetParkedRequest(
            fence=fence, parked=parked, inbox_next_seq=inbox_next_seq
        )
        if timeout_deadline:
            request.timeout_deadline.FromSeconds(timeout_deadline)
        response = await self._unary(
            "SetParked", lambda: self.stub.SetParked(request, timeout=self.timeout)
        )
        return response.inbox_head

    def watch_bells(self, instance_id: str) -> AsyncIterator[list[Bell]]:
        """The bells of this instance's parked sessions, in arrival order."""
        request = hooks_pb.WatchBellsRequest(instance_id=instance_id)
        return self._stream("WatchBells", self.stub.WatchBells(request), _bells)

    async def transfer(
        self, request: hooks_pb.TransferRequest, deadline_s: float | None = None
    ) -> Moved:
        """`deadline_s` overrides the client's call deadline for this call."""
        response = await self._unary(
            "Transfer", lambda: self.stub.Transfer(request, timeout=deadline_s or self.timeout)
        )
        return Moved(response.fence, response.replayed)

    async def get_owner(self, session_id: str) -> SessionOwner:
        request = hooks_pb.GetOwnerRequest(session_id=session_id)
        response = await self._unary(
            "GetOwner", lambda: self.stub.GetOwner(request, timeout=self.timeout)
        )
        return SessionOwner(response.fence, response.owner, response.parked, response.inbox_head)

    async def describe_session(
        self, session_id: str, channel: str, consumed_seq: int = 0
    ) -> SessionDescription:
        """The session as hooks stores it; NotFound when it is missing or
        (with `channel`) another channel's."""
        request = hooks_pb.DescribeSessionRequest(
            session_id=session_id, channel=channel, consumed_seq=consumed_seq
        )
        r = await self._unary(
            "DescribeSession", lambda: self.stub.DescribeSession(request, timeout=self.timeout)
        )
        has_oldest = r.HasField("oldest_unconsumed_seq")
        return SessionDescription(
            fence=r.fence,
            owner=r.owner,
            parked=r.parked,
            inbox_head=r.inbox_head,
            channel=r.channel,
            hooks=tuple(r.hooks),
            parent=r.parent if r.HasField("parent") else None,
            create_time=r.create_time if r.HasField("create_time") else None,
            oldest_unconsumed_seq=r.oldest_unconsumed_seq if has_oldest else None,
            oldest_unconsumed_accepted_at=r.oldest_unconsumed_accepted_at if has_oldest else None,
        )

    async def list_channel_sessions(
        self, channel: str, after_session_id: str, limit: int
    ) -> ChannelSessions:
        request = hooks_pb.ListChannelSessionsRequest(
            channel=channel, after_session_id=after_session_id, limit=limit
        )
        r = await self._unary(
            "ListChannelSessions",
            lambda: self.stub.ListChannelSessions(request, timeout=self.timeout),
        )
        return ChannelSessions(
            tuple((entry.session_id, entry.create_time) for entry in r.sessions), r.more
        )

    async def list_all_sessions(
        self, after_channel: str, after_session_id: str, limit: int
    ) -> tuple[tuple[tuple[str, str], ...], bool]:
        """Operator: one page of every channel's index, in (channel, session
        id) order: ((channel, session id), ...) and whether more follow."""
        request = hooks_pb.ListChannelSessionsRequest(
            after_channel=after_channel, after_session_id=after_session_id, limit=limit
        )
        r = await self._unary(
            "ListChannelSessions",
            lambda: self.stub.ListChannelSessions(request, timeout=self.timeout),
        )
        return tuple((entry.channel, entry.session_id) for entry in r.sessions), r.more

    async def get_transfer(self, session_id: str, handoff_id: str) -> RecordedTransfer:
        """A recorded transfer; `session_id` "" finds it by the handoff id
        alone (hooks' handoff index; `fence.session_id` names the session)."""
        request = hooks_pb.GetTransferRequest(session_id=session_id, handoff_id=handoff_id)
        response = await self._unary(
            "GetTransfer", lambda: self.stub.GetTransfer(request, timeout=self.timeout)
        )
        return RecordedTransfer(
            response.fence, response.successor, response.trigger_seq, response.reason
        )

    async def list_deployments(self) -> list[hooks_pb.DeploymentInfo]:
        """Operator: every deployment the registry knows, its status and fleet."""
        response = await self._unary(
            "ListDeployments",
            lambda: self.stub.ListDeployments(
                hooks_pb.ListDeploymentsRequest(), timeout=self.timeout
            ),
        )
        return list(response.deployments)

    async def describe_deployment(self, deployment_id: str) -> hooks_pb.DeploymentInfo:
        """Operator: one deployment's instances, leases and session counts."""
        request = hooks_pb.DescribeDeploymentRequest(deployment_id=deployment_id)
        response = await self._unary(
            "DescribeDeployment",
            lambda: self.stub.DescribeDeployment(request, timeout=self.timeout),
        )
        return response.deployment
