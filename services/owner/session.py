"""A session program: one owner run of one session.

It reads the session's inbox continuously (a server stream from hooks), takes
commands in inbox order, runs turns of steps, and commits each step through
anchor as one fenced transaction: the step's events plus the new snapshot,
whose inbox position says which commands the step consumed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton.session.v1 import session_pb2 as s
from services.common.clients import AnchorClient, HooksClient
from services.common.errors import BatonError, DeadlineExceeded, Fenced, Unavailable
from services.owner.agent import Agent, ToolContext, dumps_arguments

log = structlog.get_logger("baton.owner.session")

SNAPSHOT_FORMAT = 1
COMMIT_RETRY_SECONDS = 30.0
_END = object()


@dataclass(frozen=True)
class RunIdentity:
    """Who is running: the fence plus the deployment and instance."""

    fence: s.Fence
    deployment_id: str
    instance_id: str


def initial_snapshot(
    session_id: str, channel: str, deployment_id: str, hooks: list[str]
) -> s.SessionSnapshot:
    return s.SessionSnapshot(
        format_version=SNAPSHOT_FORMAT,
        session_id=session_id,
        channel=channel,
        deployment_id=deployment_id,
        hooks=hooks,
        status=s.SESSION_STATUS_ACTIVE,
    )


class SessionRun:
    """Executes one session for one owner run until fenced or finalized."""

    def __init__(
        self,
        identity: RunIdentity,
        snapshot: s.SessionSnapshot,
        agent: Agent,
        hooks: HooksClient,
        anchor: AnchorClient,
        on_exit: Callable[[SessionRun], None] | None = None,
    ) -> None:
        self.identity = identity
        self.snapshot = snapshot
        self.agent = agent
        self._hooks = hooks
        self._anchor = anchor
        self._on_exit = on_exit
        self._inbox: asyncio.Queue[s.InboxEntry | object] = asyncio.Queue()
        self._turn_id = ""
        self._log = log.bind(
            session_id=identity.fence.session_id,
            run_id=identity.fence.owner_run_id,
            epoch=identity.fence.epoch,
            deployment_id=identity.deployment_id,
        )

    @property
    def session_id(self) -> str:
        return self.identity.fence.session_id

    # -- the program ------------------------------------------------------

    async def run(self) -> None:
        reader = asyncio.get_running_loop().create_task(self._read_inbox())
        try:
            while self.snapshot.status != s.SESSION_STATUS_FINALIZED:
                entry = await self._inbox.get()
                if entry is _END:
                    return
                assert isinstance(entry, s.InboxEntry)
                if entry.seq < self.snapshot.inbox_next_seq:
                    continue  # consumed by a committed step already
                await self._handle(entry)
        except Fenced:
            self._log.info("fenced; run ends")
        except BatonError as exc:
            self._log.error("run failed", reason=exc.reason, error=exc.message)
        finally:
            reader.cancel()
            if self._on_exit is not None:
                self._on_exit(self)

    async def _read_inbox(self) -> None:
        """Feed the inbox queue in seq order; reconnect on transient errors."""
        next_seq = self.snapshot.inbox_next_seq
        backoff = 0.05
        while True:
            try:
                async for response in self._hooks.stream_inbox(self.identity.fence, next_seq):
                    for entry in response.entries:
                        if entry.seq >= next_seq:
                            next_seq = entry.seq + 1
                            self._inbox.put_nowait(entry)
                    backoff = 0.05
            except Fenced:
                self._inbox.put_nowait(_END)
                return
            except BatonError as exc:
                if not exc.retryable:
                    self._log.error("inbox stream failed", reason=exc.reason, error=exc.message)
                    self._inbox.put_nowait(_END)
                    return
                self._log.warning("inbox stream interrupted; reconnecting", reason=exc.reason)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _handle(self, entry: s.InboxEntry) -> None:
        kind = entry.command.WhichOneof("kind")
        if kind == "send":
            if entry.command.send.input_responses:
                await self._reject(entry, "INPUT_NOT_PENDING", "no input request is pending")
            elif not entry.command.send.text.strip():
                await self._reject(entry, "EMPTY_MESSAGE", "the message is empty")
            else:
                await self._run_turn(entry)
        elif kind == "reset":
            await self._finalize(entry)
        elif kind == "clear":
            del self.snapshot.history[:]
            self._consume(entry)
            await self._commit([self._event(s.EVENT_KIND_CONTEXT_CLEARED, entry)])
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

    async def _run_turn(self, entry: s.InboxEntry) -> None:
        snap = self.snapshot
        snap.turn_count += 1
        self._turn_id = f"turn_{snap.turn_count}"
        text = entry.command.send.text
        self._consume(entry)
        snap.history.append(s.ChatMessage(role=s.ROLE_USER, content=text))
        events = [
            self._event(s.EVENT_KIND_TURN_STARTED, entry),
            self._event(s.EVENT_KIND_MESSAGE_RECEIVED, entry, text=text),
        ]
        turn_usage = s.Usage()
        for step in range(1, self.agent.max_steps_per_turn + 1):
            events.append(self._event(s.EVENT_KIND_STEP_STARTED, step=step))
            try:
                reply = await self.agent.model.complete(
                    self.agent.instructions, snap.history, self.agent.tools
                )
            except Exception as exc:  # noqa: BLE001 - authored code: any failure fails the turn
                self._log.warning("model call failed", error=repr(exc), turn_id=self._turn_id)
                await self._settle(
                    events,
                    s.EVENT_KIND_TURN_FAILED,
                    turn_usage,
                    error=s.ErrorDetail(reason="MODEL_ERROR", message=str(exc)),
                )
                return
            step_usage = s.Usage(
                input_tokens=reply.input_tokens,
                output_tokens=reply.output_tokens,
                model_calls=1,
                cost_micros=reply.cost_micros,
            )
            _add_usage(turn_usage, step_usage)
            _add_usage(snap.usage, step_usage)
            if not reply.tool_calls:
                snap.history.append(s.ChatMessage(role=s.ROLE_ASSISTANT, content=reply.text))
                events.append(self._event(s.EVENT_KIND_MESSAGE_COMPLETED, step=step, text=reply.text))
                events.append(self._event(s.EVENT_KIND_STEP_COMPLETED, step=step, usage=step_usage))
                await self._settle(events, s.EVENT_KIND_TURN_COMPLETED, turn_usage)
                return
            await self._run_tools(reply, step, events)
            events.append(self._event(s.EVENT_KIND_STEP_COMPLETED, step=step, usage=step_usage))
            snap.open_turn.CopyFrom(
                s.OpenTurn(turn_id=self._turn_id, steps=step, usage=turn_usage)
            )
            await self._commit(events)
            events = []
        await self._settle(
            events,
            s.EVENT_KIND_TURN_FAILED,
            turn_usage,
            error=s.ErrorDetail(
                reason="MAX_STEPS",
                message=f"the turn reached {self.agent.max_steps_per_turn} steps",
            ),
        )

    async def _run_tools(self, reply: object, step: int, events: list[s.Event]) -> None:
        snap = self.snapshot
        calls = []
        for requested in reply.tool_calls:  # type: ignore[attr-defined]
            snap.tool_call_count += 1
            calls.append(
                s.ToolCall(
                    id=f"call_{snap.tool_call_count}",
                    name=requested.name,
                    arguments_json=dumps_arguments(requested.arguments),
                )
            )
        snap.history.append(s.ChatMessage(role=s.ROLE_ASSISTANT, tool_calls=calls))
        context = ToolContext(
            session_id=self.session_id,
            deployment_id=self.identity.deployment_id,
            owner_run_id=self.identity.fence.owner_run_id,
        )
        for call in calls:
            events.append(self._event(s.EVENT_KIND_TOOL_CALL_REQUESTED, step=step, tool_call=call))
            tool = self.agent.tool_index.get(call.name)
            result = s.ToolResult(tool_call_id=call.id, name=call.name)
            if tool is None:
                result.output, result.is_error = f"unknown tool {call.name!r}", True
            else:
                try:
                    result.output = await tool.run(json.loads(call.arguments_json), context)
                except Exception as exc:  # noqa: BLE001 - authored code: the model sees the error
                    result.output, result.is_error = f"{type(exc).__name__}: {exc}", True
            events.append(self._event(s.EVENT_KIND_TOOL_CALL_RESULT, step=step, tool_result=result))
            snap.history.append(
                s.ChatMessage(role=s.ROLE_TOOL, content=result.output, tool_call_id=call.id)
            )

    async def _settle(
        self,
        events: list[s.Event],
        kind: s.EventKind.ValueType,
        usage: s.Usage,
        error: s.ErrorDetail | None = None,
    ) -> None:
        """Close the turn and wait: one commit with the turn's last events."""
        events.append(self._event(kind, usage=usage, error=error))
        self.snapshot.ClearField("open_turn")
        self._turn_id = ""
        events.append(self._event(s.EVENT_KIND_SESSION_WAITING))
        await self._commit(events)

    # -- other commands -------------------------------------------------------

    async def _reject(self, entry: s.InboxEntry, reason: str, message: str) -> None:
        self._log.info("command rejected", reason=reason, inbox_seq=entry.seq)
        self._consume(entry)
        error = s.ErrorDetail(reason=reason, message=message)
        await self._commit([self._event(s.EVENT_KIND_COMMAND_REJECTED, entry, error=error)])

    async def _finalize(self, entry: s.InboxEntry) -> None:
        """Reset: terminal. Close the stream once, then release every token."""
        self._consume(entry)
        self.snapshot.status = s.SESSION_STATUS_FINALIZED
        await self._commit([self._event(s.EVENT_KIND_SESSION_COMPLETED, entry)], close=True)
        await self._hooks.dispose(self.identity.fence)
        self._log.info("session finalized")

    # -- events and commits ---------------------------------------------------

    def _consume(self, entry: s.InboxEntry) -> None:
        self.snapshot.inbox_next_seq = entry.seq + 1

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
    ) -> s.Event:
        now = Timestamp()
        now.GetCurrentTime()
        event = s.Event(
            session_id=self.session_id,
            kind=kind,
            time=now,
            turn_id=self._turn_id,
            step=step,
            owner_run_id=self.identity.fence.owner_run_id,
            deployment_id=self.identity.deployment_id,
            text=text,
            tool_call=tool_call,
            tool_result=tool_result,
            usage=usage,
            error=error,
        )
        if entry is not None:
            event.inbox_seq = entry.seq
            event.delivery_id = entry.command.delivery.delivery_id
        return event

    async def _commit(self, events: list[s.Event], close: bool = False) -> None:
        """Commit events + snapshot as one fenced txn; retry transient failures
        with the identical request (anchor recognises a replay)."""
        snap = self.snapshot
        for offset, event in enumerate(events):
            event.seq = snap.next_event_seq + offset
        snap.next_event_seq += len(events)
        snap.deployment_id = self.identity.deployment_id
        request = anchor_pb.CommitStepRequest(
            fence=self.identity.fence, events=events, snapshot=snap, close_stream=close
        )
        await commit_with_retry(self._anchor, request)


async def commit_with_retry(anchor: AnchorClient, request: anchor_pb.CommitStepRequest) -> None:
    deadline = asyncio.get_running_loop().time() + COMMIT_RETRY_SECONDS
    backoff = 0.05
    while True:
        try:
            await anchor.commit(request)
            return
        except BatonError as exc:
            transient = isinstance(exc, Unavailable | DeadlineExceeded)
            if not transient or asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("commit retry", reason=exc.reason, session_id=request.fence.session_id)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 1.0)


def _add_usage(total: s.Usage, step: s.Usage) -> None:
    total.input_tokens += step.input_tokens
    total.output_tokens += step.output_tokens
    total.model_calls += step.model_calls
    total.cost_micros += step.cost_micros
