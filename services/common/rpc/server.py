"""One grpc.aio server assembly for every Baton service (`build_server`):
TLS (mutual for internal services) or explicit loopback plaintext, the
interceptor, health (overall and per service), reflection, the plaintext
health listener and the Prometheus endpoint; `GrpcServer` starts, reloads
and stops it gracefully."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton_runtime.common.config import Capacity, ConfigError
from baton_runtime.common.observability import metrics
from baton_runtime.common.observability.metrics_endpoint import MetricsEndpoint
from baton_runtime.common.rpc.interceptor import CallInterceptor
from baton_runtime.common.security.tls import (
    CertificateWatcher,
    Security,
    is_loopback,
    request_reload,
    server_credentials,
)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_CONNECTION_AGE_MS = 5 * 60 * 1000
# How long one step of a stop may take beyond its grace (closing a store, a
# room's tasks): one that overruns is logged and left behind.
STOP_STEP_SECONDS = 10.0

log = structlog.get_logger("baton.server")


def _name(callback: Callable[[], Awaitable[None]]) -> str:
    """A stop callback's name for the log: `Store.close`, `Registry.close`."""
    return getattr(callback, "__qualname__", "") or repr(callback)


async def _bounded(step: str, run: Callable[[], Awaitable[object]], seconds: float) -> None:
    """Run one stop step for at most `seconds`. An error is raised as before;
    a step that overruns is logged (an error: something in it ignores
    cancellation or waits on a peer without a deadline) and cancelled
    without waiting for it, so the stop goes on."""
    task = asyncio.ensure_future(run())
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        log.error("a stop step overran; going on without it", step=step, seconds=seconds)
        return
    task.result()


@dataclass(frozen=True)
class ServiceBinding:
    """A servicer and how to register it, with its full proto service name."""

    full_name: str
    register: Callable[[grpc.aio.Server], None]


@dataclass
class GrpcServer:
    """A started (or startable) gRPC server with health and reflection."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: Sequence[str]
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Run on SIGHUP, after certificate watchers were told to re-check (e.g.
    # ingress re-reads its API keys).
    on_reload: list[Callable[[], object]] = field(default_factory=list)
    # The service's root object (e.g. the owner host), for in-process tests.
    app: object = None
    # Supervised loops that run while the server serves (e.g. store health,
    # sweeps); cancelled before `on_stop`.
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # The server's certificate files, when serving TLS.
    certificates: CertificateWatcher | None = None
    # The plaintext health-only listener (`--health-listen`), if any: the
    # same health statuses, nothing else.
    health_server: grpc.aio.Server | None = None
    health_port: int = 0
    # The Prometheus endpoint (`--metrics-listen`), if any; `metrics_port`
    # once started. Services add their collectors and refreshes to it.
    metrics: MetricsEndpoint | None = None
    metrics_port: int = 0

    def reload(self) -> None:
        """What SIGHUP does: re-read certificates and reloadable settings."""
        request_reload()
        if self.certificates is not None:
            self.certificates.refresh()
        for callback in self.on_reload:
            callback()

    async def start(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        if self.metrics is not None:
            await self.metrics.start()
            self.metrics_port = self.metrics.port
        await self.set_serving(True)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(run()) for run in self.background]

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0, *, step_seconds: float = STOP_STEP_SECONDS) -> None:
        """Report NOT_SERVING, drain in-flight calls for `grace` s, then close.
        Every step is bounded (the server's by `grace` + `step_seconds`, the
        others by `step_seconds`): one that overruns is logged by name and
        left behind, so a stop always ends."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        steps: list[tuple[str, Callable[[], Awaitable[object]], float]] = [
            ("background tasks", lambda: asyncio.gather(*tasks, return_exceptions=True), 0.0),
            ("health", self.health.enter_graceful_shutdown, 0.0),
            ("server", lambda: self.server.stop(grace), grace),
        ]
        health_server, endpoint = self.health_server, self.metrics
        if health_server is not None:
            steps.append(("health listener", lambda: health_server.stop(0), 0.0))
        if endpoint is not None:
            steps.append(("metrics endpoint", endpoint.stop, 0.0))
        steps += [(_name(callback), callback, 0.0) for callback in reversed(self.on_stop)]
        for step, run, extra in steps:
            await _bounded(step, run, extra + step_seconds)


