"""A session as a run holds it (services/owner/rules/turns.py's floor): the run's
identity, the snapshot, the context window and the child handles, with the
few primitives every rule uses — the events it produces, consuming an inbox
entry, recording a tool result, naming ids. Pure: no I/O.

`ChildReports` (child_reports.py) adds what a child owes its parent on
top, `ChildRules` (child_rules.py) the parent's child-session rules, and the
layers up to `SessionState` (turns.py) the wait, step and turn rules; each
layer calls only the ones below it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.agents.api import Agent
from baton_runtime.owner.rules.context import ContextWindow
from baton_runtime.owner.rules.handles import Handles


@dataclass(frozen=True)
class RunIdentity:
    """Who is running: the fence plus the deployment and instance."""

    fence: s.Fence
    deployment_id: str
    instance_id: str


def make_event(
    identity: RunIdentity,
    kind: s.EventKind.ValueType,
    turn_id: str = "",
    entry: s.InboxEntry | None = None,
    **fields: object,
) -> s.Event:
    nanos = time.time_ns()
    event = s.Event(
        session_id=identity.fence.session_id,
        kind=kind,
        time=Timestamp(seconds=nanos // 1_000_000_000, nanos=nanos % 1_000_000_000),
        turn_id=turn_id,
        owner_run_id=identity.fence.owner_run_id,
        deployment_id=identity.deployment_id,
        # Only the fields given a value; `fields` are keywords of the message,
        # which the stub types one by one (a dict of objects cannot match).
        **{k: v for k, v in fields.items() if v},  # type: ignore[arg-type]
    )
    if entry is not None:
        event.inbox_seq = entry.seq
        event.delivery_id = entry.command.delivery.delivery_id
    return event


class HeldSession:
    """A session as a run holds it: identity, snapshot, agent, context window,
    child handles. Methods that produce stream events append them to
    `events`."""

    def __init__(
        self,
        identity: RunIdentity,
        snapshot: s.SessionSnapshot,
        agent: Agent,
        context: Sequence[s.ChatMessage] = (),
    ) -> None:
        self.identity = identity
        self.snapshot = snapshot
        self.agent = agent
        self.context = ContextWindow(snapshot, context)
        self.handles = Handles(snapshot)
        # The inbox seq of the first command set aside when the last one was
        # taken past it (None: taken in order); see `consume`.
        self.set_aside_from: int | None = None

    @property
    def run_id(self) -> str:
        return self.identity.fence.owner_run_id

    @property
    def turn_id(self) -> str:
        return self.snapshot.open_turn.turn_id if self.snapshot.HasField("open_turn") else ""

    @property
    def turn_open(self) -> bool:
        return self.snapshot.HasField("open_turn")

    @property
    def is_child(self) -> bool:
        return bool(self.snapshot.parent.parent_session_id)

    def event(
        self, kind: s.EventKind.ValueType, entry: s.InboxEntry | None = None, **fields: object
    ) -> s.Event:
        return make_event(self.identity, kind, self.turn_id, entry, **fields)

    def consume(self, entry: s.InboxEntry) -> None:
        """`entry` is consumed: the inbox position moves past it (and past
        what was consumed ahead right behind it). While a command below it
        is set aside (a queued message waiting for the open turn to end,
        `AdmissionRules.take`), it is recorded as consumed ahead instead."""
        snap = self.snapshot
        if self.consumed(entry.seq):
            return
        if self.set_aside_from is not None and entry.seq > self.set_aside_from:
            ahead = sorted([*snap.inbox_consumed_ahead, entry.seq])
        else:
            snap.inbox_next_seq = entry.seq + 1
            ahead = [seq for seq in snap.inbox_consumed_ahead if seq > entry.seq]
            while ahead and ahead[0] == snap.inbox_next_seq:
                snap.inbox_next_seq = ahead.pop(0) + 1
        del snap.inbox_consumed_ahead[:]
        snap.inbox_consumed_ahead.extend(ahead)

    def consumed(self, seq: int) -> bool:
        """The inbox entry `seq` was consumed (below the position, or ahead of it)."""
        snap = self.snapshot
        return seq < snap.inbox_next_seq or seq in snap.inbox_consumed_ahead

    def record_result(self, result: s.ToolResult, events: list[s.Event], step: int = 0) -> None:
        events.append(self.event(s.EVENT_KIND_TOOL_CALL_RESULT, step=step, tool_result=result))
        self.context.remember(
            s.ChatMessage(role=s.ROLE_TOOL, content=result.output, tool_call_id=result.tool_call_id)
        )

    def next_id(self, prefix: str) -> str:
        self.snapshot.id_count += 1
        return f"{prefix}_{self.snapshot.id_count}"
