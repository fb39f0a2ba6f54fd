"""The environment a Baton service process is started with: its identity
(`identity_env`: its certificate's files, or plaintext, and its log level),
where what it calls is (`wiring_env`: etcd for hooks and anchor; hooks,
anchor and its deployment's owners for the others; every replica,
comma-separated), and, for `baton up`, the flags it passes on
(`service_env`, `console_env`). Pure. Every launcher of Baton processes
builds a service's environment here (services/cli/system/service_launcher.py)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import baton_runtime
from baton_runtime.cli.system.launch_settings import ETCD_PREFIX, LaunchSettings
from baton_runtime.cli.system.port_plan import DeploymentPorts, Ports
from baton_runtime.common.security.tls import Security


def python_path() -> str:
    """PYTHONPATH for `python -m baton_runtime.…` children, from any working dir."""
    root = str(Path(baton_runtime.__file__).resolve().parent.parent)
    return os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))


def addresses(ports: Sequence[int]) -> str:
    """Loopback addresses, comma-separated (what a client of replicas takes)."""
    return ",".join(f"127.0.0.1:{port}" for port in ports)


def identity_env(security: Security, log_level: str = "info") -> dict[str, str]:
    """Who the process is: its certificate's files (BATON_TLS_CERT/KEY/CA;
    the certificate also authenticates hooks and anchor to etcd, its CN
    being the etcd user), or BATON_PLAINTEXT; its log level; and the Python
    path it imports `baton_runtime` from."""
    env = {
        "PYTHONPATH": python_path(),
        "PYTHONUNBUFFERED": "1",
        "BATON_LOG_LEVEL": log_level,
    }
    if security.files is None:
        env["BATON_PLAINTEXT"] = "1"
    else:
        env |= {
            "BATON_TLS_CERT": security.files.cert,
            "BATON_TLS_KEY": security.files.key,
            "BATON_TLS_CA": security.files.ca,
        }
    return env


def wiring_env(
    kind: str,
    *,
    etcd: str = "",
    prefix: str = "",
    hooks: str = "",
    anchor: str = "",
    deployment_id: str = "",
    owners: str = "",
    api_keys_file: str = "",
) -> dict[str, str]:
    """Where a `kind` process finds what it calls (addresses comma-separated,
    one per replica): hooks and anchor, etcd and their key prefix; owners and
    ingresses, hooks, anchor and their deployment; an ingress, also the
    owners it starts sessions on and its API key file."""
    if kind in ("hooks", "anchor"):
        return {"BATON_ETCD_ENDPOINT": etcd, "BATON_ETCD_PREFIX": prefix}
    env = {
        "BATON_HOOKS_ADDR": hooks,
        "BATON_ANCHOR_ADDR": anchor,
        "BATON_DEPLOYMENT_ID": deployment_id,
    }
    if kind == "ingress":
        env |= {"BATON_OWNER_ADDR": owners, "BATON_API_KEYS_FILE": api_keys_file}
    return env


def service_env(
    kind: str,
    dep: DeploymentPorts | None,
    *,
    settings: LaunchSettings,
    ports: Ports,
    api_key_file: str,
    object_store: str = "",
) -> dict[str, str]:
    """What a `kind` process of `baton up` (of `dep` for owner/ingress) is
    started with besides its identity: its wiring and the flags `baton up`
    passes on; `object_store`: anchor's object store URL."""
    env: dict[str, str] = {}
    if kind == "hooks" and settings.dedupe_window is not None:
        env["BATON_DEDUPE_WINDOW"] = f"{settings.dedupe_window:g}"
    if dep is None:
        if kind == "anchor":
            env |= _stream_retention_env(settings)
            if object_store:
                env["BATON_OBJECT_STORE"] = object_store
        etcd = addresses([client for client, _ in ports.etcd])
        return (
            env
            | wiring_env(kind, etcd=etcd, prefix=ETCD_PREFIX)
            | {
                # hooks and anchor judge etcd's members again: the same answer.
                "BATON_ACCEPT_ETCD_RISK": "1" if settings.accept_etcd_risk else "0",
            }
        )
    env |= wiring_env(
        kind,
        hooks=addresses(ports.hooks),
        anchor=addresses(ports.anchors),
        deployment_id=dep.deployment_id,
        # Each ingress starts sessions on its own deployment's owners.
        owners=addresses(dep.owners),
        api_keys_file=api_key_file,
    )
    if kind == "owner" and settings.agent_of(dep.deployment_id):
        env["BATON_AGENT"] = settings.agent_of(dep.deployment_id)
    return env


def _stream_retention_env(settings: LaunchSettings) -> dict[str, str]:
    env: dict[str, str] = {}
    if settings.stream_retention_events is not None:
        env["BATON_STREAM_RETENTION_EVENTS"] = str(settings.stream_retention_events)
    if settings.stream_retention is not None:
        env["BATON_STREAM_RETENTION"] = str(settings.stream_retention)
    return env


def console_env(
    *,
    ports: Ports,
    api_key: str,
    token: str,
) -> dict[str, str]:
    """The web console's environment (services/console/config.py) besides
    its identity (an operator's): hooks and anchor, each deployment's
    ingress, and the secrets it reads from the environment only (the API key
    its cancel and reset use, the console token)."""
    ingresses = ",".join(f"{d.deployment_id}=127.0.0.1:{d.ingress}" for d in ports.deployments)
    return {
        "BATON_HOOKS_ADDR": addresses(ports.hooks),
        "BATON_ANCHOR_ADDR": addresses(ports.anchors),
        "BATON_CONSOLE_INGRESSES": ingresses,
        "BATON_API_KEY": api_key,
        "BATON_CONSOLE_TOKEN": token,
    }
