"""Turn rules (docs/design.md §4): what a command means for a session, what a
step does to it, when a budget is spent, which events say so. Pure: no I/O.
A `SessionRun` (services/owner/run/session.py) reads the inbox, calls the model
and tools, and commits what these rules produce.

- steer (default): a message arriving while a turn is open is admitted at the
  next model-call boundary of the same turn (at most MAX_ADMITTED_PER_BOUNDARY
  at one boundary; the rest at the next); one pending when the model gives its
  final answer keeps the turn going. queue: waits for the turn to settle.
- consecutive pending steer messages from the same principal start one turn
  together; steer messages from others join it at its first model-call boundary.
- cancel, reset and an own timeout are pushed: the running step is aborted at
  once (when everything before them in the inbox can be admitted into the
  turn). The turn settles as cancelled, keeping completed model calls.
- human input and sign-in pause the turn (the session waits); responses and
  callbacks resume it. A steer message while a turn waits abandons the waits
  and is admitted into the same turn; a queued one waits for the turn to end
  (what answers or ends the wait is taken past it: admission.py).
- budgets are checked before each model call; a spent budget asks the user
  (input kind SESSION_LIMIT): approving extends it, denying fails the turn.
- child sessions (docs/design.md §11; the rules are in child_rules.py, the
  handle rules in handles.py): a turn waiting for a child's result is open
  but not waiting for the user (no session.waiting); a steer message
  arriving then is admitted into the turn and the model sees it with the
  result. A child's report joins the open turn at its next boundary, or
  starts a turn.
  Cancelling a turn cancels the children it gave work to; finalizing the
  session finalizes every child. What children spend is added to this
  session's usage and turn (budgets and the step limit see it).

The layers: `HeldSession` (held.py: identity, snapshot, context, handles,
event and id primitives) under `ChildReports` (child_reports.py: what a
child owes its parent) under `ChildRules` (child_rules.py) under
`WaitRules` (waits.py: human input, sign-in, rejections) under
`StepRules` (step_rules.py: what a step did) under `AdmissionRules`
(admission.py: how a command joins an open turn) under `SessionState`
(here: turns opened and closed, context cleared and compacted, the session
finalized, a refused commit rolled back); each calls only the layers below
it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits
from baton_runtime.common.errors import Reason
from baton_runtime.owner.agents.api import (
    Agent,
    ModelReply,
)
from baton_runtime.owner.rules import handles as h
from baton_runtime.owner.rules.admission import Admission, AdmissionRules, principal
from baton_runtime.owner.rules.held import RunIdentity, make_event
from baton_runtime.owner.rules.step_rules import usage_of

TURN_END_KINDS = frozenset(
    {s.EVENT_KIND_TURN_COMPLETED, s.EVENT_KIND_TURN_FAILED, s.EVENT_KIND_TURN_CANCELLED}
)


def context_change(
    before: tuple[int, int], after: tuple[int, int], automatic: bool = False
) -> s.ContextChange:
    return s.ContextChange(
        before_entries=before[0],
        before_bytes=before[1],
        after_entries=after[0],
        after_bytes=after[1],
        automatic=automatic,
    )


def safe_error(exc: BaseException) -> str:
    """What a public event may say about a failure of authored code: the
    exception's type and a bounded prefix of its message."""
    return f"{type(exc).__name__}: {str(exc)[:300]}"


