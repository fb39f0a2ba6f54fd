"""The stacks the benchmarks measure, as real processes started by the one
launcher (services/cli/system/service_launcher.py): `BenchStack` (etcd,
hooks, anchor, an owner and an ingress, and optionally a second
deployment's), `bench_service_stack` (the package's `ServiceStack` on a
PKI of the bench's, for the benches that kill, pause and add processes),
and what a bench client needs to talk to them: the bench's API key and
channel, a gateway's channel to an ingress, and waiting on a condition.

TLS is on by default, as in production: a throwaway CA in the stack's log
directory, client certificates on every hop, etcd over TLS with
client-certificate user/role auth limited to BENCH_PREFIX.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.cli.system.service_env import wiring_env
from baton_runtime.cli.system.service_launcher import ServiceLauncher, start_etcd
from baton_runtime.cli.system.service_stack import ServiceStack
from baton_runtime.common.errors import BatonError
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security
from bench.measure import Sample, context_switches, cpu_seconds

API_KEY = "bench-key-00001-loopback-Zq4v"
CHANNEL = "bench"
METADATA = (("authorization", f"Bearer {API_KEY}"),)
# Every key the bench writes lives under this prefix (the etcd role's scope).
BENCH_PREFIX = "/b/"
DEPLOYMENT_ID = "bench-dep-1"
DEPLOYMENT_ID_B = "bench-dep-2"
SERVICES = ("hooks", "anchor", "owner", "ingress")
# Process name in the stack -> the service it runs. The second deployment
# (owner-b, ingress-b) shares hooks, anchor and etcd with the first.
PROCESSES = {
    "hooks": "hooks",
    "anchor": "anchor",
    "owner": "owner",
    "ingress": "ingress",
    "owner-b": "owner",
    "ingress-b": "ingress",
}
# The bench drives one channel far past the default per-channel rates; the
# checks still run on every call.
UNLIMITED_RATES = {
    "BATON_MAX_SENDS_PER_SECOND": "1000000",
    "BATON_MAX_SESSIONS_PER_MINUTE": "1000000",
}
_T = TypeVar("_T")


def bench_pki(directory: str | Path) -> LocalPki:
    """A throwaway CA and the roles' certificates, in `directory`."""
    return LocalPki(Path(directory))


def key_file(directory: str | Path) -> str:
    """A file granting the bench's API key, in `directory`."""
    path = Path(directory) / "api-keys"
    path.write_text(f"{CHANNEL}={API_KEY}\n")
    return str(path)


def public_channel(
    target: str, pki: LocalPki | None, options: list[tuple[str, object]] | None = None
) -> grpc.aio.Channel:
    """A gateway's channel to an ingress: TLS trusting `pki`'s CA with no
    client certificate (gateways authenticate with API keys); plaintext
    without a PKI."""
    if pki is None:
        return grpc.aio.insecure_channel(target, options=options)
    ca = Path(pki.ca_path).read_bytes()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.aio.secure_channel(target, credentials, options=options)


async def eventually(
    probe: Callable[[], Awaitable[_T | None]], what: str, within: float = 30.0
) -> _T:
    """Poll `probe` until it returns something truthy, or fail after `within` s."""
    deadline = time.monotonic() + within
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = await probe()
            if result:
                return result
        except (BatonError, grpc.aio.AioRpcError) as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out after {within}s waiting for {what} (last error: {last!r})")


def bench_service_stack(
    etcd_endpoint: str, workdir: Path, pki: LocalPki, prefix: str = "", **options: object
) -> ServiceStack:
    """The package's process stack (services/cli/system/service_stack.py)
    on `pki` (the one etcd trusts), under `prefix` (default: a fresh one
    under BENCH_PREFIX), its ingresses granting the bench's API key."""
    return ServiceStack(
        etcd_endpoint,
        workdir,
        pki,
        prefix or f"{BENCH_PREFIX}s{uuid.uuid4().hex[:12]}/",
        api_key=API_KEY,
        channel=CHANNEL,
        **options,  # type: ignore[arg-type]
    )


