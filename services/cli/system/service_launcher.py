"""The one launcher of Baton's service processes (`ServiceLauncher`), used
by `baton up` (services/cli/system/local_system.py), the tests' process
stacks (tests/procs.py, tests/chaos.py), the harness of the chaos run and the
benchmarks (bench/stack.py, bench/topology.py, bench/idle_rss.py).

Each process is named (`hooks`, `o1`, `dep-a.in2`, ...) and is of a kind
(the module `python -m baton_runtime.<kind>` runs) and, for owners and
ingresses, of a deployment. The launcher gives it a loopback port, its
environment (its role's certificate from the launcher's PKI, a directory of
certificates, or plaintext; its log level; a metrics port when asked; then
the caller's wiring: services/cli/system/service_env.py), a log file in the
log directory, and starts it through the orphan guard (it dies with the
thread that started it). It waits for SERVING (and says which process died,
with the end of its log, if one exits meanwhile), kills, pauses, resumes or
terminates one by name, and stops them all, last started first: SIGTERM,
then a kill after a timeout, so no process is left behind.

etcd, with TLS and Baton's user/role auth when there is a PKI, is started by
`start_etcd` and `start_etcd_cluster` here too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton_runtime.cli.system.etcd_auth import enable_auth
from baton_runtime.cli.system.etcd_process import EtcdCluster, EtcdProcess, EtcdTls
from baton_runtime.cli.system.processes import ServiceProcess, free_port, wait_serving
from baton_runtime.cli.system.service_env import identity_env
from baton_runtime.cli.system.supervised import log_tail
from baton_runtime.common.security.identity import DEPLOYMENT_ROLES, Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security

# The etcd users of hooks' and anchor's certificates (their CN).
ETCD_USERS = ("hooks", "anchor")


class ServiceDied(RuntimeError):
    """A service process exited while it was awaited; the message names its
    log and quotes its last lines."""


def _never() -> bool:
    return False


@dataclass
class ServiceLauncher:
    """Named Baton service processes of one system, each with its role's
    identity from `pki` (None: plaintext), logging to `log_dir`."""

    log_dir: Path
    pki: LocalPki | None = None
    log_level: str = "info"
    # Every process's extra environment (after its identity, before its own).
    env: dict[str, str] = field(default_factory=dict)
    # Every process serves Prometheus metrics on a free loopback port of its own.
    metrics: bool = False
    processes: dict[str, ServiceProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.log_dir = Path(self.log_dir)

    # -- identity and addresses ------------------------------------------------

    def security(self, role: Role, deployment_id: str = "") -> Security:
        """A certificate of `role` (of `deployment_id` for owners and
        ingresses), or plaintext."""
        if self.pki is None:
            return Security.plaintext()
        return self.pki.security(role, deployment_id if role in DEPLOYMENT_ROLES else "")

    @property
    def operator(self) -> Security:
        """What the launcher's health probes present."""
        return self.security(Role.OPERATOR)

    def reserve(self, name: str, port: int = 0) -> str:
        """`name`'s address: `port`, or the one it was given before, or a
        free port (so wiring can name a process before it starts)."""
        if port:
            self.ports[name] = port
        return f"127.0.0.1:{self.ports.setdefault(name, free_port())}"

    def addr(self, name: str) -> str:
        return self.reserve(name)

    def addrs(self, names: Iterable[str]) -> str:
        """Comma-separated addresses (what a client of replicas takes)."""
        return ",".join(self.addr(name) for name in names)

    def metrics_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    # -- start -----------------------------------------------------------------

    def environment(
        self,
        kind: str,
        deployment_id: str = "",
        env: Mapping[str, str] | None = None,
        *,
        role: Role | None = None,
    ) -> dict[str, str]:
        """A `kind` process's environment: its identity (as `role`, default
        its kind's), the launcher's `env`, then `env`."""
        security = self.security(role or Role(kind), deployment_id)
        return identity_env(security, self.log_level) | self.env | dict(env or {})

    def start(
        self,
        name: str,
        kind: str,
        env: Mapping[str, str] | None = None,
        *,
        deployment_id: str = "",
        role: Role | None = None,
        metrics_port: int = 0,
        wait: bool = True,
        timeout: float = 30.0,
    ) -> ServiceProcess:
        """Start `name` (a `kind` process; again, on its port, if it ran
        before) with `env` as its wiring; with `wait`, until SERVING."""
        full = self.environment(kind, deployment_id, env, role=role)
        if metrics_port or self.metrics:
            port = self.metrics_ports.setdefault(name, metrics_port or free_port())
            full.setdefault("BATON_METRICS_LISTEN", f"127.0.0.1:{port}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        process = ServiceProcess(kind, self.addr(name), full, log_path=str(self.log_path(name)))
        self.processes[name] = process.start()
        if wait:
            self.wait_serving([name], timeout)
        return process

    def wait_serving(
        self,
        names: Iterable[str] | None = None,
        timeout: float = 30.0,
        *,
        cancelled: Callable[[], bool] = _never,
    ) -> bool:
        """Until each of `names` (default: every process) is SERVING; False
        if `cancelled` says so first. Raises ServiceDied if one exits, or
        TimeoutError."""
        deadline = time.monotonic() + timeout
        for name in list(self.processes if names is None else names):
            while True:
                if cancelled():
                    return False
                self.check_alive([name])
                left = deadline - time.monotonic()
                try:
                    wait_serving(self.addr(name), self.operator, timeout=min(1.0, max(left, 0.1)))
                    break
                except TimeoutError:
                    if left <= 0:
                        self.check_alive([name])
                        raise TimeoutError(
                            f"{name} not SERVING after {timeout:g}s; see {self.log_path(name)}"
                        ) from None
        return True

    # -- supervise -------------------------------------------------------------

    def alive(self, name: str) -> bool:
        proc = self.processes[name].proc
        return proc is not None and proc.poll() is None

    def check_alive(self, names: Iterable[str] | None = None) -> None:
        """Raise ServiceDied if any of `names` (default: every process) exited."""
        for name in list(self.processes if names is None else names):
            proc = self.processes[name].proc
            if proc is None or proc.poll() is None:
                continue
            path = self.processes[name].log_path or ""
            tail = log_tail(path) if path else ""
            detail = f"\n--- last lines of {path} ---\n{tail}" if tail else ""
            raise ServiceDied(
                f"{name} (pid {proc.pid}) exited with code {proc.returncode}; "
                f"its log is {path}{detail}"
            )

    def pids(self) -> dict[str, int]:
        return {name: process.pid for name, process in self.processes.items()}

    def signal(self, name: str, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.processes[name].pid, signum)

    def pause(self, name: str) -> None:
        self.signal(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.signal(name, signal.SIGCONT)

    def kill(self, name: str) -> None:
        """kill -9 (and reaped)."""
        self.processes[name].kill()

    def terminate(self, name: str, timeout: float = 10.0) -> None:
        """SIGTERM (a graceful shutdown), a kill after `timeout`."""
        self.processes[name].stop(timeout)

    # -- stop ------------------------------------------------------------------

    def stop(self, timeout: float = 10.0, *, graceful: bool = True) -> list[str]:
        """Stop every process, last started first (each resumed first, in
        case it is paused): SIGTERM and a kill after `timeout`, or at once
        without `graceful`. Returns what could not be stopped."""
        problems = []
        for name, process in reversed(list(self.processes.items())):
            if process.proc is None or process.proc.poll() is not None:
                continue
            self.resume(name)
            try:
                if graceful:
                    process.stop(timeout)
                else:
                    process.kill()
            except OSError as exc:
                problems.append(f"{name} (pid {process.pid}): {exc}")
                continue
            if process.proc.poll() is None:
                problems.append(f"{name} (pid {process.pid}) is still running")
        return problems


# -- etcd ----------------------------------------------------------------------


def etcd_tls(pki: LocalPki) -> EtcdTls:
    """etcd's server certificate and its `root` user's, from `pki`."""
    return EtcdTls(server=pki.etcd_server(), root=pki.etcd_user("root"))


def start_etcd(pki: LocalPki | None, prefix: str, **options: Any) -> EtcdProcess:
    """One etcd member, healthy; with `pki`, over TLS with user/role auth on:
    hooks' and anchor's certificates are users whose role reads and writes
    `prefix` only. Without, plaintext and no auth."""
    tls = etcd_tls(pki) if pki is not None else None
    server = EtcdProcess(tls=tls, **options).start()
    if tls is not None:
        enable_auth(server.endpoint, tls.root, ETCD_USERS, prefix)
    return server


def start_etcd_cluster(
    pki: LocalPki | None, prefix: str, size: int = 3, **options: Any
) -> EtcdCluster:
    """`size` members, with TLS and the auth of `start_etcd` (enabled once,
    through the first member: it is cluster state)."""
    tls = etcd_tls(pki) if pki is not None else None
    cluster = EtcdCluster(size=size, tls=tls, **options).start()
    if tls is not None:
        enable_auth(cluster.members[0].endpoint, tls.root, ETCD_USERS, prefix)
    return cluster
