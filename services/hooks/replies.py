"""The hooks API's reply messages built from domain records: an owner's
identity and fence, a session's description, instance and deployment
information. The servicer's proto side, written once (three replies name
an owner)."""

from __future__ import annotations

from collections.abc import Iterable

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.etcd.keys import InstanceRecord, OwnerRecord
from baton_runtime.hooks.directory import SessionRecord, timestamp_ms
from baton_runtime.hooks.fleet_views import Fleet, FleetStatus
from baton_runtime.hooks.owned_listing import OwnedPage


def owner_identity(record: OwnerRecord) -> s.OwnerIdentity:
    return s.OwnerIdentity(
        owner_run_id=record.owner_run_id,
        deployment_id=record.deployment_id,
        instance_id=record.instance_id,
    )


def owned_page_reply(page: OwnedPage) -> pb.ListInstanceSessionsResponse:
    return pb.ListInstanceSessionsResponse(
        sessions=[
            pb.OwnedSession(
                fence=o.fence,
                owner=owner_identity(o.owner),
                parked=o.owner.parked,
                input_waiting=o.input_waiting,
            )
            for o in page.sessions
        ],
        next_page_token=page.next_page_token,
    )


def channel_sessions_reply(
    sessions: Iterable[tuple[str, str, int]], more: bool
) -> pb.ListChannelSessionsResponse:
    """A listing page of (channel, session id, creation ms)."""
    return pb.ListChannelSessionsResponse(
        sessions=[
            pb.ChannelSession(session_id=sid, create_time=timestamp_ms(ms), channel=channel)
            for channel, sid, ms in sessions
        ],
        more=more,
    )


def owner_fence(session_id: str, record: OwnerRecord) -> s.Fence:
    return s.Fence(session_id=session_id, owner_run_id=record.owner_run_id, epoch=record.epoch)


def describe_reply(record: SessionRecord) -> pb.DescribeSessionResponse:
    response = pb.DescribeSessionResponse(
        fence=owner_fence(record.session_id, record.owner),
        owner=owner_identity(record.owner),
        parked=record.owner.parked,
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


_FLEET_STATUS = {
    FleetStatus.ACTIVE: pb.DEPLOYMENT_STATUS_ACTIVE,
    FleetStatus.DRAINING: pb.DEPLOYMENT_STATUS_DRAINING,
    FleetStatus.DRAINED: pb.DEPLOYMENT_STATUS_DRAINED,
    FleetStatus.RETIRED: pb.DEPLOYMENT_STATUS_RETIRED,
}


def deployment_info(fleet: Fleet) -> pb.DeploymentInfo:
    return pb.DeploymentInfo(
        deployment_id=fleet.deployment_id,
        status=_FLEET_STATUS[fleet.status],
        instances=[
            pb.InstanceLease(
                instance=instance_info(i.record),
                lease_id=i.lease_id,
                ttl_seconds=i.ttl_seconds,
                granted_ttl_seconds=i.granted_ttl_seconds,
                sessions=i.sessions,
                drain_to_deployment_id=i.record.drain_to,
            )
            for i in fleet.instances
        ],
        sessions=fleet.sessions,
        sessions_of_gone_instances=fleet.sessions_of_gone_instances,
    )


def instance_info(record: InstanceRecord) -> pb.InstanceInfo:
    return pb.InstanceInfo(
        deployment_id=record.deployment_id,
        instance_id=record.instance_id,
        address=record.address,
        agent=pb.AgentInfo(
            spec=record.agent.spec, name=record.agent.name, version=record.agent.version
        ),
        drain_to_deployment_id=record.drain_to,
    )
