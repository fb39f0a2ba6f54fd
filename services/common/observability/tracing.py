"""OpenTelemetry traces, off unless the standard `OTEL_*` environment asks.

Tracing is on when `OTEL_TRACES_EXPORTER` is `otlp` (or `console`, for a
look on a terminal) and `OTEL_SDK_DISABLED` is not `true`. Baton's default is
off (the SDK's own default exporter is otlp): a process that was not asked
imports no SDK, starts no exporter, installs no client interceptor, and its
one server interceptor tests one boolean per call. Everything else is the
SDK's own reading of the environment: `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`,
`_INSECURE`, `_HEADERS`, `_TIMEOUT` (OTLP over gRPC), `OTEL_TRACES_SAMPLER`
(default parentbased_always_on), `OTEL_BSP_*` (the batch processor),
`OTEL_SPAN_*_LIMIT`, `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`
(service.name defaults to `baton-<service>`).

Spans of gRPC calls are Baton's own (the server span in
`baton_runtime.common.rpc.interceptor`, the client spans in `client_interceptors`), not
opentelemetry-instrumentation-grpc's grpc.aio interceptors: tried with
grpcio 1.85 and 0.66b2, its server interceptor answers UNKNOWN for a
streaming handler that writes with `context.write` (grpc's own health
Watch), and its client span of a server stream the caller cancels is never
ended. W3C trace context travels in the `traceparent`/`tracestate` metadata.

A command's producer context (`traceparent`, W3C format, exactly 55
characters) is stored with its inbox entry in `DeliveryMetadata.traceparent`,
set by `HooksClient` from the span current where the command is sent; hooks
refuses a malformed one (INVALID_ARGUMENT, MALFORMED_TRACEPARENT) before
writing anything. Owners link their `process` spans to it
(services/owner/run/spans.py).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import grpc

from baton_runtime.common.errors import InvalidArgument, Reason

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Link, Span, Tracer

TRACEPARENT_LENGTH = 55
# version 00: trace id (32 hex, not all zero), span id (16 hex, not all zero), flags.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
# The gRPC codes that make a server span an error (OpenTelemetry's RPC
# conventions: the others are the caller's doing). A client span is an error
# for every code but OK.
_SERVER_ERRORS = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)
_TRACE_ID = re.compile(r"(?!0{32})[0-9a-f]{32}")
_EXPORTERS = ("otlp", "console")
SHUTDOWN_SECONDS = 2.0


class Tracing:
    """Whether this process traces, and its tracer while it does."""

    def __init__(self) -> None:
        self.enabled = False
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None

    @property
    def tracer(self) -> Tracer:
        assert self._tracer is not None, "tracing is not configured"
        return self._tracer

    def configure(
        self,
        service: str,
        deployment_id: str = "",
        instance_id: str = "",
        env: Mapping[str, str] = os.environ,
    ) -> bool:
        """Start tracing if `env` asks for it (see the module doc); True if on.
        Raises ConfigError for an exporter Baton does not ship. (`env` says
        whether to trace; the SDK itself reads the process environment.)"""
        from baton_runtime.common.config import (
            ConfigError,  # (config imports channels, which import this)
        )

        exporter_name = env.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter_name == "none":
            return False
        if exporter_name not in _EXPORTERS:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER={exporter_name!r}: Baton exports traces with "
                f"{' or '.join(_EXPORTERS)} (or none, the default)"
            )
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

        from baton_runtime.common.observability.build_info import version

        attributes: dict[str, str] = {"service.version": version()}
        if not env.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = f"baton-{service}"
        if deployment_id:
            attributes["baton.deployment_id"] = deployment_id
        if instance_id:
            attributes["service.instance.id"] = instance_id
        exporter: SpanExporter
        if exporter_name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter = ConsoleSpanExporter()
        provider = TracerProvider(resource=Resource.create(attributes))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        self.start(provider)
        return True

    def start(self, provider: TracerProvider) -> None:
        """Trace into `provider` (what `configure` does; tests hand their own)."""
        from baton_runtime.common.observability.build_info import version

        self._provider = provider
        self._tracer = provider.get_tracer("baton", version())
        self.enabled = True

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> None:
        """Export what is buffered and stop, waiting at most `timeout` s: an
        unreachable collector (the SDK would wait up to 30 s) never holds up a
        process's exit; its daemon threads end with it."""
        self.enabled = False
        provider, self._provider, self._tracer = self._provider, None, None
        if provider is not None:
            stopping = threading.Thread(
                target=provider.shutdown, name="tracing-shutdown", daemon=True
            )
            stopping.start()
            stopping.join(timeout)


