"""`baton up`: the whole system on one machine, as real processes.

Starts a single-member etcd, then hooks and anchor, then the owner and the
ingress of one deployment, each as a child process with its log in the run
directory. Waits until every process answers its health check, prints the
endpoints, optionally runs the demo, and then supervises: SIGINT/SIGTERM (or
any child exiting) stops everything it started, by PID — SIGTERM first, a kill
after a timeout — and removes the run directory unless the user chose it.

Default ports (`--port-base 50051`): ingress 50051, hooks 50052, anchor 50053,
owner 50054; etcd clients 23790 and etcd peers the next port. Port 0 means
"pick free ports".
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
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import services
from services.cli.processes import EtcdProcess, ServiceProcess

DEFAULT_DEPLOYMENT_ID = "dep-1"
DEFAULT_PORT_BASE = 50051
DEFAULT_ETCD_PORT = 23790
DEMO_CHANNEL = "demo"
DEMO_API_KEY = "demo-key-0001"
ETCD_PREFIX = "/baton/"
READY_LINE = "baton up: ready"

# Offsets from --port-base, in start order after etcd.
PORT_OFFSETS = {"ingress": 0, "hooks": 1, "anchor": 2, "owner": 3}
START_ORDER = (("hooks", "anchor"), ("owner", "ingress"))

_PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class LaunchError(Exception):
    """Startup failed; the message says what and where to look."""


@dataclass(frozen=True)
class LaunchSettings:
    deployment_id: str = DEFAULT_DEPLOYMENT_ID
    port_base: int = DEFAULT_PORT_BASE
    etcd_port: int = DEFAULT_ETCD_PORT
    # API key -> channel, as the ingress parses BATON_API_KEYS.
    api_keys: Mapping[str, str] = field(default_factory=lambda: {DEMO_API_KEY: DEMO_CHANNEL})
    # Print the keys themselves (only for the built-in demo key).
    show_keys: bool = True
    demo: bool = False
    run_dir: str | None = None
    log_level: str = "info"
    startup_timeout: float = 60.0
    stop_timeout: float = 10.0

    @property
    def api_keys_spec(self) -> str:
        return ",".join(f"{channel}={key}" for key, channel in self.api_keys.items())


@dataclass(frozen=True)
class Ports:
    ingress: int
    hooks: int
    anchor: int
    owner: int
    etcd_client: int
    etcd_peer: int

    @classmethod
    def plan(cls, port_base: int, etcd_port: int) -> Ports:
        """Ports from the bases; a base of 0 picks free ports instead."""
        spare = iter(_distinct_free_ports(6))
        if port_base:
            service = {name: port_base + offset for name, offset in PORT_OFFSETS.items()}
        else:
            service = {name: next(spare) for name in PORT_OFFSETS}
        if etcd_port:
            etcd_client, etcd_peer = etcd_port, etcd_port + 1
        else:
            etcd_client, etcd_peer = next(spare), next(spare)
        ports = cls(etcd_client=etcd_client, etcd_peer=etcd_peer, **service)
        ports.validate()
        return ports

    def items(self) -> list[tuple[str, int]]:
        return [
            ("etcd client", self.etcd_client),
            ("etcd peer", self.etcd_peer),
            ("ingress", self.ingress),
            ("hooks", self.hooks),
            ("anchor", self.anchor),
            ("owner", self.owner),
        ]

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

    @property
    def pid(self) -> int:
        return self.proc.pid

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


def _etcd_healthy(port: int) -> bool:
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 - loopback
            return b'"health":"true"' in response.read()
    except OSError:
        return False


def _grpc_serving(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
    except grpc.RpcError:
        return False
    serving: bool = response.status == health_pb2.HealthCheckResponse.SERVING
    return serving


class LocalSystem:
    """The processes of one `baton up`, in start order."""

    def __init__(self, settings: LaunchSettings, ports: Ports, run_dir: Path, out: TextIO) -> None:
        self.settings = settings
        self.ports = ports
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.children: list[Child] = []
        self._out = out

    def say(self, line: str) -> None:
        print(line, file=self._out, flush=True)

    # -- start -------------------------------------------------------------

    def start(self, signals: StopSignals) -> bool:
        """Start everything; False if a stop was requested meanwhile.
        Raises LaunchError if a process dies or is not ready in time."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        etcd = self._start_etcd()
        self._await([etcd], lambda: _etcd_healthy(self.ports.etcd_client), "etcd health", signals)
        if signals.requested:
            return False
        for group in START_ORDER:
            started = [self._start_service(name) for name in group]
            for child in started:
                with grpc.insecure_channel(child.address, options=_PROBE_OPTIONS) as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    probe = functools.partial(_grpc_serving, stub)
                    self._await(started, probe, f"{child.name} health", signals)
                if signals.requested:
                    return False
        return True

    def _start_etcd(self) -> Child:
        data_dir = self.run_dir / "etcd"
        data_dir.mkdir(parents=True, exist_ok=True)
        etcd = EtcdProcess(
            client_port=self.ports.etcd_client,
            peer_port=self.ports.etcd_peer,
            data_dir=str(data_dir),
            log_path=str(self.log_dir / "etcd.log"),
        )
        try:
            etcd.start(wait=False)
        except OSError as exc:
            raise LaunchError(f"could not start etcd: {exc}") from exc
        assert etcd.proc is not None
        return self._started(Child("etcd", etcd.endpoint, etcd.log_path, etcd.proc, etcd.stop))

    def _service_env(self, name: str) -> dict[str, str]:
        env = {
            "PYTHONPATH": _python_path(),
            "PYTHONUNBUFFERED": "1",
            "BATON_LOG_LEVEL": self.settings.log_level,
        }
        hooks = f"127.0.0.1:{self.ports.hooks}"
        anchor = f"127.0.0.1:{self.ports.anchor}"
        if name in ("hooks", "anchor"):
            env |= {
                "BATON_ETCD_ENDPOINT": f"127.0.0.1:{self.ports.etcd_client}",
                "BATON_ETCD_PREFIX": ETCD_PREFIX,
            }
        if name in ("owner", "ingress"):
            env |= {
                "BATON_DEPLOYMENT_ID": self.settings.deployment_id,
                "BATON_HOOKS_ADDR": hooks,
                "BATON_ANCHOR_ADDR": anchor,
            }
        if name == "ingress":
            env |= {
                "BATON_OWNER_ADDR": f"127.0.0.1:{self.ports.owner}",
                "BATON_API_KEYS": self.settings.api_keys_spec,
            }
        return env

    def _start_service(self, name: str) -> Child:
        address = f"127.0.0.1:{getattr(self.ports, name)}"
        log_path = str(self.log_dir / f"{name}.log")
        service = ServiceProcess(name, address, self._service_env(name), log_path=log_path)
        try:
            service.start()
        except OSError as exc:
            raise LaunchError(f"could not start {name}: {exc}") from exc
        assert service.proc is not None
        return self._started(Child(name, address, log_path, service.proc, service.stop))

    def _started(self, child: Child) -> Child:
        self.children.append(child)
        self.say(f"baton up: started {child.name} (pid {child.pid}) on {child.address}")
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
                names = ", ".join(f"{c.name} ({c.log_path})" for c in starting)
                raise LaunchError(
                    f"{what} not SERVING after {self.settings.startup_timeout:g}s; see {names}"
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
                    f"{child.name} (pid {child.pid}) exited with code {code} during {during}; "
                    f"its log is {child.log_path}{detail}"
                )

    def describe(self) -> list[str]:
        lines = [f"  {'process':<8} {'address':<17} {'pid':>7}  log"]
        for child in self.children:
            lines.append(f"  {child.name:<8} {child.address:<17} {child.pid:>7}  {child.log_path}")
        return lines

    # -- stop --------------------------------------------------------------

    def stop(self) -> list[str]:
        """Stop every child, last started first; returns problems, if any."""
        problems: list[str] = []
        for child in reversed(self.children):
            try:
                child.stop(self.settings.stop_timeout)
            except (OSError, subprocess.SubprocessError) as exc:
                problems.append(f"{child.name} (pid {child.pid}): {exc}")
                continue
            code = child.exit_code()
            if code is None:
                problems.append(f"{child.name} (pid {child.pid}) is still running")
            else:
                self.say(f"baton up: stopped {child.name} (pid {child.pid}, exit code {code})")
        return problems


