"""Assembly of the hooks server."""

from __future__ import annotations

from baton.hooks.v1 import hooks_pb2, hooks_pb2_grpc
from services.common.etcd_members import connect_checked
from services.common.grpc_server import GrpcServer, ServiceBinding, build_server
from services.common.keys import Keys
from services.common.permits import PermitVerifier
from services.common.scope import DeploymentScope
from services.common.store_health import StoreHealth
from services.hooks.config import HooksConfig
from services.hooks.consent import Consent
from services.hooks.expiry import ExpiryLeases
from services.hooks.fleets import FleetViews
from services.hooks.instances import InstanceRegistry
from services.hooks.registry import HookRegistry
from services.hooks.servicer import HookRegistryServicer
from services.hooks.transfer import Transfers

SERVICE_NAME = hooks_pb2.DESCRIPTOR.services_by_name["HookRegistryService"].full_name


async def create_server(config: HooksConfig) -> GrpcServer:
    # An external cluster's members are judged too: refuse a known-bad release.
    store = await connect_checked(config.etcd)
    keys = Keys(config.etcd.prefix)
    leases = ExpiryLeases(store, config.dedupe_window_seconds)
    registry = HookRegistry(store, keys, leases)
    transfers = Transfers(store, keys, leases)
    instances = InstanceRegistry(store, keys)
    scope = DeploymentScope(store, keys)
    servicer = HookRegistryServicer(
        registry,
        instances,
        transfers,
        scope,
        Consent(registry, scope, PermitVerifier(config.tls)),
        FleetViews(store, keys),
    )
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
        capacity=config.capacity,
        health_listen=config.health_listen,
        metrics_listen=config.metrics_listen,
    )
    server.background.append(StoreHealth(store, server.set_serving).run)
    if server.metrics is not None:
        server.metrics.refresh.append(instances.refresh_metrics)
    server.app = registry
    server.on_stop.append(store.close)
    server.on_stop.append(registry.close)
    return server
