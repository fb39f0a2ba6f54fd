"""`baton sessions create|events|send|answer|cancel|reset`: a new session,
its stream and the commands a channel may send it, through the public API
(IngressService CreateSession / StreamEvents / SendMessage / SendControl)
as the channel whose API key is in BATON_API_KEY. Connection settings and exit codes are those of
`baton_runtime.cli.commands.sessions`.

Output (`-o`): `text` (one line per event, as the demo prints them; a
receipt line), `json` (the proto3 JSON mapping with the proto's field
names: an array of `baton.session.v1.Event`, or the SendMessageResponse /
SendControlResponse), `jsonl` (one event or receipt per line). While
following, text and jsonl lines are printed (and flushed) as each event
arrives; `json` needs the whole array, so it is refused with --follow.

Following also shows the running step's live items (docs/design.md "Live
items"; not with --no-live): in text, lines that start with `~` (no seq:
they are not events), the model's text appended to its line as it is
written, then the step's committed events, which supersede it; in jsonl,
a line `{"live": LiveBatch}` (StreamEventsResponse's `live`) beside the
event lines.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands.event_text import format_event
from baton_runtime.cli.commands.sessions import CALL_TIMEOUT, EXIT_OK, Connection, UsageError
from baton_runtime.common.rpc.status_map import from_rpc_error

REPLAY_TIMEOUT = 10 * CALL_TIMEOUT
"""Seconds a replay (no --follow) may take: a long stream is many pages."""
CONTROLS = {"cancel": pb.CONTROL_KIND_CANCEL, "reset": pb.CONTROL_KIND_RESET}
TERMINAL = frozenset({s.EVENT_KIND_SESSION_COMPLETED, s.EVENT_KIND_SESSION_FAILED})


_R = TypeVar("_R", pb.StreamEventsRequest, pb.SendMessageRequest, pb.SendControlRequest)


def _aimed(request: _R, session: str) -> _R:
    """`request` addressed to a session id, or to an alias of the channel."""
    if session.startswith("ses_"):
        request.session_id = session
    else:
        request.alias = session
    return request


def message_json(message: Message) -> dict[str, object]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _flushed(line: str) -> None:
    """A line out at once, also into a pipe (`... --follow | grep`)."""
    print(line, flush=True)


def _flushed_part(text: str) -> None:
    """Part of a line (live text as it is written), out at once."""
    sys.stdout.write(text)
    sys.stdout.flush()


async def events(
    connection: Connection,
    session: str,
    output: str,
    *,
    follow: bool = False,
    start_seq: int = 0,
    live: bool = False,
    write: Callable[[str], None] = _flushed,
    write_part: Callable[[str], None] = _flushed_part,
) -> int:
    """`baton sessions events ID [--follow] [--from SEQ] [--no-live]`: the
    stream from `start_seq`; with `follow`, live until the session's
    terminal event (or Ctrl-C), and with `live` the running steps' live
    items too. If the stream breaks (an ingress restarting), the error says
    which --from continues it without a gap or a repeat."""
    if follow and output == "json":
        raise UsageError("-o json prints one array at the end; use -o jsonl or text with --follow")
    printed = _Printed(output, write, start_seq, write_part)
    channel = connection.open()
    try:
        stub = ingress_pb2_grpc.IngressServiceStub(channel)
        # No deadline while following: the stream lasts as long as the
        # session (Ctrl-C ends it); a replay is bounded.
        call = stub.StreamEvents(
            _aimed(
                pb.StreamEventsRequest(start_seq=start_seq, follow=follow, live=follow and live),
                session,
            ),
            metadata=connection.metadata,
            timeout=None if follow else REPLAY_TIMEOUT,
        )
        try:
            async for response in call:
                if response.HasField("live"):
                    printed.live(response.live)
                    continue
                printed.add(response.events)
                if follow and any(e.kind in TERMINAL for e in response.events):
                    break  # the stream closes here; do not wait for the server's end
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
            if printed.next_seq > start_seq:
                error.message += f" (continue with --from {printed.next_seq})"
            raise error from exc
        finally:
            call.cancel()
    finally:
        await channel.close()
    printed.close()
    return EXIT_OK


class _Printed:
    """Events printed in the `-o` format as they arrive (`json`: kept for
    the one array `close` prints), and the seq after the last one; live
    items as `_LiveLines` (text) or their own jsonl lines."""

    def __init__(
        self,
        output: str,
        write: Callable[[str], None],
        next_seq: int,
        write_part: Callable[[str], None] = _flushed_part,
    ) -> None:
        self.output = output
        self.write = write
        self.next_seq = next_seq
        self._kept: list[s.Event] = []
        self._live = _LiveLines(write, write_part)

    def live(self, batch: s.LiveBatch) -> None:
        if batch.step.base_seq < self.next_seq:
            return  # its step's commit is already printed
        if self.output == "jsonl":
            self.write(json.dumps({"live": message_json(batch)}, sort_keys=True))
        elif self.output == "text":
            self._live.batch(batch)

    def add(self, events: Iterable[s.Event]) -> None:
        for event in events:
            self._live.end_line()
            self.next_seq = event.seq + 1
            if self.output == "json":
                self._kept.append(event)
            elif self.output == "jsonl":
                self.write(json.dumps(message_json(event), sort_keys=True))
            else:
                self.write(format_event(event))

    def close(self) -> None:
        self._live.end_line()
        if self.output == "json":
            self.write(json.dumps([message_json(e) for e in self._kept], indent=2, sort_keys=True))


def _run(step: s.LiveStep) -> tuple[str, int, int, int]:
    return (step.owner_run_id, step.epoch, step.attempt, step.base_seq)


class _LiveLines:
    """Live items as text: a line per step start, tool progress and drop,
    and the model's text (or a tool call's arguments) appended to one line
    as it is written, ended when something else is printed. `~` stands
    where an event's seq would: these are not events."""

    def __init__(self, write: Callable[[str], None], write_part: Callable[[str], None]) -> None:
        self._write = write
        self._part = write_part
        self._open: tuple[object, ...] | None = None  # what the open line shows
        self._runs: dict[int, tuple[str, int, int, int]] = {}  # base_seq -> its step run

    def end_line(self) -> None:
        if self._open is not None:
            self._part("\n")
            self._open = None

    def _line(self, kind: str, details: str) -> None:
        self.end_line()
        self._write(f"~    {kind:<22} {details}".rstrip())

    def _append(self, key: tuple[object, ...], head: str, text: str) -> None:
        if self._open != key:
            self.end_line()
            self._part(head)
            self._open = key
        self._part(text)

    def batch(self, batch: s.LiveBatch) -> None:
        step = batch.step
        run = _run(step)
        earlier = self._runs.get(step.base_seq)
        if earlier is not None and earlier != run:
            self._line(
                "live.void",
                f"step {step.step} runs again (epoch {step.epoch}, attempt {step.attempt}): "
                "the text above is void",
            )
        self._runs = {base: r for base, r in self._runs.items() if base < step.base_seq}
        self._runs[step.base_seq] = run
        for item in batch.items:
            self._item(step, run, item)

    def _item(self, step: s.LiveStep, run: tuple[object, ...], item: s.LiveItem) -> None:
        if item.kind == s.LIVE_KIND_TURN_STARTED:
            self._line("turn.started", f"{step.turn_id}")
        elif item.kind == s.LIVE_KIND_STEP_STARTED:
            self._line("step.started", f"{step.turn_id} step {step.step}")
        elif item.kind == s.LIVE_KIND_TEXT:
            self._append((*run, "text"), f"~    {'live.text':<22} ", item.text)
        elif item.kind == s.LIVE_KIND_TOOL_CALL:
            key = (*run, "call", item.tool_call_index)
            head = f"~    {'live.tool_call':<22} {item.tool_name or '?'}("
            self._append(key, head, item.text)
        elif item.kind == s.LIVE_KIND_TOOL_PROGRESS:
            self._line("live.progress", f"{item.tool_name} {item.tool_call_id}: {item.text}")
        elif item.kind == s.LIVE_KIND_DROPPED:
            self._line("live.dropped", f"{item.dropped} item(s) missed: the commit has them all")