def _run_demo_child(system: LocalSystem, signals: StopSignals, time_limit: float) -> None:
    """Run `baton demo` as a child process against this system, supervising it."""
    key = next(iter(system.settings.api_keys))
    env = {**os.environ, "PYTHONPATH": _python_path(), "BATON_API_KEY": key}
    system.say("baton up: running the demo")
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "demo",
            "--ingress",
            f"127.0.0.1:{system.ports.ingress}",
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
    ingress = f"127.0.0.1:{system.ports.ingress}"
    system.say(f"Baton is up: deployment {settings.deployment_id}, public API at {ingress}")
    for line in system.describe():
        system.say(line)
    if settings.show_keys:
        for key, channel in settings.api_keys.items():
            system.say(f"API key: channel {channel!r}, key {key!r} (authorization: Bearer {key})")
    else:
        channels = ", ".join(sorted(set(settings.api_keys.values())))
        system.say(f"API keys: channels {channels} (keys as given)")
    system.say(f"Try:  baton demo --ingress {ingress}")
    system.say(f"      grpcurl -plaintext {ingress} list")
    system.say("Ctrl-C or SIGTERM stops everything.")
    system.say(READY_LINE)


def launch(settings: LaunchSettings, out: TextIO | None = None) -> int:
    """`baton up`: returns the process exit code."""
    stream = out or sys.stdout
    err = sys.stderr
    with StopSignals().installed() as signals:
        try:
            ports = Ports.plan(settings.port_base, settings.etcd_port)
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
        code = 0
        try:
            if system.start(signals):
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
            problems = system.stop()
            for problem in problems:
                print(f"baton up: could not stop {problem}", file=err, flush=True)
                code = 1
            if own_dir:
                shutil.rmtree(run_dir, ignore_errors=True)
                system.say(f"baton up: removed {run_dir}")
            system.say("baton up: stopped")
        return code
