"""Typed clients between Baton services: every call has a deadline, and a
failed call raises the domain error it carried (see `grpc_errors`).

Each client balances over every replica its target names and lets gRPC
retry the methods listed as idempotent below (`channels.open_channel`). A
method is on the list when running it twice has the effect of running it
once: reads, and writes the server deduplicates by an id in the request
(a delivery id, a handoff id, the fence of a replayed commit). Left off:
RegisterInstance (each call grants a new lease) and AcceptHandoff (the old
owner settles an uncertain handoff itself, and a replay on another instance
would be refused as a reused handoff id after the first one moved the
session).

Calls answer with domain values (the frozen dataclasses below, or the stored
`session_pb2` messages: fences, snapshots, receipts, inbox entries, events),
never with a `…Response` proto: a caller needs no generated module to read
an answer. A stream yields one value per message the server sends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton.anchor.v1 import anchor_pb2_grpc
from baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton.hooks.v1 import hooks_pb2_grpc
from baton.owner.v1 import owner_pb2 as owner_pb
from baton.owner.v1 import owner_pb2_grpc
from baton.session.v1 import session_pb2 as s
from services.common import ids, metrics, tracing
from services.common.channels import DEFAULT_CALL_TIMEOUT, open_channel
from services.common.errors import Reason, Unavailable
from services.common.grpc_errors import from_rpc_error
from services.common.keys import Bell
from services.common.tls import Security

_T = TypeVar("_T")
_R = TypeVar("_R")

HOOKS_SERVICE = hooks_pb.DESCRIPTOR.services_by_name["HookRegistryService"].full_name
ANCHOR_SERVICE = anchor_pb.DESCRIPTOR.services_by_name["AnchorService"].full_name
OWNER_SERVICE = owner_pb.DESCRIPTOR.services_by_name["OwnerService"].full_name

HOOKS_IDEMPOTENT = frozenset(
    {
        # Reads.
        "LookupHook",
        "StreamInbox",
        "ListInstances",
        "ListInstanceSessions",
        "WatchBells",
        "WatchInstances",
        "GetTransfer",
        "GetOwner",
        "DescribeSession",
        "ListChannelSessions",
        "ListDeployments",
        "DescribeDeployment",
        # A repeat returns the first result: the same session and fence
        # (CreateSession), the same claim set (ClaimHooks, DisposeHooks), the
        # first receipt for a delivery id (ResumeHook; `HooksClient.resume`
        # gives every command one), the replayed takeover or transfer
        # (TakeOverSession, Transfer), the state already set (SetParked).
        "CreateSession",
        "ClaimHooks",
        "DisposeHooks",
        "ResumeHook",
        "TakeOverSession",
        "SetParked",
        "Transfer",
        # A lease refreshed or revoked twice is refreshed or revoked; a drain
        # target set twice is set.
        "KeepAliveInstance",
        "DeregisterInstance",
        "SetInstanceDrain",
    }
)
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
OWNER_IDEMPOTENT = frozenset(
    {
        # A repeat with the same session id finds the session (created=false).
        "StartSession",
        # Sets the same drain target again and answers the progress.
        "DrainSessions",
        # One handoff id per (old fence, adopting instance): a repeat replays
        # the same transfer.
        "AdoptSession",
        # A repeat finds the session no longer stalled (resumed = false).
        "ResumeSession",
    }
)


@dataclass
class LoadedSession:
    """A session as loaded to run it: snapshot, its revision, the context."""

    snapshot: s.SessionSnapshot
    revision: int
    context: list[s.ChatMessage]


@dataclass(frozen=True)
class OwnerInstance:
    """A live owner instance as the registry lists it."""

    deployment_id: str
    instance_id: str
    address: str


@dataclass(frozen=True)
class InstanceChange:
    """What a watch of a deployment's instances reports: the live ones, and
    the instances that died (their sessions are to be taken over)."""

    instances: tuple[OwnerInstance, ...]
    dead_instance_ids: tuple[str, ...]


@dataclass(frozen=True)
class OwnedSession:
    """A session with its current owner (and whether it is parked, as of the
    listing)."""

    fence: s.Fence
    owner: s.OwnerIdentity
    parked: bool


@dataclass(frozen=True)
class CreatedSession:
    """A session hooks created (CreateSession): its first fence, every token
    it claimed (inbox token first), and the inbox entry its first command
    became (None without a first command)."""

    fence: s.Fence
    inbox_token: str
    hooks: tuple[str, ...]
    first_entry: s.InboxEntry | None


@dataclass(frozen=True)
class HookTarget:
    """What a token resolves to (LookupHook): the session, its channel and,
    for a child session, its parent link as created."""

    session_id: str
    channel: str
    parent: s.ParentLink | None


@dataclass(frozen=True)
class InstanceLease:
    """An owner instance's registration (RegisterInstance): the lease to keep
    alive and its granted TTL."""

    lease_id: int
    ttl_seconds: int


@dataclass(frozen=True)
class TakenOver:
    """A takeover's outcome (TakeOverSession): the successor's fence; whether
    the session stays parked under it, and the inbox head at the takeover."""

    fence: s.Fence
    parked: bool
    inbox_head: int


@dataclass(frozen=True)
class Moved:
    """A session moved to a successor (Transfer, AdoptSession): its fence,
    and whether this answers a replay of a move already applied."""

    fence: s.Fence
    replayed: bool


@dataclass(frozen=True)
class RecordedTransfer:
    """A transfer's outcome as hooks recorded it under its handoff id."""

    fence: s.Fence
    successor: s.OwnerIdentity
    trigger_seq: int
    reason: s.TransferReason.ValueType


