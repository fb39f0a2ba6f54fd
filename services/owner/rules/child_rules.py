"""Child-session rules (docs/design.md §11), as a layer of `SessionState`
(turns.py): what a step's child-starting tool call asks for, recording the
work given to a child, applying a child's report to its parent, cancelling
the children of a cancelled turn. Pure: no I/O. The handle rules themselves
are in handles.py, the reports a child owes its parent in child_reports.py;
the run (step.py, upkeep.py) creates the children and delivers the commands
and reports these rules produce.

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
from collections.abc import Container, Sequence
from dataclasses import dataclass

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids, limits
from baton_runtime.common.errors import Reason
from baton_runtime.owner.agents.api import ASK_SUBAGENT, CONTINUE_TASK, Agent, ToolMode
from baton_runtime.owner.rules import child_outputs as outputs
from baton_runtime.owner.rules import handles as h
from baton_runtime.owner.rules.child_reports import ChildReports
from baton_runtime.owner.rules.handles import ReportMeaning
from baton_runtime.owner.rules.held import RunIdentity


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


class ChildRules(ChildReports):
    """The child-session rules of one held session as a parent (handles,
    work given, reports received), over what it owes as a child."""

    def __init__(
        self,
        identity: RunIdentity,
        snapshot: s.SessionSnapshot,
        agent: Agent,
        context: Sequence[s.ChatMessage] = (),
    ) -> None:
        super().__init__(identity, snapshot, agent, context)
        # Commands for children (cancels, resets) that must be in their inboxes
        # before the next commit; derived delivery ids make a repeat harmless.
        self.outgoing: list[tuple[str, s.Command]] = []

    # -- what a child's command means ---------------------------------------------

    def refuses_message(self, entry: s.InboxEntry) -> bool:
        """A child session takes conversational messages only from its parent
        (input responses and controls from its channel are fine)."""
        send = entry.command.send
        return (
            self.is_child
            and not send.parent_work
            and not send.input_responses
            and bool(send.text.strip())
        )

    def read_report(self, entry: s.InboxEntry) -> h.ReportReading:
        return self.handles.read_report(
            self.identity.fence.session_id, self.turn_id, entry.command.task_result
        )

    # -- children: giving work, and their reports ----------------------------------

    def child_given_work(
        self, work: ChildWork, call: s.ToolCall, events: list[s.Event], step: int
    ) -> None:
        """A step gave `work` to a child: record its handle and say so; a
        background call gets the handle as its result at once."""
        waiting_call = "" if work.background else call.id
        existing = self.handles.find(work.child_session_id)
        if work.resumed and existing is not None:
            handle = self.handles.resume(existing, self.turn_id, waiting_call)
        else:
            handle = self.handles.start(
                work.child_session_id,
                work.kind,
                work.name,
                work.deployment_id,
                self.turn_id,
                waiting_call,
            )
            evicted = self.handles.evict()
            if evicted is not None:
                # The least recently used idle child makes room: finalized.
                parent = self.identity.fence.session_id
                command = h.child_control(parent, f"session {parent} holds too many children")
                self.outgoing.append((evicted.child_session_id, command))
                handle = self.handles.find(work.child_session_id) or handle
        events.append(
            self.event(
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
            self.record_result(result, events, step)

    def plan_child_work(
        self,
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
        ask = self._what_call_asks(call, reserved, subagents)
        if isinstance(ask, h.Refusal):
            return ask
        child, kind, name, text, background = ask
        resumed = call.name == CONTINUE_TASK
        link = None
        if not resumed:
            new = self._new_child(call, kind, name, len(reserved), step)
            if isinstance(new, h.Refusal):
                return new
            child, link = new
        parent = self.identity.fence.session_id
        work = self.next_work(child) if resumed else 1
        command = s.Command(
            delivery=s.DeliveryMetadata(delivery_id=f"work:{parent}:{work}"),
            send=s.SendCommand(text=text, parent_work=work),
        )
        given = ChildWork(child, kind, name, self.identity.deployment_id, text, background, resumed)
        return ChildPlan(given, command, link)

    def _what_call_asks(
        self, call: s.ToolCall, reserved: frozenset[str], subagents: Container[str]
    ) -> tuple[str, s.TaskKind.ValueType, str, str, bool] | h.Refusal:
        """(child, kind, name, text, background) of a child-starting call;
        child is "" for a new child (its id is derived later)."""
        arguments = _arguments(call)
        background = bool(arguments.get("background"))
        child = ""
        if call.name == CONTINUE_TASK:
            child = str(arguments.get("handle", ""))
            text = str(arguments.get("message", ""))
            refusal = self.handles.refuse_continue(child, reserved)
            if refusal is not None:
                return refusal
            handle = self.handles.find(child)
            assert handle is not None
            kind, name = handle.kind, handle.name
        elif call.name == ASK_SUBAGENT:
            kind, name = s.TASK_KIND_SUBAGENT, str(arguments.get("agent", ""))
            text = str(arguments.get("prompt", ""))
            if name not in subagents:
                return h.Refusal(Reason.UNKNOWN_SUBAGENT, f"no subagent named {name!r}")
        else:
            tool = self.agent.tool_index[call.name]
            background = tool.mode is ToolMode.BACKGROUND
            kind = s.TASK_KIND_BACKGROUND if background else s.TASK_KIND_WORKFLOW
            name, text = tool.name, call.arguments_json
        if not text.strip():
            return h.Refusal(Reason.EMPTY_MESSAGE, "there is nothing to ask")
        return child, kind, name, text, background

    def _new_child(
        self,
        call: s.ToolCall,
        kind: s.TaskKind.ValueType,
        name: str,
        reserved: int,
        step: s.Usage,
    ) -> tuple[str, s.ParentLink] | h.Refusal:
        """A new child for `call`: its id and parent link (its depth, and the
        budget left after `step`), or why there can be none."""
        refusal = self.handles.refuse_start(reserved)
        depth = self.snapshot.parent.depth + 1
        if refusal is None and depth > limits.MAX_CHILD_DEPTH:
            refusal = h.Refusal(
                Reason.TOO_MANY_TASKS,
                f"child sessions nest at most {limits.MAX_CHILD_DEPTH} deep",
            )
        if refusal is not None:
            return refusal
        parent = self.identity.fence.session_id
        tokens, cost = h.child_budget(self.snapshot, step)
        link = s.ParentLink(
            parent_session_id=parent,
            kind=kind,
            name=name,
            depth=depth,
            limits=s.Limits(token_budget=tokens, cost_budget_micros=cost),
        )
        return ids.child_session_id(parent, call.id), link

    def next_work(self, child_session_id: str) -> int:
        """The number of the next work a (known) child would get."""
        handle = self.handles.find(child_session_id)
        return handle.work + 1 if handle is not None else 1

    def apply_report(self, entry: s.InboxEntry, events: list[s.Event]) -> ReportMeaning:
        """Apply a child's report (not a rejected one) and consume it. For
        AWAITED the waiting tool call gets the result; for ADMIT it joins
        the open turn (a caller with no open turn starts one first)."""
        reading = self.read_report(entry)
        handle = reading.handle
        meaning = reading.meaning
        assert handle is not None and meaning is not ReportMeaning.REJECT
        self.consume(entry)
        if meaning is ReportMeaning.SURFACE:
            self._surface_wait(entry, handle, events)
        elif meaning is ReportMeaning.FINALIZED:
            self.handles.mark_finalized(handle)
        else:
            self._apply_outcome(entry, handle, meaning, events)
        return meaning

    def _surface_wait(
        self, entry: s.InboxEntry, handle: s.ChildHandle, events: list[s.Event]
    ) -> None:
        """A child (or a descendant) waits on a human: say so here, and, in
        a child, report it further up."""
        report = entry.command.task_result
        handle.waiting = True
        where = report.waiting_session_id or report.child_session_id
        if report.attempt_id:
            event = self.event(
                s.EVENT_KIND_AUTHORIZATION_REQUIRED,
                entry,
                attempt_id=report.attempt_id,
                child_session_id=where,
            )
        else:
            event = self.event(
                s.EVENT_KIND_INPUT_REQUESTED,
                entry,
                input_request=report.input_request,
                child_session_id=where,
            )
        events.append(event)
        if self.is_child:  # surfaced further up: a wait of a descendant
            self.report_descendant_wait(report, where)

    def _apply_outcome(
        self,
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
        h.add_usage(self.snapshot.usage, report.usage)
        if meaning in (ReportMeaning.AWAITED, ReportMeaning.ADMIT) and self.turn_open:
            turn = self.snapshot.open_turn
            h.add_usage(turn.usage, report.usage)
            turn.child_steps += report.steps
            turn.inbox_seqs.append(entry.seq)
        self.handles.finish(handle, report)
        failed = report.status != s.TASK_STATUS_COMPLETED
        events.append(
            self.event(
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
            self.record_result(result, events)
        elif meaning is ReportMeaning.ADMIT:
            content = outputs.message_content(handle, report)
            self.context.remember(s.ChatMessage(role=s.ROLE_USER, content=content))
        self.handles.prune()

    def cancel_children(self, events: list[s.Event]) -> None:
        """The open turn is cancelled: so is the work it gave children that
        still run (cancels go out before the commit); a call that waited for
        one gets a cancelled result."""
        for handle in self.handles.detach(self.turn_id):
            if handle.tool_call_id:
                result = s.ToolResult(
                    tool_call_id=handle.tool_call_id,
                    name=handle.name,
                    output=outputs.cancelled_output(handle),
                    is_error=True,
                )
                self.record_result(result, events)
                handle.tool_call_id = ""
            parent = self.identity.fence.session_id
            command = h.child_control(
                parent, f"the turn of session {parent} was cancelled", cancel_work=handle.work
            )
            self.outgoing.append((handle.child_session_id, command))


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
