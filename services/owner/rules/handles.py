"""Child sessions as their parent sees them (docs/design.md §11): handles, what a
child's report means, eligibility for a handoff, budgets given to a child.
Pure: no I/O. The child rules (children.py, reports.py) turn these into
events and context (what the model reads of a child is child_outputs.py);
the run (run/step.py, run/upkeep.py) does the deliveries.

A handle is RUNNING while the child works for the parent (the parent is then
not idle: no handoff), PARKED (a subagent conversation waiting to be
continued) or AVAILABLE (a task-owned child that finished its work and can
be resumed) once its result was applied, and SETTLED once the child
finalized. Parked and available handles are stable addresses only: they
cross a handoff in the snapshot while the child stays on its deployment.

A child reports to its parent with `task_result` commands: the outcome of a
piece of work (COMPLETED, FAILED, CANCELLED), a wait it surfaces (WAITING),
or its finalization (FINALIZED). What a report means depends on the handle:
- the open turn waits for it (a subagent asked in the foreground, a workflow
  tool): its tool call gets the result and the turn goes on (AWAITED);
- a background result: joins the open turn at its next model-call boundary,
  or starts a turn when the parent is idle (ADMIT);
- its turn is gone (cancelled, failed): recorded on the stream only (RECORD);
- a wait: shown on the parent's stream, answered at the child (SURFACE);
- the finalization of a child that was not working: its handle is SETTLED (FINALIZED);
- anything else (an unknown child, another parent's child, a result for work
  that is not running) changes nothing and is rejected with a reason.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits
from baton_runtime.common.errors import Reason

RUNNING = s.HANDLE_STATE_RUNNING
PARKED = s.HANDLE_STATE_PARKED
AVAILABLE = s.HANDLE_STATE_AVAILABLE
SETTLED = s.HANDLE_STATE_SETTLED

OUTCOMES = frozenset({s.TASK_STATUS_COMPLETED, s.TASK_STATUS_FAILED, s.TASK_STATUS_CANCELLED})


class ReportMeaning(enum.Enum):
    """What a child's report does to its parent."""

    AWAITED = "awaited"  # the open turn waits for it: its tool call gets the result
    ADMIT = "admit"  # a background result: joins the open turn, or starts one
    RECORD = "record"  # its turn is gone: on the stream only
    SURFACE = "surface"  # a wait of the child, shown on the parent's stream
    FINALIZED = "finalized"  # a child that was not working finalized
    REJECT = "reject"  # changes nothing; a command.rejected says why


@dataclass(frozen=True)
class ReportReading:
    """A child's report read against its handle: what it means, the handle
    (when one matches) and, for a rejected report, why."""

    meaning: ReportMeaning
    handle: s.ChildHandle | None = None
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class Refusal:
    """Why a tool call cannot give work to a child (the call's error result)."""

    reason: str
    message: str

    def output(self) -> str:
        return f"{self.reason}: {self.message}"


def resting_state(kind: s.TaskKind.ValueType) -> s.HandleState.ValueType:
    """Where a handle rests once its work is done."""
    return PARKED if kind == s.TASK_KIND_SUBAGENT else AVAILABLE


def kind_name(kind: s.TaskKind.ValueType) -> str:
    return s.TaskKind.Name(kind).removeprefix("TASK_KIND_").lower()


