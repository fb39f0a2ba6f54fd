"""Turn rules (docs/design.md §4), as functions over `SessionState` (held.py):
turns opened and closed, when a budget or the step limit is spent, the
context cleared and compacted, the session's lifetime timer armed, the
session finalized, a refused commit rolled back. Pure: no I/O. A
`SessionRun` (services/owner/run/session.py) reads the inbox, calls the
model and tools, and commits what these rules produce; decisions.py
chooses among them.

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
- child sessions (docs/design.md §11; the rules are in children.py and
  reports.py, the handle rules in handles.py): a turn waiting for a child's
  result is open but not waiting for the user (no session.waiting); a steer
  message arriving then is admitted into the turn and the model sees it
  with the result. A child's report joins the open turn at its next
  boundary, or starts a turn.
  Cancelling a turn cancels the children it gave work to; finalizing the
  session finalizes every child. What children spend is added to this
  session's usage and turn (budgets and the step limit see it).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits
from baton_runtime.common.errors import Reason
from baton_runtime.owner.agents.api import ModelReply
from baton_runtime.owner.rules import admission, children, reports, waits
from baton_runtime.owner.rules import handles as h
from baton_runtime.owner.rules.admission import Admission, principal
from baton_runtime.owner.rules.held import SessionState, make_event
from baton_runtime.owner.rules.steps import safe_error as safe_error  # the host's, too
from baton_runtime.owner.rules.steps import usage_of

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


# -- turns -------------------------------------------------------------------


def start_turn(
    state: SessionState, entry: s.InboxEntry, pending: collections.deque[s.InboxEntry]
) -> list[s.Event]:
    """Open a turn with `entry` and the steer messages of the same
    principal right behind it (taken from `pending`)."""
    snap = state.snapshot
    snap.turn_count += 1
    snap.open_turn.CopyFrom(
        s.OpenTurn(turn_id=f"turn_{snap.turn_count}", caller=entry.command.delivery.caller)
    )
    state.answer = ""
    events = [state.event(s.EVENT_KIND_TURN_STARTED, entry)]
    admission.admit(state, entry, events)
    admitted = 1
    who = principal(entry)
    while (
        pending
        and admitted < limits.MAX_ADMITTED_PER_BOUNDARY
        and admission.classify(state, pending[0]) is Admission.ADMIT
        and principal(pending[0]) == who
    ):
        admission.admit(state, pending.popleft(), events)
        admitted += 1
    return events


def max_steps(state: SessionState) -> int:
    return state.snapshot.limits.max_steps_per_turn or state.agent.max_steps_per_turn


def steps_taken(state: SessionState) -> int:
    """This turn's steps and those its children took (the step limit)."""
    turn = state.snapshot.open_turn
    return turn.steps + turn.child_steps


def budget_spent(state: SessionState) -> bool:
    limits_, usage = state.snapshot.limits, state.snapshot.usage
    tokens = usage.input_tokens + usage.output_tokens
    if limits_.token_budget and tokens >= limits_.token_budget:
        return True
    return bool(limits_.cost_budget_micros and usage.cost_micros >= limits_.cost_budget_micros)


