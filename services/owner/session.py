"""A session program: one owner run of one session.

The run reads the session's inbox continuously (a server stream from hooks),
takes commands in inbox order, runs turns of steps, and commits each step
through anchor as one fenced transaction: the step's events plus the new
snapshot, whose inbox position says which commands the step consumed.

Turn rules (DESIGN.md §4):
- steer (default): a message arriving while a turn is open is admitted at the
  next model-call boundary of the same turn; one pending when the model gives
  its final answer keeps the turn going. queue: waits for the turn to settle.
- consecutive pending steer messages from the same principal start one turn
  together; steer messages from others join it at its first model-call boundary.
- cancel, reset and an own timeout are pushed: the running step is aborted at
  once (when everything before them in the inbox can be admitted into the
  turn). The turn settles as cancelled, keeping completed model calls.
- human input and sign-in pause the turn (the session waits); responses and
  callbacks resume it. A plain message while a turn waits abandons the waits
  and is admitted into the same turn.
- budgets are checked before each model call; a spent budget asks the user
  (input kind SESSION_LIMIT): approving extends it, denying fails the turn.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton.session.v1 import session_pb2 as s
from services.common import ids, limits
from services.common.clients import AnchorClient, HooksClient
from services.common.errors import (
    Aborted,
    BatonError,
    DeadlineExceeded,
    Fenced,
    InvalidArgument,
    Reason,
    ResourceExhausted,
    Unavailable,
)
from services.owner.agent import (
    Agent,
    ModelRejected,
    ModelReply,
    Tool,
    ToolContext,
    dumps_arguments,
)
from services.owner.checkpoint import Checkpoint

log = structlog.get_logger("baton.owner.session")

SNAPSHOT_FORMAT = 2  # 2: the model history is appended as entries of its own
COMMIT_RETRY_SECONDS = 30.0
STORE_FULL_RETRY_MAX_SECONDS = 5.0


class RunExit(enum.Enum):
    """Why a run ended."""

    FENCED = "fenced"
    FINALIZED = "finalized"
    PARKED = "parked"
    HANDED_OFF = "handed_off"
    FAILED = "failed"


@dataclass(frozen=True)
class RunIdentity:
    """Who is running: the fence plus the deployment and instance."""

    fence: s.Fence
    deployment_id: str
    instance_id: str


def initial_snapshot(
    session_id: str,
    channel: str,
    deployment_id: str,
    hooks: list[str],
    *,
    timeout_seconds: int = 0,
    token_budget: int = 0,
) -> s.SessionSnapshot:
    snapshot = s.SessionSnapshot(
        format_version=SNAPSHOT_FORMAT,
        session_id=session_id,
        channel=channel,
        deployment_id=deployment_id,
        hooks=hooks,
        status=s.SESSION_STATUS_ACTIVE,
        limits=s.Limits(token_budget=token_budget),
    )
    if timeout_seconds:
        # The deadline is committed with session.started: it survives restarts.
        snapshot.timeout.duration_seconds = timeout_seconds
        snapshot.timeout.deadline.FromSeconds(int(time.time()) + timeout_seconds)
    return snapshot


class _Admission(enum.Enum):
    ADMIT = "admit"  # a steer message: joins the open turn
    CANCEL = "cancel"  # settles the open turn as cancelled
    FINALIZE = "finalize"  # reset or own timeout: ends the session
    DROP = "drop"  # stale timeout or sign-in attempt: consumed, nothing else
    REJECT = "reject"  # unknown kind: consumed with an error event
    BLOCK = "block"  # waits until the turn settles


class _Outcome(enum.Enum):
    CONTINUE = "continue"  # tools ran; next step
    FINAL = "final"  # the model answered
    PAUSED = "paused"  # waits for input or sign-in
    ABORTED = "aborted"  # a pushed command aborted the step
    FAILED = "failed"  # the model failed


@dataclass
class _StepProgress:
    """What an (abortable) step produced so far; applied by the run."""

    reply: ModelReply | None = None
    error: str = ""
    reason: str = "MODEL_ERROR"
    calls: list[s.ToolCall] = field(default_factory=list)
    results: dict[int, s.ToolResult] = field(default_factory=dict)
    aborted: bool = False


HandOff = Callable[[Checkpoint, s.InboxEntry], Awaitable[bool]]
"""Tries to move a run's session to the deployment that accepted a trigger."""


_SETTLE_KINDS = frozenset(
    {s.EVENT_KIND_TURN_COMPLETED, s.EVENT_KIND_TURN_FAILED, s.EVENT_KIND_TURN_CANCELLED}
)


