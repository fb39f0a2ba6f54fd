"""A session program: one owner run of one session.

The run reads the session's inbox continuously (a server stream from hooks),
takes commands in inbox order, runs turns of steps, and commits each step
through anchor as one fenced transaction: the step's events, the history
entries it appended and the new snapshot, whose inbox position says which
commands the step consumed. What commands and steps mean is decided by the
pure turn rules (`services.owner.turns.SessionState`); this module does the
I/O: the inbox, the model and tool calls, commits, the timer, parking,
handoffs, and child sessions (work given in a step reaches the child before
the step commits; cancels and resets for children before the commit that
decides them; a child's reports reach its parent after the commit that
makes them, or before it when the child finalizes).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import json
import time
from collections.abc import Awaitable, Callable, Sequence

import structlog

from baton.session.v1 import session_pb2 as s
from services.common import failpoints, ids, metrics
from services.common.clients import AnchorClient, HooksClient
from services.common.errors import (
    Aborted,
    BatonError,
    Fenced,
    InvalidArgument,
    Reason,
    ResourceExhausted,
)
from services.owner import handles as h
from services.owner import spans  # tracing
from services.owner.agent import (
    Agent,
    ModelRejected,
    Tool,
    ToolContext,
)
from services.owner.checkpoint import Checkpoint
from services.owner.child_rules import ChildWork
from services.owner.children import Children
from services.owner.commit import commit_step
from services.owner.handles import Refusal, Verdict
from services.owner.held import RunIdentity, make_event
from services.owner.metering import TurnMeter, waited
from services.owner.spans import RunSpans  # tracing
from services.owner.turns import (
    SNAPSHOT_FORMAT,
    Admission,
    Outcome,
    SessionState,
    StepProgress,
    initial_snapshot,
    safe_error,
    usage_of,
)

__all__ = [
    "SNAPSHOT_FORMAT",
    "RunExit",
    "RunIdentity",
    "SessionRun",
    "commit_step",
    "initial_snapshot",
    "make_event",
    "safe_error",
]

log = structlog.get_logger("baton.owner.session")


class RunExit(enum.Enum):
    """Why a run ended."""

    FENCED = "fenced"
    FINALIZED = "finalized"
    PARKED = "parked"
    HANDED_OFF = "handed_off"
    FAILED = "failed"


HandOff = Callable[[Checkpoint, s.InboxEntry], Awaitable[bool]]
"""Tries to move a run's session to the deployment that accepted a trigger."""

Drain = Callable[[Checkpoint, str], Awaitable[bool]]
"""Tries to move a run's idle session to an operator's drain target."""

DRAIN_RETRY_SECONDS = 2.0


class _CommitRefused(Exception):
    """A commit that can never succeed as it is (docs/failures.md)."""

    def __init__(
        self, reason: str, message: str, close: bool, events: list[s.Event], carry: list[s.Event]
    ) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.close = close
        self.events = events
        self.carry = carry


class _RunEnded(Exception):
    def __init__(self, exit: RunExit) -> None:
        super().__init__(exit.value)
        self.exit = exit


