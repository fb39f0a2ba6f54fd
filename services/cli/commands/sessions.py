"""`baton sessions list` and `baton sessions get ID`: session introspection
through the public API (IngressService.GetSession / ListSessions), as the
channel whose API key is in BATON_API_KEY (default: the loopback demo key).

Output (`-o`): `text` (a table or key/value lines, for people), `json` (the
proto3 JSON mapping of `baton.ingress.v1.Session` with the proto's field
names, as grpcurl prints GetSession: the stable contract; `list` prints a
JSON array), `jsonl` (one session per line).

Exit codes:
    0  done
    1  Baton refused the call (the reason is printed, e.g. INVALID_FILTER)
    2  usage: bad flags or connection settings
    3  NOT_FOUND: no such session for this channel
    4  UNAVAILABLE: Baton could not be reached (retry)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import BatonError, ErrorKind
from baton_runtime.common.rpc.status_map import from_rpc_error

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_UNAVAILABLE = 4
OUTPUTS = ("text", "json", "jsonl")
CALL_TIMEOUT = 30.0


class UsageError(Exception):
    """Bad connection settings (the message says which)."""


@dataclass(frozen=True)
class Connection:
    """Where and how to reach an ingress."""

    ingress: str
    api_key: str
    ca_cert: str = ""
    plaintext: bool = False
    server_name: str = ""

    def open(self) -> grpc.aio.Channel:
        if self.plaintext:
            return grpc.aio.insecure_channel(self.ingress)
        if not self.ca_cert:
            raise UsageError(
                "pass --ca-cert CA (or BATON_TLS_CA; `baton up` prints it and writes a "
                "profile with it) or --plaintext"
            )
        try:
            root = Path(self.ca_cert).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read the CA certificate {self.ca_cert}: {exc}") from exc
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        credentials = grpc.ssl_channel_credentials(root_certificates=root)
        return grpc.aio.secure_channel(self.ingress, credentials, options=options)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),)


def to_json(session: pb.Session) -> dict[str, object]:
    """The proto3 JSON mapping of a session with the proto's field names
    (what grpcurl prints for GetSession)."""
    return json_format.MessageToDict(session, preserving_proto_field_name=True)


def status_name(status: pb.SessionStatus.ValueType) -> str:
    return pb.SessionStatus.Name(status).removeprefix("SESSION_STATUS_").lower()


def _when(session: pb.Session, name: str) -> str:
    stamp: Timestamp = getattr(session, name)
    if not stamp.ByteSize():
        return "-"
    return stamp.ToDatetime().replace(microsecond=0).isoformat() + "Z"


def text_of(session: pb.Session) -> list[str]:
    """Key/value lines for people."""
    status = status_name(session.status)
    if session.status_reason.reason:
        status += f" ({session.status_reason.reason}: {session.status_reason.message})"
    age = ""
    if session.HasField("oldest_unconsumed_age"):
        age = f", oldest waiting {session.oldest_unconsumed_age.ToTimedelta().total_seconds():.1f}s"
    used = session.usage.input_tokens + session.usage.output_tokens
    remaining = (
        f", {session.remaining.tokens} tokens left" if session.remaining.HasField("tokens") else ""
    )
    lines = [
        f"session:     {session.session_id}",
        f"channel:     {session.channel}",
        f"status:      {status}",
        f"deployment:  {session.deployment_id}",
        f"owner:       run {session.owner_run_id}, epoch {session.epoch}, "
        f"instance {session.instance_id}",
        f"inbox:       {session.inbox_depth} unconsumed{age}",
        f"stream head: {session.stream_head} (kept from seq {session.earliest_seq})",
        f"turns:       {session.turn_count}",
        f"usage:       {used} tokens, {session.usage.model_calls} model calls{remaining}",
        f"aliases:     {', '.join(session.aliases) or '-'}",
        f"created:     {_when(session, 'create_time')}",
        f"updated:     {_when(session, 'update_time')}",
        f"timeout:     {_when(session, 'timeout_deadline')}",
    ]
    for request in session.pending_inputs:
        lines.append(f"waits for:   input {request.request_id}: {request.prompt}")
    for wait in session.pending_authorizations:
        lines.append(f"waits for:   sign-in {', '.join(wait.expected_attempt_ids)}")
    if session.HasField("parent"):
        lines.append(f"parent:      {session.parent.parent_session_id}")
    for child in session.children:
        state = handle_state_name(child.state)
        lines.append(f"child:       {child.child_session_id} {child.name} {state}")
    if session.HasField("last_failure"):
        failure = session.last_failure
        lines.append(f"last failure: {failure.reason}: {failure.message} (seq {failure.seq})")
    return lines


def handle_state_name(state: s.HandleState.ValueType) -> str:
    return s.HandleState.Name(state).removeprefix("HANDLE_STATE_").lower()


_COLUMNS = ("SESSION", "STATUS", "DEPLOYMENT", "TURNS", "INBOX", "UPDATED")


def table_of(sessions: Sequence[pb.Session]) -> list[str]:
    rows = [_COLUMNS] + [
        (
            v.session_id,
            status_name(v.status),
            v.deployment_id,
            str(v.turn_count),
            str(v.inbox_depth),
            _when(v, "update_time"),
        )
        for v in sessions
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def render(sessions: Sequence[pb.Session], output: str, single: bool) -> list[str]:
    if output == "json":
        data: object = to_json(sessions[0]) if single else [to_json(v) for v in sessions]
        return [json.dumps(data, indent=2, sort_keys=True)]
    if output == "jsonl":
        return [json.dumps(to_json(v), sort_keys=True) for v in sessions]
    return text_of(sessions[0]) if single else table_of(sessions)


def exit_code_of(error: BatonError) -> int:
    if error.kind is ErrorKind.NOT_FOUND:
        return EXIT_NOT_FOUND
    if error.kind is ErrorKind.UNAVAILABLE or error.retryable:
        return EXIT_UNAVAILABLE
    return EXIT_REFUSED


async def get(
    connection: Connection, session: str, output: str, write: Callable[[str], None] = print
) -> int:
    """`baton sessions get ID` (an id, or an alias of the channel)."""
    target = {"session_id": session} if session.startswith("ses_") else {"alias": session}
    channel = connection.open()
    try:
        stub = ingress_pb2_grpc.IngressServiceStub(channel)
        try:
            response = await stub.GetSession(
                pb.GetSessionRequest(**target),
                metadata=connection.metadata,
                timeout=CALL_TIMEOUT,
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
    finally:
        await channel.close()
    for line in render([response.session], output, single=True):
        write(line)
    return EXIT_OK


async def list_sessions(
    connection: Connection,
    output: str,
    *,
    filter_text: str = "",
    order_by: str = "",
    limit: int = 100,
    page_size: int = 0,
    write: Callable[[str], None] = print,
) -> int:
    """`baton sessions list`: every page until `limit` sessions (0: all),
    in session id order or `order_by`'s."""
    channel = connection.open()
    found: list[pb.Session] = []
    try:
        stub = ingress_pb2_grpc.IngressServiceStub(channel)
        token = ""
        while True:
            size = page_size or (min(limit - len(found), 200) if limit else 0)
            try:
                page = await stub.ListSessions(
                    pb.ListSessionsRequest(
                        page_size=size, page_token=token, filter=filter_text, order_by=order_by
                    ),
                    metadata=connection.metadata,
                    timeout=CALL_TIMEOUT,
                )
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from exc
            found.extend(page.sessions)
            if output == "jsonl":  # streamed as pages arrive
                for line in render(page.sessions[: _room(limit, found, page)], output, False):
                    write(line)
            token = page.next_page_token
            if not token or (limit and len(found) >= limit):
                break
    finally:
        await channel.close()
    if limit:
        found = found[:limit]
    if output != "jsonl":
        for line in render(found, output, single=False):
            write(line)
    return EXIT_OK


def _room(limit: int, found: list[pb.Session], page: pb.ListSessionsResponse) -> int:
    """How many of the page's sessions are within `limit` (all when 0)."""
    if not limit:
        return len(page.sessions)
    before = len(found) - len(page.sessions)
    return max(0, limit - before)