@dataclass(frozen=True)
class SessionOwner:
    """Who owns a session now (GetOwner)."""

    fence: s.Fence
    owner: s.OwnerIdentity
    parked: bool
    inbox_head: int


@dataclass(frozen=True)
class SessionDescription:
    """What hooks stores of a session (DescribeSession)."""

    fence: s.Fence
    owner: s.OwnerIdentity
    parked: bool
    inbox_head: int
    channel: str
    hooks: tuple[str, ...]
    parent: s.ParentLink | None
    create_time: Timestamp | None
    oldest_unconsumed_seq: int | None
    oldest_unconsumed_accepted_at: Timestamp | None


@dataclass(frozen=True)
class ChannelSessions:
    """One page of a channel's index (ListChannelSessions)."""

    sessions: tuple[tuple[str, Timestamp], ...]
    more: bool


@dataclass(frozen=True)
class Committed:
    """A step committed (CommitStep): the etcd revision, and whether an
    identical earlier commit was found (a retried request)."""

    revision: int
    replayed: bool


@dataclass(frozen=True)
class StartedSession:
    """A session an owner started (StartSession), or found started."""

    session_id: str
    owner_run_id: str
    created: bool
    inbox_token: str
    first_command_appended: bool = False


@dataclass(frozen=True)
class HandoffAccepted:
    """A handoff the target accepted (AcceptHandoff): the successor run now
    holding the session, its fence, and whether this answers a repeat."""

    successor: s.OwnerIdentity
    fence: s.Fence
    replayed: bool


@dataclass(frozen=True)
class DrainBlocker:
    """A session a drain has not moved yet, and why."""

    session_id: str
    reason: str
    detail: str


@dataclass(frozen=True)
class DrainReport:
    """One owner instance's drain progress (DrainSessions)."""

    deployment_id: str
    instance_id: str
    to_deployment_id: str
    moved: int
    remaining: int
    blockers: tuple[DrainBlocker, ...]


def _inbox_page(response: hooks_pb.StreamInboxResponse) -> list[s.InboxEntry]:
    return list(response.entries)


def _instance(info: hooks_pb.InstanceInfo) -> OwnerInstance:
    return OwnerInstance(info.deployment_id, info.instance_id, info.address)


