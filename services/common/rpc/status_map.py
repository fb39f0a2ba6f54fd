"""The one table between domain errors and gRPC statuses (both directions)."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from baton_runtime.common import errors as e

_TO_CODE: dict[e.ErrorKind, grpc.StatusCode] = {
    e.ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    e.ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    e.ErrorKind.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
    e.ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    e.ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    e.ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    e.ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    e.ErrorKind.ABORTED: grpc.StatusCode.ABORTED,
    e.ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    e.ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    e.ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    e.ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

_FROM_CODE: dict[grpc.StatusCode, type[e.BatonError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: e.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: e.NotFound,
    grpc.StatusCode.OUT_OF_RANGE: e.OutOfRange,
    grpc.StatusCode.ALREADY_EXISTS: e.AlreadyExists,
    grpc.StatusCode.PERMISSION_DENIED: e.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: e.Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: e.FailedPrecondition,
    grpc.StatusCode.ABORTED: e.Aborted,
    grpc.StatusCode.UNAVAILABLE: e.Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: e.ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: e.DeadlineExceeded,
    grpc.StatusCode.CANCELLED: e.Unavailable,
}


def status_code(err: e.BatonError) -> grpc.StatusCode:
    return _TO_CODE.get(err.kind, grpc.StatusCode.INTERNAL)


# Bounds on what a status carries back: a default client refuses trailers
# over 16 KiB, and a refusal must never echo a caller's oversize value.
MAX_STATUS_MESSAGE = 1024
MAX_METADATA_VALUE = 256
MAX_METADATA_ENTRIES = 16


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def to_status(err: e.BatonError) -> grpc.Status:
    """A rich status: code, message, one ErrorInfo with the reason and, for a
    retryable refusal that says when, a RetryInfo."""
    return rpc_status.to_status(status_proto(err))


def status_proto(err: e.BatonError) -> status_pb2.Status:
    """`to_status`'s google.rpc.Status, as a message (a multiplexed stream
    carries one per refused call: services/common/streams/multiplex.py)."""
    metadata = {
        _clip(k, 64): _clip(str(v), MAX_METADATA_VALUE)
        for k, v in list(err.metadata.items())[:MAX_METADATA_ENTRIES]
    }
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=e.DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    details = [detail]
    if err.retry_after is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(max(err.retry_after, 0.0) * 1e9))
        retry = any_pb2.Any()
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(retry)
    code = status_code(err)
    return status_pb2.Status(
        code=getattr(code_pb2, code.name),
        message=_clip(err.message, MAX_STATUS_MESSAGE),
        details=details,
    )


def from_rpc_error(exc: grpc.RpcError) -> e.BatonError:
    """Turn a failed call back into the typed domain error it carried. A
    status without Baton's ErrorInfo was made by gRPC or the network, not
    by a Baton service: its reason says so (TRANSPORT_FAILED, or
    UPSTREAM_UNAVAILABLE and TIMEOUT for the codes that are retried)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    reason = {
        grpc.StatusCode.UNAVAILABLE: e.Reason.UPSTREAM_UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED: e.Reason.TIMEOUT,
        grpc.StatusCode.CANCELLED: e.Reason.UPSTREAM_UNAVAILABLE,
    }.get(code, e.Reason.TRANSPORT_FAILED)
    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]  # an AioRpcError is a Call
    except (ValueError, AttributeError):
        status = None
    return _domain_error(code, details or "", reason, status)


def from_status_proto(status: status_pb2.Status) -> e.BatonError:
    """The domain error a google.rpc.Status carries (`status_proto`'s inverse)."""
    try:
        code = grpc.StatusCode[code_pb2.Code.Name(status.code)]
    except (KeyError, ValueError):
        code = grpc.StatusCode.UNKNOWN
    return _domain_error(code, status.message, e.Reason.INTERNAL, status)


def _domain_error(
    code: grpc.StatusCode, details: str, reason: str, status: status_pb2.Status | None
) -> e.BatonError:
    metadata: dict[str, str] = {}
    retry_after: float | None = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
                metadata = dict(info.metadata)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_after = retry.retry_delay.ToNanoseconds() / 1e9
    cls = _FROM_CODE.get(code, e.Internal)
    if reason == e.Reason.FENCED:
        return e.Fenced(details or "fenced", **metadata)
    return cls(reason, details or code.name, retry_after=retry_after, **metadata)


def error_reason(exc: grpc.RpcError) -> str:
    return from_rpc_error(exc).reason