TRACING = Tracing()


# -- trace context --------------------------------------------------------------------


def check_traceparent(value: str, field: str = "delivery.traceparent") -> None:
    """Refuse anything but an empty value or a W3C version-00 traceparent."""
    if value and (len(value) != TRACEPARENT_LENGTH or not _TRACEPARENT.fullmatch(value)):
        raise InvalidArgument(
            Reason.MALFORMED_TRACEPARENT,
            f"{field} must be a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>, "
            f"{TRACEPARENT_LENGTH} characters)",
            field=field,
        )


def check_trace_id(value: str, field: str) -> None:
    """Refuse anything but an empty value or a trace id (32 lowercase hex, not all zero)."""
    if value and (len(value) != 32 or not _TRACE_ID.fullmatch(value)):
        raise InvalidArgument(
            Reason.MALFORMED_TRACE_ID,
            f"{field} must be a trace id (32 lowercase hex digits, not all zero)",
            field=field,
        )


def current_trace_id() -> str:
    """The trace id of the current span (32 hex); empty when tracing is off
    or no span is current."""
    if not TRACING.enabled:
        return ""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""


def current_traceparent() -> str:
    """The W3C traceparent of the current span; empty when tracing is off or
    no span is current."""
    if not TRACING.enabled:
        return ""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return _traceparent_of(context) if context.is_valid else ""


def _traceparent_of(context: Any) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def link_to(traceparent: str, **attributes: str | int) -> Link | None:
    """A span link to the producer context `traceparent` (None if unusable)."""
    if not traceparent or not _TRACEPARENT.fullmatch(traceparent):
        return None
    from opentelemetry.trace import Link, SpanContext, TraceFlags

    _, trace_id, span_id, flags = traceparent.split("-")
    context = SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16))
    )
    return Link(context, attributes=attributes or None)


# What every span helper returns while tracing is off: a block that does
# nothing (one shared object, no generator per call).
OFF: AbstractContextManager[None] = nullcontext()


def span(name: str, **attributes: str | int | bool) -> AbstractContextManager[Span | None]:
    """An internal child span of the current one while tracing is on; a
    plain block (None) while it is off."""
    if not TRACING.enabled:
        return OFF
    return TRACING.tracer.start_as_current_span(name, attributes=attributes)


def annotate(**attributes: str | int | bool) -> None:
    """Set attributes on the current span (nothing while tracing is off)."""
    if TRACING.enabled:
        from opentelemetry import trace

        trace.get_current_span().set_attributes(attributes)


def log_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the trace and span ids of the current span on
    every line written inside one (nothing while tracing is off)."""
    if TRACING.enabled:
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            event.setdefault("trace_id", f"{context.trace_id:032x}")
            event.setdefault("span_id", f"{context.span_id:016x}")
    return event


# -- server spans ---------------------------------------------------------------------


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def start_server_span(method: str, metadata: Iterable[tuple[str, Any]] | None) -> Span:
    """The SERVER span of one call, child of the caller's context in its
    `traceparent` metadata, made current for the rest of the call. The
    context is never detached: grpc.aio serves every call in a task of its
    own, whose context ends with it (as the log bindings do)."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    carrier = {key: value for key, value in metadata or () if key in ("traceparent", "tracestate")}
    parent = extract(carrier) if carrier else None
    current = TRACING.tracer.start_span(
        method.lstrip("/"),
        context=parent,
        kind=trace.SpanKind.SERVER,
        attributes=_rpc_attributes(method),
    )
    otel_context.attach(trace.set_span_in_context(current, parent))
    return current


