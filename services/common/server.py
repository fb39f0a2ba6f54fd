"""One grpc.aio server bootstrap for every Baton service.

Health (overall and per service), reflection, a logging/error interceptor that
binds request ids and maps domain errors through `grpc_errors`, and graceful
shutdown on SIGTERM/SIGINT within a bounded grace period.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import errors
from services.common.grpc_errors import status_code, to_status
from services.common.ids import new_request_id

log = structlog.get_logger("baton.server")

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


class LoggingInterceptor(grpc.aio.ServerInterceptor):
    """Binds service/rpc/request ids, maps errors, logs one line per call."""

    def __init__(self, service: str, deployment_id: str = "") -> None:
        self._context = {"service": service}
        if deployment_id:
            self._context["deployment_id"] = deployment_id

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_QUIET_PREFIXES):
            return handler
        request_id = _request_id(handler_call_details)
        bound = dict(self._context, rpc=method, request_id=request_id)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, bound))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, bound))
        return handler


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, errors.BatonError):
        err = exc
    else:
        log.exception("unhandled error", exc_info=exc)
        err = errors.Internal(errors.Reason.INTERNAL, "internal error")
    status = to_status(err)
    await context.abort(status.code, status.details, status.trailing_metadata)


def _wrap_unary(behavior: Any, bound: dict[str, str]) -> Any:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        structlog.contextvars.bind_contextvars(**bound)
        start = time.perf_counter()
        code = "OK"
        reason = ""
        try:
            return await behavior(request, context)
        except errors.BatonError as exc:
            code, reason = status_code(exc).name, exc.reason
            await _abort(context, exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            code = "CANCELLED"
            raise
        except Exception as exc:  # noqa: BLE001 - the boundary: anything unmapped is INTERNAL
            code, reason = "INTERNAL", errors.Reason.INTERNAL
            await _abort(context, exc)
        finally:
            _log_call(code, reason, start)

    return wrapped


def _wrap_stream(behavior: Any, bound: dict[str, str]) -> Any:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        structlog.contextvars.bind_contextvars(**bound)
        start = time.perf_counter()
        code = "OK"
        reason = ""
        try:
            async for item in behavior(request, context):
                yield item
        except errors.BatonError as exc:
            code, reason = status_code(exc).name, exc.reason
            await _abort(context, exc)
        except (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit):
            code = "CANCELLED"
            raise
        except Exception as exc:  # noqa: BLE001 - the boundary: anything unmapped is INTERNAL
            code, reason = "INTERNAL", errors.Reason.INTERNAL
            await _abort(context, exc)
        finally:
            _log_call(code, reason, start)

    return wrapped


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
    # The service's root object (e.g. the owner host), for in-process tests.
    app: object = None
    # Supervised loops that run while the server serves (e.g. store health,
    # sweeps); cancelled before `on_stop`.
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        await self.server.start()
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
        for callback in reversed(self.on_stop):
            await callback()


def build_server(
    listen: str,
    bindings: Sequence[ServiceBinding],
    *,
    service: str,
    deployment_id: str = "",
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> GrpcServer:
    """Assemble a server: interceptor, services, health, reflection, port."""
    server = grpc.aio.server(
        interceptors=[LoggingInterceptor(service, deployment_id)],
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
    port = server.add_insecure_port(listen)
    if port == 0:
        raise RuntimeError(f"could not bind {listen}")
    return GrpcServer(server=server, health=health_servicer, port=port, service_names=names)


async def run_until_signalled(server: GrpcServer, *, grace: float) -> None:
    """Start, serve until SIGTERM/SIGINT, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    log.info("serving", port=server.port, services=list(server.service_names))
    await stop.wait()
    log.info("shutting down", grace_s=grace)
    await server.stop(grace)
    log.info("stopped")


class _ServiceConfig(Protocol):
    @property
    def log_level(self) -> str: ...

    @property
    def grace(self) -> float: ...


def run_main(load: Callable[[], _C], create: Callable[[_C], Awaitable[GrpcServer]]) -> None:
    """The `python -m services.<name>` entry: config, logging, serve, exit."""
    from services.common.config import ConfigError
    from services.common.logs import configure_logging

    try:
        config = load()
    except ConfigError as exc:
        sys.exit(str(exc))
    configure_logging(config.log_level)

    async def _serve() -> None:
        server = await create(config)
        await run_until_signalled(server, grace=config.grace)

    asyncio.run(_serve())
