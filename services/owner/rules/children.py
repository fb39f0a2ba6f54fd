"""A parent's child sessions (docs/design.md §11), as functions over
`SessionState` (held.py): what a step's child-starting tool call asks for,
recording the work given to a child, applying a child's report to its
parent, cancelling the children of a cancelled turn and finalizing them
all. Pure: no I/O. The handle rules themselves are in handles.py, the
reports a child owes its parent in reports.py; the run (run/step.py,
run/upkeep.py) creates the children and delivers the commands and reports
these rules produce.

- a step may give work to children; a turn waiting for a child's result is
  open but not waiting for the user; a child's report is a `task_result`
  command: it answers the waiting tool call, joins the open turn at its next
  boundary, starts a turn, or is only recorded.
- cancelling a turn cancels the children it gave work to; what children
  spend is added to this session's usage and turn.
- a child session takes conversational messages only from its parent.
"""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids, limits
from baton_runtime.common.errors import BatonError, Reason
from baton_runtime.owner.agents.api import ASK_SUBAGENT, CONTINUE_TASK, ToolMode
from baton_runtime.owner.rules import child_outputs as outputs
from baton_runtime.owner.rules import handles as h
from baton_runtime.owner.rules import reports
from baton_runtime.owner.rules.handles import ReportMeaning
from baton_runtime.owner.rules.held import SessionState


@dataclass(frozen=True)
class ChildWork:
    """Work a step gave a child session (the I/O is done: the child exists
    and the work is in its inbox); `apply_step` records the handle."""

    child_session_id: str
    kind: s.TaskKind.ValueType
    name: str
    deployment_id: str
    text: str
    background: bool
    resumed: bool


@dataclass(frozen=True)
class ChildPlan:
    """How a tool call gives work to a child: the work as the step will
    record it, the command for the child's inbox, and, for a new child, its
    parent link (None: the child exists)."""

    work: ChildWork
    command: s.Command
    link: s.ParentLink | None


# -- what a child's command means ---------------------------------------------


def refuses_message(state: SessionState, entry: s.InboxEntry) -> bool:
    """A child session takes conversational messages only from its parent
    (input responses and controls from its channel are fine)."""
    send = entry.command.send
    return (
        state.is_child
        and not send.parent_work
        and not send.input_responses
        and bool(send.text.strip())
    )


def read_report(state: SessionState, entry: s.InboxEntry) -> h.ReportReading:
    return state.handles.read_report(
        state.identity.fence.session_id, state.turn_id, entry.command.task_result
    )


# -- children: giving work, and their reports ----------------------------------


def child_given_work(
    state: SessionState, work: ChildWork, call: s.ToolCall, events: list[s.Event], step: int
) -> None:
    """A step gave `work` to a child: record its handle and say so; a
    background call gets the handle as its result at once."""
    waiting_call = "" if work.background else call.id
    existing = state.handles.find(work.child_session_id)
    if work.resumed and existing is not None:
        handle = state.handles.give_work(existing, state.turn_id, waiting_call)
    else:
        handle = state.handles.start(
            work.child_session_id,
            work.kind,
            work.name,
            work.deployment_id,
            state.turn_id,
            waiting_call,
        )
        evicted = state.handles.evict()
        if evicted is not None:
            # The least recently used idle child makes room: finalized.
            parent = state.identity.fence.session_id
            command = h.child_control(parent, f"session {parent} holds too many children")
            state.outgoing.append((evicted.child_session_id, command))
            handle = state.handles.find(work.child_session_id) or handle
    events.append(
        state.event(
            s.EVENT_KIND_TASK_STARTED,
            step=step,
            text=work.text,
            child_session_id=work.child_session_id,
            task=_copy(handle),
        )
    )
    if work.background:
        result = s.ToolResult(
            tool_call_id=call.id, name=call.name, output=outputs.started_output(handle)
        )
        state.record_result(result, events, step)