@dataclass
class BenchStack:
    """etcd + hooks + anchor + owner + ingress as separate processes; with
    `second_deployment`, also owner-b + ingress-b of deployment DEPLOYMENT_ID_B.

    With `tls` (the default, as in production): a throwaway CA in the log dir,
    TLS with client certificates on every hop, and etcd over TLS with
    client-certificate user/role auth (role limited to BENCH_PREFIX). Without
    it: everything plaintext (explicit `--plaintext`), etcd without auth."""

    log_dir: str
    second_deployment: bool = True
    log_level: str = "warning"
    tls: bool = True
    # Every service serves Prometheus metrics (--metrics-listen) on its own port.
    metrics: bool = False
    # Every service's extra environment (e.g. OTEL_* for tracing).
    env: dict[str, str] = field(default_factory=dict)
    etcd: EtcdProcess | None = None
    prefix: str = ""
    launcher: ServiceLauncher = field(init=False)

    def __post_init__(self) -> None:
        self.launcher = ServiceLauncher(
            Path(self.log_dir), None, self.log_level, self.env, metrics=self.metrics
        )

    @property
    def names(self) -> list[str]:
        return [n for n in PROCESSES if self.second_deployment or not n.endswith("-b")]

    @property
    def pki(self) -> LocalPki | None:
        return self.launcher.pki

    @property
    def addrs(self) -> dict[str, str]:
        return {name: self.launcher.addr(name) for name in self.names}

    @property
    def metrics_addrs(self) -> dict[str, str]:
        return {name: f"127.0.0.1:{port}" for name, port in self.launcher.metrics_ports.items()}

    def security(self, role: Role, deployment_id: str = "") -> Security:
        return self.launcher.security(role, deployment_id)

    @property
    def etcd_security(self) -> Security:
        """How the bench reads and writes etcd itself (as the hooks user)."""
        return self.security(Role.HOOKS)

    def public_channel(self, name: str) -> grpc.aio.Channel:
        """A gateway's channel to an ingress: TLS trusting the CA, no client cert."""
        return public_channel(self.addrs[name], self.pki)

    def start(self) -> None:
        if self.tls:
            self.launcher.pki = bench_pki(os.path.join(self.log_dir, "certs"))
        etcd_log = os.path.join(self.log_dir, "etcd.log")
        self.etcd = start_etcd(self.launcher.pki, BENCH_PREFIX, log_path=etcd_log)
        self.prefix = f"{BENCH_PREFIX}bench/{uuid.uuid4().hex[:12]}/"
        keys = key_file(self.log_dir)
        for name in self.names:
            kind = PROCESSES[name]
            deployment = DEPLOYMENT_ID_B if name.endswith("-b") else DEPLOYMENT_ID
            wiring = wiring_env(
                kind,
                etcd=self.etcd.endpoint,
                prefix=self.prefix,
                hooks=self.launcher.addr("hooks"),
                anchor=self.launcher.addr("anchor"),
                deployment_id=deployment,
                owners=self.launcher.addr("owner-b" if name.endswith("-b") else "owner"),
                api_keys_file=keys,
            )
            if kind == "owner":
                wiring["BATON_INSTANCE_ID"] = f"{deployment}-i1"
            if kind == "ingress":
                wiring |= UNLIMITED_RATES
            self.launcher.start(name, kind, wiring, deployment_id=deployment, wait=False)
        self.launcher.wait_serving(timeout=30)

    def pids(self) -> dict[str, int]:
        out = self.launcher.pids()
        if self.etcd is not None and self.etcd.proc is not None:
            out["etcd"] = self.etcd.proc.pid
        return out

    def sample(self) -> Sample:
        """(CPU seconds, context switches) of every process, this client included."""
        pids = {**self.pids(), "bench client": os.getpid()}
        return {name: (cpu_seconds(pid), context_switches(pid)) for name, pid in pids.items()}

    def cpu(self) -> dict[str, float]:
        """CPU seconds of every process, this client included (cheaper than `sample`)."""
        pids = {**self.pids(), "bench client": os.getpid()}
        return {name: cpu_seconds(pid) for name, pid in pids.items()}

    def check_alive(self) -> None:
        self.launcher.check_alive()

    def stop(self) -> None:
        self.launcher.stop(timeout=5)
        if self.etcd is not None:
            with contextlib.suppress(Exception):
                self.etcd.stop()
