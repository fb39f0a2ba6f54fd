"""The processes of one `baton up` (`LocalSystem`), in start order: the
certificates and the demo key file, etcd (one member or a cluster) with TLS
and user/role auth and a consistency check, then hooks and anchor, then each
deployment's owners and ingresses, each awaited until SERVING (owners until
registered with hooks); then supervised, and stopped last started first.
"""

from __future__ import annotations

import functools
import os
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import aetcd
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2, hooks_pb2_grpc
from baton_runtime.cli.system.etcd_auth import enable_auth
from baton_runtime.cli.system.etcd_binary import EtcdRefused, find_etcd
from baton_runtime.cli.system.etcd_check import members_consistent
from baton_runtime.cli.system.etcd_process import EtcdCluster, EtcdProcess, EtcdTls, etcd_healthy
from baton_runtime.cli.system.launch_settings import (
    DEMO_API_KEY,
    DEMO_CHANNEL,
    ETCD_PREFIX,
    LaunchError,
    LaunchSettings,
)
from baton_runtime.cli.system.port_plan import (
    PER_DEPLOYMENT,
    SHARED_OFFSETS,
    DeploymentPorts,
    Ports,
    replica_label,
)
from baton_runtime.cli.system.processes import sync_channel
from baton_runtime.cli.system.service_env import addresses, console_env, service_env
from baton_runtime.cli.system.service_launcher import ETCD_USERS, ServiceLauncher
from baton_runtime.cli.system.supervised import Child, StopSignals, log_tail
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security

CERTS_DIR = "certs"
# What the certificate directory holds (besides owner-<dep>/ingress-<dep>).
CERTIFICATE_FILES = ("ca.crt", "operator.crt", "operator.key", "hooks.crt", "anchor.crt")

_PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def _grpc_serving(stub: Any) -> bool:
    """`stub`: a HealthStub (Any: its stubs declare no methods)."""
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
    except grpc.RpcError:
        return False
    serving: bool = response.status == health_pb2.HealthCheckResponse.SERVING
    return serving


def _registered(
    stub: hooks_pb2_grpc.HookRegistryServiceStub, deployment_id: str, count: int
) -> bool:
    """Hooks lists `count` live owner instances of `deployment_id` (an owner
    reports SERVING before its background registration is done)."""
    try:
        response = stub.ListInstances(
            hooks_pb2.ListInstancesRequest(deployment_id=deployment_id), timeout=1
        )
    except grpc.RpcError:
        return False
    return len(response.instances) >= count


def _http_answers(url: str) -> bool:
    """`url` answers 200 (the console is up)."""
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:  # noqa: S310 - loopback
            return bool(answer.status == 200)
    except OSError:
        return False


