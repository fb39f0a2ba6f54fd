"""Assembly of the anchor server."""

from __future__ import annotations

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2, anchor_pb2_grpc
from baton_runtime.anchor.config import AnchorConfig
from baton_runtime.anchor.horizon import StreamHorizon
from baton_runtime.anchor.journal import Journal
from baton_runtime.anchor.retention import Retention
from baton_runtime.anchor.servicer import AnchorServicer
from baton_runtime.common.etcd.health import StoreHealth
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.members import connect_checked
from baton_runtime.common.etcd.scope import DeploymentScope
from baton_runtime.common.rpc.server import GrpcServer, ServiceBinding, build_server

SERVICE_NAME = anchor_pb2.DESCRIPTOR.services_by_name["AnchorService"].full_name


async def create_server(config: AnchorConfig) -> GrpcServer:
    # An external cluster's members are judged too: refuse a known-bad release.
    store = await connect_checked(config.etcd)
    keys = Keys(config.etcd.prefix)
    horizon = StreamHorizon(
        store, keys, config.stream_policy, interval_seconds=config.retention_sweep_seconds
    )
    journal = Journal(store, keys, retention_seconds=config.retention_seconds, horizon=horizon)
    servicer = AnchorServicer(journal, DeploymentScope(store, keys))
    server = build_server(
        config.listen,
        [
            ServiceBinding(
                SERVICE_NAME,
                lambda srv: anchor_pb2_grpc.add_AnchorServiceServicer_to_server(servicer, srv),
            )
        ],
        service="anchor",
        security=config.tls,
        capacity=config.capacity,
        health_listen=config.health_listen,
        metrics_listen=config.metrics_listen,
    )
    retention = Retention(store, keys, interval_seconds=config.retention_sweep_seconds)
    server.background += [StoreHealth(store, server.set_serving).run, retention.run, horizon.run]
    server.app = journal
    server.on_stop.append(store.close)
    return server
