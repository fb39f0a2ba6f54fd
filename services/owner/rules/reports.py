"""What a child session owes its parent (docs/design.md §11): the outcome of
each turn that its parent's work started, the waits it (or a descendant)
pauses on, and its finalization, as reports in its snapshot's outbox. The
run delivers them after the commit that holds them (upkeep.py); delivery
ids derived from the child and the report make a repeat harmless. Functions
over `SessionState` (held.py); in a session that is not a child they do
nothing. Pure: no I/O.
"""

from __future__ import annotations

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits
from baton_runtime.common.errors import Reason
from baton_runtime.owner.rules import handles as h
from baton_runtime.owner.rules.held import SessionState


def _report(
    state: SessionState, status: s.TaskStatus.ValueType, key: str, **fields: object
) -> None:
    link = state.snapshot.parent
    report = s.TaskResultCommand(
        task_delivery_id=key,
        child_session_id=state.identity.fence.session_id,
        parent_session_id=link.parent_session_id,
        status=status,
        deployment_id=state.identity.deployment_id,
        # Only the fields given a value; `fields` are keywords of the message,
        # which the stub types one by one (a dict of objects cannot match).
        **{k: v for k, v in fields.items() if v},  # type: ignore[arg-type]
    )
    link.outbox.append(report)


def report_work(
    state: SessionState,
    kind: s.EventKind.ValueType,
    error: s.ErrorDetail | None,
    usage: s.Usage,
) -> None:
    """A turn of a child settled (`kind`): report the outcome of the
    parent's work it served, if any."""
    link = state.snapshot.parent
    if not state.is_child or not link.work:
        return
    work = link.work
    link.work = 0
    turn = state.snapshot.open_turn
    steps = turn.steps + turn.child_steps if state.turn_open else 0
    key = f"task:{state.identity.fence.session_id}:{work}"
    if kind == s.EVENT_KIND_TURN_COMPLETED:
        answer = state.answer
        if len(answer.encode()) > limits.MAX_TASK_RESULT_BYTES:
            error = s.ErrorDetail(
                reason=Reason.TASK_RESULT_TOO_LARGE,
                message=f"the answer is {len(answer.encode())} bytes; a result may have "
                f"{limits.MAX_TASK_RESULT_BYTES} (the whole answer is on session "
                f"{state.identity.fence.session_id}'s stream)",
            )
            _report(
                state, s.TASK_STATUS_FAILED, key, work=work, error=error, usage=usage, steps=steps
            )
            return
        _report(
            state, s.TASK_STATUS_COMPLETED, key, work=work, result=answer, usage=usage, steps=steps
        )
    elif kind == s.EVENT_KIND_TURN_CANCELLED:
        cancelled = s.ErrorDetail(reason=Reason.CANCELLED, message="the work was cancelled")
        _report(
            state,
            s.TASK_STATUS_CANCELLED,
            key,
            work=work,
            error=cancelled,
            usage=usage,
            steps=steps,
        )
    else:
        failed = error or s.ErrorDetail(reason=Reason.INTERNAL, message="the work failed")
        _report(state, s.TASK_STATUS_FAILED, key, work=work, error=failed, usage=usage, steps=steps)


def unreport_refused(state: SessionState) -> None:
    """A refused commit settled the turn that served the parent's work:
    take back the outcome it reported (never committed) so the turn's
    failure is reported instead."""
    link = state.snapshot.parent
    kept = []
    for report in link.outbox:
        fresh = report.task_delivery_id not in state.last_commit.reports
        if fresh and report.status in h.OUTCOMES:
            link.work = report.work
        else:
            kept.append(report)
    if len(kept) != len(link.outbox):
        del link.outbox[:]
        link.outbox.extend(kept)


def report_wait(
    state: SessionState, *, request: s.InputRequest | None = None, attempt_id: str = ""
) -> None:
    """The open turn waits for the user (`request`) or a sign-in (`attempt_id`)."""
    if not state.is_child:
        return
    sid = state.identity.fence.session_id
    _report(
        state,
        s.TASK_STATUS_WAITING,
        f"wait:{sid}:{attempt_id or (request.request_id if request else '')}",
        work=state.snapshot.parent.work,
        input_request=request,
        attempt_id=attempt_id,
        waiting_session_id=sid,
    )


def report_descendant_wait(state: SessionState, report: s.TaskResultCommand, where: str) -> None:
    """A descendant (`where`) waits on a human: this child reports the
    wait to its parent in turn."""
    _report(
        state,
        s.TASK_STATUS_WAITING,
        f"wait:{state.identity.fence.session_id}:{where}:"
        f"{report.attempt_id or report.input_request.request_id}",
        work=state.snapshot.parent.work,
        input_request=report.input_request,
        attempt_id=report.attempt_id,
        waiting_session_id=where,
    )


def report_finalized(state: SessionState, error: s.ErrorDetail | None) -> None:
    """The child session finalized (reset, its timeout, its parent's end)."""
    if not state.is_child:
        return
    sid = state.identity.fence.session_id
    reason = error.reason if error is not None else Reason.RESET
    _report(
        state,
        s.TASK_STATUS_FINALIZED,
        f"final:{sid}",
        error=s.ErrorDetail(reason=reason, message=f"child session {sid} finalized"),
    )


def delivered_uncommitted(state: SessionState) -> bool:
    """Reports delivered since the last commit, which still lists them: a
    run that stops now (parks) must commit first, or the next run sends
    them again, and a repeat after the delivery ids' window would be
    appended anew."""
    outbox = {report.task_delivery_id for report in state.snapshot.parent.outbox}
    return bool(state.last_commit.reports - outbox)
