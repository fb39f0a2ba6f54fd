"""Local child processes: free loopback ports, the guard that takes a child
down with its parent, Baton service processes (`python -m baton_runtime.<name>`)
started and stopped by PID, and waiting for a gRPC server to be SERVING.

Used by `baton up`, the benchmarks and the tests that need real processes;
etcd's own processes are services/cli/system/etcd_process.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton_runtime.common.security.tls import Security, channel_credentials, load_material

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


def guarded(command: Sequence[str]) -> list[str]:
    """`command` run so that it dies with the thread that starts it (Linux's
    PR_SET_PDEATHSIG, set by services/cli/system/orphan_guard.py before it becomes
    the command, keeping its pid): a test run or `baton up` that is itself
    killed, timed out or interrupted leaves no etcd or service behind, though
    each child has a session of its own. Elsewhere the command as it is.

    The signal follows the *thread* that starts the child: a process started
    from a worker thread (asyncio.to_thread) lives as long as that thread,
    which for the default executor is the event loop's life."""
    if not sys.platform.startswith("linux"):
        return list(command)
    guard = [sys.executable, "-m", "baton_runtime.cli.system.orphan_guard", str(os.getpid()), "--"]
    return [*guard, *command]


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then a kill if `proc` has not exited after `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


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
    """One `python -m baton_runtime.<name>` child process."""

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
                    f"baton_runtime.{self.name}",
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
            terminate(self.proc, timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