class _CommitRefused(Exception):
    """A commit that can never succeed as it is (DETERMINISTIC_FAILURES)."""

    def __init__(
        self,
        reason: str,
        message: str,
        close: bool,
        events: list[s.Event],
        carry: list[s.Event],
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
    """Executes one session for one owner run until fenced, finalized or parked."""

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
    ) -> None:
        self.identity = identity
        self.snapshot = snapshot
        # What the model sees: history entries [context_start, next_index),
        # as loaded with the snapshot; `_appended`: entries not committed yet.
        self._context: list[s.ChatMessage] = list(context)
        self._appended: list[s.ChatMessage] = []
        # The committed state a refused commit rolls back to.
        self._committed_log = s.HistoryLog()
        self._committed_log.CopyFrom(snapshot.history_log)
        self._committed_context = (self._context, len(self._context))
        self._committed_next_seq = snapshot.next_event_seq
        self._committed_turn_id = snapshot.open_turn.turn_id
        self._committed_snapshot = snapshot.SerializeToString()
        self._retiring: asyncio.Task[None] | None = None
        self._largest_appended = 0
        self.progressed = False  # a commit of this run succeeded
        self.failure: BaseException | None = None  # why the run failed, when it did
        self.agent = agent
        self._hooks = hooks
        self._anchor = anchor
        self._on_exit = on_exit
        self._park_after = park_after
        self._clock = clock
        self._snapshot_revision = snapshot_revision
        # `seed`: inbox entries already read (a handoff's trigger), ahead of the stream.
        self._pending: collections.deque[s.InboxEntry] = collections.deque(seed)
        self._arrived = asyncio.Event()
        self._reader_exit: RunExit | None = None
        self._step_task: asyncio.Task[None] | None = None
        self._abort_requested = False
        self._timer: asyncio.Task[None] | None = None
        self._hand_off = hand_off
        self._idle = False  # waiting for a command with nothing pending and no open turn
        self._trigger_seq = -1  # the delivery found eligible for a handoff at arrival
        self._carry: list[s.Event] = []  # events for the next commit
        self._handoff_id = handoff_id  # the handoff that started this run, if one did
        self._log = log.bind(
            session_id=identity.fence.session_id,
            run_id=identity.fence.owner_run_id,
            epoch=identity.fence.epoch,
            deployment_id=identity.deployment_id,
        )

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
    def _turn_id(self) -> str:
        return self.snapshot.open_turn.turn_id if self.snapshot.HasField("open_turn") else ""

    # -- the program ------------------------------------------------------

    async def run(self) -> RunExit:
        exit = RunExit.FAILED
        reader = asyncio.get_running_loop().create_task(self._read_inbox())
        try:
            if self.agent.on_load is not None:
                # Authored code sees the session first; if it raises, the run
                # fails and counts against the host's restart budget.
                self.agent.on_load(self.snapshot)
            self._start_retire()
            arrived_from = self.snapshot.deployment_id
            handed_off = bool(arrived_from) and arrived_from != self.identity.deployment_id
            if handed_off:
                # First run on this deployment after a handoff: say so on the
                # stream (with the first commit here) and restart the timeout.
                self._carry.append(
                    self._event(
                        s.EVENT_KIND_SESSION_HANDED_OFF,
                        text=arrived_from,
                        handoff_id=self._handoff_id,
                    )
                )
            self._arm_timeout(restart=handed_off)
            turn = self.snapshot.open_turn
            if self.snapshot.HasField("open_turn") and not (
                turn.pending_inputs or turn.pending_authorizations
            ):
                # Recovery: the step in flight at the predecessor's crash runs again.
                self._log.info("continuing open turn", turn_id=turn.turn_id, steps=turn.steps)
                await self._guarded(self._turn_loop([]))
            while self.snapshot.status != s.SESSION_STATUS_FINALIZED:
                entry = await self._take(self._park_after)
                if entry is None:
                    if await self._try_park():
                        exit = RunExit.PARKED
                        return exit
                    continue
                if entry.seq == self._trigger_seq:
                    self._trigger_seq = -1
                    if not self._pending and await self._try_hand_off(entry):
                        exit = RunExit.HANDED_OFF
                        return exit
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
            if self._timer is not None:
                self._timer.cancel()
            if self._retiring is not None:
                self._retiring.cancel()
            if self._on_exit is not None:
                self._on_exit(self, exit)
        return exit

    async def _take(self, idle_s: float | None) -> s.InboxEntry | None:
        self._idle = not self.snapshot.HasField("open_turn")
        try:
            while not self._pending:
                if self._reader_exit is not None:
                    raise _RunEnded(self._reader_exit)
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), idle_s)
                except TimeoutError:
                    return None
            return self._pending.popleft()
        finally:
            self._idle = False

    async def _read_inbox(self) -> None:
        """Buffer the inbox in seq order; reconnect on transient errors."""
        next_seq = max(
            self.snapshot.inbox_next_seq, self._pending[-1].seq + 1 if self._pending else 0
        )
        backoff = 0.05
        while True:
            try:
                async for response in self._hooks.stream_inbox(self.identity.fence, next_seq):
                    for entry in response.entries:
                        if entry.seq >= next_seq:
                            next_seq = entry.seq + 1
                            if self._idle and not self._pending and self._is_trigger(entry):
                                self._trigger_seq = entry.seq
                            self._pending.append(entry)
                            self._push(entry)
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

    # -- handoff (DESIGN.md §6) ------------------------------------------------

    def _is_trigger(self, entry: s.InboxEntry) -> bool:
        """Evaluated once, when the delivery arrives while the session is idle
        (no open turn: no step, pending input or sign-in; nothing pending) and
        before it is buffered or applied. Only a conversational send accepted
        by another deployment qualifies; everything else — input responses,
        results, cancel, reset, clear, compact — never does."""
        if self._hand_off is None or self._snapshot_revision is None:
            return False  # unknown eligibility: skip
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
        context, length = self._committed_context
        checkpoint = Checkpoint(
            fence=self.identity.fence,
            revision=self._snapshot_revision,
            snapshot=self._committed_snapshot,
            context=context[:length],
            context_bytes=self._committed_log.context_bytes,
            settle=self.commit_checkpoint,
        )
        try:
            return await self._hand_off(checkpoint, entry)
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
        if self._classify(entry) not in (_Admission.CANCEL, _Admission.FINALIZE):
            return
        ahead = list(self._pending)[:-1]
        if all(
            self._classify(e) in (_Admission.ADMIT, _Admission.DROP, _Admission.REJECT)
            for e in ahead
        ):
            self._abort_requested = True
            task.cancel()

    async def _try_park(self) -> bool:
        if self._park_after is None or self._pending:
            return False
        # Still idle while parking: an arrival that fails the park is
        # evaluated as a handoff trigger like any other.
        self._idle = not self.snapshot.HasField("open_turn")
        try:
            await self._hooks.set_parked(self.identity.fence, True, self.snapshot.inbox_next_seq)
        except Aborted:
            return False  # something arrived; the stream will deliver it
        finally:
            self._idle = False
        self._log.debug("parked", inbox_next_seq=self.snapshot.inbox_next_seq)
        return True

    # -- dispatch -------------------------------------------------------------

    def _classify(self, entry: s.InboxEntry) -> _Admission:
        """How a command joins an open turn at a model-call boundary."""
        command = entry.command
        kind = command.WhichOneof("kind")
        if kind == "send":
            send = command.send
            if send.input_responses or send.turn_policy == s.TURN_POLICY_QUEUE:
                return _Admission.BLOCK
            return _Admission.ADMIT if send.text.strip() else _Admission.REJECT
        if kind == "cancel":
            return _Admission.CANCEL
        if kind == "reset":
            return _Admission.FINALIZE
        if kind == "timeout":
            own = command.timeout.armed_by_owner_run_id == self.run_id
            return _Admission.FINALIZE if own else _Admission.DROP
        if kind == "authorization_callback":
            return (
                _Admission.BLOCK
                if self._auth_wait(command.authorization_callback.attempt_id) is not None
                else _Admission.DROP
            )
        if kind is None or kind == "task_result":
            return _Admission.REJECT
        return _Admission.BLOCK

    async def _dispatch(self, entry: s.InboxEntry) -> None:
        command = entry.command
        kind = command.WhichOneof("kind")
        waiting = self.snapshot.HasField("open_turn")
        if kind == "send":
            if command.send.input_responses:
                await self._answer_inputs(entry)
            elif not command.send.text.strip():
                await self._reject(entry, "EMPTY_MESSAGE", "the message is empty")
            elif waiting:
                events = self._abandon_waits()
                self._admit_message(entry, events)
                await self._turn_loop(events)
            else:
                await self._start_turn(entry)
        elif kind == "cancel":
            if waiting:
                self._consume(entry)
                await self._settle([], s.EVENT_KIND_TURN_CANCELLED, entry=entry)
            else:
                await self._reject(entry, "NOTHING_TO_CANCEL", "no turn is running")
        elif kind == "reset":
            await self._finalize([], entry)
        elif kind == "timeout":
            if self._classify(entry) is _Admission.FINALIZE:
                await self._finalize([], entry, error=s.ErrorDetail(reason="TIMEOUT"))
            else:
                self._consume(entry)  # a predecessor's timer: ignored
                await self._commit([])
        elif kind == "clear":
            events = self._cancel_waiting_turn(entry)
            before = self._context_size()
            self._reset_context([])
            self._consume(entry)
            events.append(
                self._event(
                    s.EVENT_KIND_CONTEXT_CLEARED,
                    entry,
                    context_change=_change(before, self._context_size()),
                )
            )
            await self._commit(events)
        elif kind == "compact":
            await self._compact(entry)
        elif kind == "authorization_callback":
            await self._authorization_callback(entry)
        elif kind is None:
            await self._reject(
                entry,
                "UNKNOWN_COMMAND_KIND",
                f"deployment {self.identity.deployment_id} does not know this command kind",
            )
        else:
            await self._reject(
                entry,
                "UNSUPPORTED_COMMAND",
                f"command kind {kind!r} is not supported by deployment "
                f"{self.identity.deployment_id}",
            )

    # -- turns --------------------------------------------------------------

    def _principal(self, entry: s.InboxEntry) -> tuple[str, str]:
        return entry.command.delivery.channel, entry.command.delivery.caller

    async def _start_turn(self, entry: s.InboxEntry) -> None:
        snap = self.snapshot
        snap.turn_count += 1
        snap.open_turn.CopyFrom(
            s.OpenTurn(turn_id=f"turn_{snap.turn_count}", caller=entry.command.delivery.caller)
        )
        events = [self._event(s.EVENT_KIND_TURN_STARTED, entry)]
        self._admit_message(entry, events)
        principal = self._principal(entry)
        while self._pending and (
            self._classify(self._pending[0]) is _Admission.ADMIT
            and self._principal(self._pending[0]) == principal
        ):
            self._admit_message(self._pending.popleft(), events)
        await self._turn_loop(events)

    def _admit_message(self, entry: s.InboxEntry, events: list[s.Event]) -> None:
        text = entry.command.send.text
        self._consume(entry)
        self.snapshot.open_turn.inbox_seqs.append(entry.seq)
        self._remember(s.ChatMessage(role=s.ROLE_USER, content=text))
        events.append(self._event(s.EVENT_KIND_MESSAGE_RECEIVED, entry, text=text))

    def _admit_pending(self, events: list[s.Event]) -> tuple[_Admission, s.InboxEntry | None]:
        """At a model-call boundary: admit what may join the turn, in order."""
        while self._pending:
            entry = self._pending[0]
            verdict = self._classify(entry)
            if verdict is _Admission.BLOCK:
                break
            self._pending.popleft()
            if verdict is _Admission.ADMIT:
                self._admit_message(entry, events)
            elif verdict is _Admission.DROP:
                self._consume(entry)
            elif verdict is _Admission.REJECT:
                self._consume(entry)
                events.append(self._rejection(entry))
            else:
                self._consume(entry)
                return verdict, entry
        return _Admission.BLOCK, None

    async def _turn_loop(self, events: list[s.Event]) -> None:
        snap = self.snapshot
        while True:
            verdict, stop = self._admit_pending(events)
            if verdict is _Admission.CANCEL:
                await self._settle(events, s.EVENT_KIND_TURN_CANCELLED, entry=stop)
                return
            if verdict is _Admission.FINALIZE:
                assert stop is not None
                is_timeout = stop.command.WhichOneof("kind") == "timeout"
                error = s.ErrorDetail(reason="TIMEOUT") if is_timeout else None
                await self._finalize(events, stop, error=error)
                return
            max_steps = snap.limits.max_steps_per_turn or self.agent.max_steps_per_turn
            if snap.open_turn.steps >= max_steps:
                await self._settle(
                    events,
                    s.EVENT_KIND_TURN_FAILED,
                    error=s.ErrorDetail(
                        reason="MAX_STEPS", message=f"the turn reached {max_steps} steps"
                    ),
                )
                return
            if self._budget_spent():
                self._request_input(
                    events, s.INPUT_KIND_SESSION_LIMIT, "The session budget is spent. Extend it?"
                )
                events.append(self._event(s.EVENT_KIND_SESSION_WAITING))
                await self._commit(events)
                return
            progress = await self._run_step()
            outcome = self._apply_step(progress, events)
            if outcome is _Outcome.ABORTED:
                continue  # the boundary finds the pushed command
            if outcome is _Outcome.FAILED:
                await self._settle(
                    events,
                    s.EVENT_KIND_TURN_FAILED,
                    error=s.ErrorDetail(reason=progress.reason, message=progress.error),
                )
                return
            if outcome is _Outcome.PAUSED:
                events.append(self._event(s.EVENT_KIND_SESSION_WAITING))
                await self._commit(events)
                return
            if outcome is _Outcome.FINAL and not self._steer_pending():
                await self._settle(events, s.EVENT_KIND_TURN_COMPLETED)
                return
            await self._commit(events)
            events = []

    def _steer_pending(self) -> bool:
        return bool(self._pending) and self._classify(self._pending[0]) is not _Admission.BLOCK

    def _budget_spent(self) -> bool:
        limits, usage = self.snapshot.limits, self.snapshot.usage
        tokens = usage.input_tokens + usage.output_tokens
        if limits.token_budget and tokens >= limits.token_budget:
            return True
        return bool(limits.cost_budget_micros and usage.cost_micros >= limits.cost_budget_micros)

    async def _run_step(self) -> _StepProgress:
        """One model call plus the tools it asks for, abortable by a push."""
        progress = _StepProgress()
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

    async def _execute(self, progress: _StepProgress) -> None:
        snap = self.snapshot
        try:
            reply = await self.agent.model.complete(
                self.agent.instructions, self._context, self.agent.tools
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - authored code: any failure fails the turn
            self._log.warning("model call failed", error=repr(exc), turn_id=self._turn_id)
            progress.error = safe_error(exc)
            progress.reason = "MODEL_REJECTED" if isinstance(exc, ModelRejected) else "MODEL_ERROR"
            return
        progress.reply = reply
        for offset, requested in enumerate(reply.tool_calls):
            progress.calls.append(
                s.ToolCall(
                    id=f"call_{snap.tool_call_count + offset + 1}",
                    name=requested.name,
                    arguments_json=dumps_arguments(requested.arguments),
                )
            )
        for index, call in enumerate(progress.calls):
            tool = self.agent.tool_index.get(call.name)
            if tool is not None and (tool.needs_approval or tool.sign_in_attempts):
                continue  # waits for the user
            progress.results[index] = await self._call_tool(call, tool)

    async def _call_tool(self, call: s.ToolCall, tool: Tool | None) -> s.ToolResult:
        result = s.ToolResult(tool_call_id=call.id, name=call.name)
        if tool is None:
            result.output, result.is_error = f"unknown tool {call.name!r}", True
            return result
        try:
            result.output = await tool.run(json.loads(call.arguments_json), self._tool_context())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - authored code: the model sees the error
            result.output, result.is_error = f"{type(exc).__name__}: {exc}", True
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

    def _apply_step(self, progress: _StepProgress, events: list[s.Event]) -> _Outcome:
        """Fold a step's progress into history, usage and events."""
        snap = self.snapshot
        reply = progress.reply
        if reply is None:
            return _Outcome.ABORTED if progress.aborted else _Outcome.FAILED
        snap.open_turn.steps += 1
        step = snap.open_turn.steps
        events.append(self._event(s.EVENT_KIND_STEP_STARTED, step=step))
        usage = s.Usage(
            input_tokens=reply.input_tokens,
            output_tokens=reply.output_tokens,
            model_calls=1,
            cost_micros=reply.cost_micros,
        )
        _add_usage(snap.open_turn.usage, usage)
        _add_usage(snap.usage, usage)
        outcome = _Outcome.CONTINUE
        if reply.question:
            self._remember(s.ChatMessage(role=s.ROLE_ASSISTANT, content=reply.question))
            events.append(
                self._event(s.EVENT_KIND_MESSAGE_COMPLETED, step=step, text=reply.question)
            )
            self._request_input(events, s.INPUT_KIND_QUESTION, reply.question, step=step)
            outcome = _Outcome.PAUSED
        elif not progress.calls:
            self._remember(s.ChatMessage(role=s.ROLE_ASSISTANT, content=reply.text))
            events.append(self._event(s.EVENT_KIND_MESSAGE_COMPLETED, step=step, text=reply.text))
            outcome = _Outcome.FINAL
        else:
            snap.tool_call_count += len(progress.calls)
            self._remember(s.ChatMessage(role=s.ROLE_ASSISTANT, tool_calls=progress.calls))
            for index, call in enumerate(progress.calls):
                events.append(
                    self._event(s.EVENT_KIND_TOOL_CALL_REQUESTED, step=step, tool_call=call)
                )
                tool = self.agent.tool_index.get(call.name)
                if index in progress.results:
                    self._record_result(progress.results[index], events, step)
                elif progress.aborted:
                    cancelled = s.ToolResult(
                        tool_call_id=call.id, name=call.name, output="cancelled", is_error=True
                    )
                    self._record_result(cancelled, events, step)
                elif tool is not None and tool.needs_approval:
                    self._request_input(
                        events,
                        s.INPUT_KIND_APPROVAL,
                        f"Allow {call.name}({call.arguments_json})?",
                        step=step,
                        tool_call=call,
                    )
                    outcome = _Outcome.PAUSED
                elif tool is not None and tool.sign_in_attempts:
                    self._require_authorization(events, call, tool.sign_in_attempts, step)
                    outcome = _Outcome.PAUSED
        events.append(self._event(s.EVENT_KIND_STEP_COMPLETED, step=step, usage=usage))
        return _Outcome.ABORTED if progress.aborted else outcome

    def _record_result(self, result: s.ToolResult, events: list[s.Event], step: int = 0) -> None:
        events.append(self._event(s.EVENT_KIND_TOOL_CALL_RESULT, step=step, tool_result=result))
        self._remember(
            s.ChatMessage(role=s.ROLE_TOOL, content=result.output, tool_call_id=result.tool_call_id)
        )

    def _next_id(self, prefix: str) -> str:
        self.snapshot.id_count += 1
        return f"{prefix}_{self.snapshot.id_count}"

    def _request_input(
        self,
        events: list[s.Event],
        kind: s.InputKind.ValueType,
        prompt: str,
        *,
        step: int = 0,
        tool_call: s.ToolCall | None = None,
    ) -> None:
        request = s.InputRequest(
            request_id=self._next_id("input"), kind=kind, prompt=prompt, tool_call=tool_call
        )
        self.snapshot.open_turn.pending_inputs.append(request)
        events.append(self._event(s.EVENT_KIND_INPUT_REQUESTED, step=step, input_request=request))

    def _require_authorization(
        self, events: list[s.Event], call: s.ToolCall, attempts: int, step: int
    ) -> None:
        wait = s.AuthorizationWait(tool_call=call)
        for _ in range(attempts):
            attempt = self._next_id("attempt")
            wait.expected_attempt_ids.append(attempt)
            events.append(
                self._event(
                    s.EVENT_KIND_AUTHORIZATION_REQUIRED,
                    step=step,
                    tool_call=call,
                    attempt_id=attempt,
                )
            )
        self.snapshot.open_turn.pending_authorizations.append(wait)

    async def _settle(
        self,
        events: list[s.Event],
        kind: s.EventKind.ValueType,
        *,
        entry: s.InboxEntry | None = None,
        error: s.ErrorDetail | None = None,
        commit: bool = True,
    ) -> None:
        """Close the open turn; with `commit`, the session then waits."""
        usage = s.Usage()
        usage.CopyFrom(self.snapshot.open_turn.usage)
        events.append(self._event(kind, entry, usage=usage, error=error))
        self.snapshot.ClearField("open_turn")
        if commit:
            events.append(self._event(s.EVENT_KIND_SESSION_WAITING))
            await self._commit(events)

    # -- waits: human input and sign-in ---------------------------------------

    async def _answer_inputs(self, entry: s.InboxEntry) -> None:
        snap = self.snapshot
        turn = snap.open_turn
        if not snap.HasField("open_turn") or not turn.pending_inputs:
            await self._reject(entry, "INPUT_NOT_PENDING", "no input request is pending")
            return
        pending = {r.request_id: r for r in turn.pending_inputs}
        responses = list(entry.command.send.input_responses)
        unknown = [r.request_id for r in responses if r.request_id not in pending]
        self._consume(entry)
        events: list[s.Event] = []
        if entry.command.send.text.strip():
            snap.open_turn.inbox_seqs.append(entry.seq)
            events.append(
                self._event(s.EVENT_KIND_MESSAGE_RECEIVED, entry, text=entry.command.send.text)
            )
        if unknown:
            events.append(
                self._event(
                    s.EVENT_KIND_COMMAND_REJECTED,
                    entry,
                    error=s.ErrorDetail(
                        reason="UNKNOWN_INPUT_REQUEST",
                        message=f"no pending input request {', '.join(unknown)}",
                    ),
                )
            )
        failed = False
        for response in responses:
            request = pending.pop(response.request_id, None)
            if request is None:
                continue
            if request.kind == s.INPUT_KIND_QUESTION:
                self._remember(s.ChatMessage(role=s.ROLE_USER, content=response.text))
            elif request.kind == s.INPUT_KIND_APPROVAL:
                call = request.tool_call
                if response.approved:
                    result = await self._call_tool(call, self.agent.tool_index.get(call.name))
                else:
                    result = s.ToolResult(
                        tool_call_id=call.id,
                        name=call.name,
                        output="the user denied this call",
                        is_error=True,
                    )
                self._record_result(result, events)
            elif response.approved:
                used = snap.usage.input_tokens + snap.usage.output_tokens
                snap.limits.token_budget = used + max(snap.limits.token_budget, 1)
                if snap.limits.cost_budget_micros:
                    snap.limits.cost_budget_micros = (
                        snap.usage.cost_micros + snap.limits.cost_budget_micros
                    )
            else:
                failed = True
        del turn.pending_inputs[:]
        turn.pending_inputs.extend(pending.values())
        if failed:
            await self._settle(
                events,
                s.EVENT_KIND_TURN_FAILED,
                error=s.ErrorDetail(reason="LIMIT_EXCEEDED", message="the user kept the limit"),
            )
        elif turn.pending_inputs or turn.pending_authorizations:
            events.append(self._event(s.EVENT_KIND_SESSION_WAITING))
            await self._commit(events)
        else:
            await self._turn_loop(events)

    def _auth_wait(self, attempt_id: str) -> s.AuthorizationWait | None:
        if not self.snapshot.HasField("open_turn"):
            return None
        for wait in self.snapshot.open_turn.pending_authorizations:
            if (
                attempt_id in wait.expected_attempt_ids
                and attempt_id not in wait.reported_attempt_ids
            ):
                return wait
        return None

    async def _authorization_callback(self, entry: s.InboxEntry) -> None:
        callback = entry.command.authorization_callback
        wait = self._auth_wait(callback.attempt_id)
        self._consume(entry)
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
            self._event(
                s.EVENT_KIND_AUTHORIZATION_COMPLETED,
                entry,
                tool_call=call,
                attempt_id=callback.attempt_id,
                error=s.ErrorDetail(reason="DENIED") if wait.denied else None,
            )
        )
        if wait.denied:
            result = s.ToolResult(
                tool_call_id=call.id, name=call.name, output="sign-in was refused", is_error=True
            )
        else:
            result = await self._call_tool(call, self.agent.tool_index.get(call.name))
        self._record_result(result, events)
        turn = self.snapshot.open_turn
        remaining = [w for w in turn.pending_authorizations if w.tool_call.id != call.id]
        del turn.pending_authorizations[:]
        turn.pending_authorizations.extend(remaining)
        if turn.pending_inputs or turn.pending_authorizations:
            await self._commit(events)
        else:
            await self._turn_loop(events)

    def _abandon_waits(self) -> list[s.Event]:
        """A plain message while the turn waits: pending waits are closed
        (approvals and sign-ins as not done) and the turn goes on."""
        events: list[s.Event] = []
        turn = self.snapshot.open_turn
        for request in turn.pending_inputs:
            if request.kind == s.INPUT_KIND_APPROVAL:
                call = request.tool_call
                self._record_result(
                    s.ToolResult(
                        tool_call_id=call.id,
                        name=call.name,
                        output="not approved: the user sent a new message",
                        is_error=True,
                    ),
                    events,
                )
        for wait in turn.pending_authorizations:
            call = wait.tool_call
            self._record_result(
                s.ToolResult(
                    tool_call_id=call.id,
                    name=call.name,
                    output="sign-in abandoned: the user sent a new message",
                    is_error=True,
                ),
                events,
            )
        del turn.pending_inputs[:]
        del turn.pending_authorizations[:]
        return events

    def _cancel_waiting_turn(self, entry: s.InboxEntry) -> list[s.Event]:
        events: list[s.Event] = []
        if self.snapshot.HasField("open_turn"):
            events = self._abandon_waits()
            usage = s.Usage()
            usage.CopyFrom(self.snapshot.open_turn.usage)
            events.append(self._event(s.EVENT_KIND_TURN_CANCELLED, entry, usage=usage))
            self.snapshot.ClearField("open_turn")
        return events

    # -- other commands -------------------------------------------------------

    async def _compact(self, entry: s.InboxEntry) -> None:
        events = self._cancel_waiting_turn(entry)
        self._consume(entry)
        await self._summarize(events, entry)

    async def _compact_if_over_budget(self) -> None:
        """At a turn boundary: compact when what the model sees outgrew the
        agent's context budget (DESIGN.md §4)."""
        budget, entries = self.agent.context_budget_bytes, self.agent.context_budget_entries
        log = self.snapshot.history_log
        over = (budget and log.context_bytes > budget) or (entries and len(self._context) > entries)
        if not over or self.snapshot.HasField("open_turn"):
            return
        self._log.info(
            "context over budget; compacting",
            bytes=log.context_bytes,
            entries=len(self._context),
            budget_bytes=budget,
            budget_entries=entries,
        )
        await self._summarize([], None)

    async def _summarize(self, events: list[s.Event], entry: s.InboxEntry | None) -> None:
        """Replace the context with the model's summary of it; `entry` is the
        compact command, or None when the owner compacts on its own."""
        automatic = entry is None
        before = self._context_size()
        try:
            reply = await self.agent.model.complete(
                self.agent.compaction_instructions, self._context, ()
            )
        except Exception as exc:  # noqa: BLE001 - authored code
            message = safe_error(exc)
            self._log.warning("compaction failed", error=repr(exc), automatic=automatic)
            if entry is not None:
                events.append(self._rejection(entry, "COMPACTION_FAILED", message))
            else:
                events.append(
                    self._event(
                        s.EVENT_KIND_CONTEXT_COMPACTED,
                        error=s.ErrorDetail(reason="COMPACTION_FAILED", message=message),
                        context_change=_change(before, before, automatic=True),
                    )
                )
            await self._commit(events)
            return
        usage = s.Usage(
            input_tokens=reply.input_tokens,
            output_tokens=reply.output_tokens,
            model_calls=1,
            cost_micros=reply.cost_micros,
        )
        _add_usage(self.snapshot.usage, usage)
        summary = f"Summary of earlier conversation: {reply.text}"
        self._reset_context([s.ChatMessage(role=s.ROLE_SYSTEM, content=summary)])
        events.append(
            self._event(
                s.EVENT_KIND_CONTEXT_COMPACTED,
                entry,
                text=reply.text,
                usage=usage,
                context_change=_change(before, self._context_size(), automatic=automatic),
            )
        )
        await self._commit(events)

    # -- the model history (DESIGN.md §4) ---------------------------------------

    def _remember(self, message: s.ChatMessage) -> None:
        """Append to the history: the model sees it now; the next commit
        writes it as an entry of its own."""
        log = self.snapshot.history_log
        size = message.ByteSize()
        self._context.append(message)
        self._appended.append(message)
        self._largest_appended = max(self._largest_appended, size)
        log.next_index += 1
        log.context_bytes += size

    def _reset_context(self, messages: Sequence[s.ChatMessage]) -> None:
        """Start a new context (clear, compaction): the model sees only
        `messages`; the entries before them are retired after the commit."""
        log = self.snapshot.history_log
        log.context_start = log.next_index
        log.context_bytes = 0
        self._context = []
        for message in messages:
            self._remember(message)

    def _context_size(self) -> tuple[int, int]:
        return len(self._context), self.snapshot.history_log.context_bytes

    def _start_retire(self) -> None:
        """Retire (delete) committed history entries the model no longer
        sees, in the background: never blocks a turn. The mark is persisted
        by the next commit; until then a successor simply retires again."""
        if self._retiring is not None and not self._retiring.done():
            return
        below = self._committed_log.context_start
        start = self.snapshot.history_log.retired_below
        if below <= start:
            return
        self._retiring = asyncio.get_running_loop().create_task(self._retire(start, below))

    async def _retire(self, start: int, below: int) -> None:
        try:
            deleted = await self._anchor.retire_history(self.identity.fence, below, start)
        except BatonError as exc:
            # Fenced: the run learns it from its next commit. Anything else:
            # retried after the next commit or by a successor.
            self._log.info("history not retired yet", reason=exc.reason, below=below)
            return
        log = self.snapshot.history_log
        log.retired_below = max(log.retired_below, below)
        self._log.debug("history retired", below=below, deleted=deleted)

    async def _retired(self) -> None:
        """Wait for the retirement in progress (a finalized session's)."""
        if self._retiring is not None:
            await self._retiring

    def _rejection(self, entry: s.InboxEntry, reason: str = "", message: str = "") -> s.Event:
        if not reason:
            kind = entry.command.WhichOneof("kind")
            if kind is None:
                reason = "UNKNOWN_COMMAND_KIND"
                message = (
                    f"deployment {self.identity.deployment_id} does not know this command kind"
                )
            elif kind == "send":
                reason, message = "EMPTY_MESSAGE", "the message is empty"
            else:
                reason = "UNSUPPORTED_COMMAND"
                message = f"command kind {kind!r} is not supported here"
        self._log.info("command rejected", reason=reason, inbox_seq=entry.seq)
        return self._event(
            s.EVENT_KIND_COMMAND_REJECTED,
            entry,
            error=s.ErrorDetail(reason=reason, message=message),
        )

    async def _reject(self, entry: s.InboxEntry, reason: str, message: str) -> None:
        self._consume(entry)
        await self._commit([self._rejection(entry, reason, message)])

    async def _finalize(
        self, events: list[s.Event], entry: s.InboxEntry, error: s.ErrorDetail | None = None
    ) -> None:
        """Terminal: close the stream once, then release every token. The
        history is retired: nothing will read it again."""
        self._consume(entry)
        if self.snapshot.HasField("open_turn"):
            events += self._cancel_waiting_turn(entry)
        self._reset_context([])
        self.snapshot.status = s.SESSION_STATUS_FINALIZED
        events.append(self._event(s.EVENT_KIND_SESSION_COMPLETED, entry, error=error))
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

    # -- events and commits ---------------------------------------------------

    def _consume(self, entry: s.InboxEntry) -> None:
        self.snapshot.inbox_next_seq = max(self.snapshot.inbox_next_seq, entry.seq + 1)

    def _event(
        self,
        kind: s.EventKind.ValueType,
        entry: s.InboxEntry | None = None,
        *,
        step: int = 0,
        text: str = "",
        tool_call: s.ToolCall | None = None,
        tool_result: s.ToolResult | None = None,
        usage: s.Usage | None = None,
        error: s.ErrorDetail | None = None,
        input_request: s.InputRequest | None = None,
        attempt_id: str = "",
        handoff_id: str = "",
        context_change: s.ContextChange | None = None,
    ) -> s.Event:
        return make_event(
            self.identity,
            kind,
            self._turn_id,
            entry,
            step=step,
            text=text,
            tool_call=tool_call,
            tool_result=tool_result,
            usage=usage,
            error=error,
            input_request=input_request,
            attempt_id=attempt_id,
            handoff_id=handoff_id,
            context_change=context_change,
        )

    async def commit_checkpoint(self) -> None:
        """Commit the snapshot unchanged (fenced, compared with the last
        revision): settles an uncertain handoff. Raises Fenced if it moved."""
        await self._commit([])

    async def _commit(self, events: list[s.Event], close: bool = False) -> None:
        carry, self._carry = self._carry, []
        events[:0] = carry
        try:
            if self._largest_appended > limits.MAX_HISTORY_ENTRY_BYTES:
                raise InvalidArgument(
                    Reason.HISTORY_ENTRY_TOO_LARGE,
                    f"a history entry of {self._largest_appended} bytes is over the limit "
                    f"of {limits.MAX_HISTORY_ENTRY_BYTES}",
                )
            self._snapshot_revision = await commit_step(
                self._anchor,
                self.identity,
                self.snapshot,
                events,
                close,
                self._snapshot_revision,
                self._appended,
            )
        except (InvalidArgument, ResourceExhausted) as exc:
            if exc.reason == Reason.STORE_FULL:
                raise
            raise _CommitRefused(exc.reason, exc.message, close, events, carry) from exc
        snap = self.snapshot
        self._appended = []
        self._largest_appended = 0
        self._committed_log.CopyFrom(snap.history_log)
        self._committed_context = (self._context, len(self._context))
        self._committed_next_seq = snap.next_event_seq
        self._committed_turn_id = snap.open_turn.turn_id
        self._committed_snapshot = snap.SerializeToString()
        self.progressed = True
        self._start_retire()

    async def _guarded(self, work: Awaitable[None]) -> None:
        """Run `work`; a commit it makes that can never succeed (too large,
        invalid) fails the turn instead (DETERMINISTIC_FAILURES)."""
        try:
            await work
        except _CommitRefused as refused:
            await self._fail_refused(refused)

    async def _fail_refused(self, refused: _CommitRefused) -> None:
        """Roll back what the refused commit would have written (its events
        and history entries) and commit in its place: the turn failed, with
        the reason. Whatever it consumed from the inbox stays consumed, and
        usage (model calls were made) stays counted; the session then waits
        for the next message."""
        snap = self.snapshot
        self._log.warning(
            "commit refused; the turn fails", reason=refused.reason, error=refused.message
        )
        snap.next_event_seq = self._committed_next_seq
        snap.history_log.CopyFrom(self._committed_log)
        context, length = self._committed_context
        self._context = context[:length]
        self._appended = []
        self._largest_appended = 0
        self._carry = refused.carry
        error = s.ErrorDetail(reason=refused.reason, message=refused.message[:500])
        # The turn the refused commit belonged to: still open, or settled by
        # that very commit (its final answer was what did not fit).
        usage = s.Usage()
        turn_id = snap.open_turn.turn_id
        if turn_id:
            usage.CopyFrom(snap.open_turn.usage)
        else:
            settled = [e for e in refused.events if e.kind in _SETTLE_KINDS and e.turn_id]
            if settled:
                turn_id = settled[-1].turn_id
                usage.CopyFrom(settled[-1].usage)
        snap.ClearField("open_turn")
        events: list[s.Event] = []
        if turn_id:
            if turn_id != self._committed_turn_id:  # it never reached the stream
                events.append(make_event(self.identity, s.EVENT_KIND_TURN_STARTED, turn_id))
            events.append(
                make_event(
                    self.identity, s.EVENT_KIND_TURN_FAILED, turn_id, usage=usage, error=error
                )
            )
        else:
            events.append(self._event(s.EVENT_KIND_COMMAND_REJECTED, error=error))
        if refused.close:
            events.append(refused.events[-1])
        else:
            events.append(self._event(s.EVENT_KIND_SESSION_WAITING))
        await self._commit(events, close=refused.close)