def build_server(
    listen: str,
    bindings: Sequence[ServiceBinding],
    *,
    service: str,
    security: Security,
    client_certificates: bool = True,
    deployment_id: str = "",
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    capacity: Capacity | None = None,
    health_listen: str = "",
    metrics_listen: str = "",
) -> GrpcServer:
    """Assemble a server, one step each: the interceptor and the server's
    options, the services with health and reflection, the API port (TLS, or
    plaintext on loopback only: `_bind`), then the optional plaintext health
    listener (`health_listen`, `_health_listener`) and Prometheus endpoint
    (`metrics_listen`, `_metrics_endpoint`)."""
    _refuse_public_plaintext(service, listen, security)
    interceptor = CallInterceptor(
        service, deployment_id, verify_callers=security.is_tls, capacity=capacity
    )
    server = grpc.aio.server(interceptors=[interceptor], options=server_options(max_message_bytes))
    health_servicer, names = _register(server, bindings)
    port, watcher = _bind(server, listen, security, client_certificates)
    health_server, health_port = _health_listener(health_servicer, health_listen)
    return GrpcServer(
        server=server,
        health=health_servicer,
        port=port,
        service_names=names,
        certificates=watcher,
        health_server=health_server,
        health_port=health_port,
        metrics=_metrics_endpoint(service, deployment_id, metrics_listen),
    )


def _refuse_public_plaintext(service: str, listen: str, security: Security) -> None:
    """Plaintext must be asked for and binds only loopback addresses."""
    if not security.is_tls and not is_loopback(listen):
        raise ConfigError(
            f"{service}: refusing to serve plaintext on {listen}: plaintext is for "
            "local development on a loopback address; configure --tls-cert/--tls-key/--tls-ca"
        )


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The API server's channel options: message sizes, keepalive, ports."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        # Never share a port with another process silently.
        ("grpc.so_reuseport", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        # Clients reconnect every few minutes (streams in flight run to
        # their end), and so resolve a dns:/// target again: replicas
        # added since are balanced onto too.
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
    ]


def _register(
    server: grpc.aio.Server, bindings: Sequence[ServiceBinding]
) -> tuple[health.aio.HealthServicer, list[str]]:
    """Register the services, health and reflection (over the services,
    health and reflection itself); the health servicer and service names."""
    for binding in bindings:
        binding.register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [b.full_name for b in bindings]
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    return health_servicer, names


def _bind(
    server: grpc.aio.Server, listen: str, security: Security, client_certificates: bool
) -> tuple[int, CertificateWatcher | None]:
    """Bind the API port: the port, and the watcher of the server's
    certificate files when serving TLS.

    With TLS, `client_certificates` (hooks, anchor, owner) makes the
    handshake demand a certificate from the CA bundle and the interceptor
    check each call's role; without it (ingress) any TLS client may connect
    and only RPCs open to the public are served."""
    watcher: CertificateWatcher | None = None
    if security.is_tls:
        credentials, watcher = server_credentials(security, require_client_auth=client_certificates)
        port = server.add_secure_port(listen, credentials)
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise RuntimeError(f"could not bind {listen}")
    return port, watcher


def _health_listener(
    health_servicer: health.aio.HealthServicer, health_listen: str
) -> tuple[grpc.aio.Server | None, int]:
    """With `health_listen`, a plaintext listener that serves grpc.health.v1
    and nothing else, with the same statuses, on any address: Kubernetes'
    gRPC probes cannot speak TLS. Health says SERVING or NOT_SERVING per
    service name and carries no data; the API stays behind TLS."""
    if not health_listen:
        return None, 0
    health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
    health_port = health_server.add_insecure_port(health_listen)
    if health_port == 0:
        raise RuntimeError(f"could not bind {health_listen}")
    return health_server, health_port


def _metrics_endpoint(
    service: str, deployment_id: str, metrics_listen: str
) -> MetricsEndpoint | None:
    """With `metrics_listen`, a plaintext HTTP listener serving Prometheus
    metrics at /metrics (what `service` exposes, see
    `metrics.SERVICE_METRICS`), on the address given: counts and timings, no
    session data."""
    if not metrics_listen:
        return None
    return MetricsEndpoint(metrics_listen, metrics.registry_for(service, deployment_id))