class SessionRun:
    """Executes one session for one owner run until fenced, finalized, parked
    or handed off."""

    def __init__(
        self,
        identity: RunIdentity,
        snapshot: s.SessionSnapshot,
        agent: Agent,
        hooks: HooksClient,
        anchor: AnchorClient,
        on_exit: Callable[[SessionRun, RunExit], None] | None = None,
        *,
        park_after: float | None = None,
        clock: Callable[[], float] = time.time,
        snapshot_revision: int | None = None,
        hand_off: HandOff | None = None,
        seed: Sequence[s.InboxEntry] = (),
        handoff_id: str = "",
        context: Sequence[s.ChatMessage] = (),
        drain: Drain | None = None,
        drain_to: str = "",
        children: Children | None = None,
        subagents: Callable[[str], Agent | None] | None = None,
        unstarted: bool = False,
    ) -> None:
        self.identity = identity
        self.state = SessionState(identity, snapshot, agent, context)
        self.agent = agent
        self._children = children
        self._subagent = subagents or agent.subagent
        self._delivering: asyncio.Task[None] | None = None
        self._hooks = hooks
        self._anchor = anchor
        self._on_exit = on_exit
        self._park_after = park_after
        self._clock = clock
        self._snapshot_revision = snapshot_revision
        self._committed_snapshot = snapshot.SerializeToString()
        # The inbox position of this run's last commit: the next commit
        # deletes the entries consumed since (its first, every one below:
        # also any an older version left behind).
        self._committed_inbox: int | None = None
        self.progressed = False  # a commit of this run succeeded
        self.failure: BaseException | None = None  # why the run failed, when it did
        # `seed`: inbox entries already read (a handoff's trigger), ahead of the stream.
        self._pending: collections.deque[s.InboxEntry] = collections.deque(seed)
        self._next_seq = max(snapshot.inbox_next_seq, seed[-1].seq + 1 if seed else 0)
        self._unstarted = unstarted  # session.started goes with the first commit
        self._arrived = asyncio.Event()
        self._reader_exit: RunExit | None = None
        self._step_task: asyncio.Task[None] | None = None
        self._abort_requested = False
        self._timer: asyncio.Task[None] | None = None
        self._retiring: asyncio.Task[None] | None = None
        self._hand_off = hand_off
        self._idle = False  # waiting for a command with nothing pending and no open turn
        self._trigger_seq = -1  # the delivery found eligible for a handoff at arrival
        self._carry: list[s.Event] = []  # events for the next commit
        self._handoff_id = handoff_id  # the handoff that started this run, if one did
        self._drain = drain
        self.drain_to = drain_to  # an operator's drain target ("" = none)
        self._drain_after = 0.0  # monotonic time of the next drain attempt
        self.drained = False  # the run ended because a drain moved the session
        self._turns = TurnMeter()
        self._spans = RunSpans(identity.fence.session_id, identity.fence.owner_run_id)  # tracing
        for entry in seed:
            self._spans.arrived(entry)  # tracing
        self._log = log.bind(
            session_id=identity.fence.session_id,
            run_id=identity.fence.owner_run_id,
            epoch=identity.fence.epoch,
            deployment_id=identity.deployment_id,
        )

    @property
    def snapshot(self) -> s.SessionSnapshot:
        return self.state.snapshot

    @property
    def session_id(self) -> str:
        return self.identity.fence.session_id

    @property
    def run_id(self) -> str:
        return self.identity.fence.owner_run_id

    @property
    def snapshot_revision(self) -> int | None:
        """The mod revision of the last committed snapshot, when known."""
        return self._snapshot_revision

    @property
    def pending(self) -> int:
        """Inbox entries read and not processed yet."""
        return len(self._pending)

    def oldest_pending_accepted(self) -> float | None:
        """When the oldest entry read and not processed yet was accepted
        (epoch seconds), or None."""
        if not self._pending or not self._pending[0].HasField("accepted_at"):
            return None
        accepted = self._pending[0].accepted_at
        return accepted.seconds + accepted.nanos / 1e9

    # -- the program ------------------------------------------------------

    async def run(self) -> RunExit:
        exit = RunExit.FAILED
        reader = asyncio.get_running_loop().create_task(self._read_inbox())
        state = self.state
        try:
            if self.agent.on_load is not None:
                # Authored code sees the session first; if it raises, the run
                # fails and counts against the host's restart budget.
                self.agent.on_load(self.snapshot)
            self._start_retire()
            if self._unstarted:
                self._carry.append(state.event(s.EVENT_KIND_SESSION_STARTED))
            arrived_from = self.snapshot.deployment_id
            handed_off = bool(arrived_from) and arrived_from != self.identity.deployment_id
            if handed_off:
                # First run on this deployment after a handoff: say so on the
                # stream (with the first commit here) and restart the timeout.
                self._carry.append(
                    state.event(
                        s.EVENT_KIND_SESSION_HANDED_OFF,
                        text=arrived_from,
                        handoff_id=self._handoff_id,
                    )
                )
            self._arm_timeout(restart=handed_off)
            if handed_off and not self._pending:
                # Moved by a drain or an adoption (no trigger in hand): say so
                # on the stream now, not with whatever comes next.
                await self._guarded(self._commit([]))
            self._deliver_reports()  # a predecessor's, if it could not
            if state.turn_open and not state.still_waiting():
                # Recovery: the step in flight at the predecessor's crash runs again.
                turn = self.snapshot.open_turn
                self._log.info("continuing open turn", turn_id=turn.turn_id, steps=turn.steps)
                with self._spans.process(state, None):  # tracing
                    await self._guarded(self._turn_loop([]))
            while self.snapshot.status != s.SESSION_STATUS_FINALIZED:
                if self._drain_due() and await self._try_drain():
                    exit = RunExit.HANDED_OFF
                    return exit
                entry = await self._take(self._park_after)
                if entry is None:
                    if self._drain_due():
                        continue
                    if await self._try_park():
                        exit = RunExit.PARKED
                        return exit
                    continue
                if entry.seq == self._trigger_seq:
                    self._trigger_seq = -1
                    if not self._pending and await self._try_hand_off(entry):
                        exit = RunExit.HANDED_OFF
                        return exit
                waited(entry)  # (a trigger handed off is dispatched, and counted, there)
                with self._spans.process(state, entry):  # tracing
                    await self._guarded(self._dispatch(entry))
                if self.snapshot.status != s.SESSION_STATUS_FINALIZED:
                    await self._guarded(self._compact_if_over_budget())
            await self._retired()
            exit = RunExit.FINALIZED
        except _RunEnded as ended:
            exit = ended.exit
        except Fenced:
            self._log.info("fenced; run ends")
            exit = RunExit.FENCED
        except BatonError as exc:
            self._log.error("run failed", reason=exc.reason, error=exc.message)
            self.failure = exc
            exit = RunExit.FAILED
        except Exception as exc:  # noqa: BLE001 - authored or owner code: the host restarts
            self._log.exception("run crashed")
            self.failure = exc
            exit = RunExit.FAILED
        finally:
            reader.cancel()
            for task in (self._timer, self._retiring, self._delivering):
                if task is not None:
                    task.cancel()
            if self._on_exit is not None:
                self._on_exit(self, exit)
        return exit

    async def _take(self, idle_s: float | None) -> s.InboxEntry | None:
        """The next inbox entry; None after `idle_s` with nothing (park), or
        when a drain attempt is due."""
        self._idle = not self.state.turn_open
        try:
            while not self._pending:
                if self._reader_exit is not None:
                    raise _RunEnded(self._reader_exit)
                if self._drain_due():
                    return None
                self._arrived.clear()
                wait = idle_s
                retry = self._drain_wait()
                if retry is not None:
                    wait = retry if wait is None else min(wait, retry)
                try:
                    await asyncio.wait_for(self._arrived.wait(), wait)
                except TimeoutError:
                    if not self._drain_due():
                        return None
            return self._pending.popleft()
        finally:
            self._idle = False

    # -- drain (issue 12) ---------------------------------------------------------

    def request_drain(self, target: str) -> None:
        """An operator drains this deployment to `target`: the session moves
        there through the ordinary handoff the next time it is idle."""
        self.drain_to = target
        self._drain_after = 0.0
        self._arrived.set()

    def _drain_wait(self) -> float | None:
        """Seconds until a drain attempt is due; None while none can be (no
        drain, or the session is not idle: an open turn, something pending)."""
        if (
            not self.drain_to
            or self._drain is None
            or self._pending
            or self.state.turn_open
            or self.state.handles.busy()  # a child works for it: moves when it is done
            or self.snapshot.status != s.SESSION_STATUS_ACTIVE
        ):
            return None
        return max(0.0, self._drain_after - time.monotonic())

    def _drain_due(self) -> bool:
        return self._drain_wait() == 0.0

    async def _try_drain(self) -> bool:
        assert self._drain is not None
        self._drain_after = time.monotonic() + DRAIN_RETRY_SECONDS
        try:
            with self._spans.handoff(None, self.drain_to):  # tracing
                moved = await self._drain(self._checkpoint(), self.drain_to)
        except Fenced:
            raise
        except BatonError as exc:
            self._log.warning("drain attempt failed", reason=exc.reason, error=exc.message)
            if exc.retryable:
                raise  # outcome unknown: run again from the snapshot
            return False
        self.drained = moved
        return moved

    def _checkpoint(self) -> Checkpoint:
        context = self.state.context
        return Checkpoint(
            fence=self.identity.fence,
            revision=self._snapshot_revision,
            snapshot=self._committed_snapshot,
            context=context.committed_messages(),
            context_bytes=context.committed_log.context_bytes,
            settle=self.commit_checkpoint,
        )

    async def _read_inbox(self) -> None:
        """Buffer the inbox in seq order; reconnect on transient errors."""
        backoff = 0.05
        while True:
            try:
                async for page in self._hooks.stream_inbox(self.identity.fence, self._next_seq):
                    for entry in page:
                        if entry.seq >= self._next_seq:
                            self._arrive(entry)
                    self._arrived.set()
                    backoff = 0.05
            except Fenced:
                self._reader_exit = RunExit.FENCED
                self._arrived.set()
                return
            except BatonError as exc:
                if not exc.retryable:
                    self._log.error("inbox stream failed", reason=exc.reason, error=exc.message)
                    self._reader_exit = RunExit.FAILED
                    self._arrived.set()
                    return
                self._log.warning("inbox stream interrupted; reconnecting", reason=exc.reason)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _arrive(self, entry: s.InboxEntry) -> None:
        self._next_seq = entry.seq + 1
        self._spans.arrived(entry)  # tracing
        if self._idle and not self._pending and self._is_trigger(entry):
            self._trigger_seq = entry.seq
        self._pending.append(entry)
        self._push(entry)

    def offer(self, entry: s.InboxEntry) -> None:
        """An entry appended to this session's inbox by this process (a
        child's work or report): taken now when it is the next one, instead
        of a hop later from the inbox stream, which then skips it."""
        if entry.seq == self._next_seq and self._reader_exit is None:
            self._arrive(entry)
            self._arrived.set()

    # -- handoff (DESIGN.md §6) ------------------------------------------------

    def _is_trigger(self, entry: s.InboxEntry) -> bool:
        """Evaluated once, when the delivery arrives while the session is idle
        (no open turn: no step, pending input or sign-in; nothing pending) and
        before it is buffered or applied. Only a conversational send accepted
        by another deployment qualifies; everything else — input responses,
        results, cancel, reset, clear, compact — never does."""
        if self._hand_off is None or self._snapshot_revision is None:
            return False  # unknown eligibility: skip
        if not self.state.idle_for_handoff():
            return False  # a child works for it (or it is a child): not idle
        command = entry.command
        if command.WhichOneof("kind") != "send":
            return False
        send = command.send
        accepted = command.delivery.accepted_deployment_id
        return (
            bool(send.text.strip())
            and not send.input_responses
            and bool(accepted)
            and accepted != self.identity.deployment_id
            and self.snapshot.status == s.SESSION_STATUS_ACTIVE
        )

    async def _try_hand_off(self, entry: s.InboxEntry) -> bool:
        """The trigger is the only unprocessed command: try to move the
        session. False (skipped or failed) leaves nothing behind; the
        delivery is then processed here and the signal forgotten."""
        assert self._hand_off is not None
        try:
            target = entry.command.delivery.accepted_deployment_id
            with self._spans.handoff(entry, target):  # tracing
                return await self._hand_off(self._checkpoint(), entry)
        except Fenced:
            raise
        except BatonError as exc:
            self._log.warning(
                "handoff failed",
                reason=exc.reason,
                error=exc.message,
                inbox_seq=entry.seq,
                to_deployment_id=entry.command.delivery.accepted_deployment_id,
            )
            if exc.retryable:
                raise  # outcome unknown: run again from the snapshot
            return False

    def _push(self, entry: s.InboxEntry) -> None:
        """Cancel, reset and an own timeout abort the running step at once,
        when every command before them can be admitted into the turn."""
        task = self._step_task
        if task is None or task.done():
            return
        if self.state.aborts_step(entry, list(self._pending)[:-1]):
            self._abort_requested = True
            task.cancel()

    async def _try_park(self) -> bool:
        if self._park_after is None or self._pending or self._reports_pending():
            return False
        # Still idle while parking: an arrival that fails the park is
        # evaluated as a handoff trigger like any other.
        self._idle = not self.state.turn_open
        try:
            await self._hooks.set_parked(self.identity.fence, True, self.snapshot.inbox_next_seq)
        except Aborted:
            return False  # something arrived; the stream will deliver it
        finally:
            self._idle = False
        self._log.debug("parked", inbox_next_seq=self.snapshot.inbox_next_seq)
        return True

    # -- dispatch -------------------------------------------------------------

    async def _dispatch(self, entry: s.InboxEntry) -> None:
        state = self.state
        command = entry.command
        kind = command.WhichOneof("kind")
        if kind == "send":
            if command.send.input_responses:
                await self._answer_inputs(entry)
            elif not command.send.text.strip() or state.refuses_message(entry):
                await self._reject(entry)
            elif state.turn_open:
                events = state.abandon_waits()
                state.admit_message(entry, events)
                if state.still_waiting():  # for children: the model sees it with their results
                    await self._commit(events)
                else:
                    await self._turn_loop(events)
            else:
                await self._turn_loop(state.start_turn(entry, self._pending))
        elif kind == "cancel":
            if state.turn_open:
                state.consume(entry)
                cancelled: list[s.Event] = []
                state.settle(cancelled, s.EVENT_KIND_TURN_CANCELLED, entry=entry)
                await self._commit(cancelled)
            else:
                await self._reject(entry, Reason.NOTHING_TO_CANCEL, "no turn is running")
        elif kind == "reset":
            await self._finalize([], entry)
        elif kind == "timeout":
            if state.classify(entry) is Admission.FINALIZE:
                await self._finalize([], entry, error=s.ErrorDetail(reason=Reason.TIMEOUT))
            else:
                state.consume(entry)  # a predecessor's timer: ignored
                await self._commit([])
        elif kind == "clear":
            await self._commit(state.clear(entry))
        elif kind == "compact":
            events = state.cancel_waiting_turn(entry)
            state.consume(entry)
            await self._summarize(events, entry)
        elif kind == "authorization_callback":
            await self._authorization_callback(entry)
        elif kind == "task_result":
            await self._task_result(entry)
        else:
            await self._reject(entry)

    async def _task_result(self, entry: s.InboxEntry) -> None:
        """A child's report, between steps (see handles.py for what it means)."""
        state = self.state
        judgement = state.judge(entry)
        if judgement.verdict is Verdict.REJECT:
            await self._reject(entry, judgement.reason, judgement.message)
            return
        if judgement.verdict is Verdict.ADMIT and not state.turn_open:
            await failpoints.hit("children.apply_result")
            await self._turn_loop(state.start_turn(entry, self._pending))
            return
        await failpoints.hit("children.apply_result")
        events: list[s.Event] = []
        verdict = state.apply_report(entry, events)
        goes_on = verdict in (Verdict.AWAITED, Verdict.ADMIT)
        if goes_on and state.turn_open and not state.still_waiting():
            await self._turn_loop(events)
        else:
            await self._commit(events)

    async def _reject(self, entry: s.InboxEntry, reason: str = "", message: str = "") -> None:
        self.state.consume(entry)
        event = self.state.rejection(entry, reason, message)
        self._log.info("command rejected", reason=event.error.reason, inbox_seq=entry.seq)
        await self._commit([event])

    # -- turns --------------------------------------------------------------

    async def _turn_loop(self, events: list[s.Event]) -> None:
        state = self.state
        while True:
            verdict, stop = state.admit_pending(self._pending, events)
            if verdict is Admission.CANCEL:
                state.settle(events, s.EVENT_KIND_TURN_CANCELLED, entry=stop)
                await self._commit(events)
                return
            if verdict is Admission.FINALIZE:
                assert stop is not None
                is_timeout = stop.command.WhichOneof("kind") == "timeout"
                error = s.ErrorDetail(reason=Reason.TIMEOUT) if is_timeout else None
                await self._finalize(events, stop, error=error)
                return
            max_steps = state.max_steps()
            if state.steps_taken() >= max_steps:
                message = f"the turn reached {max_steps} steps"
                error = s.ErrorDetail(reason=Reason.MAX_STEPS, message=message)
                state.settle(events, s.EVENT_KIND_TURN_FAILED, error=error)
                await self._commit(events)
                return
            if state.budget_spent():
                state.ask_to_extend_budget(events)
                await self._commit(events)
                return
            progress = await self._run_step()
            outcome = state.apply_step(progress, events)
            if outcome is Outcome.ABORTED:
                continue  # the boundary finds the pushed command
            if outcome is Outcome.FAILED:
                error = s.ErrorDetail(reason=progress.reason, message=progress.error)
                state.settle(events, s.EVENT_KIND_TURN_FAILED, error=error)
                await self._commit(events)
                return
            if outcome in (Outcome.PAUSED, Outcome.AWAITING):
                if state.waiting_for_user():
                    events.append(state.event(s.EVENT_KIND_SESSION_WAITING))
                await self._commit(events)
                return
            if outcome is Outcome.FINAL and not state.steer_pending(self._pending):
                state.settle(events, s.EVENT_KIND_TURN_COMPLETED)
                await self._commit(events)
                return
            await self._commit(events)
            events = []

    async def _run_step(self) -> StepProgress:
        """One model call plus the tools it asks for, abortable by a push."""
        progress = StepProgress()
        metrics.STEPS.inc()
        self._abort_requested = False
        self._step_task = asyncio.get_running_loop().create_task(self._execute(progress))
        try:
            await self._step_task
        except asyncio.CancelledError:
            if not self._abort_requested:
                raise
            progress.aborted = True
        finally:
            self._step_task = None
            self._abort_requested = False
        return progress

    async def _execute(self, progress: StepProgress) -> None:
        state = self.state
        try:
            with metrics.MODEL_CALL_SECONDS.time(), spans.model_call():  # tracing
                reply = await self.agent.model.complete(
                    self.agent.instructions, state.context.messages, self.agent.all_tools
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - authored code: any failure fails the turn
            self._log.warning("model call failed", error=repr(exc), turn_id=state.turn_id)
            progress.error = safe_error(exc)
            if isinstance(exc, ModelRejected):
                progress.reason = Reason.MODEL_REJECTED
            return
        progress.reply = reply
        progress.calls = state.tool_calls(reply)
        for index, call in enumerate(progress.calls):
            if state.starts_child(call):
                await self._start_child_work(progress, index, call, usage_of(reply))
            elif state.runs_now(call):
                progress.results[index] = await self._call_tool(call)

    async def _start_child_work(
        self, progress: StepProgress, index: int, call: s.ToolCall, step: s.Usage
    ) -> None:
        """Give a child its work. Not abortable half-way: a child that got
        its work is recorded (then a cancel cancels it), so none is orphaned."""
        reserved = frozenset(w.child_session_id for w in progress.children.values())
        task = asyncio.ensure_future(self._give_work(call, reserved, step))
        try:
            outcome = await asyncio.shield(task)
        except asyncio.CancelledError:
            outcome = await task
            self._record_child_work(progress, index, call, outcome)
            raise
        self._record_child_work(progress, index, call, outcome)

    def _record_child_work(
        self, progress: StepProgress, index: int, call: s.ToolCall, outcome: ChildWork | Refusal
    ) -> None:
        if isinstance(outcome, ChildWork):
            progress.children[index] = outcome
        else:
            progress.results[index] = s.ToolResult(
                tool_call_id=call.id, name=call.name, output=outcome.output(), is_error=True
            )

    async def _give_work(
        self, call: s.ToolCall, reserved: frozenset[str], step: s.Usage
    ) -> ChildWork | Refusal:
        """Start a child (or pick a parked or available one) and put the work
        in its inbox; or say why not (the call's error result)."""
        children = self._children
        if children is None:
            return Refusal(Reason.UNSUPPORTED_COMMAND, "this owner cannot start child sessions")
        plan = self.state.plan_child_work(
            call, reserved, step, lambda name: self._subagent(name) is not None
        )
        if isinstance(plan, Refusal):
            return plan
        child = plan.work.child_session_id
        delivered = False
        try:
            if plan.link is not None:
                delivered = await children.start(
                    child, self.snapshot.channel, plan.link, plan.command
                )
            if not delivered:
                await children.send(child, plan.command)
        except BatonError as exc:
            if exc.retryable:
                raise  # the run starts again from its last commit; the child is derived
            if exc.reason in (Reason.SESSION_FINALIZED, Reason.SESSION_NOT_FOUND):
                return Refusal(Reason.TASK_SETTLED, f"child session {child}: {exc.message}")
            # Never succeeds as asked (e.g. the work is over the command limit):
            # the model sees why.
            return Refusal(exc.reason, exc.message)
        self._log.info(
            "child given work",
            child_session_id=child,
            work=plan.command.send.parent_work,
            kind=h.kind_name(plan.work.kind),
        )
        return plan.work

    async def _call_tool(self, call: s.ToolCall) -> s.ToolResult:
        tool: Tool | None = self.agent.tool_index.get(call.name)
        result = s.ToolResult(tool_call_id=call.id, name=call.name)
        if tool is None:
            metrics.TOOL_CALL_SECONDS.labels("unknown").observe(0.0)
            result.output, result.is_error = f"unknown tool {call.name!r}", True
            return result
        start = time.perf_counter()
        try:
            arguments = json.loads(call.arguments_json)
            with spans.tool_call(call):  # tracing
                result.output = await tool.run(arguments, self._tool_context())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - authored code: the model sees the error
            # Public too (tool_call.result): the type and a bounded prefix.
            result.output, result.is_error = safe_error(exc), True
        outcome = "error" if result.is_error else "ok"
        metrics.TOOL_CALL_SECONDS.labels(outcome).observe(time.perf_counter() - start)
        return result

    def _tool_context(self) -> ToolContext:
        return ToolContext(
            session_id=self.session_id,
            deployment_id=self.identity.deployment_id,
            owner_run_id=self.run_id,
            channel=self.snapshot.channel,
            add_alias=self._add_alias,
        )

    async def _add_alias(self, token: str) -> None:
        """Claimed durably (fenced) before the step that adds it commits."""
        hooks = await self._hooks.claim(self.identity.fence, [token])
        del self.snapshot.hooks[:]
        self.snapshot.hooks.extend(hooks)

    # -- waits: human input and sign-in ---------------------------------------

    async def _answer_inputs(self, entry: s.InboxEntry) -> None:
        state = self.state
        turn = self.snapshot.open_turn
        if not state.turn_open or not turn.pending_inputs:
            await self._reject(entry, Reason.INPUT_NOT_PENDING, "no input request is pending")
            return
        pending = {r.request_id: r for r in turn.pending_inputs}
        responses = list(entry.command.send.input_responses)
        unknown = [r.request_id for r in responses if r.request_id not in pending]
        state.consume(entry)
        events: list[s.Event] = []
        if entry.command.send.text.strip():
            turn.inbox_seqs.append(entry.seq)
            events.append(
                state.event(s.EVENT_KIND_MESSAGE_RECEIVED, entry, text=entry.command.send.text)
            )
        if unknown:
            message = f"no pending input request {', '.join(unknown)}"
            events.append(state.rejection(entry, Reason.UNKNOWN_INPUT_REQUEST, message))
        failed = False
        for response in responses:
            request = pending.pop(response.request_id, None)
            if request is None:
                continue
            if request.kind == s.INPUT_KIND_QUESTION:
                state.context.remember(s.ChatMessage(role=s.ROLE_USER, content=response.text))
            elif request.kind == s.INPUT_KIND_APPROVAL:
                call = request.tool_call
                if response.approved:
                    result = await self._call_tool(call)
                else:
                    result = s.ToolResult(
                        tool_call_id=call.id,
                        name=call.name,
                        output="the user denied this call",
                        is_error=True,
                    )
                state.record_result(result, events)
            elif response.approved:
                state.extend_budget()
            else:
                failed = True
        del turn.pending_inputs[:]
        turn.pending_inputs.extend(pending.values())
        if failed:
            error = s.ErrorDetail(reason=Reason.LIMIT_EXCEEDED, message="the user kept the limit")
            state.settle(events, s.EVENT_KIND_TURN_FAILED, error=error)
            await self._commit(events)
        elif state.still_waiting():
            if state.waiting_for_user():
                events.append(state.event(s.EVENT_KIND_SESSION_WAITING))
            await self._commit(events)
        else:
            await self._turn_loop(events)

    async def _authorization_callback(self, entry: s.InboxEntry) -> None:
        state = self.state
        callback = entry.command.authorization_callback
        wait = state.auth_wait(callback.attempt_id)
        state.consume(entry)
        if wait is None:
            self._log.info("stale sign-in attempt dropped", attempt_id=callback.attempt_id)
            await self._commit([])
            return
        wait.reported_attempt_ids.append(callback.attempt_id)
        wait.denied = wait.denied or not callback.granted
        events: list[s.Event] = []
        if len(wait.reported_attempt_ids) < len(wait.expected_attempt_ids):
            await self._commit(events)
            return
        call = wait.tool_call
        events.append(
            state.event(
                s.EVENT_KIND_AUTHORIZATION_COMPLETED,
                entry,
                tool_call=call,
                attempt_id=callback.attempt_id,
                error=s.ErrorDetail(reason=Reason.DENIED) if wait.denied else None,
            )
        )
        if wait.denied:
            result = s.ToolResult(
                tool_call_id=call.id, name=call.name, output="sign-in was refused", is_error=True
            )
        else:
            result = await self._call_tool(call)
        state.record_result(result, events)
        state.close_auth_wait(call)
        if state.still_waiting():
            await self._commit(events)
        else:
            await self._turn_loop(events)

    # -- compaction, retirement, finalization --------------------------------------

    async def _compact_if_over_budget(self) -> None:
        """At a turn boundary: compact when what the model sees outgrew the
        agent's context budget (DESIGN.md §4)."""
        context = self.state.context
        budget, entries = self.agent.context_budget_bytes, self.agent.context_budget_entries
        if self.state.turn_open or not context.over(budget, entries):
            return
        size = context.size()
        self._log.info(
            "context over budget; compacting",
            entries=size[0],
            bytes=size[1],
            budget_bytes=budget,
            budget_entries=entries,
        )
        await self._summarize([], None)

    async def _summarize(self, events: list[s.Event], entry: s.InboxEntry | None) -> None:
        """Replace the context with the model's summary of it; `entry` is the
        compact command, or None when the owner compacts on its own."""
        state = self.state
        before = state.context.size()
        try:
            reply = await self.agent.model.complete(
                self.agent.compaction_instructions, state.context.messages, ()
            )
        except Exception as exc:  # noqa: BLE001 - authored code
            self._log.warning("compaction failed", error=repr(exc), automatic=entry is None)
            state.compaction_failed(events, entry, safe_error(exc))
        else:
            state.compacted(events, entry, reply, before)
        await self._commit(events)

    def _start_retire(self) -> None:
        """Retire (delete) committed history entries the model no longer
        sees, in the background: never blocks a turn. The mark is persisted
        by the next commit; until then a successor simply retires again."""
        if self._retiring is not None and not self._retiring.done():
            return
        retirable = self.state.context.retirable()
        if retirable is not None:
            self._retiring = asyncio.get_running_loop().create_task(self._retire(*retirable))

    async def _retire(self, start: int, below: int) -> None:
        try:
            deleted = await self._anchor.retire_history(self.identity.fence, below, start)
        except BatonError as exc:
            # Fenced: the run learns it from its next commit. Anything else:
            # retried after the next commit or by a successor.
            self._log.info("history not retired yet", reason=exc.reason, below=below)
            return
        self.state.context.retired(below)
        self._log.debug("history retired", below=below, deleted=deleted)

    async def _retired(self) -> None:
        """Wait for the retirement in progress (a finalized session's)."""
        if self._retiring is not None:
            await self._retiring

    async def _finalize(
        self, events: list[s.Event], entry: s.InboxEntry, error: s.ErrorDetail | None = None
    ) -> None:
        """Terminal: close the stream once, then release every token."""
        self.state.finalize(events, entry, error)
        await self._commit(events, close=True)
        inbox = ids.inbox_token(self.session_id)
        aliases = [t for t in self.snapshot.hooks if t != inbox]
        if aliases:  # the inbox token stays: late sends learn the session is finalized
            await self._hooks.dispose(self.identity.fence, aliases)
        self._log.info("session finalized", reason=error.reason if error else "RESET")

    # -- the session timeout --------------------------------------------------

    def _arm_timeout(self, restart: bool = False) -> None:
        """Arm the durable lifetime timer, stamped with this run; `restart`
        (a successor on a new deployment) counts the configured duration
        from now."""
        timeout = self.snapshot.timeout
        if not timeout.duration_seconds:
            return
        if restart or not timeout.HasField("deadline"):
            timeout.deadline.FromSeconds(int(self._clock()) + timeout.duration_seconds)
        timeout.armed_by_owner_run_id = self.run_id
        delay = max(0.0, timeout.deadline.ToSeconds() - self._clock())
        self._timer = asyncio.get_running_loop().create_task(self._fire_timeout(delay))

    async def _fire_timeout(self, delay: float) -> None:
        await asyncio.sleep(delay)
        command = s.Command(
            delivery=s.DeliveryMetadata(delivery_id=f"timeout-{self.run_id}"),
            timeout=s.TimeoutCommand(armed_by_owner_run_id=self.run_id),
        )
        backoff = 0.1
        while True:
            try:
                await self._hooks.resume(ids.inbox_token(self.session_id), command)
                return
            except BatonError as exc:
                if not exc.retryable:
                    self._log.warning("timeout not delivered", reason=exc.reason)
                    return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    # -- commits ---------------------------------------------------------------

    async def commit_checkpoint(self) -> None:
        """Commit the snapshot unchanged (fenced, compared with the last
        revision): settles an uncertain handoff. Raises Fenced if it moved."""
        await self._commit([], idle_after=False)

    async def _commit(
        self, events: list[s.Event], close: bool = False, *, idle_after: bool = True
    ) -> None:
        carry, self._carry = self._carry, []
        events[:0] = carry
        await self._send_outgoing()
        if close and self.state.is_child:
            # Finalization is reported before the commit that closes the
            # stream (no run follows it); a repeat is deduplicated.
            await self._deliver_reports_now()
        context = self.state.context
        # A commit that settles the session: a delivery arriving while it is in
        # flight arrives at an idle session (a reader may see the commit, and
        # send, before this run has the answer), so it may trigger a handoff.
        self._idle = idle_after and not close and not self.state.turn_open
        try:
            oversized = context.oversized_entry()
            if oversized:
                raise InvalidArgument(Reason.HISTORY_ENTRY_TOO_LARGE, oversized)
            self._snapshot_revision = await commit_step(
                self._anchor,
                self.identity,
                self.snapshot,
                events,
                close,
                self._snapshot_revision,
                context.appended,
                self._committed_inbox,
            )
        except (InvalidArgument, ResourceExhausted) as exc:
            if exc.reason == Reason.STORE_FULL:
                raise
            raise _CommitRefused(exc.reason, exc.message, close, events, carry) from exc
        finally:
            self._idle = False
        self.state.mark_committed()
        self._turns.committed(events)
        self._committed_snapshot = self.snapshot.SerializeToString()
        self._committed_inbox = self.snapshot.inbox_next_seq
        self.progressed = True
        self._start_retire()
        self._deliver_reports()

    # -- child sessions: controls out, reports up -----------------------------------

    async def _send_outgoing(self) -> None:
        """Cancels and resets the state decided for children, before the
        commit that decides them (a repeat after a crash is deduplicated)."""
        outgoing = self.state.outgoing
        while outgoing:
            child, command = outgoing[0]
            if self._children is not None:
                await self._children.send_control(child, command)
            outgoing.pop(0)

    def _reports_pending(self) -> bool:
        busy = self._delivering is not None and not self._delivering.done()
        return busy or bool(self.snapshot.parent.outbox)

    def _deliver_reports(self) -> None:
        """Deliver this child's committed reports in the background."""
        if self._children is None or not self.snapshot.parent.outbox:
            return
        if self._delivering is not None and not self._delivering.done():
            return
        self._delivering = asyncio.get_running_loop().create_task(self._deliver_loop())

    async def _deliver_loop(self) -> None:
        assert self._children is not None
        count = len(self.snapshot.parent.outbox)
        try:
            await self._children.deliver_reports(self.snapshot.parent)
        except BatonError as exc:
            self._log.error("reports not delivered", reason=exc.reason, error=exc.message)
            return
        self._log.info(
            "reports delivered",
            reports=count,
            parent_session_id=self.snapshot.parent.parent_session_id,
        )

    async def _deliver_reports_now(self) -> None:
        if self._delivering is not None and not self._delivering.done():
            await asyncio.shield(self._delivering)
        if self._children is not None:
            await self._children.deliver_reports(self.snapshot.parent)

    async def _guarded(self, work: Awaitable[None]) -> None:
        """Run `work`; a commit it makes that can never succeed (too large,
        invalid) fails the turn instead (docs/failures.md)."""
        try:
            await work
        except _CommitRefused as refused:
            self._log.warning(
                "commit refused; the turn fails", reason=refused.reason, error=refused.message
            )
            self._carry = refused.carry
            error = s.ErrorDetail(reason=refused.reason, message=refused.message[:500])
            events = self.state.refused(refused.events, refused.close, error)
            await self._commit(events, close=refused.close)
