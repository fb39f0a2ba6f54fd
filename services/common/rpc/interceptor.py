"""The one interceptor of every Baton server (`CallInterceptor`): caller
identity and the per-RPC role table, a cap on concurrent calls, request
decoding, error mapping through `status_map`, one log line, a span and the
RPC metrics per call."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import grpc
import structlog

from baton_runtime.common import errors
from baton_runtime.common.config import Capacity
from baton_runtime.common.ids import new_request_id
from baton_runtime.common.observability import rpc_metrics, tracing
from baton_runtime.common.rpc.status_map import status_code, to_status
from baton_runtime.common.security import access, identity
from baton_runtime.common.security.identity import Caller, Role

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
       per-RPC role table (`baton_runtime.common.security.access`; deny by default);
    3. admits the call against the server's `Capacity`;
    4. decodes the request body itself (gRPC hands over raw bytes), so an
       undecodable body is INVALID_ARGUMENT/MALFORMED_REQUEST, not UNKNOWN;
    5. maps domain errors to statuses with ErrorInfo (anything unmapped is
       INTERNAL) and writes one log line per call, and, while this process
       serves metrics, counts it by method and code and times it
       (`rpc_metrics.RPC`).
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
        if handler.stream_stream is not None and method in access.MULTIPLEXED:
            # A multiplexed stream between peers (services/common/streams/multiplex.py).
            return _replaced(
                handler,
                request_deserializer=None,
                stream_stream=call.bidi(handler.stream_stream, decode),
            )
        # Other client-streaming methods are not part of Baton's API; never
        # serve one.
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

    __slots__ = ("method", "bound", "allowed", "verify", "gate", "metered")

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
        self.metered = method not in gate.capacity.unmetered

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
                meter = rpc_metrics.RPC
                async for item in behavior(decode(raw), context):
                    if meter.enabled:
                        meter.sent(self.method)
                    yield item

        return wrapped

    def bidi(self, behavior: Any, decode: Callable[[bytes], Any]) -> Any:
        """A multiplexed stream: admitted once, at its opening; each message
        decoded (an undecodable one ends it with INVALID_ARGUMENT); the calls
        it carries are metered, traced and mapped one by one by
        `multiplex.serve_calls`."""

        async def wrapped(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
            async with _Served(self, context, stream=True) as served:
                served.admit()
                meter = rpc_metrics.RPC

                async def decoded() -> AsyncIterator[Any]:
                    async for raw in requests:
                        yield decode(raw)

                # Closed with the call (a client that goes away), so the
                # servicer's calls in flight are cancelled then, not at GC.
                async with contextlib.aclosing(behavior(decoded(), context)) as answers:
                    async for item in answers:
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
        """The role table, then the gate (raises when refused; a method the
        gate does not meter is never refused for capacity)."""
        self.call.admit(self.context)
        if self.call.metered:
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
    if rpc_metrics.RPC.enabled:
        rpc_metrics.RPC.served(method, code, time.perf_counter() - start)


def _log_call(code: str, reason: str, start: float) -> None:
    duration_ms = round((time.perf_counter() - start) * 1000, 3)
    if code in ("OK", "CANCELLED"):
        log.debug("rpc", code=code, duration_ms=duration_ms)
    else:
        log.info("rpc", code=code, reason=reason, duration_ms=duration_ms)