class SessionState(AdmissionRules):
    """A session as a run holds it — snapshot, context window, identity — and
    every rule of how commands and steps change it (the child-session rules
    are the `ChildRules` layer). The run decides when to call the model, a
    tool, hooks or anchor; this decides what the results mean. Methods that
    produce stream events append them to `events`."""

    def __init__(
        self,
        identity: RunIdentity,
        snapshot: s.SessionSnapshot,
        agent: Agent,
        context: Sequence[s.ChatMessage] = (),
    ) -> None:
        super().__init__(identity, snapshot, agent, context)
        # What the last commit left (a refused commit rolls back to it).
        self.committed_turn_id = snapshot.open_turn.turn_id
        self.committed_next_seq = snapshot.next_event_seq

    def mark_committed(self) -> None:
        """A commit of the current state succeeded."""
        self.context.mark_committed()
        self.committed_turn_id = self.snapshot.open_turn.turn_id
        self.committed_next_seq = self.snapshot.next_event_seq
        self.committed_reports = {r.task_delivery_id for r in self.snapshot.parent.outbox}

    def idle_for_handoff(self) -> bool:
        """Nothing of this session works on: no open turn, no running child
        (a running task, an active subagent turn or workflow tool, a child
        waiting on a human), and not a child session itself (a child stays
        on the deployment that owns it). Pending commands are the run's
        business (docs/design.md §6)."""
        return not (self.turn_open or self.handles.busy() or self.is_child)

    # -- turns -------------------------------------------------------------------

    def start_turn(
        self, entry: s.InboxEntry, pending: collections.deque[s.InboxEntry]
    ) -> list[s.Event]:
        """Open a turn with `entry` and the steer messages of the same
        principal right behind it (taken from `pending`)."""
        snap = self.snapshot
        snap.turn_count += 1
        snap.open_turn.CopyFrom(
            s.OpenTurn(turn_id=f"turn_{snap.turn_count}", caller=entry.command.delivery.caller)
        )
        self.answer = ""
        events = [self.event(s.EVENT_KIND_TURN_STARTED, entry)]
        self.admit(entry, events)
        admitted = 1
        who = principal(entry)
        while (
            pending
            and admitted < limits.MAX_ADMITTED_PER_BOUNDARY
            and self.classify(pending[0]) is Admission.ADMIT
            and principal(pending[0]) == who
        ):
            self.admit(pending.popleft(), events)
            admitted += 1
        return events

    def max_steps(self) -> int:
        return self.snapshot.limits.max_steps_per_turn or self.agent.max_steps_per_turn

    def steps_taken(self) -> int:
        """This turn's steps and those its children took (the step limit)."""
        turn = self.snapshot.open_turn
        return turn.steps + turn.child_steps

    def budget_spent(self) -> bool:
        limits_, usage = self.snapshot.limits, self.snapshot.usage
        tokens = usage.input_tokens + usage.output_tokens
        if limits_.token_budget and tokens >= limits_.token_budget:
            return True
        return bool(limits_.cost_budget_micros and usage.cost_micros >= limits_.cost_budget_micros)

    def close_turn(
        self,
        events: list[s.Event],
        kind: s.EventKind.ValueType,
        *,
        entry: s.InboxEntry | None = None,
        error: s.ErrorDetail | None = None,
        waiting: bool = True,
    ) -> None:
        """Close the open turn; with `waiting`, the session then waits. A
        cancelled turn cancels the work it gave children; a child reports the
        outcome to its parent."""
        usage = s.Usage()
        usage.CopyFrom(self.snapshot.open_turn.usage)
        if kind == s.EVENT_KIND_TURN_CANCELLED:
            self.cancel_children(events)
        events.append(self.event(kind, entry, usage=usage, error=error))
        self.report_work(kind, error, usage)
        self.snapshot.ClearField("open_turn")
        if waiting:
            events.append(self.event(s.EVENT_KIND_SESSION_WAITING))

    def cancel_waiting_turn(self, entry: s.InboxEntry) -> list[s.Event]:
        events: list[s.Event] = []
        if self.turn_open:
            events = self.abandon_waits()
            self.close_turn(events, s.EVENT_KIND_TURN_CANCELLED, entry=entry, waiting=False)
        return events

    # -- context: clear, compaction, finalization ---------------------------------

    def clear(self, entry: s.InboxEntry) -> list[s.Event]:
        events = self.cancel_waiting_turn(entry)
        before = self.context.size()
        self.context.reset()
        self.consume(entry)
        change = context_change(before, self.context.size())
        events.append(self.event(s.EVENT_KIND_CONTEXT_CLEARED, entry, context_change=change))
        return events

    def compacted(
        self,
        events: list[s.Event],
        entry: s.InboxEntry | None,
        reply: ModelReply,
        before: tuple[int, int],
    ) -> None:
        """Replace the context with the summary in `reply`; `entry` is the
        compact command, or None when the owner compacted on its own."""
        usage = usage_of(reply)
        h.add_usage(self.snapshot.usage, usage)
        summary = f"Summary of earlier conversation: {reply.text}"
        self.context.reset([s.ChatMessage(role=s.ROLE_SYSTEM, content=summary)])
        change = context_change(before, self.context.size(), automatic=entry is None)
        events.append(
            self.event(
                s.EVENT_KIND_CONTEXT_COMPACTED,
                entry,
                text=reply.text,
                usage=usage,
                context_change=change,
            )
        )

    def compaction_failed(
        self, events: list[s.Event], entry: s.InboxEntry | None, message: str
    ) -> None:
        if entry is not None:
            events.append(self.rejection(entry, Reason.COMPACTION_FAILED, message))
            return
        size = self.context.size()
        events.append(
            self.event(
                s.EVENT_KIND_CONTEXT_COMPACTED,
                error=s.ErrorDetail(reason=Reason.COMPACTION_FAILED, message=message),
                context_change=context_change(size, size, automatic=True),
            )
        )

    def finalize(
        self, events: list[s.Event], entry: s.InboxEntry, error: s.ErrorDetail | None
    ) -> None:
        """Terminal: the stream closes with this commit; the history is
        retired (nothing will read it again). Every child that is not settled
        is finalized too (resets go out before the commit); a child reports
        its finalization to its parent."""
        self.consume(entry)
        if self.turn_open:
            events += self.cancel_waiting_turn(entry)
        parent = self.identity.fence.session_id
        for handle in self.handles.finalize_all():
            command = h.child_control(parent, f"its parent session {parent} finalized")
            self.outgoing.append((handle.child_session_id, command))
        self.context.reset()
        self.snapshot.status = s.SESSION_STATUS_FINALIZED
        if self.is_child:
            reason = error.reason if error is not None else Reason.RESET
            self._report(
                s.TASK_STATUS_FINALIZED,
                f"final:{parent}",
                error=s.ErrorDetail(reason=reason, message=f"child session {parent} finalized"),
            )
        events.append(self.event(s.EVENT_KIND_SESSION_COMPLETED, entry, error=error))

    def refused(
        self, refused_events: Sequence[s.Event], close: bool, error: s.ErrorDetail
    ) -> list[s.Event]:
        """A commit that can never succeed (docs/failures.md): roll back what
        it would have written (events, history entries, stream position) and
        return the events to commit in its place — the turn failed, with the
        reason. What it consumed from the inbox stays consumed; usage stays
        counted (model calls were made)."""
        snap = self.snapshot
        snap.next_event_seq = self.committed_next_seq
        self.context.rollback()
        # The turn the refused commit belonged to: still open, or settled by
        # that very commit (its final answer was what did not fit).
        usage = s.Usage()
        turn_id = snap.open_turn.turn_id
        if turn_id:
            usage.CopyFrom(snap.open_turn.usage)
        else:
            settled = [e for e in refused_events if e.kind in TURN_END_KINDS and e.turn_id]
            if settled:
                turn_id = settled[-1].turn_id
                usage.CopyFrom(settled[-1].usage)
        if turn_id:
            self._unreport_refused()
            self.report_work(s.EVENT_KIND_TURN_FAILED, error, usage)
        snap.ClearField("open_turn")
        events: list[s.Event] = []
        if turn_id:
            if turn_id != self.committed_turn_id:  # it never reached the stream
                events.append(make_event(self.identity, s.EVENT_KIND_TURN_STARTED, turn_id))
            events.append(
                make_event(
                    self.identity, s.EVENT_KIND_TURN_FAILED, turn_id, usage=usage, error=error
                )
            )
        else:
            events.append(self.event(s.EVENT_KIND_COMMAND_REJECTED, error=error))
        if close:
            events.append(refused_events[-1])
        else:
            events.append(self.event(s.EVENT_KIND_SESSION_WAITING))
        return events
