"""The environment each service process of `baton up` is started with:
its identity (certificate, or plaintext), where etcd or its peers are
(every replica, comma-separated), and the flags `baton up` passes on.
Pure: from the settings, the port plan and the service's security."""

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


def service_env(
    kind: str,
    dep: DeploymentPorts | None,
    *,
    settings: LaunchSettings,
    ports: Ports,
    security: Security,
    api_key_file: str,
) -> dict[str, str]:
    """The environment of a `kind` process (of `dep` for owner/ingress)."""
    env = _identity_env(settings, security)
    if kind == "hooks" and settings.dedupe_window is not None:
        env["BATON_DEDUPE_WINDOW"] = f"{settings.dedupe_window:g}"
    if dep is None:
        if kind == "anchor":
            env |= _stream_retention_env(settings)
        return env | {
            "BATON_ETCD_ENDPOINT": addresses([client for client, _ in ports.etcd]),
            "BATON_ETCD_PREFIX": ETCD_PREFIX,
            # hooks and anchor judge etcd's members again: the same answer.
            "BATON_ACCEPT_ETCD_RISK": "1" if settings.accept_etcd_risk else "0",
        }
    env |= {
        "BATON_DEPLOYMENT_ID": dep.deployment_id,
        "BATON_HOOKS_ADDR": addresses(ports.hooks),
        "BATON_ANCHOR_ADDR": addresses(ports.anchors),
    }
    if kind == "ingress":
        env |= {
            # Each ingress starts sessions on its own deployment's owners.
            "BATON_OWNER_ADDR": addresses(dep.owners),
            "BATON_API_KEYS_FILE": api_key_file,
        }
    return env


def _identity_env(settings: LaunchSettings, security: Security) -> dict[str, str]:
    env = {
        "PYTHONPATH": python_path(),
        "PYTHONUNBUFFERED": "1",
        "BATON_LOG_LEVEL": settings.log_level,
    }
    if security.files is None:
        env["BATON_PLAINTEXT"] = "1"
    else:
        # The service's own certificate also authenticates it to etcd (its
        # CN is the etcd user).
        env |= {
            "BATON_TLS_CERT": security.files.cert,
            "BATON_TLS_KEY": security.files.key,
            "BATON_TLS_CA": security.files.ca,
        }
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
    settings: LaunchSettings,
    ports: Ports,
    security: Security,
    api_key: str,
    token: str,
) -> dict[str, str]:
    """The web console's environment (services/console/config.py): the
    operator identity, hooks and anchor, each deployment's ingress, and the
    secrets it reads from the environment only (the API key its cancel and
    reset use, the console token)."""
    ingresses = ",".join(f"{d.deployment_id}=127.0.0.1:{d.ingress}" for d in ports.deployments)
    return _identity_env(settings, security) | {
        "BATON_HOOKS_ADDR": addresses(ports.hooks),
        "BATON_ANCHOR_ADDR": addresses(ports.anchors),
        "BATON_CONSOLE_INGRESSES": ingresses,
        "BATON_API_KEY": api_key,
        "BATON_CONSOLE_TOKEN": token,
    }