def _instance_change(response: hooks_pb.WatchInstancesResponse) -> InstanceChange:
    return InstanceChange(
        tuple(_instance(info) for info in response.instances), tuple(response.dead_instance_ids)
    )


def _bells(response: hooks_pb.WatchBellsResponse) -> list[Bell]:
    return [Bell(bell.session_id, bell.inbox_head) for bell in response.bells]


def _events_page(response: anchor_pb.ReadEventsResponse) -> list[s.Event]:
    return list(response.events)


def _load_part(response: anchor_pb.LoadSessionResponse) -> anchor_pb.LoadSessionResponse:
    return response


def _traced(command: s.Command) -> s.Command:
    """`command` with the current span's trace context in its delivery
    metadata, when tracing is on and it has none yet (a copy; `command`
    itself is left as it is)."""
    if not tracing.TRACING.enabled or command.delivery.traceparent:
        return command
    traceparent = tracing.current_traceparent()
    if not traceparent:
        return command
    stamped = s.Command()
    stamped.CopyFrom(command)
    stamped.delivery.traceparent = traceparent
    return stamped


class _Client:
    """`target`: one address, several comma-separated, or a `dns:///` name
    (see `channels.grpc_target`); `security`: this process's identity, which
    the server checks against its roles."""

    service = ""
    # The `target` label of `baton_rpc_client_handled_total`: the kind of
    # service, never an address (owner peers are many).
    kind = ""
    idempotent: frozenset[str] = frozenset()

    def __init__(
        self, target: str, timeout: float = DEFAULT_CALL_TIMEOUT, *, security: Security
    ) -> None:
        self.target = target
        self.security = security
        self.channel = open_channel(target, security, self.service, self.idempotent)
        self.timeout = timeout

    async def close(self) -> None:
        await self.channel.close()

    def _done(self, method: str, code: str) -> None:
        if metrics.RPC.enabled:
            metrics.RPC.called(self.kind, f"/{self.service}/{method}", code)

    async def _unary(self, method: str, call: Awaitable[_T]) -> _T:
        """The answer of `call` (the stub's `method`); a failure raises the
        domain error it carried. Counted when metrics are served."""
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            self._done(method, exc.code().name)
            raise from_rpc_error(exc) from exc
        except asyncio.CancelledError:
            self._done(method, "CANCELLED")
            raise
        self._done(method, "OK")
        return response

    async def _stream(
        self, method: str, call: grpc.aio.UnaryStreamCall[Any, _R], convert: Callable[[_R], _T]
    ) -> AsyncIterator[_T]:
        """The messages of `call` (the stub's `method`), each as `convert`
        makes it; the call is cancelled when the iteration ends (or the
        iterator is closed). Counted when metrics are served: OK at its end,
        CANCELLED when the caller stopped reading first."""
        code = "CANCELLED"
        meter, path = metrics.RPC, f"/{self.service}/{method}"
        if meter.enabled:
            meter.opened(self.kind, path)
        try:
            async for item in call:
                if meter.enabled:
                    meter.received(self.kind, path)
                yield convert(item)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            raise from_rpc_error(exc) from exc
        finally:
            call.cancel()
            self._done(method, code)