def plan_child_work(
    state: SessionState,
    call: s.ToolCall,
    reserved: frozenset[str],
    step: s.Usage,
    subagents: Container[str],
) -> ChildPlan | h.Refusal:
    """What the child-starting tool `call` asks for (ask_subagent,
    continue_task, a background or workflow tool), or why it cannot be
    done (`reserved`: children given work earlier in this step; `step`:
    what this step spent so far, which the new child's budget leaves out;
    `subagents`: the names of this deployment's subagents)."""
    ask = _what_call_asks(state, call, reserved, subagents)
    if isinstance(ask, h.Refusal):
        return ask
    child, kind, name, text, background = ask
    resumed = call.name == CONTINUE_TASK
    link = None
    if not resumed:
        new = _new_child(state, call, kind, name, len(reserved), step)
        if isinstance(new, h.Refusal):
            return new
        child, link = new
    parent = state.identity.fence.session_id
    work = next_work(state, child) if resumed else 1
    command = s.Command(
        delivery=s.DeliveryMetadata(delivery_id=f"work:{parent}:{work}"),
        send=s.SendCommand(text=text, parent_work=work),
    )
    given = ChildWork(child, kind, name, state.identity.deployment_id, text, background, resumed)
    return ChildPlan(given, command, link)


def _what_call_asks(
    state: SessionState, call: s.ToolCall, reserved: frozenset[str], subagents: Container[str]
) -> tuple[str, s.TaskKind.ValueType, str, str, bool] | h.Refusal:
    """(child, kind, name, text, background) of a child-starting call;
    child is "" for a new child (its id is derived later)."""
    arguments = _arguments(call)
    background = bool(arguments.get("background"))
    child = ""
    if call.name == CONTINUE_TASK:
        child = str(arguments.get("handle", ""))
        text = str(arguments.get("message", ""))
        refusal = state.handles.refuse_continue(child, reserved)
        if refusal is not None:
            return refusal
        handle = state.handles.find(child)
        assert handle is not None
        kind, name = handle.kind, handle.name
    elif call.name == ASK_SUBAGENT:
        kind, name = s.TASK_KIND_SUBAGENT, str(arguments.get("agent", ""))
        text = str(arguments.get("prompt", ""))
        if name not in subagents:
            return h.Refusal(Reason.UNKNOWN_SUBAGENT, f"no subagent named {name!r}")
    else:
        tool = state.agent.tool_index[call.name]
        background = tool.mode is ToolMode.BACKGROUND
        kind = s.TASK_KIND_BACKGROUND if background else s.TASK_KIND_WORKFLOW
        name, text = tool.name, call.arguments_json
    if not text.strip():
        return h.Refusal(Reason.EMPTY_MESSAGE, "there is nothing to ask")
    return child, kind, name, text, background


def _new_child(
    state: SessionState,
    call: s.ToolCall,
    kind: s.TaskKind.ValueType,
    name: str,
    reserved: int,
    step: s.Usage,
) -> tuple[str, s.ParentLink] | h.Refusal:
    """A new child for `call`: its id and parent link (its depth, and the
    budget left after `step`), or why there can be none."""
    refusal = state.handles.refuse_start(reserved)
    depth = state.snapshot.parent.depth + 1
    if refusal is None and depth > limits.MAX_CHILD_DEPTH:
        refusal = h.Refusal(
            Reason.TOO_MANY_TASKS,
            f"child sessions nest at most {limits.MAX_CHILD_DEPTH} deep",
        )
    if refusal is not None:
        return refusal
    parent = state.identity.fence.session_id
    tokens, cost = h.child_budget(state.snapshot, step)
    link = s.ParentLink(
        parent_session_id=parent,
        kind=kind,
        name=name,
        depth=depth,
        limits=s.Limits(token_budget=tokens, cost_budget_micros=cost),
    )
    return ids.child_session_id(parent, call.id), link


def next_work(state: SessionState, child_session_id: str) -> int:
    """The number of the next work a (known) child would get."""
    handle = state.handles.find(child_session_id)
    return handle.work + 1 if handle is not None else 1


def apply_report(state: SessionState, entry: s.InboxEntry, events: list[s.Event]) -> ReportMeaning:
    """Apply a child's report (not a rejected one) and consume it. For
    AWAITED the waiting tool call gets the result; for ADMIT it joins
    the open turn (a caller with no open turn starts one first)."""
    reading = read_report(state, entry)
    handle = reading.handle
    meaning = reading.meaning
    assert handle is not None and meaning is not ReportMeaning.REJECT
    state.inbox.consume(entry)
    if meaning is ReportMeaning.SURFACE:
        _surface_wait(state, entry, handle, events)
    elif meaning is ReportMeaning.FINALIZED:
        state.handles.mark_finalized(handle)
    else:
        _apply_outcome(state, entry, handle, meaning, events)
    return meaning


