"""`baton up`: the whole system on one machine, as real processes.

Creates a throwaway CA and one certificate per role in `{run dir}/certs`
(TLS on every hop; see `services.common.pki`), starts etcd (one member, or a
cluster of `--etcd-members`) with TLS and user/role auth (the hooks and
anchor certificates are etcd users limited to the `/baton/` prefix), then
hooks and anchor (shared), then an owner and an ingress for each deployment
id given (each of them `--replicas` times), each as a child process with its
log in the run directory. `--plaintext` runs all of it without TLS or etcd
auth, on loopback. Waits until every process answers its health check and
every owner has registered with hooks, prints the endpoints, optionally runs
the demo, and then supervises: SIGINT/SIGTERM (or any child exiting) stops
everything it started, by PID — SIGTERM first, a kill after a timeout — and
removes the run directory unless the user chose it.

Port plan, from `--port-base P` (default 50051): the first deployment's
ingress P, hooks P+1, anchor P+2, the first deployment's owner P+3; the N-th
deployment (N >= 2, in the order given) has its ingress at P+2N and its owner
at P+2N+1 (dep 2: P+4, P+5; dep 3: P+6, P+7). With `--replicas R`, replica k
(k >= 2) of each of them listens 100 (k - 1) above the first (hooks P+1,
P+101, P+201, ...). etcd clients use `--etcd-port E` (default 23790) and etcd
peers E+1; with `--etcd-members M`, member m (m >= 2) uses E+2(m-1) and the
port after it. Port 0 means "pick free ports". Each service process also
serves Prometheus metrics (`--metrics-listen`) on loopback, METRICS_OFFSET
above its gRPC port (free ports too with a port base of 0); `baton up`
prints every process's `http://127.0.0.1:PORT/metrics`.

Every client is given all replicas of what it calls (comma-separated
addresses, balanced round-robin) and every etcd member's endpoint.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import aetcd
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import services
from baton.hooks.v1 import hooks_pb2, hooks_pb2_grpc
from services.cli import profile
from services.cli.etcd_auth import enable_auth
from services.cli.etcd_binary import EtcdRefused, find_etcd
from services.cli.etcd_check import members_consistent
from services.cli.etcd_process import EtcdCluster, EtcdProcess, EtcdTls, etcd_healthy
from services.cli.processes import ServiceProcess, sync_channel
from services.common.identity import Role
from services.common.pki import LocalPki
from services.common.tls import Security

DEFAULT_DEPLOYMENT_ID = "dep-1"
DEFAULT_PORT_BASE = 50051
DEFAULT_ETCD_PORT = 23790
DEMO_CHANNEL = "demo"
# Well known, so loopback-only: `baton up` grants it unless given a key file.
DEMO_API_KEY = "demo-key-0001-loopback-only"
# What `baton up --demo` says once the demo has ended: the system stays up.
DEMO_DONE_LINE = (
    "baton up: the demo is over; Baton keeps running (try `baton sessions list`). "
    "Ctrl-C or SIGTERM stops everything."
)
CERTS_DIR = "certs"
# What the certificate directory holds (besides owner-<dep>/ingress-<dep>).
CERTIFICATE_FILES = ("ca.crt", "operator.crt", "operator.key", "hooks.crt", "anchor.crt")
ETCD_USERS = ("hooks", "anchor")
ETCD_PREFIX = "/baton/"
READY_LINE = "baton up: ready"

# Offsets from --port-base of the shared services; per-deployment offsets are
# `deployment_offsets`. Start order after etcd: the shared services, then
# every deployment's owner and ingress together.
SHARED_OFFSETS = {"hooks": 1, "anchor": 2}
PER_DEPLOYMENT = ("owner", "ingress")
# With --replicas N, replica k (k >= 2) of each service listens at the first
# replica's port + REPLICA_STRIDE * (k - 1); with --etcd-members M, member m
# (m >= 2) at the first member's client and peer ports + ETCD_MEMBER_STRIDE * (m - 1).
REPLICA_STRIDE = 100
ETCD_MEMBER_STRIDE = 2
# A service's metrics port: its gRPC port + METRICS_OFFSET.
METRICS_OFFSET = 1000

_PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class LaunchError(Exception):
    """Startup failed; the message says what and where to look."""


def deployment_offsets(index: int) -> tuple[int, int]:
    """(ingress, owner) offsets from --port-base of the `index`-th (0-based)
    deployment: the first keeps 0 and 3 (around hooks +1 and anchor +2); the
    N-th (N = index + 1 >= 2) uses 2N and 2N + 1."""
    if index == 0:
        return 0, 3
    n = index + 1
    return 2 * n, 2 * n + 1


@dataclass(frozen=True)
class LaunchSettings:
    # One owner + one ingress per id, in this order; the first is where the
    # demo creates its session.
    deployment_ids: tuple[str, ...] = (DEFAULT_DEPLOYMENT_ID,)
    port_base: int = DEFAULT_PORT_BASE
    etcd_port: int = DEFAULT_ETCD_PORT
    # The ingress's API key file; "" grants the demo key (written to the run dir).
    api_key_file: str = ""
    # No TLS, no etcd auth (loopback only).
    plaintext: bool = False
    demo: bool = False
    run_dir: str | None = None
    log_level: str = "info"
    startup_timeout: float = 60.0
    stop_timeout: float = 10.0
    # Processes per service (hooks, anchor, and each deployment's owner and
    # ingress), and etcd members forming one cluster.
    replicas: int = 1
    etcd_members: int = 1
    # The etcd executable ("" = the first safe one found: `find_etcd`), and
    # whether a known-bad release may run (services/common/etcd_releases.py).
    etcd_binary: str = ""
    accept_etcd_risk: bool = False
    # A live session's stream retention, passed to anchor
    # (--stream-retention-events, --stream-retention); None: anchor's default.
    stream_retention_events: int | None = None
    stream_retention: float | None = None
    # hooks' --dedupe-window (seconds; None: hooks' default, a day).
    dedupe_window: float | None = None

    def __post_init__(self) -> None:
        if not self.deployment_ids:
            raise ValueError("at least one deployment id is required")
        if len(set(self.deployment_ids)) != len(self.deployment_ids):
            raise ValueError(f"deployment ids repeat: {', '.join(self.deployment_ids)}")


def replica_label(name: str, replica: int) -> str:
    """ "hooks" for the first replica, "hooks-2" for the second, ..."""
    return name if replica == 0 else f"{name}-{replica + 1}"


def _listing(ports: Sequence[int]) -> str:
    return ", ".join(str(port) for port in ports)


@dataclass(frozen=True)
class DeploymentPorts:
    """The ports of one deployment's own processes, one per replica."""

    deployment_id: str
    ingresses: tuple[int, ...]
    owners: tuple[int, ...]

    @property
    def ingress(self) -> int:
        return self.ingresses[0]

    @property
    def owner(self) -> int:
        return self.owners[0]