def close_turn(
    state: SessionState,
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
    usage.CopyFrom(state.snapshot.open_turn.usage)
    if kind == s.EVENT_KIND_TURN_CANCELLED:
        children.cancel_children(state, events)
    events.append(state.event(kind, entry, usage=usage, error=error))
    reports.report_work(state, kind, error, usage)
    state.snapshot.ClearField("open_turn")
    if waiting:
        events.append(state.event(s.EVENT_KIND_SESSION_WAITING))


def cancel_waiting_turn(state: SessionState, entry: s.InboxEntry) -> list[s.Event]:
    events: list[s.Event] = []
    if state.turn_open:
        events = waits.abandon_waits(state)
        close_turn(state, events, s.EVENT_KIND_TURN_CANCELLED, entry=entry, waiting=False)
    return events


def arm_timeout(state: SessionState, *, now: float, restart: bool) -> float | None:
    """Arm the session's durable lifetime timer for this run: seconds until
    it fires, None when the session has no timeout. The deadline was
    committed with session.started and survives restarts; `restart` (a
    successor on a new deployment) counts the configured duration from
    `now` instead. The timer is stamped with the run: a successor takes only
    its own timer's command as its timeout (admission.classify)."""
    timeout = state.snapshot.timeout
    if not timeout.duration_seconds:
        return None
    if restart or not timeout.HasField("deadline"):
        timeout.deadline.FromSeconds(int(now) + timeout.duration_seconds)
    timeout.armed_by_owner_run_id = state.run_id
    return max(0.0, timeout.deadline.ToSeconds() - now)


# -- context: clear, compaction, finalization ---------------------------------


def clear(state: SessionState, entry: s.InboxEntry) -> list[s.Event]:
    events = cancel_waiting_turn(state, entry)
    before = state.context.size()
    state.context.reset()
    state.inbox.consume(entry)
    change = context_change(before, state.context.size())
    events.append(state.event(s.EVENT_KIND_CONTEXT_CLEARED, entry, context_change=change))
    return events


def compacted(
    state: SessionState,
    events: list[s.Event],
    entry: s.InboxEntry | None,
    reply: ModelReply,
    before: tuple[int, int],
    *,
    now: float,
) -> None:
    """Replace the context with the summary in `reply`; `entry` is the
    compact command, or None when the owner compacted on its own."""
    state.now = now
    usage = usage_of(reply)
    h.add_usage(state.snapshot.usage, usage)
    summary = f"Summary of earlier conversation: {reply.text}"
    state.context.reset([s.ChatMessage(role=s.ROLE_SYSTEM, content=summary)])
    change = context_change(before, state.context.size(), automatic=entry is None)
    events.append(
        state.event(
            s.EVENT_KIND_CONTEXT_COMPACTED,
            entry,
            text=reply.text,
            usage=usage,
            context_change=change,
        )
    )


def compaction_failed(
    state: SessionState,
    events: list[s.Event],
    entry: s.InboxEntry | None,
    message: str,
    *,
    now: float,
) -> None:
    """The model could not summarize: the compact command is rejected, or
    the owner's own compaction says it failed; the context stays."""
    state.now = now
    if entry is not None:
        events.append(admission.rejection(state, entry, Reason.COMPACTION_FAILED, message))
        return
    size = state.context.size()
    events.append(
        state.event(
            s.EVENT_KIND_CONTEXT_COMPACTED,
            error=s.ErrorDetail(reason=Reason.COMPACTION_FAILED, message=message),
            context_change=context_change(size, size, automatic=True),
        )
    )


def finalize(
    state: SessionState,
    events: list[s.Event],
    entry: s.InboxEntry,
    error: s.ErrorDetail | None,
    *,
    now: float,
) -> None:
    """Terminal: the stream closes with this commit; the history is
    retired (nothing will read it again). Every child that is not settled
    is finalized too (resets go out before the commit); a child reports
    its finalization to its parent."""
    state.now = now
    state.inbox.consume(entry)
    if state.turn_open:
        events += cancel_waiting_turn(state, entry)
    children.finalize_children(state)
    state.context.reset()
    state.snapshot.status = s.SESSION_STATUS_FINALIZED
    reports.report_finalized(state, error)
    events.append(state.event(s.EVENT_KIND_SESSION_COMPLETED, entry, error=error))


def refused(
    state: SessionState,
    refused_events: Sequence[s.Event],
    close: bool,
    error: s.ErrorDetail,
    *,
    now: float,
) -> list[s.Event]:
    """A commit that can never succeed (docs/failures.md): roll back what
    it would have written (events, history entries, stream position) and
    return the events to commit in its place — the turn failed, with the
    reason. What it consumed from the inbox stays consumed; usage stays
    counted (model calls were made)."""
    state.now = now
    snap = state.snapshot
    snap.next_event_seq = state.last_commit.next_event_seq
    state.context.rollback()
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
        reports.unreport_refused(state)
        reports.report_work(state, s.EVENT_KIND_TURN_FAILED, error, usage)
    snap.ClearField("open_turn")
    events: list[s.Event] = []
    if turn_id:
        if turn_id != state.last_commit.turn_id:  # it never reached the stream
            events.append(make_event(state.identity, s.EVENT_KIND_TURN_STARTED, turn_id, now=now))
        events.append(
            make_event(
                state.identity, s.EVENT_KIND_TURN_FAILED, turn_id, now=now, usage=usage, error=error
            )
        )
    else:
        events.append(state.event(s.EVENT_KIND_COMMAND_REJECTED, error=error))
    if close:
        events.append(refused_events[-1])
    else:
        events.append(state.event(s.EVENT_KIND_SESSION_WAITING))
    return events