def _surface_wait(
    state: SessionState, entry: s.InboxEntry, handle: s.ChildHandle, events: list[s.Event]
) -> None:
    """A child (or a descendant) waits on a human: say so here, and, in
    a child, report it further up."""
    report = entry.command.task_result
    handle.waiting = True
    where = report.waiting_session_id or report.child_session_id
    if report.attempt_id:
        event = state.event(
            s.EVENT_KIND_AUTHORIZATION_REQUIRED,
            entry,
            attempt_id=report.attempt_id,
            child_session_id=where,
        )
    else:
        event = state.event(
            s.EVENT_KIND_INPUT_REQUESTED,
            entry,
            input_request=report.input_request,
            child_session_id=where,
        )
    events.append(event)
    if state.is_child:  # surfaced further up: a wait of a descendant
        reports.report_descendant_wait(state, report, where)


def _apply_outcome(
    state: SessionState,
    entry: s.InboxEntry,
    handle: s.ChildHandle,
    meaning: ReportMeaning,
    events: list[s.Event],
) -> None:
    """A child's work ended: count what it spent, finish the handle, say
    so, and give the result to the call waiting for it (AWAITED) or to
    the open turn (ADMIT)."""
    report = entry.command.task_result
    call_id = handle.tool_call_id
    h.add_usage(state.snapshot.usage, report.usage)
    if meaning in (ReportMeaning.AWAITED, ReportMeaning.ADMIT) and state.turn_open:
        turn = state.snapshot.open_turn
        h.add_usage(turn.usage, report.usage)
        turn.child_steps += report.steps
        turn.inbox_seqs.append(entry.seq)
    state.handles.finish(handle, report)
    failed = report.status != s.TASK_STATUS_COMPLETED
    events.append(
        state.event(
            s.EVENT_KIND_TASK_FAILED if failed else s.EVENT_KIND_TASK_COMPLETED,
            entry,
            text=report.result,
            usage=report.usage,
            error=report.error if failed else None,
            child_session_id=handle.child_session_id,
            task=_copy(handle),
        )
    )
    if meaning is ReportMeaning.AWAITED:
        output = outputs.tool_output(handle, report)
        result = s.ToolResult(
            tool_call_id=call_id, name=handle.name, output=output, is_error=failed
        )
        state.record_result(result, events)
    elif meaning is ReportMeaning.ADMIT:
        content = outputs.message_content(handle, report)
        state.context.remember(s.ChatMessage(role=s.ROLE_USER, content=content))
    state.handles.prune()


def cancel_children(state: SessionState, events: list[s.Event]) -> None:
    """The open turn is cancelled: so is the work it gave children that
    still run (cancels go out before the commit); a call that waited for
    one gets a cancelled result."""
    for handle in state.handles.detach(state.turn_id):
        if handle.tool_call_id:
            result = s.ToolResult(
                tool_call_id=handle.tool_call_id,
                name=handle.name,
                output=outputs.cancelled_output(handle),
                is_error=True,
            )
            state.record_result(result, events)
            handle.tool_call_id = ""
        parent = state.identity.fence.session_id
        command = h.child_control(
            parent, f"the turn of session {parent} was cancelled", cancel_work=handle.work
        )
        state.outgoing.append((handle.child_session_id, command))


def finalize_children(state: SessionState) -> None:
    """The session finalizes: so does every child that is not settled
    (resets go out before the commit)."""
    parent = state.identity.fence.session_id
    for handle in state.handles.finalize_all():
        command = h.child_control(parent, f"its parent session {parent} finalized")
        state.outgoing.append((handle.child_session_id, command))


def work_not_given(child_session_id: str, exc: BatonError) -> h.Refusal:
    """Why a child did not get its work, when starting it or sending it the
    work failed for good (`exc` is not retryable): the call's error result."""
    if exc.reason in (Reason.SESSION_FINALIZED, Reason.SESSION_NOT_FOUND):
        return h.Refusal(Reason.TASK_SETTLED, f"child session {child_session_id}: {exc.message}")
    # Never succeeds as asked (e.g. the work is over the command limit): the
    # model sees why.
    return h.Refusal(exc.reason, exc.message)


def _arguments(call: s.ToolCall) -> dict[str, object]:
    """A call's arguments; anything but a JSON object reads as none."""
    try:
        arguments = json.loads(call.arguments_json)
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def _copy(handle: s.ChildHandle) -> s.ChildHandle:
    copy = s.ChildHandle()
    copy.CopyFrom(handle)
    return copy
