"""Baton's client SDK for channel gateways.

    from baton_client import Client

    with Client.from_profile() as client:
        session = client.create_session()
        client.send(session.session_id, "hello")
        for event in client.follow(session.session_id):
            ...

`Client` (sync) and `AsyncClient` (asyncio) call IngressService with TLS
and the channel's API key (`Settings`); errors are typed
(`baton_client.errors`), retries safe (`baton_client.retry`), and a
follower resumes from its cursor without gap or duplicate. With
`follow(..., live=True)` it also yields the live items of running steps
(`LiveBatch`), which `LiveView` assembles into the answer as it is written
(`baton_client.live`).
"""

from __future__ import annotations

from baton_client.aio import AsyncClient, AsyncFollower
from baton_client.client import Client, Follower
from baton_client.errors import (
    Aborted,
    AlreadyExists,
    BatonError,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    StreamGap,
    Unauthenticated,
    Unavailable,
)
from baton_client.live import LiveDraft, LiveToolCall, LiveUpdate, LiveView
from baton_client.retry import RetryPolicy
from baton_client.settings import Settings, SettingsError
from baton_client.types import (
    AuthorizationWait,
    ControlKind,
    CreatedSession,
    ErrorDetail,
    Event,
    EventKind,
    InputKind,
    InputRequest,
    InputResponse,
    LiveBatch,
    LiveItem,
    LiveKind,
    LiveStep,
    Receipt,
    Session,
    SessionPage,
    SessionStatus,
    ToolCall,
    ToolResult,
    TurnPolicy,
    status_name,
)

__version__ = "0.1.0"

__all__ = [
    "Aborted",
    "AlreadyExists",
    "AsyncClient",
    "AsyncFollower",
    "AuthorizationWait",
    "BatonError",
    "Client",
    "ControlKind",
    "CreatedSession",
    "DataLoss",
    "DeadlineExceeded",
    "ErrorDetail",
    "Event",
    "EventKind",
    "FailedPrecondition",
    "Follower",
    "InputKind",
    "InputRequest",
    "InputResponse",
    "Internal",
    "InvalidArgument",
    "LiveBatch",
    "LiveDraft",
    "LiveItem",
    "LiveKind",
    "LiveStep",
    "LiveToolCall",
    "LiveUpdate",
    "LiveView",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "Reason",
    "Receipt",
    "ResourceExhausted",
    "RetryPolicy",
    "Session",
    "SessionPage",
    "SessionStatus",
    "Settings",
    "SettingsError",
    "StreamGap",
    "ToolCall",
    "ToolResult",
    "TurnPolicy",
    "Unauthenticated",
    "Unavailable",
    "status_name",
]
