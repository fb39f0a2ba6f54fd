"""What the clients return: small frozen values for receipts and pages, and
Baton's own messages for what has many fields (a session's view, an event).

`Session` is `baton.ingress.v1.Session` and `Event` is
`baton.session.v1.Event` (their fields are documented in the protos,
protos/baton/ingress/v1/ingress.proto and protos/baton/session/v1/session.proto).
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_client._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_client._proto.baton.session.v1 import session_pb2 as session_pb

Session = ingress_pb.Session
SessionStatus = ingress_pb.SessionStatus
ControlKind = ingress_pb.ControlKind
Event = session_pb.Event
EventKind = session_pb.EventKind
TurnPolicy = session_pb.TurnPolicy
#: What a paused turn waits for (`Event.input_request` of input.requested):
#: its `request_id`, `kind` (an `InputKind`), `prompt`, and for an approval
#: the `tool_call` waiting to run.
InputRequest = session_pb.InputRequest
InputKind = session_pb.InputKind
#: The answer to an InputRequest, sent with `send(..., input_responses=[...])`:
#: `request_id`, `approved` (approvals, limits) and/or `text` (questions).
InputResponse = session_pb.InputResponse
#: A tool call (`Event.tool_call`, `InputRequest.tool_call`): `id`, `name`,
#: `arguments_json`.
ToolCall = session_pb.ToolCall
#: A tool's result (`Event.tool_result`).
ToolResult = session_pb.ToolResult
#: The pending input and sign-ins of a session's open turn (`Session.pending_inputs`,
#: `Session.pending_authorizations`).
AuthorizationWait = session_pb.AuthorizationWait
#: What an event's `error` carries: `reason`, `message`.
ErrorDetail = session_pb.ErrorDetail
#: Live items (docs/design.md "Live items"), yielded by a follower that asked
#: for them (`follow(..., live=True)`): not events (no seq, never stored, the
#: step's commit supersedes them). A `LiveBatch` is consecutive `LiveItem`s
#: (`offset`, `kind`, `text`, tool call fields, `dropped`, `time`) of one step
#: run, its `LiveStep` (`base_seq`, `turn_id`, `step`, `owner_run_id`, `epoch`,
#: `attempt`). `baton_client.live.LiveView` assembles them.
LiveBatch = session_pb.LiveBatch
LiveItem = session_pb.LiveItem
LiveStep = session_pb.LiveStep
LiveKind = session_pb.LiveKind

#: Event kinds that close a stream (a follower ends after one).
TERMINAL_KINDS = frozenset(
    {session_pb.EVENT_KIND_SESSION_COMPLETED, session_pb.EVENT_KIND_SESSION_FAILED}
)


@dataclass(frozen=True)
class CreatedSession:
    """The answer to `create_session`."""

    session_id: str
    #: False when `request_id` named a session created before.
    created: bool
    #: The deployment the session runs on.
    deployment_id: str
    #: The idempotency key used (the caller's, or generated).
    request_id: str

    @classmethod
    def _from_raw(cls, raw: ingress_pb.CreateSessionResponse, request_id: str) -> CreatedSession:
        return cls(raw.session_id, raw.created, raw.deployment_id, request_id)


@dataclass(frozen=True)
class Receipt:
    """A delivery's receipt: accepted means durably in the session's inbox."""

    session_id: str
    #: The command's inbox seq.
    seq: int
    #: The delivery id used (the caller's, or generated).
    delivery_id: str
    #: True when an earlier delivery with the same id was accepted (this is its receipt).
    duplicate: bool
    #: The session's current owner run ("" while none is live).
    owner_run_id: str
    #: The deployment of the session's current owner.
    owner_deployment_id: str
    #: The deployment of the ingress that accepted it ("" for control commands).
    accepted_deployment_id: str = ""

    @classmethod
    def _from_raw(
        cls, raw: session_pb.Receipt, delivery_id: str, accepted_deployment_id: str = ""
    ) -> Receipt:
        return cls(
            session_id=raw.session_id,
            seq=raw.seq,
            delivery_id=delivery_id,
            duplicate=raw.duplicate,
            owner_run_id=raw.owner_run_id,
            owner_deployment_id=raw.owner_deployment_id,
            accepted_deployment_id=accepted_deployment_id,
        )


@dataclass(frozen=True)
class SessionPage:
    """One page of `list_sessions`."""

    sessions: tuple[Session, ...]
    #: Pass it as `page_token` for the next page; "" at the end.
    next_page_token: str


def status_name(status: SessionStatus.ValueType) -> str:
    """`SESSION_STATUS_WAITING_FOR_INPUT` -> `waiting_for_input`."""
    return SessionStatus.Name(status).removeprefix("SESSION_STATUS_").lower()