class Handles:
    """The handles in one session's snapshot, and the rules over them, in
    order of last use (the least recently used first)."""

    def __init__(self, snapshot: s.SessionSnapshot) -> None:
        self._snapshot = snapshot

    def __iter__(self) -> Iterator[s.ChildHandle]:
        return iter(self._snapshot.handles)

    def find(self, child_session_id: str) -> s.ChildHandle | None:
        for handle in self._snapshot.handles:
            if handle.child_session_id == child_session_id:
                return handle
        return None

    def running(self) -> list[s.ChildHandle]:
        return [h for h in self._snapshot.handles if h.state == RUNNING]

    def busy(self) -> bool:
        """A child works for this session (a running task, an active subagent
        turn or workflow tool, a child waiting on a human): not idle, so a
        delivery from another deployment is processed here (docs/design.md §6)."""
        return any(h.state == RUNNING for h in self._snapshot.handles)

    def awaited(self, turn_id: str) -> list[s.ChildHandle]:
        """The running children the turn `turn_id` waits for."""
        if not turn_id:
            return []
        return [
            h
            for h in self._snapshot.handles
            if h.state == RUNNING and h.tool_call_id and h.turn_id == turn_id and not h.detached
        ]

    # -- giving work -----------------------------------------------------------

    def refuse_start(self, reserved: int = 0) -> Refusal | None:
        """Why no new child can start: every one of the MAX_LIVE_HANDLES
        children the session may hold is running (`reserved`: children given
        work earlier in the same step). An idle one would be evicted."""
        running = sum(1 for h in self._snapshot.handles if h.state == RUNNING) + reserved
        if running >= limits.MAX_LIVE_HANDLES:
            return Refusal(
                Reason.TOO_MANY_TASKS,
                f"this session already has {running} child sessions at work "
                f"(at most {limits.MAX_LIVE_HANDLES})",
            )
        return None

    def evict(self) -> s.ChildHandle | None:
        """Over MAX_LIVE_HANDLES children that are not settled: the least
        recently used idle one (parked or available) is settled here and
        returned, for its child to be finalized."""
        live = [h for h in self._snapshot.handles if h.state != SETTLED]
        if len(live) <= limits.MAX_LIVE_HANDLES:
            return None
        idle = next((h for h in live if h.state in (PARKED, AVAILABLE)), None)
        if idle is None:
            return None
        evicted = s.ChildHandle()
        evicted.CopyFrom(idle)
        self.mark_finalized(idle)
        return evicted

    def _to_end(self, handle: s.ChildHandle) -> s.ChildHandle:
        """Most recently used last (eviction takes the first idle one)."""
        handles = self._snapshot.handles
        keep = [h for h in handles if h.child_session_id != handle.child_session_id]
        moved = s.ChildHandle()
        moved.CopyFrom(handle)
        del handles[:]
        handles.extend(keep)
        handles.append(moved)
        return handles[-1]

    def refuse_continue(
        self, child_session_id: str, reserved: frozenset[str] = frozenset()
    ) -> Refusal | None:
        """Why work cannot be given to the child at `child_session_id` now
        (`reserved`: children given work earlier in the same step)."""
        handle = self.find(child_session_id)
        if handle is None:
            return Refusal(
                Reason.UNKNOWN_TASK, f"no child session {child_session_id!r} of this session"
            )
        if handle.state == RUNNING or child_session_id in reserved:
            return Refusal(
                Reason.TASK_RUNNING,
                f"child session {child_session_id} is still working; wait for its result",
            )
        if handle.state == SETTLED:
            return Refusal(Reason.TASK_SETTLED, f"child session {child_session_id} is finalized")
        return None

    def start(
        self,
        child_session_id: str,
        kind: s.TaskKind.ValueType,
        name: str,
        deployment_id: str,
        turn_id: str,
        tool_call_id: str,
    ) -> s.ChildHandle:
        """A new child, given its first work (work 1); `tool_call_id` when
        the turn waits for its result."""
        handle = self.find(child_session_id)
        if handle is None:
            handle = self._snapshot.handles.add(
                child_session_id=child_session_id,
                kind=kind,
                name=name,
                deployment_id=deployment_id,
            )
        handle.state = RUNNING
        handle.work = 1
        handle.turn_id = turn_id
        handle.tool_call_id = tool_call_id
        handle.detached = handle.waiting = False
        return handle

    def give_work(self, handle: s.ChildHandle, turn_id: str, tool_call_id: str) -> s.ChildHandle:
        """A parked or available child, given its next work."""
        handle = self._to_end(handle)
        handle.state = RUNNING
        handle.work += 1
        handle.turn_id = turn_id
        handle.tool_call_id = tool_call_id
        handle.detached = handle.waiting = False
        return handle

    # -- reports ---------------------------------------------------------------

    def read_report(
        self, session_id: str, turn_id: str, report: s.TaskResultCommand
    ) -> ReportReading:
        """What `report` means for this session, whose open turn is `turn_id`."""
        child = report.child_session_id
        if report.parent_session_id and report.parent_session_id != session_id:
            return ReportReading(
                ReportMeaning.REJECT,
                reason=Reason.NOT_OUR_TASK,
                message=f"child session {child} reports to session "
                f"{report.parent_session_id}, not to this one",
            )
        handle = self.find(child)
        if handle is None:
            return ReportReading(
                ReportMeaning.REJECT,
                reason=Reason.UNKNOWN_TASK,
                message=f"this session never started child session {child!r}",
            )
        status = report.status
        if status == s.TASK_STATUS_FINALIZED:
            if handle.state == SETTLED:
                return ReportReading(
                    ReportMeaning.REJECT,
                    handle,
                    Reason.TASK_SETTLED,
                    f"child session {child} is settled already",
                )
            if handle.state != RUNNING:
                return ReportReading(ReportMeaning.FINALIZED, handle)
            return ReportReading(self._outcome(handle, turn_id), handle)
        running = handle.state == RUNNING and report.work == handle.work
        if status == s.TASK_STATUS_WAITING and running:
            return ReportReading(ReportMeaning.SURFACE, handle)
        if status not in OUTCOMES and status != s.TASK_STATUS_WAITING:
            return ReportReading(
                ReportMeaning.REJECT, handle, Reason.INVALID_FIELD, f"unknown task status {status}"
            )
        if not running:
            return ReportReading(
                ReportMeaning.REJECT,
                handle,
                Reason.TASK_NOT_RUNNING,
                f"child session {child} has no running work {report.work} "
                f"(its handle is {s.HandleState.Name(handle.state)}, work {handle.work})",
            )
        return ReportReading(self._outcome(handle, turn_id), handle)

    def _outcome(self, handle: s.ChildHandle, turn_id: str) -> ReportMeaning:
        if handle.detached:
            return ReportMeaning.RECORD
        if handle.tool_call_id:
            return (
                ReportMeaning.AWAITED
                if handle.turn_id == turn_id and turn_id
                else ReportMeaning.RECORD
            )
        return ReportMeaning.ADMIT

    def finish(self, handle: s.ChildHandle, report: s.TaskResultCommand) -> None:
        """The running work is done (its result is being applied)."""
        add_usage(handle.usage, report.usage)
        handle.state = (
            SETTLED if report.status == s.TASK_STATUS_FINALIZED else resting_state(handle.kind)
        )
        handle.tool_call_id = ""
        handle.detached = handle.waiting = False

    def mark_finalized(self, handle: s.ChildHandle) -> None:
        """The child finalized (`handle` is not to be used after this)."""
        handle.state = SETTLED
        handle.tool_call_id = ""
        handle.detached = handle.waiting = False
        self._to_end(handle)
        self.prune()

    # -- the parent's turn ends ------------------------------------------------

    def detach(self, turn_id: str) -> list[s.ChildHandle]:
        """The turn `turn_id` was cancelled: the children it gave work and
        that still run are to be cancelled; their results will be recorded,
        not admitted. Returns them."""
        cancelled = []
        for handle in self._snapshot.handles:
            if handle.state == RUNNING and handle.turn_id == turn_id and not handle.detached:
                handle.detached = True
                cancelled.append(handle)
        return cancelled

    def finalize_all(self) -> list[s.ChildHandle]:
        """The session finalizes: every child that is not settled yet is to
        be finalized too. Returns them (settled here)."""
        ending = [h for h in self._snapshot.handles if h.state != SETTLED]
        for handle in ending:
            handle.state = SETTLED
            handle.tool_call_id = ""
            handle.detached = True
        return ending

    def prune(self) -> None:
        """Keep the snapshot bounded: only the latest settled handles stay
        (a report of a forgotten one is rejected as UNKNOWN_TASK)."""
        settled = [h for h in self._snapshot.handles if h.state == SETTLED]
        extra = len(settled) - limits.MAX_SETTLED_HANDLES
        if extra <= 0:
            return
        drop = {h.child_session_id for h in settled[:extra]}
        kept = [h for h in self._snapshot.handles if h.child_session_id not in drop]
        del self._snapshot.handles[:]
        self._snapshot.handles.extend(kept)


