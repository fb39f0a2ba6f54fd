"""HookRegistryService: translates between protos and the registry."""

from __future__ import annotations

from collections.abc import AsyncIterator

import structlog

from baton.hooks.v1 import hooks_pb2 as pb
from baton.hooks.v1 import hooks_pb2_grpc
from baton.session.v1 import session_pb2 as s
from services.common import identity, ids, metrics
from services.common.bounds import check_seq
from services.common.errors import InvalidArgument, PermissionDenied, Reason
from services.common.identity import Caller, Role
from services.common.ids import brief
from services.common.interceptor import Context
from services.common.keys import InstanceRecord
from services.common.permits import PermitVerifier, grant_for
from services.common.scope import DeploymentScope
from services.hooks.directory import timestamp_ms
from services.hooks.fleets import Fleet, FleetViews
from services.hooks.instances import InstanceRegistry
from services.hooks.registry import HookRegistry
from services.hooks.transfer import Transfers, plan_transfer


def _require_fence(fence: s.Fence, present: bool) -> None:
    if not present:
        raise InvalidArgument(Reason.MISSING_FIELD, "fence is required")
    check_seq(fence.epoch, "fence.epoch")


def _tenant_channel(channel: str) -> str:
    """The channel a call addresses tokens as. Only internal callers (owners,
    or anyone in plaintext mode) may leave it empty, which addresses every
    channel; an ingress always names the tenant it authenticated."""
    if not channel and not identity.current().internal:
        raise InvalidArgument(Reason.MISSING_FIELD, "channel is required")
    return channel


