"""Assembly of the owner server: the host, its fleet membership, the servicer."""

from __future__ import annotations

import os
import sys

import structlog

from baton_runtime._proto.baton.owner.v1 import owner_pb2, owner_pb2_grpc
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.etcd.keys import AgentLabel
from baton_runtime.common.rpc.server import GrpcServer, ServiceBinding, build_server
from baton_runtime.owner.agents.api import Agent, load_agent
from baton_runtime.owner.config import OwnerConfig
from baton_runtime.owner.host.fleet import FleetMembership
from baton_runtime.owner.host.heap import HeapTrimmer
from baton_runtime.owner.host.host import OwnerHost
from baton_runtime.owner.host.sessions import HostSettings
from baton_runtime.owner.host.sweep import UnclaimedSessions
from baton_runtime.owner.run.metering import HeldSessions
from baton_runtime.owner.servicer import OwnerServicer

SERVICE_NAME = owner_pb2.DESCRIPTOR.services_by_name["OwnerService"].full_name
EXIT_LEASE_LOST = 3

log = structlog.get_logger("baton.owner")


async def exit_process() -> None:
    """The lease is lost and every run stopped: exit non-zero at once, for a
    supervisor to start a fresh instance (which registers anew)."""
    log.error("exiting: lease lost", exit_code=EXIT_LEASE_LOST)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


def advertised_address(listen: str, port: int) -> str:
    host = listen.rpartition(":")[0] or "127.0.0.1"
    if host in ("0.0.0.0", "[::]", ""):
        host = "127.0.0.1"
    return f"{host}:{port}"


def _peer_clients(config: OwnerConfig) -> tuple[HooksClient, AnchorClient]:
    """Hooks and anchor, each with the bound on calls in flight to it."""
    bound = config.max_calls_in_flight
    hooks = HooksClient(
        config.hooks, security=config.tls, max_in_flight=bound, inbox_feed=config.inbox_feed
    )
    anchor = AnchorClient(
        config.anchor, security=config.tls, multiplexed=config.commit_stream, max_in_flight=bound
    )
    return hooks, anchor


def _loaded(spec: str, agent: Agent) -> AgentLabel:
    """Say which agent code this owner runs (the log, and its registry
    entry for `baton deployments describe`)."""
    label = AgentLabel(spec=spec, name=agent.name, version=agent.version)
    log.info(
        "agent loaded",
        agent=spec,
        agent_name=agent.name,
        agent_version=agent.version,
        tools=[t.name for t in agent.tools],
        subagents=[a.name for a in agent.subagents],
    )
    return label


async def create_server(config: OwnerConfig) -> GrpcServer:
    agent = load_agent(config.agent, config.deployment_id)
    label = _loaded(config.agent, agent)
    hooks, anchor = _peer_clients(config)
    settings = HostSettings(
        config.deployment_id,
        config.instance_id,
        park_after=config.park_after,
        readable_formats=config.snapshot_formats,
        restart_budget=config.restart_budget,
    )
    host = OwnerHost(settings, agent, hooks, anchor)
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
        security=config.tls,
        deployment_id=config.deployment_id,
        capacity=config.capacity,
        health_listen=config.health_listen,
        metrics_listen=config.metrics_listen,
    )
    fleet = FleetMembership(
        host,
        hooks,
        address=config.advertise or advertised_address(config.listen, server.port),
        agent=label,
        lease_ttl=config.lease_ttl,
        keepalive_every=config.keepalive_every,
        on_lease_lost=exit_process if config.exit_on_lease_loss else None,
        reconcile_every=config.reconcile_interval,
    )
    fleet.start()
    trimmer = HeapTrimmer(lambda: host.parking.parks)
    trimmer.start()
    if server.metrics is not None:
        server.metrics.add(HeldSessions(host))
        server.metrics.add(UnclaimedSessions(fleet.parked))
    server.app = host
    # on_stop runs in reverse: the fleet (streams, runs, deregistration), then channels.
    server.on_stop.append(hooks.close)
    server.on_stop.append(anchor.close)
    server.on_stop.append(host.close)
    server.on_stop.append(fleet.close)
    server.on_stop.append(trimmer.close)
    return server
