"""Assembly of the owner server."""

from __future__ import annotations

from baton.owner.v1 import owner_pb2, owner_pb2_grpc
from services.common.clients import AnchorClient, HooksClient
from services.common.server import GrpcServer, ServiceBinding, build_server
from services.owner.agent import load_agent
from services.owner.config import OwnerConfig
from services.owner.host import OwnerHost
from services.owner.servicer import OwnerServicer

SERVICE_NAME = owner_pb2.DESCRIPTOR.services_by_name["OwnerService"].full_name


async def create_server(config: OwnerConfig) -> GrpcServer:
    agent = load_agent(config.agent, config.deployment_id)
    hooks = HooksClient(config.hooks)
    anchor = AnchorClient(config.anchor)
    host = OwnerHost(config.deployment_id, config.instance_id, agent, hooks, anchor)
    servicer = OwnerServicer(host)
    server = build_server(
        config.listen,
        [
            ServiceBinding(
                SERVICE_NAME,
                lambda srv: owner_pb2_grpc.add_OwnerServiceServicer_to_server(servicer, srv),
            )
        ],
        service="owner",
        deployment_id=config.deployment_id,
    )
    server.on_stop.append(hooks.close)
    server.on_stop.append(anchor.close)
    server.on_stop.append(host.close)
    return server