@dataclass(frozen=True)
class Ports:
    """Every port of one `baton up`: one per replica of each service, a
    client and a peer port per etcd member."""

    hooks: tuple[int, ...]
    anchors: tuple[int, ...]
    etcd: tuple[tuple[int, int], ...]  # (client, peer) per member
    deployments: tuple[DeploymentPorts, ...]
    # Each service process's metrics port, by its gRPC port (see METRICS_OFFSET).
    metrics: Mapping[int, int] = field(default_factory=dict, compare=False)

    @property
    def ingress(self) -> int:
        """The first deployment's ingress (where the demo starts)."""
        return self.deployments[0].ingress

    @property
    def owner(self) -> int:
        return self.deployments[0].owner

    @property
    def etcd_client(self) -> int:
        return self.etcd[0][0]

    @property
    def etcd_peer(self) -> int:
        return self.etcd[0][1]

    @classmethod
    def plan(
        cls,
        port_base: int,
        etcd_port: int,
        deployment_ids: Sequence[str] = (DEFAULT_DEPLOYMENT_ID,),
        *,
        replicas: int = 1,
        etcd_members: int = 1,
    ) -> Ports:
        """Ports from the bases (see the module doc); a base of 0 picks free
        ports instead."""
        if replicas < 1 or etcd_members < 1:
            raise LaunchError("--replicas and --etcd-members must be at least 1")
        services = replicas * (2 + 2 * len(deployment_ids))
        count = 2 * services + 2 * etcd_members
        spare = iter(_distinct_free_ports(count))

        def ports(first: int) -> tuple[int, ...]:
            if not port_base:
                return tuple(next(spare) for _ in range(replicas))
            return tuple(first + REPLICA_STRIDE * k for k in range(replicas))

        deployments = []
        for index, deployment_id in enumerate(deployment_ids):
            ingress_offset, owner_offset = deployment_offsets(index)
            deployments.append(
                DeploymentPorts(
                    deployment_id,
                    ports(port_base + ingress_offset),
                    ports(port_base + owner_offset),
                )
            )
        if etcd_port:
            etcd = tuple(
                (etcd_port + ETCD_MEMBER_STRIDE * m, etcd_port + ETCD_MEMBER_STRIDE * m + 1)
                for m in range(etcd_members)
            )
        else:
            etcd = tuple((next(spare), next(spare)) for _ in range(etcd_members))
        hooks = ports(port_base + SHARED_OFFSETS["hooks"])
        anchors = ports(port_base + SHARED_OFFSETS["anchor"])
        grpc_ports = [*hooks, *anchors]
        for dep in deployments:
            grpc_ports += [*dep.ingresses, *dep.owners]
        metrics = {port: port + METRICS_OFFSET if port_base else next(spare) for port in grpc_ports}
        plan = cls(hooks, anchors, etcd, tuple(deployments), metrics)
        plan.validate()
        return plan

    def service_ports(self, name: str, dep: DeploymentPorts | None = None) -> tuple[int, ...]:
        """The ports of every replica of `name` (of `dep`, for owner/ingress)."""
        if dep is None:
            return self.hooks if name == "hooks" else self.anchors
        return dep.owners if name == "owner" else dep.ingresses

    def items(self) -> list[tuple[str, int]]:
        items = []
        for m, (client, peer) in enumerate(self.etcd):
            items += [(f"{replica_label('etcd', m)} client", client)]
            items += [(f"{replica_label('etcd', m)} peer", peer)]
        for name in SHARED_OFFSETS:
            for k, port in enumerate(self.service_ports(name)):
                items.append((replica_label(name, k), port))
        for dep in self.deployments:
            for name in ("ingress", "owner"):
                for k, port in enumerate(self.service_ports(name, dep)):
                    items.append((f"{replica_label(name, k)} of {dep.deployment_id}", port))
        services = items[2 * len(self.etcd) :]
        items += [(f"{name} metrics", self.metrics[port]) for name, port in services]
        return items

    def summary(self) -> str:
        """The plan on one line, as `baton up` prints it before starting."""
        clients = _listing([client for client, _ in self.etcd])
        peers = _listing([peer for _, peer in self.etcd])
        parts = [
            f"etcd {clients} (peer {peers})"
            if len(self.etcd) == 1
            else f"etcd {clients} (peers {peers})",
            f"hooks {_listing(self.hooks)}",
            f"anchor {_listing(self.anchors)}",
        ]
        for dep in self.deployments:
            parts.append(
                f"{dep.deployment_id}: ingress {_listing(dep.ingresses)}, "
                f"owner {_listing(dep.owners)}"
            )
        return "; ".join(parts)

    def validate(self) -> None:
        seen: dict[int, str] = {}
        for name, port in self.items():
            if not 0 < port < 65536:
                raise LaunchError(f"{name} port {port} is out of range")
            if port in seen:
                raise LaunchError(f"{name} and {seen[port]} would both use port {port}")
            seen[port] = name

    def check_free(self) -> None:
        """Fail early if any port is taken. gRPC servers bind with SO_REUSEPORT,
        so a second Baton would otherwise share ports with the first silently."""
        for name, port in self.items():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError as exc:
                    raise LaunchError(
                        f"{name} port 127.0.0.1:{port} is not free ({exc.strerror}); "
                        "is another `baton up` running? Try --port-base/--etcd-port"
                    ) from exc


