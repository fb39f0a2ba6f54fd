"""One grpc.aio server bootstrap for every Baton service.

TLS (mutual for internal services) or explicit loopback plaintext, health
(overall and per service), reflection, one interceptor (caller identity and
the per-RPC role table, a cap on concurrent calls, request decoding, error
mapping through `grpc_errors`, one log line and the RPC metrics per call),
the Prometheus endpoint (`--metrics-listen`), graceful shutdown on
SIGTERM/SIGINT within a bounded grace period, and reload on SIGHUP.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, cast

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import access, errors, identity, metrics, tracing
from services.common.config import Capacity, ConfigError
from services.common.grpc_errors import status_code, to_status
from services.common.identity import Caller, Role
from services.common.ids import new_request_id
from services.common.tls import (
    CertificateWatcher,
    Security,
    is_loopback,
    request_reload,
    server_credentials,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = structlog.get_logger("baton.server")

# What a servicer method is handed, and what the interceptor wraps. (grpc's
# stubs are generic over request and response types; Baton's servicers and
# interceptor serve many.)
Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

# Paths that are polled constantly; not worth a log line each.
_QUIET_PREFIXES = ("/grpc.health.", "/grpc.reflection.")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_CONNECTION_AGE_MS = 5 * 60 * 1000

_C = TypeVar("_C", bound="_ServiceConfig")


@dataclass(frozen=True)
class ServiceBinding:
    """A servicer and how to register it, with its full proto service name."""

    full_name: str
    register: Callable[[grpc.aio.Server], None]


def _request_id(details: grpc.HandlerCallDetails) -> str:
    for key, value in details.invocation_metadata or ():
        if key == "x-request-id" and isinstance(value, str) and value:
            return value[:128]
    return new_request_id()


class _Gate:
    """Counts calls in flight against a `Capacity`: unary calls and streams
    each against their own limit."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.unary = 0
        self.streams = 0

    def enter(self, stream: bool) -> None:
        """Admit one more call of its kind, or refuse with RESOURCE_EXHAUSTED."""
        if stream:
            if self.streams >= self.capacity.max_streams:
                raise self._refuse("streams")
            self.streams += 1
        else:
            if self.unary >= self.capacity.max_unary:
                raise self._refuse("calls")
            self.unary += 1

    def leave(self, stream: bool) -> None:
        if stream:
            self.streams -= 1
        else:
            self.unary -= 1

    def _refuse(self, what: str) -> errors.ResourceExhausted:
        return errors.ResourceExhausted(
            errors.Reason.SERVER_BUSY,
            f"the server is at its limit of concurrent {what}; retry later",
            retry_after=self.capacity.retry_after,
        )


