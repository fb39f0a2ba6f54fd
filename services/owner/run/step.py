"""One step of a turn, the I/O (docs/design.md §4): the model call, the tools it
asks for, and the work it gives child sessions. A step is abortable: a
pushed cancel, reset or own timeout (`abort`) cancels it at once, keeping
what it produced so far (`StepProgress`); giving a child its work is not
cut half-way (a child that got its work is recorded, so none is orphaned).

What the step's results mean is the rules' business (rules/steps.py: the
calls it makes, what a failure or a child's work means, how the progress
folds into the session); which tool calls to run for answered waits, the
decisions' (rules/decisions.py). This room only calls out and records.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import failpoints
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.live import LivePublisher
from baton_runtime.common.errors import BatonError, Reason
from baton_runtime.common.observability import metrics
from baton_runtime.common.tasks import Background
from baton_runtime.owner.agents.api import (
    AgentCatalog,
    ModelDelta,
    Tool,
    ToolContext,
    streamed_reply,
)
from baton_runtime.owner.rules import handles as h
from baton_runtime.owner.rules import steps
from baton_runtime.owner.rules.children import ChildWork, plan_child_work, work_not_given
from baton_runtime.owner.rules.handles import Refusal
from baton_runtime.owner.rules.held import RunIdentity, SessionState
from baton_runtime.owner.rules.steps import StepProgress, safe_error, usage_of
from baton_runtime.owner.run import spans  # tracing
from baton_runtime.owner.run.children import Children
from baton_runtime.owner.run.live import StepLive
from baton_runtime.owner.run.terms import Lease

# How long a step's end waits for its last live items to be handed to
# anchor's streams (a replica slow or down is not waited for longer).
_LIVE_SENT_SECONDS = 0.1


def _ignore(delta: ModelDelta) -> None:
    """Deltas nobody sees."""


class StepRunner:
    """Runs the steps of one run's turns, one at a time."""

    def __init__(
        self,
        identity: RunIdentity,
        state: SessionState,
        hooks: HooksClient,
        children: Children | None,
        catalog: AgentCatalog,
        background: Background,
        log: structlog.BoundLogger,
        lease: Lease | None = None,
        live: LivePublisher | None = None,
    ) -> None:
        """`lease`: the instance's (None: none), checked before every model
        and tool call (`Lease`). `live`: where the steps' live items go
        (anchor's replicas; None: nowhere)."""
        self._identity = identity
        self._lease = lease
        self._state = state
        self._hooks = hooks
        self._children = children
        self._catalog = catalog  # where a subagent's name is looked up
        self._background = background
        self._log = log
        self._task: asyncio.Task[None] | None = None
        self._abort_requested = False
        self._publisher = live
        self._live: StepLive | None = None
        self._attempts: dict[int, int] = {}  # step runs started per base seq

    def abort(self) -> None:
        """Cancel the running step, if one runs (the shell saw a pushed
        command that aborts it)."""
        if self._task is not None and not self._task.done():
            self._abort_requested = True
            self._task.cancel()

    async def run(self) -> StepProgress:
        """One model call plus the tools it asks for, abortable by `abort`."""
        progress = StepProgress()
        metrics.STEPS.inc()
        self._abort_requested = False
        self._task = self._background.spawn(self._execute(progress))
        try:
            await self._task
        except asyncio.CancelledError:
            if not self._abort_requested:
                raise
            progress.aborted = True
        finally:
            self._task = None
            self._abort_requested = False
        if self._publisher is not None:
            # The step's last live items leave before its commit does.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_LIVE_SENT_SECONDS):
                    await self._publisher.sent()
        return progress

    async def _execute(self, progress: StepProgress) -> None:
        self._live = self._start_live()
        try:
            await self._call_out(progress)
        finally:
            if self._live is not None:
                self._live.close()
            self._live = None

    def _start_live(self) -> StepLive | None:
        """The step's live items, its start sent at once (docs/design.md
        "Live items"); None when they go nowhere."""
        if self._publisher is None:
            return None
        snapshot = self._state.snapshot
        base = snapshot.next_event_seq
        self._attempts[base] = attempt = self._attempts.get(base, 0) + 1
        fence = self._identity.fence
        step = s.LiveStep(
            session_id=fence.session_id,
            base_seq=base,
            turn_id=self._state.turn_id,
            step=snapshot.open_turn.steps + 1,
            owner_run_id=fence.owner_run_id,
            epoch=fence.epoch,
            attempt=attempt,
        )
        live = StepLive(step, self._publisher.publish)
        live.started(turn_started=snapshot.open_turn.steps == 0)
        return live

    async def _call_out(self, progress: StepProgress) -> None:
        state = self._state
        agent = state.agent
        await failpoints.hit("step.start")
        await self._lease_held()
        await failpoints.hit("step.model_call")
        live = self._live
        try:
            with metrics.MODEL_CALL_SECONDS.time(), spans.model_call():  # tracing
                reply = await streamed_reply(
                    agent.model,
                    agent.instructions,
                    state.context.messages,
                    agent.all_tools,
                    live.delta if live is not None else _ignore,
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - authored code: any failure fails the turn
            self._log.warning("model call failed", error=repr(exc), turn_id=state.turn_id)
            steps.model_failed(progress, exc)
            return
        if live is not None:
            live.flush()  # the reply's last deltas before its tools' progress
        progress.reply = reply
        progress.calls = steps.tool_calls(state, reply)
        for index, call in enumerate(progress.calls):
            if steps.starts_child(state, call):
                await self._start_child_work(progress, index, call, usage_of(reply))
            elif steps.runs_now(state, call):
                progress.results[index] = await self.call_tool(call)

    # -- child work ------------------------------------------------------------------

    async def _start_child_work(
        self, progress: StepProgress, index: int, call: s.ToolCall, step: s.Usage
    ) -> None:
        """Give a child its work. Not abortable half-way: a child that got
        its work is recorded (then a cancel cancels it), so none is orphaned."""
        reserved = frozenset(w.child_session_id for w in progress.children.values())
        task = self._background.spawn(self._give_work(call, reserved, step))
        try:
            outcome = await asyncio.shield(task)
        except asyncio.CancelledError:
            outcome = await task
            steps.child_work_done(progress, index, call, outcome)
            raise
        steps.child_work_done(progress, index, call, outcome)

    async def _give_work(
        self, call: s.ToolCall, reserved: frozenset[str], step: s.Usage
    ) -> ChildWork | Refusal:
        """Start a child (or pick a parked or available one) and put the work
        in its inbox; or say why not (the call's error result)."""
        children = self._children
        if children is None:
            return Refusal(Reason.UNSUPPORTED_COMMAND, "this owner cannot start child sessions")
        plan = plan_child_work(self._state, call, reserved, step, self._catalog.subagent_names)
        if isinstance(plan, Refusal):
            return plan
        child = plan.work.child_session_id
        delivered = False
        try:
            if plan.link is not None:
                channel = self._state.snapshot.channel
                delivered = await children.start(child, channel, plan.link, plan.command)
            if not delivered:
                await children.send(child, plan.command)
        except BatonError as exc:
            if exc.retryable:
                raise  # the run starts again from its last commit; the child is derived
            return work_not_given(child, exc)
        self._log.info(
            "child given work",
            child_session_id=child,
            work=plan.command.send.parent_work,
            kind=h.kind_name(plan.work.kind),
        )
        return plan.work

    # -- tools -------------------------------------------------------------------------

    async def call_tool(self, call: s.ToolCall) -> s.ToolResult:
        """Run an authored tool; its failure is the model's to see."""
        tool: Tool | None = self._state.agent.tool_index.get(call.name)
        result = s.ToolResult(tool_call_id=call.id, name=call.name)
        if tool is None:
            metrics.TOOL_CALL_SECONDS.labels("unknown").observe(0.0)
            result.output, result.is_error = f"unknown tool {call.name!r}", True
            return result
        await self._lease_held()
        start = time.perf_counter()
        try:
            arguments = json.loads(call.arguments_json)
            with spans.tool_call(call):  # tracing
                context = self._tool_context(call.id, call.name)
                result.output = await tool.run(arguments, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - authored code: the model sees the error
            # Public too (tool_call.result): the type and a bounded prefix.
            result.output, result.is_error = safe_error(exc), True
        outcome = "error" if result.is_error else "ok"
        metrics.TOOL_CALL_SECONDS.labels(outcome).observe(time.perf_counter() - start)
        return result

    async def _lease_held(self) -> None:
        """Wait while the instance's lease may have expired: a successor may
        have run this step meanwhile (docs/recovery.md, a paused owner)."""
        lease = self._lease
        if lease is None or not lease.may_have_expired():
            return
        self._log.warning("the lease may have expired: no model or tool call until it is renewed")
        await lease.held()
        self._log.info("the lease was renewed: the step goes on")

    def _tool_context(self, tool_call_id: str, tool_name: str = "") -> ToolContext:
        fence = self._identity.fence
        live = self._live
        progress = None
        if live is not None:

            def progress(text: str) -> None:
                live.progress(tool_call_id, tool_name, text)

        return ToolContext(
            session_id=fence.session_id,
            deployment_id=self._identity.deployment_id,
            owner_run_id=fence.owner_run_id,
            channel=self._state.snapshot.channel,
            add_alias=self._add_alias,
            tool_call_id=tool_call_id,
            progress=progress,
        )

    async def _add_alias(self, token: str) -> None:
        """Claimed durably (fenced) before the step that adds it commits."""
        steps.aliases_claimed(self._state, await self._hooks.claim(self._identity.fence, [token]))