def _receipt_line(verb: str, receipt: s.Receipt, delivery_id: str) -> str:
    return (
        f"{verb}: session {receipt.session_id}, inbox seq {receipt.seq}, "
        f"delivery {delivery_id}" + (" (a repeat: the first receipt)" if receipt.duplicate else "")
    )


def _print(response: Message, output: str, line: str, write: Callable[[str], None]) -> None:
    if output == "json":
        write(json.dumps(message_json(response), indent=2, sort_keys=True))
    elif output == "jsonl":
        write(json.dumps(message_json(response), sort_keys=True))
    else:
        write(line)


async def create(
    connection: Connection,
    output: str,
    *,
    aliases: Sequence[str] = (),
    request_id: str = "",
    timeout_seconds: int = 0,
    token_budget: int = 0,
    write: Callable[[str], None] = print,
) -> int:
    """`baton sessions create`: a new session on the ingress's deployment. A
    repeat with the same --request-id finds the session the first created."""
    channel = connection.open()
    try:
        stub = ingress_pb2_grpc.IngressServiceStub(channel)
        request = pb.CreateSessionRequest(
            request_id=request_id or f"cli-{uuid.uuid4().hex}",
            aliases=list(aliases),
            timeout_seconds=timeout_seconds,
            token_budget=token_budget,
        )
        try:
            response = await stub.CreateSession(
                request, metadata=connection.metadata, timeout=CALL_TIMEOUT
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
    finally:
        await channel.close()
    verb = "created" if response.created else "found (a repeat of its --request-id)"
    line = f"{verb}: session {response.session_id} on deployment {response.deployment_id}"
    if output == "text":
        write(line)
    else:  # `created` printed when false too: it says whether this call made it
        data = json_format.MessageToDict(
            response,
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
        write(json.dumps(data, indent=2 if output == "json" else None, sort_keys=True))
    return EXIT_OK


async def send(
    connection: Connection,
    session: str,
    text: str,
    output: str,
    *,
    delivery_id: str = "",
    queue: bool = False,
    write: Callable[[str], None] = print,
) -> int:
    """`baton sessions send ID TEXT`: accepted means durably in the inbox.
    A repeat with the same --delivery-id returns the first receipt."""
    channel = connection.open()
    try:
        stub = ingress_pb2_grpc.IngressServiceStub(channel)
        request = _aimed(
            pb.SendMessageRequest(
                text=text,
                delivery_id=delivery_id,
                turn_policy=s.TURN_POLICY_QUEUE if queue else s.TURN_POLICY_UNSPECIFIED,
            ),
            session,
        )
        try:
            response = await stub.SendMessage(
                request, metadata=connection.metadata, timeout=CALL_TIMEOUT
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
    finally:
        await channel.close()
    line = _receipt_line("accepted", response.receipt, response.delivery_id)
    _print(response, output, line, write)
    return EXIT_OK


async def answer(
    connection: Connection,
    session: str,
    request_id: str,
    output: str,
    *,
    approved: bool | None = None,
    text: str = "",
    delivery_id: str = "",
    write: Callable[[str], None] = print,
) -> int:
    """`baton sessions answer ID REQUEST --approve|--deny|--text T`: the
    answer to a pending input request (the request id is on its
    input.requested event): an approval or a refusal of a tool call (or of
    a spent limit), or the text of an answer to the model's question."""
    if approved is None and not text:
        raise UsageError("answer with --approve, --deny or --text TEXT")
    response_message = s.InputResponse(request_id=request_id, text=text, approved=bool(approved))
    channel = connection.open()
    try:
        stub = ingress_pb2_grpc.IngressServiceStub(channel)
        request = _aimed(
            pb.SendMessageRequest(input_responses=[response_message], delivery_id=delivery_id),
            session,
        )
        try:
            response = await stub.SendMessage(
                request, metadata=connection.metadata, timeout=CALL_TIMEOUT
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
    finally:
        await channel.close()
    what = {True: "approval", False: "refusal", None: "answer"}[approved]
    line = _receipt_line(f"{what} of {request_id} accepted", response.receipt, response.delivery_id)
    _print(response, output, line, write)
    return EXIT_OK


async def control(
    connection: Connection,
    session: str,
    action: str,
    output: str,
    *,
    reason: str = "",
    delivery_id: str = "",
    write: Callable[[str], None] = print,
) -> int:
    """`baton sessions cancel|reset ID`: a control command, accepted into the
    inbox (cancel reaches the running turn at once; reset finalizes the
    session once admitted)."""
    channel = connection.open()
    try:
        stub = ingress_pb2_grpc.IngressServiceStub(channel)
        request = _aimed(
            pb.SendControlRequest(kind=CONTROLS[action], reason=reason, delivery_id=delivery_id),
            session,
        )
        try:
            response = await stub.SendControl(
                request, metadata=connection.metadata, timeout=CALL_TIMEOUT
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
    finally:
        await channel.close()
    line = _receipt_line(f"{action} accepted", response.receipt, response.delivery_id)
    _print(response, output, line, write)
    return EXIT_OK