def _decoder(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    if deserializer is None:
        return lambda raw: raw

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any decoder failure is the caller's bad body
            raise errors.InvalidArgument(
                errors.Reason.MALFORMED_REQUEST,
                f"the request body does not decode as the method's message ({type(exc).__name__})",
            ) from exc

    return decode


class CallInterceptor(grpc.aio.ServerInterceptor):
    """The one interceptor of every server. Per call, in this order:

    1. binds service/rpc/request ids for the logs;
    2. identifies the caller from its verified certificate and checks the
       per-RPC role table (`services.common.access`; deny by default);
    3. admits the call against the server's `Capacity`;
    4. decodes the request body itself (gRPC hands over raw bytes), so an
       undecodable body is INVALID_ARGUMENT/MALFORMED_REQUEST, not UNKNOWN;
    5. maps domain errors to statuses with ErrorInfo (anything unmapped is
       INTERNAL) and writes one log line per call, and, while this process
       serves metrics, counts it by method and code and times it
       (`metrics.RPC`).
    """

    def __init__(
        self,
        service: str,
        deployment_id: str = "",
        *,
        verify_callers: bool = True,
        capacity: Capacity | None = None,
    ) -> None:
        self._context = {"service": service}
        if deployment_id:
            self._context["deployment_id"] = deployment_id
        self._verify = verify_callers
        self._gate = _Gate(capacity or Capacity())

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        allowed = access.allowed_roles(method)
        if allowed == access.ANY and method.startswith(_QUIET_PREFIXES):
            return handler  # health and reflection: no per-call work
        call = _Call(
            method,
            dict(self._context, rpc=method, request_id=_request_id(handler_call_details)),
            allowed,
            self._verify,
            self._gate,
        )
        decode = _decoder(handler.request_deserializer)
        if handler.unary_unary is not None:
            return _replaced(
                handler,
                request_deserializer=None,
                unary_unary=call.unary(handler.unary_unary, decode),
            )
        if handler.unary_stream is not None:
            return _replaced(
                handler,
                request_deserializer=None,
                unary_stream=call.stream(handler.unary_stream, decode),
            )
        if allowed == access.ANY:
            return handler
        # Client-streaming methods are not part of Baton's API; never serve
        # one that has no open entry.
        if handler.stream_unary is not None:
            return _replaced(handler, stream_unary=call.denied)
        return _replaced(handler, stream_stream=call.denied)


def _replaced(handler: Handler, **fields: Any) -> Handler:
    """`handler` with `fields` replaced: grpc's handlers are namedtuples, which
    its type stubs declare only as the abstract RpcMethodHandler."""
    replaced: Handler = cast(Any, handler)._replace(**fields)
    return replaced


class _Call:
    """What the interceptor knows about one call before it runs."""

    __slots__ = ("method", "bound", "allowed", "verify", "gate")

    def __init__(
        self,
        method: str,
        bound: dict[str, str],
        allowed: frozenset[Role] | None,
        verify: bool,
        gate: _Gate,
    ) -> None:
        self.method = method
        self.bound = bound
        self.allowed = allowed
        self.verify = verify
        self.gate = gate

    def admit(self, context: Context) -> None:
        """Identify the caller and check the table (raises when refused)."""
        allowed = self.allowed
        if allowed is None:
            raise errors.PermissionDenied(
                errors.Reason.RPC_NOT_ALLOWED, "this RPC has no entry in the access table"
            )
        if not self.verify:
            identity.bind(Caller.UNVERIFIED)
            return
        if Role.PUBLIC in allowed:
            identity.bind(PUBLIC_CALLER)
            return
        caller = Caller.from_peer(context.peer_identities())
        if not caller.has(allowed):
            raise errors.PermissionDenied(
                errors.Reason.ROLE_NOT_ALLOWED,
                f"a certificate of role {caller.describe()} may not call this RPC",
            )
        identity.bind(caller)
        structlog.contextvars.bind_contextvars(caller=caller.describe())

    async def denied(self, request: Any, context: Context) -> Any:
        structlog.contextvars.bind_contextvars(**self.bound)
        start = time.perf_counter()
        _log_call("PERMISSION_DENIED", errors.Reason.RPC_NOT_ALLOWED, start)
        _meter(self.method, "PERMISSION_DENIED", start)
        await _abort(
            context,
            errors.PermissionDenied(
                errors.Reason.RPC_NOT_ALLOWED, "this RPC has no entry in the access table"
            ),
        )

    def unary(self, behavior: Any, decode: Callable[[bytes], Any]) -> Any:
        async def wrapped(raw: bytes, context: Context) -> Any:
            async with _Served(self, context, stream=False) as served:
                served.admit()
                return await behavior(decode(raw), context)

        return wrapped

    def stream(self, behavior: Any, decode: Callable[[bytes], Any]) -> Any:
        async def wrapped(raw: bytes, context: Context) -> AsyncIterator[Any]:
            async with _Served(self, context, stream=True) as served:
                served.admit()
                meter = metrics.RPC
                async for item in behavior(decode(raw), context):
                    if meter.enabled:
                        meter.sent(self.method)
                    yield item

        return wrapped


class _Served:
    """One call being served, unary or stream alike: admitted (the role table,
    then the gate), its errors mapped at the boundary (a BatonError to its
    status, anything unmapped to INTERNAL), one log line and the RPC metrics
    at its end."""

    __slots__ = ("call", "context", "stream", "start", "admitted", "span")

    def __init__(self, call: _Call, context: Context, stream: bool) -> None:
        self.call = call
        self.context = context
        self.stream = stream
        self.start = 0.0
        self.admitted = False
        self.span: Span | None = None

    async def __aenter__(self) -> _Served:
        structlog.contextvars.bind_contextvars(**self.call.bound)
        if tracing.TRACING.enabled:
            self.span = tracing.start_server_span(
                self.call.method, self.context.invocation_metadata()
            )
        self.start = time.perf_counter()
        return self

    def admit(self) -> None:
        """The role table, then the gate (raises when refused)."""
        self.call.admit(self.context)
        self.call.gate.enter(self.stream)
        self.admitted = True

    async def __aexit__(
        self, _type: type[BaseException] | None, exc: BaseException | None, _tb: object
    ) -> None:
        if self.admitted:
            self.admitted = False
            self.call.gate.leave(self.stream)
        if exc is None:
            _log_call("OK", "", self.start)
            self._end("OK")
            return
        if isinstance(exc, grpc.aio.AbortError) or not isinstance(exc, Exception):
            # Cancelled, closed (GeneratorExit) or already answered.
            _log_call("CANCELLED", "", self.start)
            self._end("CANCELLED")
            return
        if isinstance(exc, errors.BatonError):
            code, reason = status_code(exc).name, exc.reason
        else:  # the boundary: anything unmapped is INTERNAL
            code, reason = "INTERNAL", errors.Reason.INTERNAL
        _log_call(code, reason, self.start)
        self._end(code, reason)
        await _abort(self.context, exc)

    def _end(self, code: str, reason: str = "") -> None:
        """The call's metrics and its span, with its status code."""
        _meter(self.call.method, code, self.start)
        if self.span is not None:
            tracing.end_server_span(self.span, code, reason)
            self.span = None


PUBLIC_CALLER = Caller(role=Role.PUBLIC)


async def _abort(context: Context, exc: BaseException) -> None:
    if isinstance(exc, errors.BatonError):
        err = exc
    else:
        log.exception("unhandled error", exc_info=exc)
        err = errors.Internal(errors.Reason.INTERNAL, "internal error")
    status = to_status(err)
    await context.abort(status.code, status.details, status.trailing_metadata)


def _meter(method: str, code: str, start: float) -> None:
    if metrics.RPC.enabled:
        metrics.RPC.served(method, code, time.perf_counter() - start)


def _log_call(code: str, reason: str, start: float) -> None:
    duration_ms = round((time.perf_counter() - start) * 1000, 3)
    if code in ("OK", "CANCELLED"):
        log.debug("rpc", code=code, duration_ms=duration_ms)
    else:
        log.info("rpc", code=code, reason=reason, duration_ms=duration_ms)


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
    metrics: metrics.MetricsEndpoint | None = None
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

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING, drain in-flight calls for `grace` s, then close."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.metrics is not None:
            await self.metrics.stop()
        for callback in reversed(self.on_stop):
            await callback()


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
    """Assemble a server: interceptor, services, health, reflection, port.

    With TLS, `client_certificates` (hooks, anchor, owner) makes the
    handshake demand a certificate from the CA bundle and the interceptor
    check each call's role; without it (ingress) any TLS client may connect
    and only RPCs open to the public are served. Plaintext must be asked for
    and binds only loopback addresses.

    `health_listen` adds a plaintext listener that serves grpc.health.v1 and
    nothing else, with the same statuses, on any address: Kubernetes' gRPC
    probes cannot speak TLS. Health says SERVING or NOT_SERVING per service
    name and carries no data; the API stays behind TLS.

    `metrics_listen` adds a plaintext HTTP listener serving Prometheus
    metrics at /metrics (what `service` exposes, see `metrics.SERVICE_METRICS`),
    on the address given: counts and timings, no session data."""
    if not security.is_tls and not is_loopback(listen):
        raise ConfigError(
            f"{service}: refusing to serve plaintext on {listen}: plaintext is for "
            "local development on a loopback address; configure --tls-cert/--tls-key/--tls-ca"
        )
    server = grpc.aio.server(
        interceptors=[
            CallInterceptor(
                service,
                deployment_id,
                verify_callers=security.is_tls,
                capacity=capacity,
            )
        ],
        options=[
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
        ],
    )
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
    watcher: CertificateWatcher | None = None
    if security.is_tls:
        credentials, watcher = server_credentials(security, require_client_auth=client_certificates)
        port = server.add_secure_port(listen, credentials)
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise RuntimeError(f"could not bind {listen}")
    health_server: grpc.aio.Server | None = None
    health_port = 0
    if health_listen:
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = health_server.add_insecure_port(health_listen)
        if health_port == 0:
            raise RuntimeError(f"could not bind {health_listen}")
    endpoint = None
    if metrics_listen:
        endpoint = metrics.MetricsEndpoint(
            metrics_listen, metrics.registry_for(service, deployment_id)
        )
    return GrpcServer(
        server=server,
        health=health_servicer,
        port=port,
        service_names=names,
        certificates=watcher,
        health_server=health_server,
        health_port=health_port,
        metrics=endpoint,
    )


async def run_until_signalled(server: GrpcServer, *, grace: float) -> None:
    """Start, serve until SIGTERM/SIGINT, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reloader(server))
    await server.start()
    log.info(
        "serving",
        port=server.port,
        services=list(server.service_names),
        **({"health_port": server.health_port} if server.health_server else {}),
        **({"metrics_port": server.metrics_port} if server.metrics else {}),
    )
    await stop.wait()
    log.info("shutting down", grace_s=grace)
    await server.stop(grace)
    log.info("stopped")


def _reloader(server: GrpcServer) -> Callable[[], None]:
    def reload() -> None:
        log.info("SIGHUP: reloading certificates and settings")
        try:
            server.reload()
        except Exception:  # noqa: BLE001 - a bad reload keeps the old settings
            log.exception("reload failed; keeping the previous settings")

    return reload


class _ServiceConfig(Protocol):
    @property
    def log_level(self) -> str: ...

    @property
    def grace(self) -> float: ...


def run_main(
    load: Callable[[], _C], create: Callable[[_C], Awaitable[GrpcServer]], *, service: str
) -> None:
    """The `python -m services.<name>` entry: config, tracing (if the OTEL_*
    environment asks, services.common.tracing), logging, serve, exit."""
    from services.common.logs import configure_logging

    try:
        config = load()
        # Before any channel opens: channels get tracing's interceptors then.
        tracing.TRACING.configure(
            service,
            str(getattr(config, "deployment_id", "")),
            str(getattr(config, "instance_id", "")),
        )
    except ConfigError as exc:
        sys.exit(str(exc))
    configure_logging(config.log_level)

    async def _serve() -> None:
        server = await create(config)
        await run_until_signalled(server, grace=config.grace)

    try:
        asyncio.run(_serve())
    except ConfigError as exc:
        sys.exit(str(exc))
    finally:
        tracing.TRACING.shutdown()  # exports the spans still buffered