def make_event(
    identity: RunIdentity,
    kind: s.EventKind.ValueType,
    turn_id: str = "",
    entry: s.InboxEntry | None = None,
    **fields: object,
) -> s.Event:
    nanos = time.time_ns()
    event = s.Event(
        session_id=identity.fence.session_id,
        kind=kind,
        time=Timestamp(seconds=nanos // 1_000_000_000, nanos=nanos % 1_000_000_000),
        turn_id=turn_id,
        owner_run_id=identity.fence.owner_run_id,
        deployment_id=identity.deployment_id,
        **{k: v for k, v in fields.items() if v},  # type: ignore[arg-type]
    )
    if entry is not None:
        event.inbox_seq = entry.seq
        event.delivery_id = entry.command.delivery.delivery_id
    return event


async def commit_step(
    anchor: AnchorClient,
    identity: RunIdentity,
    snapshot: s.SessionSnapshot,
    events: list[s.Event],
    close: bool = False,
    expected_snapshot_revision: int | None = None,
    history: Sequence[s.ChatMessage] = (),
) -> int | None:
    """Commit events + history entries + snapshot as one fenced txn; returns
    the snapshot's new revision. Transient failures are retried with the
    identical request (anchor recognises a replay): for COMMIT_RETRY_SECONDS,
    and while etcd is full (STORE_FULL) until an operator has made room, so
    the step's work is never lost or redone for it."""
    for offset, event in enumerate(events):
        event.seq = snapshot.next_event_seq + offset
    snapshot.next_event_seq += len(events)
    snapshot.deployment_id = identity.deployment_id
    request = anchor_pb.CommitStepRequest(
        fence=identity.fence,
        events=events,
        snapshot=snapshot,
        close_stream=close,
        expected_snapshot_revision=expected_snapshot_revision,
        history=history,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + COMMIT_RETRY_SECONDS
    backoff = 0.05
    while True:
        try:
            response = await anchor.commit(request)
            return response.revision if expected_snapshot_revision is not None else None
        except (Unavailable, DeadlineExceeded) as exc:
            if loop.time() > deadline:
                raise
            log.warning("commit retry", reason=exc.reason, session_id=identity.fence.session_id)
        except ResourceExhausted as exc:
            if exc.reason != Reason.STORE_FULL:
                raise
            log.error(
                "commit waits: etcd is full",
                reason=exc.reason,
                session_id=identity.fence.session_id,
            )
            await asyncio.sleep(STORE_FULL_RETRY_MAX_SECONDS)
            continue
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 1.0)


def _change(
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


def _add_usage(total: s.Usage, step: s.Usage) -> None:
    total.input_tokens += step.input_tokens
    total.output_tokens += step.output_tokens
    total.model_calls += step.model_calls
    total.cost_micros += step.cost_micros
