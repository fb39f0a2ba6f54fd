"""Child-session rules (docs/design.md §11), as a layer of `SessionState`
(turns.py): what a step's child-starting tool call asks for, recording the
work given to a child, applying a child's report to its parent, cancelling
the children of a cancelled turn, and — in a child — the reports it owes
its parent. Pure: no I/O. The handle rules themselves are in handles.py;
`SessionRun` (session.py) creates the children and delivers the commands
and reports these rules produce.

- a step may give work to children; a turn waiting for a child's result is
  open but not waiting for the user; a child's report is a `task_result`
  command: it answers the waiting tool call, joins the open turn at its next
  boundary, starts a turn, or is only recorded.
- cancelling a turn cancels the children it gave work to; what children
  spend is added to this session's usage and turn.
- a child session reports to its parent: the outcome of each turn that its
  parent's work started, the waits it pauses on, and its finalization, as
  reports in its snapshot's outbox (delivered by the run, deduplicated by
  delivery ids derived from the child and the report). It takes
  conversational messages only from its parent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton.session.v1 import session_pb2 as s
from services.common import ids, limits
from services.common.errors import Reason
from services.owner import handles as h
from services.owner.agent import ASK_SUBAGENT, CONTINUE_TASK, Agent, ToolMode
from services.owner.handles import Verdict
from services.owner.held import HeldSession, RunIdentity


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


class ChildRules(HeldSession):
    """The child-session rules of one held session: as a parent (handles,
    work given, reports received) and as a child (reports owed)."""

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
        self.committed_reports = {r.task_delivery_id for r in snapshot.parent.outbox}
        self.answer = ""  # the open turn's latest final answer (a child reports it)

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

    def report_judgement(self, entry: s.InboxEntry) -> h.Judgement:
        return self.handles.judge_report(
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
                tool_call_id=call.id, name=call.name, output=h.started_output(handle)
            )
            self.record_result(result, events, step)

    def plan_child_work(
        self,
        call: s.ToolCall,
        reserved: frozenset[str],
        step: s.Usage,
        has_subagent: Callable[[str], bool],
    ) -> ChildPlan | h.Refusal:
        """What the child-starting tool `call` asks for (ask_subagent,
        continue_task, a background or workflow tool), or why it cannot be
        done (`reserved`: children given work earlier in this step; `step`:
        what this step spent so far, which the new child's budget leaves out)."""
        try:
            arguments = json.loads(call.arguments_json)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            arguments = {}
        background = bool(arguments.get("background"))
        resumed = call.name == CONTINUE_TASK
        if resumed:
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
            if not has_subagent(name):
                return h.Refusal(Reason.UNKNOWN_SUBAGENT, f"no subagent named {name!r}")
        else:
            tool = self.agent.tool_index[call.name]
            background = tool.mode is ToolMode.BACKGROUND
            kind = s.TASK_KIND_BACKGROUND if background else s.TASK_KIND_WORKFLOW
            name, text = tool.name, call.arguments_json
        if not text.strip():
            return h.Refusal(Reason.EMPTY_MESSAGE, "there is nothing to ask")
        parent = self.identity.fence.session_id
        link = None
        if not resumed:
            refusal = self.handles.refuse_start(len(reserved))
            depth = self.snapshot.parent.depth + 1
            if refusal is None and depth > limits.MAX_CHILD_DEPTH:
                refusal = h.Refusal(
                    Reason.TOO_MANY_TASKS,
                    f"child sessions nest at most {limits.MAX_CHILD_DEPTH} deep",
                )
            if refusal is not None:
                return refusal
            child = ids.child_session_id(parent, call.id)
            tokens, cost = h.child_budget(self.snapshot, step)
            link = s.ParentLink(
                parent_session_id=parent,
                kind=kind,
                name=name,
                depth=depth,
                limits=s.Limits(token_budget=tokens, cost_budget_micros=cost),
            )
        work = self.next_work(child) if resumed else 1
        command = s.Command(
            delivery=s.DeliveryMetadata(delivery_id=f"work:{parent}:{work}"),
            send=s.SendCommand(text=text, parent_work=work),
        )
        given = ChildWork(child, kind, name, self.identity.deployment_id, text, background, resumed)
        return ChildPlan(given, command, link)

    def next_work(self, child_session_id: str) -> int:
        """The number of the next work a (known) child would get."""
        handle = self.handles.find(child_session_id)
        return handle.work + 1 if handle is not None else 1

    def apply_report(self, entry: s.InboxEntry, events: list[s.Event]) -> Verdict:
        """Apply a child's report (not a rejected one) and consume it. For
        AWAITED the waiting tool call gets the result; for ADMIT it joins
        the open turn (a caller with no open turn starts one first)."""
        judgement = self.report_judgement(entry)
        handle = judgement.handle
        verdict = judgement.verdict
        assert handle is not None and verdict is not Verdict.REJECT
        report = entry.command.task_result
        self.consume(entry)
        if verdict is Verdict.SURFACE:
            handle.waiting = True
            where = report.waiting_session_id or report.child_session_id
            if report.attempt_id:
                events.append(
                    self.event(
                        s.EVENT_KIND_AUTHORIZATION_REQUIRED,
                        entry,
                        attempt_id=report.attempt_id,
                        child_session_id=where,
                    )
                )
            else:
                events.append(
                    self.event(
                        s.EVENT_KIND_INPUT_REQUESTED,
                        entry,
                        input_request=report.input_request,
                        child_session_id=where,
                    )
                )
            if self.is_child:  # surfaced further up: a wait of a descendant
                self._report(
                    s.TASK_STATUS_WAITING,
                    f"wait:{self.identity.fence.session_id}:{where}:"
                    f"{report.attempt_id or report.input_request.request_id}",
                    work=self.snapshot.parent.work,
                    input_request=report.input_request,
                    attempt_id=report.attempt_id,
                    waiting_session_id=where,
                )
            return verdict
        if verdict is Verdict.FINALIZED:
            self.handles.mark_finalized(handle)
            return verdict
        call_id = handle.tool_call_id
        h.add_usage(self.snapshot.usage, report.usage)
        if verdict in (Verdict.AWAITED, Verdict.ADMIT) and self.turn_open:
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
        if verdict is Verdict.AWAITED:
            result = s.ToolResult(
                tool_call_id=call_id,
                name=handle.name,
                output=h.tool_output(handle, report),
                is_error=failed,
            )
            self.record_result(result, events)
        elif verdict is Verdict.ADMIT:
            content = h.message_content(handle, report)
            self.context.remember(s.ChatMessage(role=s.ROLE_USER, content=content))
        self.handles.prune()
        return verdict

    def cancel_children(self, events: list[s.Event]) -> None:
        """The open turn is cancelled: so is the work it gave children that
        still run (cancels go out before the commit); a call that waited for
        one gets a cancelled result."""
        for handle in self.handles.detach(self.turn_id):
            if handle.tool_call_id:
                output = json.dumps(
                    {
                        "handle": handle.child_session_id,
                        "name": handle.name,
                        "status": "cancelled",
                    },
                    sort_keys=True,
                )
                result = s.ToolResult(
                    tool_call_id=handle.tool_call_id,
                    name=handle.name,
                    output=output,
                    is_error=True,
                )
                self.record_result(result, events)
                handle.tool_call_id = ""
            parent = self.identity.fence.session_id
            command = h.child_control(
                parent, f"the turn of session {parent} was cancelled", cancel_work=handle.work
            )
            self.outgoing.append((handle.child_session_id, command))

    # -- a child session's reports to its parent -----------------------------------

    def _report(self, status: s.TaskStatus.ValueType, key: str, **fields: object) -> None:
        link = self.snapshot.parent
        report = s.TaskResultCommand(
            task_delivery_id=key,
            child_session_id=self.identity.fence.session_id,
            parent_session_id=link.parent_session_id,
            status=status,
            deployment_id=self.identity.deployment_id,
            # Only the fields given a value; `fields` are keywords of the message,
            # which the stub types one by one (a dict of objects cannot match).
            **{k: v for k, v in fields.items() if v},  # type: ignore[arg-type]
        )
        link.outbox.append(report)

    def report_work(
        self, kind: s.EventKind.ValueType, error: s.ErrorDetail | None, usage: s.Usage
    ) -> None:
        """A turn of a child settled (`kind`): report the outcome of the
        parent's work it served, if any."""
        link = self.snapshot.parent
        if not self.is_child or not link.work:
            return
        work = link.work
        link.work = 0
        turn = self.snapshot.open_turn
        steps = turn.steps + turn.child_steps if self.turn_open else 0
        key = f"task:{self.identity.fence.session_id}:{work}"
        if kind == s.EVENT_KIND_TURN_COMPLETED:
            answer = self.answer
            if len(answer.encode()) > limits.MAX_TASK_RESULT_BYTES:
                error = s.ErrorDetail(
                    reason=Reason.TASK_RESULT_TOO_LARGE,
                    message=f"the answer is {len(answer.encode())} bytes; a result may have "
                    f"{limits.MAX_TASK_RESULT_BYTES} (the whole answer is on session "
                    f"{self.identity.fence.session_id}'s stream)",
                )
                self._report(
                    s.TASK_STATUS_FAILED, key, work=work, error=error, usage=usage, steps=steps
                )
                return
            self._report(
                s.TASK_STATUS_COMPLETED, key, work=work, result=answer, usage=usage, steps=steps
            )
        elif kind == s.EVENT_KIND_TURN_CANCELLED:
            cancelled = s.ErrorDetail(reason=Reason.CANCELLED, message="the work was cancelled")
            self._report(
                s.TASK_STATUS_CANCELLED, key, work=work, error=cancelled, usage=usage, steps=steps
            )
        else:
            failed = error or s.ErrorDetail(reason=Reason.INTERNAL, message="the work failed")
            self._report(
                s.TASK_STATUS_FAILED, key, work=work, error=failed, usage=usage, steps=steps
            )

    def _unreport_refused(self) -> None:
        """A refused commit settled the turn that served the parent's work:
        take back the outcome it reported (never committed) so the turn's
        failure is reported instead."""
        link = self.snapshot.parent
        kept = []
        for report in link.outbox:
            fresh = report.task_delivery_id not in self.committed_reports
            if fresh and report.status in h.OUTCOMES:
                link.work = report.work
            else:
                kept.append(report)
        if len(kept) != len(link.outbox):
            del link.outbox[:]
            link.outbox.extend(kept)

    def report_wait(self, *, request: s.InputRequest | None = None, attempt_id: str = "") -> None:
        if not self.is_child:
            return
        sid = self.identity.fence.session_id
        self._report(
            s.TASK_STATUS_WAITING,
            f"wait:{sid}:{attempt_id or (request.request_id if request else '')}",
            work=self.snapshot.parent.work,
            input_request=request,
            attempt_id=attempt_id,
            waiting_session_id=sid,
        )


def _copy(handle: s.ChildHandle) -> s.ChildHandle:
    copy = s.ChildHandle()
    copy.CopyFrom(handle)
    return copy