class HookRegistryServicer(hooks_pb2_grpc.HookRegistryServiceServicer):
    """Role checks are the interceptor's (services.common.access); here,
    owners are held to their own deployment: they create, register, list,
    take over and transfer (as successor) only within it, and fenced calls
    must name a session of it (`DeploymentScope`)."""

    def __init__(
        self,
        registry: HookRegistry,
        instances: InstanceRegistry,
        transfers: Transfers,
        scope: DeploymentScope,
        permits: PermitVerifier,
        fleets: FleetViews,
    ) -> None:
        self._fleets = fleets
        self._registry = registry
        self._instances = instances
        self._transfers = transfers
        self._scope = scope
        self._permits = permits

    async def _fenced(self, fence: s.Fence, present: bool) -> None:
        _require_fence(fence, present)
        await self._scope.check(identity.current(), fence)

    async def Transfer(self, request: pb.TransferRequest, context: Context) -> pb.TransferResponse:
        """Counted in baton_transfers_total: moved, replayed (a repeat of a
        move already applied) or refused (any error, the checks included)."""
        try:
            response = await self._transfer(request)
        except Exception:
            metrics.TRANSFERS.labels("refused").inc()
            raise
        metrics.TRANSFERS.labels("replayed" if response.replayed else "moved").inc()
        return response

    async def _transfer(self, request: pb.TransferRequest) -> pb.TransferResponse:
        for name in ("expected", "expected_owner", "successor"):
            if not request.HasField(name):
                raise InvalidArgument(Reason.MISSING_FIELD, f"{name} is required")
        identity.current().require_deployment(request.successor.deployment_id, "the successor")
        check_seq(request.expected.epoch, "expected.epoch")
        check_seq(request.trigger_seq, "trigger_seq")
        check_seq(request.snapshot_revision, "snapshot_revision")
        structlog.contextvars.bind_contextvars(
            session_id=request.expected.session_id,
            run_id=request.expected.owner_run_id,
            handoff_id=request.handoff_id,
        )
        plan = plan_transfer(
            request.handoff_id,
            request.expected,
            request.expected_owner,
            request.successor,
            list(request.hooks),
            request.trigger_seq,
            request.snapshot_revision,
            request.reason,
            request.inbox_head,
        )
        await self._permitted(request, plan.reason)  # once the request is known well-formed
        done = await self._transfers.transfer(plan)
        if done.moved is not None:
            self._registry.owner_moved(done.moved)
        return pb.TransferResponse(fence=done.outcome.fence, replayed=done.replayed)

    async def _permitted(
        self, request: pb.TransferRequest, reason: s.TransferReason.ValueType
    ) -> None:
        """A transfer moves a session of the deployment `expected_owner`
        names (checked against the owner record while the fence is current;
        a fence that is not current is refused by the transfer itself). A
        trigger or a drain needs that deployment's signed consent
        (services/common/permits.py); an adoption's own compare is that the
        deployment has no live instance."""
        current = await self._scope.deployment_of(request.expected)
        owner_deployment = request.expected_owner.deployment_id
        if current is not None and current != owner_deployment:
            raise PermissionDenied(
                Reason.TRANSFER_NOT_PERMITTED,
                f"transfer not permitted: session {request.expected.session_id} runs on "
                f"another deployment than expected_owner names ({owner_deployment})",
            )
        if not self._permits.required or reason not in (
            s.TRANSFER_REASON_TRIGGER,
            s.TRANSFER_REASON_DRAIN,
        ):
            return
        grant = grant_for(
            request.expected,
            request.handoff_id,
            request.successor.deployment_id,
            request.snapshot_revision,
            reason,
        )
        signer = self._permits.signer(request.permit, grant)
        if signer.deployment_id != owner_deployment:
            raise PermissionDenied(
                Reason.TRANSFER_NOT_PERMITTED,
                f"transfer not permitted: its permit is signed by an owner of deployment "
                f"{signer.deployment_id}, not of the session's ({owner_deployment})",
            )

    async def GetTransfer(
        self, request: pb.GetTransferRequest, context: Context
    ) -> pb.GetTransferResponse:
        structlog.contextvars.bind_contextvars(
            session_id=request.session_id, handoff_id=request.handoff_id
        )
        outcome = await self._transfers.get(request.session_id, request.handoff_id)
        return pb.GetTransferResponse(
            fence=outcome.fence,
            successor=outcome.successor,
            trigger_seq=outcome.trigger_seq,
            reason=outcome.reason,
        )

    async def GetOwner(self, request: pb.GetOwnerRequest, context: Context) -> pb.GetOwnerResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        record, head = await self._transfers.owner(request.session_id)
        return pb.GetOwnerResponse(
            fence=s.Fence(
                session_id=request.session_id,
                owner_run_id=record.owner_run_id,
                epoch=record.epoch,
            ),
            owner=s.OwnerIdentity(
                owner_run_id=record.owner_run_id,
                deployment_id=record.deployment_id,
                instance_id=record.instance_id,
            ),
            parked=record.parked,
            inbox_head=head,
        )

    async def DescribeSession(
        self, request: pb.DescribeSessionRequest, context: Context
    ) -> pb.DescribeSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        channel = _tenant_channel(request.channel)
        record = await self._registry.describe(request.session_id, channel, request.consumed_seq)
        owner = record.owner
        response = pb.DescribeSessionResponse(
            fence=s.Fence(
                session_id=record.session_id, owner_run_id=owner.owner_run_id, epoch=owner.epoch
            ),
            owner=s.OwnerIdentity(
                owner_run_id=owner.owner_run_id,
                deployment_id=owner.deployment_id,
                instance_id=owner.instance_id,
            ),
            parked=owner.parked,
            inbox_head=record.inbox_head,
            hooks=record.hooks,
            channel=record.channel,
        )
        if record.parent:
            response.parent.ParseFromString(record.parent)
        if record.created_ms:
            response.create_time.CopyFrom(timestamp_ms(record.created_ms))
        if record.oldest_unconsumed is not None:
            response.oldest_unconsumed_seq = record.oldest_unconsumed.seq
            response.oldest_unconsumed_accepted_at.CopyFrom(record.oldest_unconsumed.accepted_at)
        return response

    async def ListChannelSessions(
        self, request: pb.ListChannelSessionsRequest, context: Context
    ) -> pb.ListChannelSessionsResponse:
        if not _tenant_channel(request.channel):  # an operator's listing across channels
            every = await self._registry.list_all_channels(
                request.after_channel, request.after_session_id, request.limit
            )
            return pb.ListChannelSessionsResponse(
                sessions=[
                    pb.ChannelSession(session_id=sid, create_time=timestamp_ms(ms), channel=channel)
                    for channel, sid, ms in every.sessions
                ],
                more=every.more,
            )
        if request.after_channel:
            raise InvalidArgument(
                Reason.INVALID_FIELD, "after_channel goes with an empty channel only"
            )
        page = await self._registry.list_channel(
            request.channel, request.after_session_id, request.limit
        )
        return pb.ListChannelSessionsResponse(
            sessions=[
                pb.ChannelSession(
                    session_id=sid, create_time=timestamp_ms(ms), channel=request.channel
                )
                for sid, ms in page.sessions
            ],
            more=page.more,
        )

    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Context
    ) -> pb.CreateSessionResponse:
        structlog.contextvars.bind_contextvars(session_id=request.session_id)
        if not request.HasField("owner"):
            raise InvalidArgument(Reason.MISSING_FIELD, "owner is required")
        identity.current().require_deployment(request.owner.deployment_id, "the owner")
        fence, hooks, first = await self._registry.create_session(
            request.session_id,
            request.owner,
            request.channel,
            list(request.aliases),
            request.parent if request.HasField("parent") else None,
            request.first_command if request.HasField("first_command") else None,
        )
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
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        hooks = await self._registry.claim(request.fence, list(request.tokens))
        return pb.ClaimHooksResponse(hooks=hooks)

    async def ResumeHook(
        self, request: pb.ResumeHookRequest, context: Context
    ) -> pb.ResumeHookResponse:
        if not request.HasField("command"):
            raise InvalidArgument(Reason.MISSING_FIELD, "command is required")
        channel = _tenant_channel(request.channel)
        caller = identity.current()
        if caller.verified and caller.role is Role.OWNER:
            await self._owner_may_deliver(caller, request.token, request.command)
        receipt = await self._registry.resume(request.token, request.command, channel)
        structlog.contextvars.bind_contextvars(session_id=receipt.session_id, seq=receipt.seq)
        return pb.ResumeHookResponse(receipt=receipt)

    async def _owner_may_deliver(self, caller: Caller, token: str, command: s.Command) -> None:
        """An owner (whatever `channel` it names) delivers only what owners
        deliver, by inbox token: to a session of its own deployment (e.g. a
        timeout), to a child whose parent runs on its deployment (work,
        cancel, reset), or a child's `task_result` to that child's own parent
        from the child's deployment. Anything else is PERMISSION_DENIED/
        DELIVERY_NOT_ALLOWED before anything is written. Deployments come
        from the owner records (cached; read again before refusing, as a
        session may have moved since)."""
        namespace, raw = ids.split_token(token)
        if namespace != ids.INBOX_NAMESPACE:
            raise PermissionDenied(
                Reason.DELIVERY_NOT_ALLOWED,
                "an owner delivers by inbox token (session:<id>) only, or names the channel",
            )
        senders: tuple[str, ...]
        if command.WhichOneof("kind") == "task_result":
            report = command.task_result
            child = ids.validate_session_id(report.child_session_id)
            link = await self._registry.parent_of(child)
            if report.parent_session_id != raw or link is None or link.parent_session_id != raw:
                raise PermissionDenied(
                    Reason.DELIVERY_NOT_ALLOWED,
                    f"session {brief(child)} is not a child of session {raw}",
                )
            senders = (child, raw)
        else:
            link = await self._registry.parent_of(raw)
            senders = (raw, link.parent_session_id) if link is not None else (raw,)
        for fresh in (False, True):
            for sid in senders:
                if await self._registry.deployment_of(sid, fresh=fresh) == caller.deployment_id:
                    return
        raise PermissionDenied(
            Reason.DELIVERY_NOT_ALLOWED,
            f"an owner of deployment {caller.deployment_id} may not deliver this to session "
            f"{raw}: neither it nor its parent (or the reporting child) runs there",
        )

    async def LookupHook(
        self, request: pb.LookupHookRequest, context: Context
    ) -> pb.LookupHookResponse:
        record = await self._registry.lookup(request.token, _tenant_channel(request.channel))
        response = pb.LookupHookResponse(session_id=record.session_id, channel=record.channel)
        if record.parent:
            response.parent.ParseFromString(record.parent)
        return response

    async def DisposeHooks(
        self, request: pb.DisposeHooksRequest, context: Context
    ) -> pb.DisposeHooksResponse:
        await self._fenced(request.fence, request.HasField("fence"))
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        hooks = await self._registry.dispose(request.fence, list(request.tokens))
        return pb.DisposeHooksResponse(hooks=hooks)

    async def StreamInbox(
        self, request: pb.StreamInboxRequest, context: Context
    ) -> AsyncIterator[pb.StreamInboxResponse]:
        await self._fenced(request.fence, request.HasField("fence"))
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        check_seq(request.from_seq, "from_seq")
        async for entries in self._registry.stream_inbox(request.fence, request.from_seq):
            yield pb.StreamInboxResponse(entries=entries)

    # -- owner instances, takeover, parking --------------------------------------

    async def RegisterInstance(
        self, request: pb.RegisterInstanceRequest, context: Context
    ) -> pb.RegisterInstanceResponse:
        structlog.contextvars.bind_contextvars(
            deployment_id=request.deployment_id, instance_id=request.instance_id
        )
        identity.current().require_deployment(request.deployment_id, "the instance")
        lease_id, ttl = await self._instances.register(
            request.deployment_id, request.instance_id, request.ttl_seconds, request.address
        )
        return pb.RegisterInstanceResponse(lease_id=lease_id, ttl_seconds=ttl)

    async def KeepAliveInstance(
        self, request: pb.KeepAliveInstanceRequest, context: Context
    ) -> pb.KeepAliveInstanceResponse:
        ttl = await self._instances.keep_alive(request.lease_id)
        return pb.KeepAliveInstanceResponse(ttl_seconds=ttl)

    async def DeregisterInstance(
        self, request: pb.DeregisterInstanceRequest, context: Context
    ) -> pb.DeregisterInstanceResponse:
        await self._instances.deregister(request.lease_id)
        return pb.DeregisterInstanceResponse()

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: Context
    ) -> pb.ListInstancesResponse:
        records = await self._instances.live(request.deployment_id)
        return pb.ListInstancesResponse(instances=[_instance_info(r) for r in records])

    async def WatchInstances(
        self, request: pb.WatchInstancesRequest, context: Context
    ) -> AsyncIterator[pb.WatchInstancesResponse]:
        structlog.contextvars.bind_contextvars(deployment_id=request.deployment_id)
        identity.current().require_deployment(request.deployment_id, "the deployment")
        async for change in self._instances.watch(request.deployment_id):
            yield pb.WatchInstancesResponse(
                instances=[_instance_info(r) for r in change.live],
                dead_instance_ids=change.dead,
            )

    async def ListInstanceSessions(
        self, request: pb.ListInstanceSessionsRequest, context: Context
    ) -> pb.ListInstanceSessionsResponse:
        structlog.contextvars.bind_contextvars(
            deployment_id=request.deployment_id, instance_id=request.instance_id
        )
        identity.current().require_deployment(request.deployment_id, "the instance")
        owned = await self._registry.list_owned(request.deployment_id, request.instance_id)
        return pb.ListInstanceSessionsResponse(
            sessions=[
                pb.OwnedSession(
                    fence=o.fence,
                    owner=s.OwnerIdentity(
                        owner_run_id=o.owner.owner_run_id,
                        deployment_id=o.owner.deployment_id,
                        instance_id=o.owner.instance_id,
                    ),
                    parked=o.owner.parked,
                )
                for o in owned
            ]
        )

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
        taken = await self._registry.take_over(
            request.expected, request.expected_instance_id, request.successor
        )
        return pb.TakeOverSessionResponse(
            fence=taken.fence, parked=taken.parked, inbox_head=taken.inbox_head
        )

    async def SetParked(
        self, request: pb.SetParkedRequest, context: Context
    ) -> pb.SetParkedResponse:
        await self._fenced(request.fence, request.HasField("fence"))
        structlog.contextvars.bind_contextvars(
            session_id=request.fence.session_id, run_id=request.fence.owner_run_id
        )
        check_seq(request.inbox_next_seq, "inbox_next_seq")
        head = await self._registry.set_parked(
            request.fence, request.parked, request.inbox_next_seq
        )
        return pb.SetParkedResponse(inbox_head=head)

    async def WatchBells(
        self, request: pb.WatchBellsRequest, context: Context
    ) -> AsyncIterator[pb.WatchBellsResponse]:
        structlog.contextvars.bind_contextvars(instance_id=request.instance_id)
        async for bells in self._instances.watch_bells(request.instance_id):
            yield pb.WatchBellsResponse(
                bells=[pb.Bell(session_id=b.session_id, inbox_head=b.inbox_head) for b in bells]
            )

    async def ListDeployments(
        self, request: pb.ListDeploymentsRequest, context: Context
    ) -> pb.ListDeploymentsResponse:
        fleets = await self._fleets.list_all()
        return pb.ListDeploymentsResponse(deployments=[_deployment_info(f) for f in fleets])

    async def DescribeDeployment(
        self, request: pb.DescribeDeploymentRequest, context: Context
    ) -> pb.DescribeDeploymentResponse:
        structlog.contextvars.bind_contextvars(deployment_id=request.deployment_id)
        fleet = await self._fleets.describe(request.deployment_id)
        return pb.DescribeDeploymentResponse(deployment=_deployment_info(fleet))


def _deployment_info(fleet: Fleet) -> pb.DeploymentInfo:
    return pb.DeploymentInfo(
        deployment_id=fleet.deployment_id,
        instances=[
            pb.InstanceLease(
                instance=_instance_info(i.record),
                lease_id=i.lease_id,
                ttl_seconds=i.ttl_seconds,
                granted_ttl_seconds=i.granted_ttl_seconds,
                sessions=i.sessions,
            )
            for i in fleet.instances
        ],
        sessions=fleet.sessions,
        sessions_of_gone_instances=fleet.sessions_of_gone_instances,
    )


def _instance_info(record: InstanceRecord) -> pb.InstanceInfo:
    return pb.InstanceInfo(
        deployment_id=record.deployment_id,
        instance_id=record.instance_id,
        address=record.address,
    )