class LocalSystem:
    """The processes of one `baton up`, in start order."""

    def __init__(self, settings: LaunchSettings, ports: Ports, run_dir: Path, out: TextIO) -> None:
        self.settings = settings
        self.ports = ports
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.cert_dir = run_dir / CERTS_DIR
        self.children: list[Child] = []
        self._out = out
        self.pki: LocalPki | None = None
        # Starts the services (and the console) with their identities; its
        # PKI is set once the certificates are made.
        self.launcher = ServiceLauncher(self.log_dir, None, settings.log_level)
        self.api_key_file = settings.api_key_file
        # Callers of the console that are not on loopback present it.
        self.console_token = secrets.token_urlsafe(24)

    def security(self, role: Role, deployment_id: str = "") -> Security:
        return self.launcher.security(role, deployment_id)

    @property
    def ca_cert(self) -> str:
        return self.pki.ca_path if self.pki is not None else ""

    @property
    def operator(self) -> Security:
        """What health probes and registration checks present."""
        return self.security(Role.OPERATOR)

    def _prepare(self) -> None:
        """The certificates (unless plaintext) and the demo key file."""
        if not self.settings.plaintext:
            self.pki = LocalPki(self.cert_dir, check_every=10.0)
            self.pki.files(Role.OPERATOR)
            for role in (Role.HOOKS, Role.ANCHOR):
                self.pki.files(role)
            for dep in self.ports.deployments:
                self.pki.files(Role.OWNER, dep.deployment_id)
                self.pki.files(Role.INGRESS, dep.deployment_id)
            self.launcher.pki = self.pki
            self.say(f"baton up: certificates in {self.cert_dir} (CA: {self.pki.ca_path})")
        if not self.api_key_file:
            path = self.run_dir / "api-keys"
            path.write_text(f"# baton up's demo key\n{DEMO_CHANNEL}={DEMO_API_KEY}\n")
            path.chmod(0o600)
            self.api_key_file = str(path)

    def say(self, line: str) -> None:
        print(line, file=self._out, flush=True)

    # -- start -------------------------------------------------------------

    def start(self, signals: StopSignals) -> bool:
        """Start everything; False if a stop was requested meanwhile.
        Raises LaunchError if a process dies or is not ready in time."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._prepare()
        if not self._etcd_ready(signals):
            return False
        shared = [
            self._start_service(name, k)
            for name in SHARED_OFFSETS
            for k in range(len(self.ports.service_ports(name)))
        ]
        if not self._await_serving(shared, signals):
            return False
        own = [
            self._start_service(name, k, dep)
            for dep in self.ports.deployments
            for name in PER_DEPLOYMENT
            for k in range(len(self.ports.service_ports(name, dep)))
        ]
        if not self._await_serving(own, signals):
            return False
        if not self._await_registered(own, signals):
            return False
        return self._start_console(signals)

    def _etcd_ready(self, signals: StopSignals) -> bool:
        """etcd started, healthy, with auth on (unless plaintext) and its
        members consistent; False on a stop request."""
        # Every member first: a cluster elects a leader (and reports healthy)
        # only once a majority is up.
        members, etcd_tls = self._start_etcd()
        root = etcd_tls.root if etcd_tls else None
        for (client, _), member in zip(self.ports.etcd, members, strict=True):
            probe = functools.partial(etcd_healthy, f"127.0.0.1:{client}", root)
            self._await(members, probe, f"{member.label} health", signals)
            if signals.requested:
                return False
        if etcd_tls is not None:
            endpoint = f"127.0.0.1:{self.ports.etcd[0][0]}"
            try:
                enable_auth(endpoint, etcd_tls.root, ETCD_USERS, ETCD_PREFIX)
            except grpc.RpcError as exc:
                raise LaunchError(f"could not enable etcd auth: {exc}") from exc
        self._check_etcd_consistency(etcd_tls)
        return True

    def _await_registered(self, own: list[Child], signals: StopSignals) -> bool:
        """Wait until hooks lists every owner of each deployment (an owner
        reports SERVING before it has registered); False on a stop request."""
        hooks = f"127.0.0.1:{self.ports.hooks[0]}"
        with sync_channel(hooks, self.operator, _PROBE_OPTIONS) as channel:
            stub = hooks_pb2_grpc.HookRegistryServiceStub(channel)
            for dep in self.ports.deployments:
                owners = [
                    c for c in own if c.kind == "owner" and c.deployment_id == dep.deployment_id
                ]
                probe = functools.partial(_registered, stub, dep.deployment_id, len(owners))
                self._await(owners, probe, f"owner of {dep.deployment_id} registration", signals)
                if signals.requested:
                    return False
        return True

    def _await_serving(self, started: list[Child], signals: StopSignals) -> bool:
        """Wait until each of `started` is SERVING; False on a stop request."""
        for child in started:
            with sync_channel(child.address, self.operator, _PROBE_OPTIONS) as channel:
                # Any: types-grpcio-health-checking's HealthStub declares no methods.
                stub: Any = health_pb2_grpc.HealthStub(channel)
                probe = functools.partial(_grpc_serving, stub)
                self._await(started, probe, f"{child.label} health", signals)
            if signals.requested:
                return False
        return True

    def _start_etcd(self) -> tuple[list[Child], EtcdTls | None]:
        """Start every etcd member (one: a cluster of one, as before), with
        TLS for clients unless plaintext."""
        data_dir = self.run_dir / "etcd"
        data_dir.mkdir(parents=True, exist_ok=True)
        tls = None
        if self.pki is not None:
            tls = EtcdTls(server=self.pki.etcd_server(), root=self.pki.etcd_user("root"))
        binary = self._etcd_binary()
        if len(self.ports.etcd) == 1:
            member = EtcdProcess(
                client_port=self.ports.etcd_client,
                peer_port=self.ports.etcd_peer,
                data_dir=str(data_dir),
                log_path=str(self.log_dir / "etcd.log"),
                tls=tls,
                binary=binary,
                accept_risk=self.settings.accept_etcd_risk,
            )
            try:
                member.start(wait=False)
            except OSError as exc:
                raise LaunchError(f"could not start etcd: {exc}") from exc
            assert member.proc is not None
            child = Child("etcd", member.endpoint, member.log_path, member.proc, member.stop)
            return [self._started(child)], tls
        cluster = EtcdCluster(
            size=len(self.ports.etcd),
            base_dir=str(data_dir),
            ports=list(self.ports.etcd),
            log_dir=str(self.log_dir),
            tls=tls,
            binary=binary,
            accept_risk=self.settings.accept_etcd_risk,
        )
        try:
            cluster.start(wait=False)
        except OSError as exc:
            raise LaunchError(f"could not start etcd: {exc}") from exc
        children = []
        for m, member in enumerate(cluster.members):
            assert member.proc is not None
            name = replica_label("etcd", m)
            child = Child(name, member.endpoint, member.log_path, member.proc, member.stop)
            children.append(self._started(child))
        return children, tls

    def _check_etcd_consistency(self, etcd_tls: EtcdTls | None) -> None:
        """Part of etcd's health: every member holds the same data (one hash
        at a common revision) and no alarm is raised; else not ready."""
        endpoints = addresses([client for client, _ in self.ports.etcd])
        try:
            report = members_consistent(endpoints, etcd_tls.root if etcd_tls else None)
        except (aetcd.ClientError, grpc.RpcError, OSError) as exc:
            raise LaunchError(f"etcd consistency check could not run: {exc}") from exc
        if not report.ok:
            raise LaunchError(f"etcd failed its consistency check:\n{report.text()}")
        self.say(
            f"baton up: etcd consistent: {len(report.members)} member(s) agree at revision "
            f"{report.revision}, no alarm"
        )

    def _etcd_binary(self) -> str:
        """The etcd to start, checked against the known-bad table; says
        which, and warns when a known-bad one runs because the risk was
        accepted. Raises LaunchError (why, what to install) otherwise."""
        try:
            etcd = find_etcd(self.settings.etcd_binary, accept_risk=self.settings.accept_etcd_risk)
        except EtcdRefused as exc:
            raise LaunchError(str(exc)) from exc
        if etcd.verdict.ok:
            self.say(f"baton up: etcd {etcd.version} ({etcd.path})")
        else:
            self.say(
                "baton up: WARNING: running a known-bad etcd (--accept-etcd-risk): "
                + etcd.verdict.explain(f"etcd at {etcd.path}")
            )
        return etcd.path

    @property
    def console_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.console}/"

    def _start_console(self, signals: StopSignals) -> bool:
        """The web console (services/console/), as an operator, with the
        key the demo uses for its cancel and reset; waits until it answers;
        False on a stop request."""
        key = os.environ.get("BATON_API_KEY", "") if self.settings.api_key_file else ""
        env = console_env(
            ports=self.ports,
            api_key=key or DEMO_API_KEY,
            token=self.console_token,
        )
        address = self.launcher.reserve("console", self.ports.console)
        try:
            service = self.launcher.start("console", "console", env, role=Role.OPERATOR, wait=False)
        except OSError as exc:
            raise LaunchError(f"could not start the console: {exc}") from exc
        assert service.proc is not None
        log_path = str(service.log_path)
        child = self._started(Child("console", address, log_path, service.proc, service.stop))
        probe = functools.partial(_http_answers, f"{self.console_url}static/console.css")
        self._await([child], probe, "console", signals)
        return not signals.requested

    def service_env(self, kind: str, dep: DeploymentPorts | None = None) -> dict[str, str]:
        """The environment a `kind` process (of `dep`) starts with, but its
        metrics address."""
        return self.launcher.environment(
            kind, dep.deployment_id if dep else "", self._wiring(kind, dep)
        )

    def _wiring(self, kind: str, dep: DeploymentPorts | None) -> dict[str, str]:
        return service_env(
            kind,
            dep,
            settings=self.settings,
            ports=self.ports,
            api_key_file=self.api_key_file,
            object_store=self.object_store,
        )

    @property
    def object_store(self) -> str:
        """anchor's object store: the one asked for, else a directory of the
        run directory (anchor creates it)."""
        return self.settings.object_store or f"file://{(self.run_dir / 'objects').resolve()}"

    def _start_service(self, kind: str, replica: int, dep: DeploymentPorts | None = None) -> Child:
        name = replica_label(kind, replica)
        port = self.ports.service_ports(kind, dep)[replica]
        # The launcher's name of it, which names its log.
        process = f"{name}-{dep.deployment_id}" if dep else name
        address = self.launcher.reserve(process, port)
        metrics_port = self.ports.metrics[port]
        deployment_id = dep.deployment_id if dep else ""
        label = f"{name} of {deployment_id}" if dep else name
        try:
            service = self.launcher.start(
                process,
                kind,
                self._wiring(kind, dep),
                deployment_id=deployment_id,
                metrics_port=metrics_port,
                wait=False,
            )
        except OSError as exc:
            raise LaunchError(f"could not start {label}: {exc}") from exc
        assert service.proc is not None and service.log_path is not None
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        return self._started(
            Child(
                name,
                address,
                service.log_path,
                service.proc,
                service.stop,
                deployment_id,
                kind,
                metrics_url,
            )
        )

    def _started(self, child: Child) -> Child:
        self.children.append(child)
        self.say(f"baton up: started {child.label} (pid {child.pid}) on {child.address}")
        return child

    def _await(
        self,
        starting: list[Child],
        ready: Callable[[], bool],
        what: str,
        signals: StopSignals,
    ) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout
        while not signals.requested:
            self.raise_if_any_died(during="startup")
            if ready():
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{c.label} ({c.log_path})" for c in starting)
                raise LaunchError(
                    f"{what} not ready after {self.settings.startup_timeout:g}s; see {names}"
                )
            time.sleep(0.1)

    # -- supervise ---------------------------------------------------------

    def raise_if_any_died(self, during: str) -> None:
        for child in self.children:
            code = child.exit_code()
            if code is not None:
                tail = log_tail(child.log_path)
                detail = f"\n--- last lines of {child.log_path} ---\n{tail}" if tail else ""
                raise LaunchError(
                    f"{child.label} (pid {child.pid}) exited with code {code} during {during}; "
                    f"its log is {child.log_path}{detail}"
                )

    def describe(self) -> list[str]:
        width = max(len("deployment"), *(len(c.deployment_id) for c in self.children))
        named = max(len("process"), *(len(c.name) for c in self.children))
        lines = [f"  {'process':<{named}} {'deployment':<{width}}  {'address':<17} {'pid':>7}  log"]
        for child in self.children:
            lines.append(
                f"  {child.name:<{named}} {child.deployment_id or '-':<{width}}  "
                f"{child.address:<17} {child.pid:>7}  {child.log_path}"
            )
        return lines

    def describe_metrics(self) -> list[str]:
        """One line per service process: its label and metrics URL."""
        served = [c for c in self.children if c.metrics_url]
        width = max(len(c.label) for c in served)
        return [f"  {c.label:<{width}}  {c.metrics_url}" for c in served]

    # -- stop --------------------------------------------------------------

    def stop(self) -> list[str]:
        """Stop every child, last started first; returns problems, if any."""
        problems: list[str] = []
        for child in reversed(self.children):
            try:
                child.stop(self.settings.stop_timeout)
            except (OSError, subprocess.SubprocessError) as exc:
                problems.append(f"{child.label} (pid {child.pid}): {exc}")
                continue
            code = child.exit_code()
            if code is None:
                problems.append(f"{child.label} (pid {child.pid}) is still running")
            else:
                self.say(f"baton up: stopped {child.label} (pid {child.pid}, exit code {code})")
        return problems