def end_server_span(current: Span, code: str, reason: str = "") -> None:
    """End a server span with the call's status code (and ErrorInfo reason)."""
    from opentelemetry.trace import Status, StatusCode

    current.set_attribute("rpc.grpc.status_code", grpc.StatusCode[code].value[0])
    if reason:
        current.set_attribute("baton.reason", reason)
    if code in _SERVER_ERRORS:
        current.set_status(Status(StatusCode.ERROR, f"{code} {reason}".strip()))
    current.end()


# -- client spans ---------------------------------------------------------------------


def client_interceptors() -> list[grpc.aio.ClientInterceptor] | None:
    """The interceptors of every client channel: a CLIENT span per call with
    its context sent along (W3C metadata). None while tracing is off: no
    interceptor at all then."""
    if not TRACING.enabled:
        return None
    return [_UnaryUnaryTracing(), _UnaryStreamTracing()]


def _start_client_span(
    details: grpc.aio.ClientCallDetails,
) -> tuple[Span, grpc.aio.ClientCallDetails]:
    from opentelemetry import trace
    from opentelemetry.propagate import inject

    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    current = TRACING.tracer.start_span(
        method.lstrip("/"), kind=trace.SpanKind.CLIENT, attributes=_rpc_attributes(method)
    )
    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(current))
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in carrier.items():
        metadata[key] = value
    return current, grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


def start_client_span(method: str) -> tuple[Span, str]:
    """The CLIENT span of a call that rides a shared stream (a follow:
    services/common/streams/feed_client.py), and its W3C traceparent to send along."""
    from opentelemetry import trace

    current = TRACING.tracer.start_span(
        method.lstrip("/"), kind=trace.SpanKind.CLIENT, attributes=_rpc_attributes(method)
    )
    return current, _traceparent_of(current.get_span_context())


def end_client_span(current: Span, code: grpc.StatusCode) -> None:
    """End a CLIENT span with the call's status code."""
    from opentelemetry.trace import Status, StatusCode

    current.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        current.set_status(Status(StatusCode.ERROR, code.name))
    current.end()


class _UnaryUnaryTracing(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        current, details = _start_client_span(client_call_details)
        code = grpc.StatusCode.CANCELLED
        try:
            call = await continuation(details, request)
            code = await call.code()
            return call
        finally:
            end_client_span(current, code)


class _UnaryStreamTracing(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        current, details = _start_client_span(client_call_details)
        try:
            call = await continuation(details, request)
        except BaseException:
            end_client_span(current, grpc.StatusCode.CANCELLED)
            raise
        # The call itself goes back to the caller (not a wrapping generator),
        # so that the span ends however the stream ends: done, failed, or
        # cancelled by a caller that stopped reading.
        call.add_done_callback(lambda done: _end_stream_span(current, done))
        return call


def _end_stream_span(current: Span, call: Any) -> None:
    if call.cancelled():
        end_client_span(current, grpc.StatusCode.CANCELLED)
        return
    # The status is there (the call is done) but read through a coroutine.
    code = _done_code(call)
    end_client_span(current, code)


def _done_code(call: Any) -> grpc.StatusCode:
    """The status code of a finished grpc.aio call, read in a done callback
    (no await there): `code()` of a done call completes without suspending,
    so one step of its coroutine gives it; UNKNOWN should it ever suspend."""
    coroutine = call.code()
    try:
        coroutine.send(None)
    except StopIteration as done:
        result: grpc.StatusCode = done.value
        return result
    finally:
        coroutine.close()
    return grpc.StatusCode.UNKNOWN
