"""Domain errors. Plain values with no gRPC import; `status_map` maps them.

Every error has a kind (the canonical status it maps to) and an UPPER_SNAKE
reason that clients can branch on (sent as google.rpc.ErrorInfo).
"""

from __future__ import annotations

import enum
from typing import ClassVar

DOMAIN = "baton.dev"


class ErrorKind(enum.Enum):
    """The canonical status class of an error."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    DATA_LOSS = "DATA_LOSS"
    INTERNAL = "INTERNAL"


class BatonError(Exception):
    """Base of every Baton error: a kind, a reason and a message."""

    kind: ClassVar[ErrorKind] = ErrorKind.INTERNAL
    retryable: bool = False

    def __init__(
        self, reason: str, message: str, *, retry_after: float | None = None, **metadata: str
    ) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.metadata = metadata
        # Seconds after which a retry may succeed (sent as google.rpc.RetryInfo).
        self.retry_after = retry_after


class InvalidArgument(BatonError):
    kind = ErrorKind.INVALID_ARGUMENT


class NotFound(BatonError):
    kind = ErrorKind.NOT_FOUND


class OutOfRange(BatonError):
    """A position outside what is kept (a stream read below the retention
    horizon); the metadata says where the kept range starts."""

    kind = ErrorKind.OUT_OF_RANGE


class AlreadyExists(BatonError):
    kind = ErrorKind.ALREADY_EXISTS


class PermissionDenied(BatonError):
    kind = ErrorKind.PERMISSION_DENIED


class Unauthenticated(BatonError):
    kind = ErrorKind.UNAUTHENTICATED


class FailedPrecondition(BatonError):
    kind = ErrorKind.FAILED_PRECONDITION


class Fenced(FailedPrecondition):
    """A write by an owner run that no longer holds the session."""

    def __init__(self, message: str, **metadata: str) -> None:
        super().__init__(Reason.FENCED, message, retry_after=None, **metadata)


class Aborted(BatonError):
    kind = ErrorKind.ABORTED
    retryable = True


class Unavailable(BatonError):
    kind = ErrorKind.UNAVAILABLE
    retryable = True


class ResourceExhausted(BatonError):
    """A limit was hit; nothing was accepted. Retryable when the server said
    when (`retry_after`, from google.rpc.RetryInfo); a message over gRPC's
    size limit (no retry info) is not."""

    kind = ErrorKind.RESOURCE_EXHAUSTED

    def __init__(
        self, reason: str, message: str, *, retry_after: float | None = None, **metadata: str
    ) -> None:
        super().__init__(reason, message, retry_after=retry_after, **metadata)
        self.retryable = retry_after is not None


class DeadlineExceeded(BatonError):
    kind = ErrorKind.DEADLINE_EXCEEDED
    retryable = True


class DataLoss(BatonError):
    """Stored data that cannot be read back as written (an object of the
    object store missing or failing its checksum): never skipped silently,
    and a retry cannot mend it."""

    kind = ErrorKind.DATA_LOSS


class Internal(BatonError):
    kind = ErrorKind.INTERNAL


class Reason:
    """Every reason Baton gives, in one vocabulary: the `google.rpc.ErrorInfo`
    reasons of RPC errors and the `ErrorDetail.reason` of stream events
    (rejected commands, failed turns, stalls)."""

    INVALID_FIELD = "INVALID_FIELD"
    INVALID_FILTER = "INVALID_FILTER"
    INVALID_PAGE_TOKEN = "INVALID_PAGE_TOKEN"
    TOO_MANY_TO_ORDER = "TOO_MANY_TO_ORDER"
    UNKNOWN_COMMAND = "UNKNOWN_COMMAND"
    MISSING_FIELD = "MISSING_FIELD"
    INVALID_TOKEN = "INVALID_TOKEN"
    INVALID_SESSION_ID = "INVALID_SESSION_ID"
    INVALID_DEPLOYMENT_ID = "INVALID_DEPLOYMENT_ID"
    WRONG_DEPLOYMENT = "WRONG_DEPLOYMENT"
    EMPTY_MESSAGE = "EMPTY_MESSAGE"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    SNAPSHOT_TOO_LARGE = "SNAPSHOT_TOO_LARGE"
    COMMIT_TOO_LARGE = "COMMIT_TOO_LARGE"
    TOO_MANY_HOOKS = "TOO_MANY_HOOKS"
    MISSING_API_KEY = "MISSING_API_KEY"
    INVALID_API_KEY = "INVALID_API_KEY"
    CROSS_TENANT = "CROSS_TENANT"
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    TOKEN_NOT_FOUND = "TOKEN_NOT_FOUND"
    SESSION_EXISTS = "SESSION_EXISTS"
    TOKEN_CLAIMED = "TOKEN_CLAIMED"
    FENCED = "FENCED"
    SESSION_FINALIZED = "SESSION_FINALIZED"
    SEQ_CONFLICT = "SEQ_CONFLICT"
    INBOX_NOT_DRAINED = "INBOX_NOT_DRAINED"
    INSTANCE_LIVE = "INSTANCE_LIVE"
    DEPLOYMENT_DRAINING = "DEPLOYMENT_DRAINING"
    DEPLOYMENT_NOT_FOUND = "DEPLOYMENT_NOT_FOUND"
    SESSION_NOT_SETTLED = "SESSION_NOT_SETTLED"
    SESSION_BUSY = "SESSION_BUSY"
    WAKING = "WAKING"
    STALLED = "STALLED"
    INVALID_LEASE = "INVALID_LEASE"
    LEASE_NOT_FOUND = "LEASE_NOT_FOUND"
    CONFLICT = "CONFLICT"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    STORE_REJECTED = "STORE_REJECTED"
    STORE_FULL = "STORE_FULL"
    STORE_CORRUPT = "STORE_CORRUPT"
    REVISION_COMPACTED = "REVISION_COMPACTED"
    BELOW_HORIZON = "BELOW_HORIZON"
    BEYOND_HEAD = "BEYOND_HEAD"
    HISTORY_ENTRY_TOO_LARGE = "HISTORY_ENTRY_TOO_LARGE"
    EVENT_TOO_LARGE = "EVENT_TOO_LARGE"
    HISTORY_INCOMPLETE = "HISTORY_INCOMPLETE"
    SNAPSHOT_UNREADABLE = "SNAPSHOT_UNREADABLE"
    # DATA_LOSS: a sealed segment (services/anchor/segments/) is missing or
    # fails its checksum.
    OBJECT_CORRUPT = "OBJECT_CORRUPT"
    # UNAVAILABLE: the object store cannot be reached (retryable).
    OBJECT_STORE_UNAVAILABLE = "OBJECT_STORE_UNAVAILABLE"
    RESTART_BUDGET_SPENT = "RESTART_BUDGET_SPENT"
    # Stream events only (ErrorDetail.reason):
    NOTHING_TO_CANCEL = "NOTHING_TO_CANCEL"
    UNSUPPORTED_COMMAND = "UNSUPPORTED_COMMAND"
    INPUT_NOT_PENDING = "INPUT_NOT_PENDING"
    UNKNOWN_INPUT_REQUEST = "UNKNOWN_INPUT_REQUEST"
    COMPACTION_FAILED = "COMPACTION_FAILED"
    MODEL_ERROR = "MODEL_ERROR"
    MODEL_REJECTED = "MODEL_REJECTED"
    MAX_STEPS = "MAX_STEPS"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    DENIED = "DENIED"
    STALE_SNAPSHOT = "STALE_SNAPSHOT"
    LATER_ARRIVAL = "LATER_ARRIVAL"
    HOOKS_CHANGED = "HOOKS_CHANGED"
    HANDOFF_ID_REUSED = "HANDOFF_ID_REUSED"
    STALE_CHECKPOINT = "STALE_CHECKPOINT"
    CHECKPOINT_UNREADABLE = "CHECKPOINT_UNREADABLE"
    CHECKPOINT_INCOMPATIBLE = "CHECKPOINT_INCOMPATIBLE"
    SESSION_NOT_IDLE = "SESSION_NOT_IDLE"
    TRANSFER_NOT_FOUND = "TRANSFER_NOT_FOUND"
    MALFORMED_REQUEST = "MALFORMED_REQUEST"
    MALFORMED_TRACEPARENT = "MALFORMED_TRACEPARENT"
    MALFORMED_TRACE_ID = "MALFORMED_TRACE_ID"
    NO_CLIENT_IDENTITY = "NO_CLIENT_IDENTITY"
    ROLE_NOT_ALLOWED = "ROLE_NOT_ALLOWED"
    RPC_NOT_ALLOWED = "RPC_NOT_ALLOWED"
    DEPLOYMENT_NOT_ALLOWED = "DEPLOYMENT_NOT_ALLOWED"
    DELIVERY_NOT_ALLOWED = "DELIVERY_NOT_ALLOWED"
    TRANSFER_NOT_PERMITTED = "TRANSFER_NOT_PERMITTED"
    RATE_LIMITED = "RATE_LIMITED"
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"
    # Live items (docs/design.md "Live items"): PublishLive's notes.
    LIVE_STALE = "LIVE_STALE"
    LIVE_RATE = "LIVE_RATE"
    LIVE_TRUNCATED = "LIVE_TRUNCATED"
    SERVER_BUSY = "SERVER_BUSY"
    UPSTREAM_UNAVAILABLE = "UPSTREAM_UNAVAILABLE"
    # A call's status that carried no reason of Baton's: gRPC or the network
    # ended it (a message over the size limit, a reset stream), not a Baton
    # service deciding on the request.
    TRANSPORT_FAILED = "TRANSPORT_FAILED"
    TIMEOUT = "TIMEOUT"
    INTERNAL = "INTERNAL"
    # Child sessions (docs/design.md §11): stream events and tool results.
    UNKNOWN_TASK = "UNKNOWN_TASK"
    NOT_OUR_TASK = "NOT_OUR_TASK"
    TASK_NOT_RUNNING = "TASK_NOT_RUNNING"
    TASK_RUNNING = "TASK_RUNNING"
    TASK_SETTLED = "TASK_SETTLED"
    TOO_MANY_TASKS = "TOO_MANY_TASKS"
    UNKNOWN_SUBAGENT = "UNKNOWN_SUBAGENT"
    TASK_RESULT_TOO_LARGE = "TASK_RESULT_TOO_LARGE"
    CHILD_SESSION = "CHILD_SESSION"
    CANCELLED = "CANCELLED"
    RESET = "RESET"
    TOOL_FAILED = "TOOL_FAILED"
