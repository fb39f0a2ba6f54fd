"""What a child session owes its parent (docs/design.md §11), as the lowest
child layer of `SessionState` (turns.py), over `HeldSession` (held.py): the
outcome of each turn that its parent's work started, the waits it (or a
descendant) pauses on, and its finalization, as reports in its snapshot's
outbox. The run delivers them after the commit that holds them (upkeep.py);
delivery ids derived from the child and the report make a repeat harmless.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits
from baton_runtime.common.errors import Reason
from baton_runtime.owner.agents.api import Agent
from baton_runtime.owner.rules import handles as h
from baton_runtime.owner.rules.held import HeldSession, RunIdentity


class ChildReports(HeldSession):
    """The reports a held session owes its parent, when it is a child."""

    def __init__(
        self,
        identity: RunIdentity,
        snapshot: s.SessionSnapshot,
        agent: Agent,
        context: Sequence[s.ChatMessage] = (),
    ) -> None:
        super().__init__(identity, snapshot, agent, context)
        self.committed_reports = {r.task_delivery_id for r in snapshot.parent.outbox}
        self.answer = ""  # the open turn's latest final answer (a child reports it)

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

    def report_descendant_wait(self, report: s.TaskResultCommand, where: str) -> None:
        """A descendant (`where`) waits on a human: this child reports the
        wait to its parent in turn."""
        self._report(
            s.TASK_STATUS_WAITING,
            f"wait:{self.identity.fence.session_id}:{where}:"
            f"{report.attempt_id or report.input_request.request_id}",
            work=self.snapshot.parent.work,
            input_request=report.input_request,
            attempt_id=report.attempt_id,
            waiting_session_id=where,
        )
