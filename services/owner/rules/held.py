"""A session as a run holds it: one state object, composed, in the shape of
Temporal's workflow instance. `SessionState` is the run's identity, the
agent and the snapshot, with the parts that read and write the snapshot —
the context window (context.py), the child handles (handles.py), the inbox
position (`InboxPosition`) — what the last commit left (`LastCommit`), and
what the next commit must carry out (`outgoing`: controls for children).

Its methods are the few primitives every rule uses: the events it produces,
ids, recording a tool result, a commit's bookkeeping. The rules themselves
are functions over it, one module per concern, each calling only those
before it: reports.py (what a child owes its parent), children.py (a
parent's child sessions), waits.py (the user's input and sign-in),
steps.py (what a step did), admission.py (how a command joins a turn),
turns.py (turns opened and closed, the context, finalization, a refused
commit); decisions.py and departure_rules.py choose among them.

Pure: no I/O, and no clock. Time is an input, as in a workflow's
activation: `now` is the time of the activation the rules are answering,
which the shell gives every rule it calls (decisions.py's, and the turn
rules it calls itself), and every event a rule makes carries it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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


def timestamp(now: float) -> Timestamp:
    """`now` (epoch seconds) as a protobuf timestamp."""
    stamp = Timestamp()
    stamp.FromNanoseconds(int(now * 1_000_000_000))
    return stamp


def make_event(
    identity: RunIdentity,
    kind: s.EventKind.ValueType,
    turn_id: str = "",
    entry: s.InboxEntry | None = None,
    *,
    now: float | None = None,
    **fields: object,
) -> s.Event:
    """An event of the session `identity` runs, about `entry` when given.
    `now`: its time (a rule gives its activation's); without one, the
    commit that carries it stamps it with its own (stamping.py)."""
    event = s.Event(
        session_id=identity.fence.session_id,
        kind=kind,
        time=timestamp(now) if now is not None else None,
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


class InboxPosition:
    """How far the session consumed its inbox: the snapshot's position
    (`inbox_next_seq`) and the entries consumed ahead of it while a queued
    message waits out the open turn (admission.take sets it aside)."""

    def __init__(self, snapshot: s.SessionSnapshot) -> None:
        self._snapshot = snapshot
        # The inbox seq of the first command set aside when the last one was
        # taken past it (None: taken in order); see `consume`.
        self.set_aside_from: int | None = None

    def consume(self, entry: s.InboxEntry) -> None:
        """`entry` is consumed: the position moves past it (and past what
        was consumed ahead right behind it). While a command below it is set
        aside, it is recorded as consumed ahead instead."""
        snap = self._snapshot
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
        snap = self._snapshot
        return seq < snap.inbox_next_seq or seq in snap.inbox_consumed_ahead


@dataclass
class LastCommit:
    """What the last commit left, which a refused commit rolls back to (the
    context window keeps its own part: `ContextWindow.mark_committed`)."""

    turn_id: str  # its open turn ("" when none was open)
    next_event_seq: int
    reports: set[str]  # the delivery ids of the reports its outbox held


@dataclass(eq=False)
class SessionState:
    """One session as a run holds it. Make one with `hold`."""

    identity: RunIdentity
    agent: Agent
    snapshot: s.SessionSnapshot
    now: float  # the time of the activation in progress (epoch seconds)
    context: ContextWindow
    handles: Handles
    inbox: InboxPosition
    last_commit: LastCommit
    answer: str = ""  # the open turn's latest final answer (a child reports it)
    # Commands for children (cancels, resets) that must be in their inboxes
    # before the next commit; derived delivery ids make a repeat harmless.
    outgoing: list[tuple[str, s.Command]] = field(default_factory=list)

    @classmethod
    def hold(
        cls,
        identity: RunIdentity,
        snapshot: s.SessionSnapshot,
        agent: Agent,
        context: Sequence[s.ChatMessage] = (),
        *,
        now: float,
    ) -> SessionState:
        """The state of a session as `snapshot` (and the `context` it refers
        to) left it, held by the run `identity` from `now` on."""
        last = LastCommit(
            turn_id=snapshot.open_turn.turn_id,
            next_event_seq=snapshot.next_event_seq,
            reports={r.task_delivery_id for r in snapshot.parent.outbox},
        )
        return cls(
            identity=identity,
            agent=agent,
            snapshot=snapshot,
            now=now,
            context=ContextWindow(snapshot, context),
            handles=Handles(snapshot),
            inbox=InboxPosition(snapshot),
            last_commit=last,
        )

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
        """An event of the open turn (if any), at the activation's time."""
        return make_event(self.identity, kind, self.turn_id, entry, now=self.now, **fields)

    def next_id(self, prefix: str) -> str:
        """An id unique in the session (input requests, sign-in attempts)."""
        self.snapshot.id_count += 1
        return f"{prefix}_{self.snapshot.id_count}"

    def record_result(self, result: s.ToolResult, events: list[s.Event], step: int = 0) -> None:
        """A tool call's result: on the stream, and in what the model sees."""
        events.append(self.event(s.EVENT_KIND_TOOL_CALL_RESULT, step=step, tool_result=result))
        self.context.remember(
            s.ChatMessage(role=s.ROLE_TOOL, content=result.output, tool_call_id=result.tool_call_id)
        )

    def mark_committed(self) -> None:
        """A commit of the current state succeeded."""
        self.context.mark_committed()
        self.last_commit = LastCommit(
            turn_id=self.snapshot.open_turn.turn_id,
            next_event_seq=self.snapshot.next_event_seq,
            reports={r.task_delivery_id for r in self.snapshot.parent.outbox},
        )
