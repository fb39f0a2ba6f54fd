"""owner configuration: flags, then env, then defaults. The deployment id is
required and exact (`latest` is refused)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baton_runtime.common.config import (
    ADDRESSES_HELP,
    COMMON_SETTINGS,
    Capacity,
    ConfigError,
    Setting,
    as_addresses,
    as_float,
    as_int,
    as_listen,
    as_switch,
    read_settings,
    security_from_values,
)
from baton_runtime.common.errors import BatonError
from baton_runtime.common.ids import validate_deployment_id
from baton_runtime.common.security.tls import Security
from baton_runtime.owner.host.fleet import DEFAULT_RECONCILE_INTERVAL

DEFAULT_AGENT = "baton_runtime.owner.agents.fixture:build_agent"
DEFAULT_LEASE_TTL = 5
DEFAULT_PARK_AFTER = 10.0
# Enough for every session of a busy instance to commit at once in a batch;
# few enough that a burst queues here, not in hooks or anchor (where every
# queued call would wait out its deadline: docs/recovery.md, owner overload).
DEFAULT_MAX_CALLS_IN_FLIGHT = 128


# The owner's flags and environment (with the settings every service shares).
SETTINGS = (
    Setting("--listen", "BATON_OWNER_LISTEN", "host:port to serve on", "127.0.0.1:50054"),
    Setting("--deployment-id", "BATON_DEPLOYMENT_ID", "exact deployment id of this build"),
    Setting("--instance-id", "BATON_INSTANCE_ID", "this instance's id", ""),
    Setting("--hooks", "BATON_HOOKS_ADDR", f"hooks: {ADDRESSES_HELP}", "127.0.0.1:50052"),
    Setting("--anchor", "BATON_ANCHOR_ADDR", f"anchor: {ADDRESSES_HELP}", "127.0.0.1:50053"),
    Setting("--agent", "BATON_AGENT", "agent factory module:function", DEFAULT_AGENT),
    Setting(
        "--lease-ttl",
        "BATON_OWNER_LEASE_TTL",
        "instance lease TTL, whole seconds",
        str(DEFAULT_LEASE_TTL),
    ),
    Setting(
        "--keepalive-interval",
        "BATON_OWNER_KEEPALIVE_INTERVAL",
        "seconds between lease keep-alives (0 = TTL/3)",
        "0",
    ),
    Setting(
        "--park-after",
        "BATON_OWNER_PARK_AFTER",
        "park a session idle this many seconds (0 = never park)",
        str(DEFAULT_PARK_AFTER),
    ),
    Setting(
        "--advertise",
        "BATON_OWNER_ADVERTISE",
        "address others reach this instance at (default: listen host + port)",
        "",
    ),
    Setting(
        "--snapshot-formats",
        "BATON_OWNER_SNAPSHOT_FORMATS",
        "snapshot format versions this build reads, comma-separated",
        "2",
    ),
    Setting(
        "--restart-budget",
        "BATON_OWNER_RESTART_BUDGET",
        "deterministically failed runs of a session in a row before it stalls",
        "5",
    ),
    Setting(
        "--reconcile-interval",
        "BATON_OWNER_RECONCILE_INTERVAL",
        "seconds between checks that every session indexed here has a run",
        str(DEFAULT_RECONCILE_INTERVAL),
    ),
    Setting(
        "--commit-stream",
        "BATON_OWNER_COMMIT_STREAM",
        "commit over one multiplexed CommitSteps stream per anchor replica (1), "
        "or with one unary CommitStep call each (0)",
        "1",
    ),
    Setting(
        "--inbox-feed",
        "BATON_OWNER_INBOX_FEED",
        "read every session's inbox over one multiplexed FollowInboxes stream (1), "
        "or with one StreamInbox call per session (0)",
        "1",
    ),
    Setting(
        "--max-calls-in-flight",
        "BATON_OWNER_MAX_CALLS_IN_FLIGHT",
        "calls in flight at once to hooks, and apart to anchor; more wait here, unsent "
        "(the lease keep-alive never waits; 0 = no bound)",
        str(DEFAULT_MAX_CALLS_IN_FLIGHT),
    ),
    *COMMON_SETTINGS,
)


@dataclass(frozen=True)
class OwnerConfig:
    listen: str
    deployment_id: str
    instance_id: str
    hooks: str
    anchor: str
    # This instance's identity (serves and calls with it), or plaintext.
    tls: Security
    agent: str = DEFAULT_AGENT
    log_level: str = "info"
    grace: float = 5.0
    # The instance's etcd lease (whole seconds); sessions of an instance that
    # misses it are taken over by the other instances of the deployment.
    lease_ttl: int = DEFAULT_LEASE_TTL
    # Seconds between lease keep-alives; 0 means lease_ttl / 3.
    keepalive_interval: float = 0.0
    # Park a session idle this many seconds (drop it from memory until its
    # inbox receives a command); None never parks.
    park_after: float | None = DEFAULT_PARK_AFTER
    # The address other services reach this instance at; "" = the listen
    # host with the bound port.
    advertise: str = ""
    # Exit the process (non-zero) when the lease is lost, so a supervisor
    # restarts it; in-process (tests) the host only stops its runs.
    exit_on_lease_loss: bool = False
    # Snapshot format versions this build reads; a handoff whose checkpoint
    # has another format is refused (the old owner keeps the session).
    snapshot_formats: frozenset[int] = frozenset({2})
    # Failed runs of a session in a row (deterministic failures only) before
    # the session stalls (session.stalled on its stream).
    restart_budget: int = 5
    # Seconds between reconciliations: sessions indexed here that no run
    # holds are taken over again (services/owner/host/fleet.py).
    reconcile_interval: float = DEFAULT_RECONCILE_INTERVAL
    # Commits ride a multiplexed CommitSteps stream (services/common/streams/multiplex.py);
    # False: one unary CommitStep call each.
    commit_stream: bool = True
    inbox_feed: bool = True
    # Calls in flight at once to hooks, and apart to anchor (the rest wait
    # in this process, unsent: services/common/clients/call_slots.py); 0: no bound.
    max_calls_in_flight: int = DEFAULT_MAX_CALLS_IN_FLIGHT
    capacity: Capacity = Capacity()
    # A plaintext listener serving only health (probes without TLS); empty: none.
    health_listen: str = ""
    # A plaintext HTTP listener serving Prometheus metrics; empty: none.
    metrics_listen: str = ""

    @property
    def keepalive_every(self) -> float:
        return self.keepalive_interval or self.lease_ttl / 3

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> OwnerConfig:
        values = read_settings("baton_runtime.owner", SETTINGS, argv, environ)
        deployment_id = _deployment_id(values["deployment_id"])
        formats = _snapshot_formats(values["snapshot_formats"])
        return cls(
            listen=values["listen"],
            deployment_id=deployment_id,
            instance_id=values["instance_id"] or f"{socket.gethostname()}-{os.getpid()}",
            hooks=as_addresses(values, "hooks"),
            anchor=as_addresses(values, "anchor"),
            tls=security_from_values(values),
            agent=values["agent"],
            log_level=values["log_level"],
            grace=as_float(values, "grace"),
            lease_ttl=as_int(values, "lease_ttl", minimum=1),
            keepalive_interval=as_float(values, "keepalive_interval"),
            park_after=as_float(values, "park_after") or None,
            advertise=values["advertise"],
            exit_on_lease_loss=True,
            snapshot_formats=formats,
            restart_budget=as_int(values, "restart_budget"),
            reconcile_interval=as_float(values, "reconcile_interval", minimum=0.1),
            commit_stream=as_switch(values, "commit_stream"),
            inbox_feed=as_switch(values, "inbox_feed"),
            max_calls_in_flight=as_int(values, "max_calls_in_flight", minimum=0),
            capacity=Capacity.from_values(values),
            health_listen=values["health_listen"],
            metrics_listen=as_listen(values, "metrics_listen"),
        )


def _deployment_id(raw: str) -> str:
    try:
        return validate_deployment_id(raw)
    except BatonError as exc:
        raise ConfigError(f"baton_runtime.owner: {exc.message}") from exc


def _snapshot_formats(raw: str) -> frozenset[int]:
    """--snapshot-formats: comma-separated integers, at least one."""
    try:
        formats = frozenset(int(f) for f in raw.split(",") if f.strip())
    except ValueError as exc:
        raise ConfigError(
            f"baton_runtime.owner: --snapshot-formats must be integers, not {raw!r}"
        ) from exc
    if not formats:
        raise ConfigError("baton_runtime.owner: --snapshot-formats names no format")
    return formats
