"""Typed errors: a refused or failed call as one exception per status family.

Baton answers every refusal with a canonical gRPC status and a
`google.rpc.ErrorInfo` whose UPPER_SNAKE `reason` says what went wrong
(`Reason` below lists them; the servers' vocabulary is
services/common/errors.py). The SDK raises the family's class with the reason,
the ErrorInfo metadata and, where the server said when to retry
(`google.rpc.RetryInfo`), `retry_after`. Every class says whether a retry may
succeed (`retryable`); the clients retry only those, and only calls that are
safe to repeat (see `baton_client.retry`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "baton.dev"
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
# The ErrorInfo metadata key of a read below the stream's retention horizon
# that names the earliest seq kept.
EARLIEST_SEQ_KEY = "earliest_seq"


class Reason:
    """The reasons an RPC refusal may carry that a gateway can act on (the
    servers give these and more; an unknown one arrives as it is)."""

    INVALID_FIELD = "INVALID_FIELD"
    INVALID_FILTER = "INVALID_FILTER"
    INVALID_PAGE_TOKEN = "INVALID_PAGE_TOKEN"
    MISSING_FIELD = "MISSING_FIELD"
    UNKNOWN_COMMAND = "UNKNOWN_COMMAND"
    INVALID_TOKEN = "INVALID_TOKEN"
    INVALID_SESSION_ID = "INVALID_SESSION_ID"
    EMPTY_MESSAGE = "EMPTY_MESSAGE"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    TOO_MANY_HOOKS = "TOO_MANY_HOOKS"
    MISSING_API_KEY = "MISSING_API_KEY"
    INVALID_API_KEY = "INVALID_API_KEY"
    CROSS_TENANT = "CROSS_TENANT"
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    TOKEN_NOT_FOUND = "TOKEN_NOT_FOUND"
    TOKEN_CLAIMED = "TOKEN_CLAIMED"
    SESSION_FINALIZED = "SESSION_FINALIZED"
    # OUT_OF_RANGE: a stream read below the retention horizon (metadata
    # `earliest_seq`: the earliest seq kept).
    BELOW_HORIZON = "BELOW_HORIZON"
    # OUT_OF_RANGE: a read or follow from a seq beyond the stream's head
    # (metadata `next_seq`: the seq the next event gets).
    BEYOND_HEAD = "BEYOND_HEAD"
    RATE_LIMITED = "RATE_LIMITED"
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"
    SERVER_BUSY = "SERVER_BUSY"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    UPSTREAM_UNAVAILABLE = "UPSTREAM_UNAVAILABLE"
    TIMEOUT = "TIMEOUT"
    INTERNAL = "INTERNAL"
    # Given by the SDK itself (no server reason).
    UNKNOWN = "UNKNOWN"
    STREAM_GAP = "STREAM_GAP"


class BatonError(Exception):
    """Base of every error the SDK raises."""

    #: The gRPC status code of the family.
    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    #: Whether the same call may succeed later (the class default).
    retryable_family: ClassVar[bool] = False

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        metadata: dict[str, str] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})
        #: Seconds the server asked the caller to wait (google.rpc.RetryInfo).
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        """Whether a retry of the same call may succeed."""
        return self.retryable_family


class InvalidArgument(BatonError):
    """Malformed, oversize or missing input; nothing was written."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(BatonError):
    """No such session or alias for this channel (or of another channel:
    Baton does not tell them apart)."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(BatonError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(BatonError):
    """E.g. an alias qualified with another channel (CROSS_TENANT)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(BatonError):
    """The API key is missing or unknown."""

    code = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(BatonError):
    """The session's state refuses it (e.g. SESSION_FINALIZED)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(BatonError):
    """A conflict inside Baton; the same call may succeed now."""

    code = grpc.StatusCode.ABORTED
    retryable_family = True


class OutOfRange(BatonError):
    """A stream cursor the server no longer has: the events below
    `earliest_seq` are gone (the stream's retention horizon). Never skipped
    silently: the caller decides whether to go on from `earliest_seq`."""

    code = grpc.StatusCode.OUT_OF_RANGE

    @property
    def earliest_seq(self) -> int | None:
        """The earliest seq the server still has, when it said."""
        value = self.metadata.get(EARLIEST_SEQ_KEY, "")
        return int(value) if value.isdigit() else None


class ResourceExhausted(BatonError):
    """A limit (rate, streams, sessions) was hit; nothing was accepted.
    Retryable when the server said when (`retry_after`)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def retryable(self) -> bool:
        return self.retry_after is not None


class Unavailable(BatonError):
    """Baton could not be reached or its store is down; retry."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable_family = True


class DeadlineExceeded(BatonError):
    """The call's deadline passed; its outcome is unknown (a send retried
    with its delivery id is still applied once)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable_family = True


class Internal(BatonError):
    """A bug or an unexpected state in Baton or in the SDK."""

    code = grpc.StatusCode.INTERNAL


class StreamGap(Internal):
    """The server skipped events of a stream (a broken invariant: Baton's
    streams are gapless). Raised instead of going on past the gap."""


FAMILIES: tuple[type[BatonError], ...] = (
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    Unauthenticated,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
    DeadlineExceeded,
    Internal,
)

_BY_CODE: dict[grpc.StatusCode, type[BatonError]] = {cls.code: cls for cls in FAMILIES}
# A call cut short by the server (an ingress shutting down, or a stream
# cancelled by it) is as good as unreachable: retry it.
_BY_CODE[grpc.StatusCode.CANCELLED] = Unavailable

_DEFAULT_REASON = {
    grpc.StatusCode.UNAVAILABLE: Reason.UPSTREAM_UNAVAILABLE,
    grpc.StatusCode.CANCELLED: Reason.UPSTREAM_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.TIMEOUT,
}


def family_of(code: grpc.StatusCode) -> type[BatonError]:
    """The exception class of a status code (unknown codes: Internal)."""
    return _BY_CODE.get(code, Internal)


def from_status(
    code: grpc.StatusCode,
    details: str | None,
    trailing_metadata: Iterable[Any] | None,
) -> BatonError:
    """The typed error a failed call's status carried."""
    reason = _DEFAULT_REASON.get(code, Reason.UNKNOWN)
    metadata: dict[str, str] = {}
    retry_after: float | None = None
    status = _rich_status(trailing_metadata)
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason or reason
                metadata = dict(info.metadata)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_after = retry.retry_delay.ToNanoseconds() / 1e9
    cls = family_of(code)
    return cls(reason, details or code.name, metadata=metadata, retry_after=retry_after)


def from_rpc_error(exc: grpc.RpcError) -> BatonError:
    """A failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`) as
    its typed error."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return from_status(code, details, trailers)


def _rich_status(trailing_metadata: Iterable[Any] | None) -> status_pb2.Status | None:
    for key, value in trailing_metadata or ():
        if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status()
            try:
                status.ParseFromString(value)
            except DecodeError:
                return None
            return status
    return None