class HooksClient(_Client):
    service = HOOKS_SERVICE
    kind = "hooks"
    idempotent = HOOKS_IDEMPOTENT

    def __init__(
        self, target: str, timeout: float = DEFAULT_CALL_TIMEOUT, *, security: Security
    ) -> None:
        super().__init__(target, timeout, security=security)
        self.stub = hooks_pb2_grpc.HookRegistryServiceStub(self.channel)

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
            first_command = _traced(first_command)
        request = hooks_pb.CreateSessionRequest(
            session_id=session_id,
            owner=owner,
            channel=channel,
            aliases=aliases,
            parent=parent,
            first_command=first_command,
        )
        response = await self._unary(
            "CreateSession", self.stub.CreateSession(request, timeout=self.timeout)
        )
        return CreatedSession(
            response.fence,
            response.inbox_token,
            tuple(response.hooks),
            response.first_entry if response.HasField("first_entry") else None,
        )

    async def resume(self, token: str, command: s.Command, channel: str = "") -> s.Receipt:
        """Append `command` to the inbox `token` names. A command without a
        delivery id gets a fresh one here, so that a retry of this call
        (by gRPC, on another replica) is deduplicated, never appended twice.
        While tracing is on, the command carries the current span's context
        (the producer of the inbox entry, see `services.common.tracing`)."""
        if not command.delivery.delivery_id:
            stamped = s.Command()
            stamped.CopyFrom(command)
            stamped.delivery.delivery_id = ids.new_delivery_id()
            command = stamped
        command = _traced(command)
        request = hooks_pb.ResumeHookRequest(token=token, command=command, channel=channel)
        response = await self._unary(
            "ResumeHook", self.stub.ResumeHook(request, timeout=self.timeout)
        )
        return response.receipt

    async def lookup(self, token: str, channel: str = "") -> HookTarget:
        request = hooks_pb.LookupHookRequest(token=token, channel=channel)
        response = await self._unary(
            "LookupHook", self.stub.LookupHook(request, timeout=self.timeout)
        )
        parent = response.parent if response.HasField("parent") else None
        return HookTarget(response.session_id, response.channel, parent)

    async def claim(self, fence: s.Fence, tokens: list[str]) -> list[str]:
        request = hooks_pb.ClaimHooksRequest(fence=fence, tokens=tokens)
        response = await self._unary(
            "ClaimHooks", self.stub.ClaimHooks(request, timeout=self.timeout)
        )
        return list(response.hooks)

    async def dispose(self, fence: s.Fence, tokens: list[str] | None = None) -> list[str]:
        request = hooks_pb.DisposeHooksRequest(fence=fence, tokens=tokens or [])
        response = await self._unary(
            "DisposeHooks", self.stub.DisposeHooks(request, timeout=self.timeout)
        )
        return list(response.hooks)

    def stream_inbox(self, fence: s.Fence, from_seq: int) -> AsyncIterator[list[s.InboxEntry]]:
        """The inbox from `from_seq` on, one page of entries at a time."""
        call = self.stub.StreamInbox(hooks_pb.StreamInboxRequest(fence=fence, from_seq=from_seq))
        return self._stream("StreamInbox", call, _inbox_page)

    async def register_instance(
        self, deployment_id: str, instance_id: str, ttl_seconds: int, address: str
    ) -> InstanceLease:
        request = hooks_pb.RegisterInstanceRequest(
            deployment_id=deployment_id,
            instance_id=instance_id,
            ttl_seconds=ttl_seconds,
            address=address,
        )
        response = await self._unary(
            "RegisterInstance", self.stub.RegisterInstance(request, timeout=self.timeout)
        )
        return InstanceLease(response.lease_id, response.ttl_seconds)

    async def keep_alive_instance(self, lease_id: int) -> int:
        """The lease's remaining TTL in seconds; 0 when it expired."""
        request = hooks_pb.KeepAliveInstanceRequest(lease_id=lease_id)
        response = await self._unary(
            "KeepAliveInstance", self.stub.KeepAliveInstance(request, timeout=self.timeout)
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
            "SetInstanceDrain", self.stub.SetInstanceDrain(request, timeout=self.timeout)
        )

    async def deregister_instance(self, lease_id: int) -> None:
        request = hooks_pb.DeregisterInstanceRequest(lease_id=lease_id)
        await self._unary(
            "DeregisterInstance", self.stub.DeregisterInstance(request, timeout=self.timeout)
        )

    async def list_instances(self, deployment_id: str) -> list[OwnerInstance]:
        request = hooks_pb.ListInstancesRequest(deployment_id=deployment_id)
        response = await self._unary(
            "ListInstances", self.stub.ListInstances(request, timeout=self.timeout)
        )
        return [_instance(info) for info in response.instances]

    def watch_instances(self, deployment_id: str) -> AsyncIterator[InstanceChange]:
        request = hooks_pb.WatchInstancesRequest(deployment_id=deployment_id)
        return self._stream("WatchInstances", self.stub.WatchInstances(request), _instance_change)

    async def list_instance_sessions(
        self, deployment_id: str, instance_id: str
    ) -> list[OwnedSession]:
        request = hooks_pb.ListInstanceSessionsRequest(
            deployment_id=deployment_id, instance_id=instance_id
        )
        response = await self._unary(
            "ListInstanceSessions", self.stub.ListInstanceSessions(request, timeout=self.timeout)
        )
        return [OwnedSession(o.fence, o.owner, o.parked) for o in response.sessions]

    async def take_over_session(
        self, expected: s.Fence, expected_instance_id: str, successor: s.OwnerIdentity
    ) -> TakenOver:
        request = hooks_pb.TakeOverSessionRequest(
            expected=expected, expected_instance_id=expected_instance_id, successor=successor
        )
        response = await self._unary(
            "TakeOverSession", self.stub.TakeOverSession(request, timeout=self.timeout)
        )
        return TakenOver(response.fence, response.parked, response.inbox_head)

    async def set_parked(self, fence: s.Fence, parked: bool, inbox_next_seq: int = 0) -> int:
        """Park (every inbox entry consumed up to `inbox_next_seq`, else
        Aborted/INBOX_NOT_DRAINED) or unpark; returns the inbox head."""
        request = hooks_pb.SetParkedRequest(
            fence=fence, parked=parked, inbox_next_seq=inbox_next_seq
        )
        response = await self._unary(
            "SetParked", self.stub.SetParked(request, timeout=self.timeout)
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
        call = self.stub.Transfer(request, timeout=deadline_s or self.timeout)
        response = await self._unary("Transfer", call)
        return Moved(response.fence, response.replayed)

    async def get_owner(self, session_id: str) -> SessionOwner:
        request = hooks_pb.GetOwnerRequest(session_id=session_id)
        response = await self._unary("GetOwner", self.stub.GetOwner(request, timeout=self.timeout))
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
            "DescribeSession", self.stub.DescribeSession(request, timeout=self.timeout)
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
            "ListChannelSessions", self.stub.ListChannelSessions(request, timeout=self.timeout)
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
            "ListChannelSessions", self.stub.ListChannelSessions(request, timeout=self.timeout)
        )
        return tuple((entry.channel, entry.session_id) for entry in r.sessions), r.more

    async def get_transfer(self, session_id: str, handoff_id: str) -> RecordedTransfer:
        """A recorded transfer; `session_id` "" finds it by the handoff id
        alone (hooks' handoff index; `fence.session_id` names the session)."""
        request = hooks_pb.GetTransferRequest(session_id=session_id, handoff_id=handoff_id)
        response = await self._unary(
            "GetTransfer", self.stub.GetTransfer(request, timeout=self.timeout)
        )
        return RecordedTransfer(
            response.fence, response.successor, response.trigger_seq, response.reason
        )

    async def list_deployments(self) -> list[hooks_pb.DeploymentInfo]:
        """Operator: every deployment the registry knows, its status and fleet."""
        response = await self._unary(
            "ListDeployments",
            self.stub.ListDeployments(hooks_pb.ListDeploymentsRequest(), timeout=self.timeout),
        )
        return list(response.deployments)

    async def describe_deployment(self, deployment_id: str) -> hooks_pb.DeploymentInfo:
        """Operator: one deployment's instances, leases and session counts."""
        request = hooks_pb.DescribeDeploymentRequest(deployment_id=deployment_id)
        response = await self._unary(
            "DescribeDeployment", self.stub.DescribeDeployment(request, timeout=self.timeout)
        )
        return response.deployment


