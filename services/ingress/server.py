"""Assembly of the ingress server."""

from __future__ import annotations

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2, ingress_pb2_grpc
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.rpc.server import GrpcServer, ServiceBinding, build_server
from baton_runtime.ingress.config import IngressConfig
from baton_runtime.ingress.edge import Edge
from baton_runtime.ingress.introspection import SessionViews
from baton_runtime.ingress.orphans import OrphanWatch
from baton_runtime.ingress.servicer import IngressServicer

SERVICE_NAME = ingress_pb2.DESCRIPTOR.services_by_name["IngressService"].full_name


async def create_server(config: IngressConfig) -> GrpcServer:
    hooks = HooksClient(config.hooks, security=config.tls, multiplexed=config.resume_stream)
    anchor = AnchorClient(config.anchor, security=config.tls, event_feed=config.event_feed)
    owner = OwnerClient(config.owner, security=config.tls)
    orphans = OrphanWatch(config.deployment_id, hooks, owner)
    edge = Edge(
        config.deployment_id,
        config.api_keys,
        hooks,
        anchor,
        owner,
        config.max_message_bytes,
        orphans,
        config.limits,
    )
    servicer = IngressServicer(edge, SessionViews(hooks, anchor))
    server = build_server(
        config.listen,
        [
            ServiceBinding(
                SERVICE_NAME,
                lambda srv: ingress_pb2_grpc.add_IngressServiceServicer_to_server(servicer, srv),
            )
        ],
        service="ingress",
        security=config.tls,
        # Gateways authenticate with API keys, not certificates.
        client_certificates=False,
        deployment_id=config.deployment_id,
        max_message_bytes=1024 * 1024,
        capacity=config.capacity,
        health_listen=config.health_listen,
        metrics_listen=config.metrics_listen,
    )
    server.on_reload.append(config.api_keys.reload)
    # A key file updated in place (a Kubernetes secret volume) is re-read
    # without a SIGHUP, as often as certificate files are checked.
    server.background.append(lambda: config.api_keys.watch(config.tls.check_every))
    for client in (hooks, anchor, owner):
        server.on_stop.append(client.close)
    server.on_stop.append(orphans.close)
    return server
