"""Assembly of the hooks server."""

from __future__ import annotations

import dataclasses

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2, hooks_pb2_grpc
from baton_runtime.common.clients.hooks_methods import HOOKS_UNLIMITED
from baton_runtime.common.etcd.health import StoreHealth
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.members import connect_checked
from baton_runtime.common.rpc.server import GrpcServer, ServiceBinding, build_server
from baton_runtime.common.security.permits import PermitVerifier
from baton_runtime.hooks.config import HooksConfig
from baton_runtime.hooks.rooms import HookRooms
from baton_runtime.hooks.servicer import HookRegistryServicer

SERVICE_NAME = hooks_pb2.DESCRIPTOR.services_by_name["HookRegistryService"].full_name
# An owner's membership is served past the server's capacity (config.Capacity).
MEMBERSHIP_METHODS = frozenset(f"/{SERVICE_NAME}/{name}" for name in HOOKS_UNLIMITED)


async def create_server(config: HooksConfig) -> GrpcServer:
    # An external cluster's members are judged too: refuse a known-bad release.
    store = await connect_checked(config.etcd)
    rooms = HookRooms.over(
        store,
        Keys(config.etcd.prefix),
        config.dedupe_window_seconds,
        PermitVerifier(config.tls),
    )
    servicer = HookRegistryServicer(rooms)
    server = build_server(
        config.listen,
        [
            ServiceBinding(
                SERVICE_NAME,
                lambda srv: hooks_pb2_grpc.add_HookRegistryServiceServicer_to_server(servicer, srv),
            )
        ],
        service="hooks",
        security=config.tls,
        capacity=dataclasses.replace(config.capacity, unmetered=MEMBERSHIP_METHODS),
        health_listen=config.health_listen,
        metrics_listen=config.metrics_listen,
    )
    server.background.append(StoreHealth(store, server.set_serving).run)
    if server.metrics is not None:
        server.metrics.refresh.append(rooms.instances.refresh_metrics)
    server.app = rooms
    server.on_stop.append(store.close)
    server.on_stop.append(rooms.close)
    return server