# -- budgets -------------------------------------------------------------------


def child_control(
    parent_session_id: str, reason: str, *, cancel_work: int | None = None
) -> s.Command:
    """The one builder of a parent's controls for a child: a reset, or with
    `cancel_work` a cancel of that piece of work. The delivery id is derived
    from the parent (and the work cancelled), so a control sent again after
    a crash is appended to the child's inbox once."""
    if cancel_work is not None:
        return s.Command(
            delivery=s.DeliveryMetadata(delivery_id=f"cancel:{parent_session_id}:{cancel_work}"),
            cancel=s.CancelCommand(reason=reason),
        )
    return s.Command(
        delivery=s.DeliveryMetadata(delivery_id=f"reset:{parent_session_id}"),
        reset=s.ResetCommand(reason=reason),
    )


def add_usage(total: s.Usage, step: s.Usage) -> None:
    total.input_tokens += step.input_tokens
    total.output_tokens += step.output_tokens
    total.model_calls += step.model_calls
    total.cost_micros += step.cost_micros


def child_budget(snapshot: s.SessionSnapshot, step: s.Usage | None = None) -> tuple[int, int]:
    """(token budget, cost budget) of a new child: what the parent has left
    after its session usage and the running `step` (0 = unlimited, as the
    parent's). Everything the child spends is added to the parent's usage
    when its result arrives."""
    limits_ = snapshot.limits
    usage = s.Usage()
    usage.CopyFrom(snapshot.usage)
    if step is not None:
        add_usage(usage, step)
    tokens = 0
    if limits_.token_budget:
        used = usage.input_tokens + usage.output_tokens
        tokens = max(1, limits_.token_budget - used)
    cost = 0
    if limits_.cost_budget_micros:
        cost = max(1, limits_.cost_budget_micros - usage.cost_micros)
    return tokens, cost
