"""How the console shows Baton's values: names of statuses and event kinds,
times and ages, and each event of a timeline as a small record the
templates draw by its kind (messages, steps, tool calls with their
arguments and results folded, input requests, child tasks, compaction,
handoffs as a move between deployments)."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands.event_text import kind_name

K = s.EventKind
_GROUPS: dict[int, str] = {
    K.EVENT_KIND_MESSAGE_RECEIVED: "message-in",
    K.EVENT_KIND_MESSAGE_COMPLETED: "message-out",
    K.EVENT_KIND_TOOL_CALL_REQUESTED: "tool",
    K.EVENT_KIND_TOOL_CALL_RESULT: "tool",
    K.EVENT_KIND_INPUT_REQUESTED: "input",
    K.EVENT_KIND_AUTHORIZATION_REQUIRED: "input",
    K.EVENT_KIND_AUTHORIZATION_COMPLETED: "input",
    K.EVENT_KIND_TASK_STARTED: "task",
    K.EVENT_KIND_TASK_COMPLETED: "task",
    K.EVENT_KIND_TASK_FAILED: "failure",
    K.EVENT_KIND_CONTEXT_CLEARED: "context",
    K.EVENT_KIND_CONTEXT_COMPACTED: "context",
    K.EVENT_KIND_SESSION_HANDED_OFF: "handoff",
    K.EVENT_KIND_SESSION_STALLED: "failure",
    K.EVENT_KIND_SESSION_FAILED: "failure",
    K.EVENT_KIND_TURN_FAILED: "failure",
    K.EVENT_KIND_COMMAND_REJECTED: "failure",
    K.EVENT_KIND_SESSION_RESUMED: "session",
    K.EVENT_KIND_SESSION_STARTED: "session",
    K.EVENT_KIND_SESSION_COMPLETED: "session",
    K.EVENT_KIND_SESSION_WAITING: "session",
}


def session_status(status: pb.SessionStatus.ValueType) -> str:
    return pb.SessionStatus.Name(status).removeprefix("SESSION_STATUS_").lower()


def status_label(name: str) -> str:
    """`SESSION_STATUS_WAITING_FOR_INPUT` -> `waiting for input`."""
    return name.removeprefix("SESSION_STATUS_").lower().replace("_", " ")


def deployment_status(status: hooks_pb.DeploymentStatus.ValueType) -> str:
    return hooks_pb.DeploymentStatus.Name(status).removeprefix("DEPLOYMENT_STATUS_").lower()


def when(stamp: Timestamp) -> str:
    """UTC, to the second ("-" when unset)."""
    if not stamp.ByteSize():
        return "-"
    moment = stamp.ToDatetime(tzinfo=dt.UTC).replace(microsecond=0)
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def age(duration: Duration) -> str:
    seconds = duration.ToTimedelta().total_seconds()
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _pretty_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


@dataclass(frozen=True)
class EventView:
    """One event of a timeline, as the templates draw it."""

    session_id: str
    seq: int
    kind: str
    group: str
    time: str
    deployment_id: str
    turn_id: str
    step: int
    text: str = ""
    tool_name: str = ""
    tool_detail: str = ""  # arguments or output, folded
    is_error: bool = False
    child_session_id: str = ""
    child_name: str = ""
    moved_from: str = ""  # handoff: from this deployment to `deployment_id`
    handoff_id: str = ""
    error: str = ""
    usage: str = ""
    context: str = ""


def event_view(event: s.Event) -> EventView:
    text = event.text
    tool_name = tool_detail = ""
    is_error = False
    if event.HasField("tool_call"):
        tool_name = event.tool_call.name
        tool_detail = _pretty_json(event.tool_call.arguments_json)
    if event.HasField("tool_result"):
        tool_name = event.tool_result.name
        tool_detail = event.tool_result.output
        is_error = event.tool_result.is_error
    if event.HasField("input_request"):
        text = event.input_request.prompt or text
    moved_from = ""
    if event.kind == K.EVENT_KIND_SESSION_HANDED_OFF:
        moved_from, text = event.text or "?", ""
    error = f"{event.error.reason}: {event.error.message}" if event.HasField("error") else ""
    usage = ""
    if event.HasField("usage"):
        usage = f"{event.usage.input_tokens} in, {event.usage.output_tokens} out"
    context = ""
    if event.HasField("context_change"):
        change = event.context_change
        context = (
            f"{change.before_entries} entries ({change.before_bytes} B) -> "
            f"{change.after_entries} ({change.after_bytes} B)"
            + (", automatic" if change.automatic else "")
        )
    return EventView(
        session_id=event.session_id,
        seq=event.seq,
        kind=kind_name(event.kind),
        group=_GROUPS.get(event.kind, "step"),
        time=when(event.time),
        deployment_id=event.deployment_id,
        turn_id=event.turn_id,
        step=event.step,
        text=text,
        tool_name=tool_name,
        tool_detail=tool_detail,
        is_error=is_error,
        child_session_id=event.child_session_id,
        child_name=event.task.name if event.HasField("task") else "",
        moved_from=moved_from,
        handoff_id=event.handoff_id,
        error=error,
        usage=usage,
        context=context,
    )


class LiveDraft:
    """The step in flight of a followed session, from its live items
    (docs/design.md "Live items"): its text as the model writes it, its
    tools' latest progress, and how many items this follower missed. A
    new step run (the next step, or a re-run that voids this one) starts
    afresh; the step's commit clears it (`committed`)."""

    def __init__(self, next_seq: int) -> None:
        self.next_seq = next_seq  # the follow's cursor: steps below it are committed
        self.step: s.LiveStep | None = None
        self.text = ""
        self.progress = ""
        self.missed = 0
        self._next_offset = 0

    def add(self, batch: s.LiveBatch) -> bool:
        """Take a live batch; whether the draft changed."""
        step = batch.step
        if step.base_seq < self.next_seq:
            return False  # its step is committed already
        if self.step is None or _run(self.step) != _run(step):
            if self.step is not None and step.base_seq < self.step.base_seq:
                return False  # an older step's late items
            self.step, self.text, self.progress, self.missed = step, "", "", 0
            self._next_offset = 0
        for item in batch.items:
            if item.offset < self._next_offset:
                continue  # seen (a follow that reconnected gets the buffer again)
            if item.kind == s.LIVE_KIND_DROPPED:
                self.missed += item.offset + item.dropped - self._next_offset
                self._next_offset = item.offset + item.dropped
                continue
            self.missed += item.offset - self._next_offset
            self._next_offset = item.offset + 1
            if item.kind == s.LIVE_KIND_TEXT:
                self.text += item.text
            elif item.kind == s.LIVE_KIND_TOOL_PROGRESS:
                self.progress = f"{item.tool_name}: {item.text}"
        return True

    def committed(self, events: list[s.Event]) -> bool:
        """Events were committed; whether they cleared the draft."""
        if events:
            self.next_seq = max(self.next_seq, events[-1].seq + 1)
        if self.step is not None and self.step.base_seq < self.next_seq:
            self.step = None
            return True
        return False


def _run(step: s.LiveStep) -> tuple[str, int, int, int]:
    return (step.owner_run_id, step.epoch, step.attempt, step.base_seq)