def _distinct_free_ports(count: int) -> list[int]:
    """`count` different ports that were free a moment ago (held open together
    so that the kernel cannot hand out the same one twice)."""
    with contextlib.ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]


class StopSignals:
    """SIGINT/SIGTERM set a flag that the supervisor polls; nothing is raised
    from the handler, so no child can be spawned without being recorded."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)


@dataclass
class Child:
    """One started process, whatever kind."""

    name: str
    address: str
    log_path: str
    proc: subprocess.Popen[bytes]
    stop: Callable[[float], None]
    # The deployment an owner or ingress serves; "" for shared processes.
    deployment_id: str = ""
    # "owner" for every owner replica ("owner", "owner-2", ...); "" = `name`.
    service: str = ""
    # Where its Prometheus metrics are served ("" for etcd).
    metrics_url: str = ""

    @property
    def kind(self) -> str:
        return self.service or self.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def label(self) -> str:
        """ "hooks", or "owner of dep-2" for a per-deployment process."""
        return f"{self.name} of {self.deployment_id}" if self.deployment_id else self.name

    def exit_code(self) -> int | None:
        return self.proc.poll()


def _python_path() -> str:
    """PYTHONPATH for `python -m services.…` children, from any working dir."""
    root = str(Path(services.__file__).resolve().parent.parent)
    return os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))


def _log_tail(path: str, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


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
        self.api_key_file = settings.api_key_file

    def security(self, role: Role, deployment_id: str = "") -> Security:
        if self.pki is None:
            return Security.plaintext()
        return self.pki.security(role, deployment_id)

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
        endpoints = self._addresses([client for client, _ in self.ports.etcd])
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

    def _addresses(self, ports: Sequence[int]) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in ports)

    def _service_env(self, name: str, dep: DeploymentPorts | None) -> dict[str, str]:
        env = {
            "PYTHONPATH": _python_path(),
            "PYTHONUNBUFFERED": "1",
            "BATON_LOG_LEVEL": self.settings.log_level,
        }
        security = self.security(Role(name), dep.deployment_id if dep else "")
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
        if name == "hooks" and self.settings.dedupe_window is not None:
            env["BATON_DEDUPE_WINDOW"] = f"{self.settings.dedupe_window:g}"
        if dep is None:
            if name == "anchor":
                env |= self._stream_retention_env()
            return env | {
                "BATON_ETCD_ENDPOINT": self._addresses([client for client, _ in self.ports.etcd]),
                "BATON_ETCD_PREFIX": ETCD_PREFIX,
                # hooks and anchor judge etcd's members again: the same answer.
                "BATON_ACCEPT_ETCD_RISK": "1" if self.settings.accept_etcd_risk else "0",
            }
        env |= {
            "BATON_DEPLOYMENT_ID": dep.deployment_id,
            "BATON_HOOKS_ADDR": self._addresses(self.ports.hooks),
            "BATON_ANCHOR_ADDR": self._addresses(self.ports.anchors),
        }
        if name == "ingress":
            env |= {
                # Each ingress starts sessions on its own deployment's owners.
                "BATON_OWNER_ADDR": self._addresses(dep.owners),
                "BATON_API_KEYS_FILE": self.api_key_file,
            }
        return env

    def _stream_retention_env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if self.settings.stream_retention_events is not None:
            env["BATON_STREAM_RETENTION_EVENTS"] = str(self.settings.stream_retention_events)
        if self.settings.stream_retention is not None:
            env["BATON_STREAM_RETENTION"] = str(self.settings.stream_retention)
        return env

    def _start_service(self, kind: str, replica: int, dep: DeploymentPorts | None = None) -> Child:
        name = replica_label(kind, replica)
        port = self.ports.service_ports(kind, dep)[replica]
        log_name = f"{name}-{dep.deployment_id}.log" if dep else f"{name}.log"
        address = f"127.0.0.1:{port}"
        log_path = str(self.log_dir / log_name)
        metrics_port = self.ports.metrics[port]
        env = self._service_env(kind, dep) | {"BATON_METRICS_LISTEN": f"127.0.0.1:{metrics_port}"}
        service = ServiceProcess(kind, address, env, log_path=log_path)
        label = f"{name} of {dep.deployment_id}" if dep else name
        try:
            service.start()
        except OSError as exc:
            raise LaunchError(f"could not start {label}: {exc}") from exc
        assert service.proc is not None
        deployment_id = dep.deployment_id if dep else ""
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        return self._started(
            Child(
                name,
                address,
                log_path,
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
                tail = _log_tail(child.log_path)
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


def demo_command(ports: Ports, ca_cert: str = "") -> list[str]:
    """`baton demo` arguments for this system: the session starts on the first
    deployment's ingress and, with more deployments, moves through the others';
    TLS trusting `ca_cert`, else plaintext."""
    args = ["--ingress", f"127.0.0.1:{ports.ingress}"]
    for dep in ports.deployments[1:]:
        args += ["--upgrade-ingress", f"127.0.0.1:{dep.ingress}"]
    return args + (["--ca-cert", ca_cert] if ca_cert else ["--plaintext"])


def _run_demo_child(system: LocalSystem, signals: StopSignals, time_limit: float) -> None:
    """Run `baton demo` as a child process against this system, supervising it.
    It uses the demo key, or BATON_API_KEY when given a key file."""
    key = os.environ.get("BATON_API_KEY", "") if system.settings.api_key_file else ""
    env = {**os.environ, "PYTHONPATH": _python_path(), "BATON_API_KEY": key or DEMO_API_KEY}
    system.say("baton up: running the demo")
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "demo",
            *demo_command(system.ports, system.ca_cert),
            "--time-limit",
            f"{time_limit:g}",
        ],
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + time_limit + 30
        while demo.poll() is None:
            if signals.requested or time.monotonic() > deadline:
                return
            system.raise_if_any_died(during="the demo")
            time.sleep(0.1)
        if demo.returncode != 0:
            system.say(f"baton up: the demo failed (exit code {demo.returncode}); still running")
        system.say(DEMO_DONE_LINE)
    finally:
        if demo.poll() is None:
            demo.terminate()
            try:
                demo.wait(5)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait(5)


def _announce(system: LocalSystem) -> None:
    settings = system.settings
    deployments = system.ports.deployments
    if len(deployments) == 1:
        only = deployments[0]
        system.say(
            f"Baton is up: deployment {only.deployment_id}, public API at 127.0.0.1:{only.ingress}"
        )
    else:
        apis = ", ".join(
            f"{dep.deployment_id} (public API at 127.0.0.1:{dep.ingress})" for dep in deployments
        )
        system.say(f"Baton is up: deployments {apis}")
    for line in system.describe():
        system.say(line)
    system.say("Prometheus metrics (plaintext HTTP, loopback):")
    for line in system.describe_metrics():
        system.say(line)
    if not settings.api_key_file:
        system.say(
            f"API key: channel {DEMO_CHANNEL!r}, key {DEMO_API_KEY!r} "
            f"(authorization: Bearer {DEMO_API_KEY}; loopback demo only)"
        )
    else:
        system.say(f"API keys: from {settings.api_key_file} (re-read on SIGHUP to the ingress)")
    if system.pki is not None:
        system.say(
            f"TLS on every hop: CA {system.ca_cert}, certificates in {system.cert_dir} "
            "(operator.crt/.key for internal servers)"
        )
        tls = f"-cacert {system.ca_cert}"
    else:
        system.say("PLAINTEXT: no TLS and no etcd auth (--plaintext; loopback only)")
        tls = "-plaintext"
    system.say(f"Try:  baton demo {' '.join(demo_command(system.ports, system.ca_cert))}")
    system.say(f"      grpcurl {tls} 127.0.0.1:{system.ports.ingress} list")
    system.say("Ctrl-C or SIGTERM stops everything.")
    system.say(READY_LINE)


def _write_profile(system: LocalSystem) -> None:
    """Where `baton sessions ...` finds this system with no flags
    (services/cli/profile.py)."""
    path = profile.default_path()
    operator = system.pki.files(Role.OPERATOR) if system.pki is not None else None
    try:
        profile.write(
            path,
            profile.Profile(
                ingress=f"127.0.0.1:{system.ports.ingress}",
                ca_cert=system.ca_cert,
                plaintext=system.pki is None,
                hooks=f"127.0.0.1:{system.ports.hooks[0]}",
                anchor=f"127.0.0.1:{system.ports.anchors[0]}",
                operator_cert=operator.cert if operator is not None else "",
                operator_key=operator.key if operator is not None else "",
                run_dir=str(system.run_dir),
            ),
        )
    except OSError as exc:
        system.say(f"baton up: no CLI profile written ({exc}); pass --ingress/--ca-cert")
        return
    system.say(f"CLI profile: {path} (baton sessions list, baton deployments list need no flags)")


def launch(settings: LaunchSettings, out: TextIO | None = None) -> int:
    """`baton up`: returns the process exit code."""
    stream = out or sys.stdout
    err = sys.stderr
    with StopSignals().installed() as signals:
        try:
            ports = Ports.plan(
                settings.port_base,
                settings.etcd_port,
                settings.deployment_ids,
                replicas=settings.replicas,
                etcd_members=settings.etcd_members,
            )
            ports.check_free()
        except LaunchError as exc:
            print(f"baton up: {exc}", file=err, flush=True)
            return 1
        own_dir = settings.run_dir is None
        if settings.run_dir is None:
            run_dir = Path(tempfile.mkdtemp(prefix="baton-up-"))
        else:
            run_dir = Path(settings.run_dir).resolve()
            run_dir.mkdir(parents=True, exist_ok=True)
        system = LocalSystem(settings, ports, run_dir, stream)
        system.say(f"baton up: run dir {run_dir}, service logs in {system.log_dir}")
        system.say(f"baton up: ports: {ports.summary()}")
        code = 0
        try:
            if system.start(signals):
                _write_profile(system)  # before the ready line: readers may start then
                _announce(system)
                if settings.demo:
                    _run_demo_child(system, signals, time_limit=60.0)
                while not signals.requested:
                    system.raise_if_any_died(during="operation")
                    time.sleep(0.2)
        except LaunchError as exc:
            print(f"baton up: {exc}", file=err, flush=True)
            code = 1
        finally:
            reason = signals.name or "error"
            system.say(f"baton up: stopping ({reason})")
            profile.remove_if_ours(profile.default_path(), str(run_dir))
            problems = system.stop()
            for problem in problems:
                print(f"baton up: could not stop {problem}", file=err, flush=True)
                code = 1
            if own_dir:
                shutil.rmtree(run_dir, ignore_errors=True)
                system.say(f"baton up: removed {run_dir}")
            system.say("baton up: stopped")
        return code