class AnchorClient(_Client):
    service = ANCHOR_SERVICE
    kind = "anchor"
    idempotent = ANCHOR_IDEMPOTENT

    def __init__(
        self, target: str, timeout: float = DEFAULT_CALL_TIMEOUT, *, security: Security
    ) -> None:
        super().__init__(target, timeout, security=security)
        self.stub = anchor_pb2_grpc.AnchorServiceStub(self.channel)

    async def commit(self, request: anchor_pb.CommitStepRequest) -> Committed:
        response = await self._unary(
            "CommitStep", self.stub.CommitStep(request, timeout=self.timeout)
        )
        return Committed(response.revision, response.replayed)

    async def snapshot(self, session_id: str) -> s.SessionSnapshot:
        return (await self.snapshot_with_revision(session_id))[0]

    async def snapshot_with_revision(self, session_id: str) -> tuple[s.SessionSnapshot, int]:
        """The snapshot and its key's mod revision (the next commit's expected one)."""
        request = anchor_pb.GetSnapshotRequest(session_id=session_id)
        response = await self._unary(
            "GetSnapshot", self.stub.GetSnapshot(request, timeout=self.timeout)
        )
        return response.snapshot, response.revision

    async def snapshot_and_horizon(self, session_id: str) -> tuple[s.SessionSnapshot, int]:
        """The snapshot and the stream's retention horizon (the earliest seq
        kept), read together."""
        request = anchor_pb.GetSnapshotRequest(session_id=session_id)
        response = await self._unary(
            "GetSnapshot", self.stub.GetSnapshot(request, timeout=self.timeout)
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
        call = self.stub.LoadSession(request, timeout=self.timeout * 3)
        loaded: LoadedSession | None = None
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
            "RetireHistory", self.stub.RetireHistory(request, timeout=self.timeout * 3)
        )
        return response.deleted

    def read_events(
        self, session_id: str, start_seq: int = 0, follow: bool = False
    ) -> AsyncIterator[list[s.Event]]:
        """The session's events from `start_seq`, a page at a time; with
        `follow`, new ones as they are committed."""
        request = anchor_pb.ReadEventsRequest(
            session_id=session_id, start_seq=start_seq, follow=follow
        )
        return self._stream("ReadEvents", self.stub.ReadEvents(request), _events_page)


class OwnerClient(_Client):
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
            "StartSession", self.stub.StartSession(request, timeout=self.timeout)
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
            "AcceptHandoff", self.stub.AcceptHandoff(request, timeout=self.timeout)
        )
        return HandoffAccepted(response.successor, response.fence, response.replayed)

    async def drain_sessions(self, to_deployment_id: str) -> DrainReport:
        request = owner_pb.DrainSessionsRequest(to_deployment_id=to_deployment_id)
        response = await self._unary(
            "DrainSessions", self.stub.DrainSessions(request, timeout=self.timeout)
        )
        return DrainReport(
            response.deployment_id,
            response.instance_id,
            response.to_deployment_id,
            response.moved,
            response.remaining,
            tuple(DrainBlocker(b.session_id, b.reason, b.detail) for b in response.blockers),
        )

    async def adopt_session(self, session_id: str) -> Moved:
        request = owner_pb.AdoptSessionRequest(session_id=session_id)
        response = await self._unary(
            "AdoptSession", self.stub.AdoptSession(request, timeout=self.timeout)
        )
        return Moved(response.fence, response.replayed)

    async def resume_session(self, session_id: str) -> tuple[bool, s.Fence]:
        """Operator: run a session stalled on this instance again (resumed,
        its fence); resumed is False when it is held here but not stalled."""
        request = owner_pb.ResumeSessionRequest(session_id=session_id)
        response = await self._unary(
            "ResumeSession", self.stub.ResumeSession(request, timeout=self.timeout)
        )
        return response.resumed, response.fence
