"""Step rules (docs/design.md §4), as functions over `SessionState` (held.py):
a step's tool calls (ids unique in the session; which run now, which give
work to a child, which wait for the user), what its model call's failure
and its child work mean, and what a step's progress does to history, usage
and the stream. Pure: no I/O; the step itself is run/step.py, which only
calls out and records what it got in a `StepProgress`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import Reason
from baton_runtime.owner.agents.api import (
    ASK_SUBAGENT,
    CONTINUE_TASK,
    ModelRejected,
    ModelReply,
    dumps_arguments,
)
from baton_runtime.owner.rules import children, waits
from baton_runtime.owner.rules.children import ChildWork
from baton_runtime.owner.rules.handles import Refusal, add_usage
from baton_runtime.owner.rules.held import SessionState
from baton_runtime.owner.rules.waits import error_result


class Outcome(enum.Enum):
    """What a step left the turn in."""

    CONTINUE = "continue"  # tools ran; next step
    FINAL = "final"  # the model answered
    PAUSED = "paused"  # waits for input or sign-in
    AWAITING = "awaiting"  # waits for children's results only
    ABORTED = "aborted"  # a pushed command aborted the step
    FAILED = "failed"  # the model failed


@dataclass
class StepProgress:
    """What an (abortable) step produced so far; applied by `apply_step`."""

    reply: ModelReply | None = None
    error: str = ""
    reason: str = Reason.MODEL_ERROR
    calls: list[s.ToolCall] = field(default_factory=list)
    results: dict[int, s.ToolResult] = field(default_factory=dict)
    children: dict[int, ChildWork] = field(default_factory=dict)
    aborted: bool = False


def usage_of(reply: ModelReply) -> s.Usage:
    return s.Usage(
        input_tokens=reply.input_tokens,
        output_tokens=reply.output_tokens,
        model_calls=reply.model_calls,
        cost_micros=reply.cost_micros,
    )


def tool_calls(state: SessionState, reply: ModelReply) -> list[s.ToolCall]:
    """The reply's tool calls, with ids unique in the session."""
    first = state.snapshot.tool_call_count
    return [
        s.ToolCall(
            id=f"call_{first + offset + 1}",
            name=requested.name,
            arguments_json=dumps_arguments(requested.arguments),
        )
        for offset, requested in enumerate(reply.tool_calls)
    ]


def runs_now(state: SessionState, call: s.ToolCall) -> bool:
    """A tool call the step runs itself (others wait for the user)."""
    tool = state.agent.tool_index.get(call.name)
    return tool is None or not (tool.needs_approval or tool.sign_in_attempts)


def starts_child(state: SessionState, call: s.ToolCall) -> bool:
    """A tool call that gives work to a child session."""
    if call.name in (ASK_SUBAGENT, CONTINUE_TASK):
        return call.name in state.agent.tool_index
    tool = state.agent.tool_index.get(call.name)
    return tool is not None and tool.starts_child and runs_now(state, call)


def apply_step(state: SessionState, progress: StepProgress, events: list[s.Event]) -> Outcome:
    """Fold a step's progress into history, usage and events."""
    snap = state.snapshot
    reply = progress.reply
    if reply is None:
        return Outcome.ABORTED if progress.aborted else Outcome.FAILED
    snap.open_turn.steps += 1
    step = snap.open_turn.steps
    events.append(state.event(s.EVENT_KIND_STEP_STARTED, step=step))
    usage = usage_of(reply)
    add_usage(snap.open_turn.usage, usage)
    add_usage(snap.usage, usage)
    if reply.question:
        state.context.remember(s.ChatMessage(role=s.ROLE_ASSISTANT, content=reply.question))
        events.append(state.event(s.EVENT_KIND_MESSAGE_COMPLETED, step=step, text=reply.question))
        waits.request_input(state, events, s.INPUT_KIND_QUESTION, reply.question, step=step)
        outcome = Outcome.PAUSED
    elif not progress.calls:
        state.context.remember(s.ChatMessage(role=s.ROLE_ASSISTANT, content=reply.text))
        events.append(state.event(s.EVENT_KIND_MESSAGE_COMPLETED, step=step, text=reply.text))
        outcome = Outcome.FINAL
    else:
        outcome = _apply_calls(state, progress, events, step)
    events.append(state.event(s.EVENT_KIND_STEP_COMPLETED, step=step, usage=usage))
    if progress.aborted:
        return Outcome.ABORTED
    if outcome is Outcome.CONTINUE and state.handles.awaited(state.turn_id):
        return Outcome.AWAITING
    if outcome is Outcome.FINAL:
        state.answer = reply.text
    return outcome


def _apply_calls(
    state: SessionState, progress: StepProgress, events: list[s.Event], step: int
) -> Outcome:
    """The step's tool calls, in order: what each did, or why it waits;
    the last call that fails or pauses the turn says what the step did."""
    state.snapshot.tool_call_count += len(progress.calls)
    state.context.remember(s.ChatMessage(role=s.ROLE_ASSISTANT, tool_calls=progress.calls))
    outcome = Outcome.CONTINUE
    for index, call in enumerate(progress.calls):
        events.append(state.event(s.EVENT_KIND_TOOL_CALL_REQUESTED, step=step, tool_call=call))
        outcome = _apply_call(state, progress, index, call, events, step) or outcome
    return outcome


def _apply_call(
    state: SessionState,
    progress: StepProgress,
    index: int,
    call: s.ToolCall,
    events: list[s.Event],
    step: int,
) -> Outcome | None:
    """One tool call of the step: given to a child, run (a failure may
    fail the turn), cancelled by an abort, or waiting for an approval or
    a sign-in (the turn pauses). None: the turn goes on."""
    tool = state.agent.tool_index.get(call.name)
    if index in progress.children:
        children.child_given_work(state, progress.children[index], call, events, step)
    elif index in progress.results:
        result = progress.results[index]
        state.record_result(result, events, step)
        if result.is_error and state.agent.fail_on_tool_error:
            progress.reason, progress.error = Reason.TOOL_FAILED, result.output[:500]
            return Outcome.FAILED
    elif progress.aborted:
        state.record_result(error_result(call, "cancelled"), events, step)
    elif tool is not None and tool.needs_approval:
        prompt = f"Allow {call.name}({call.arguments_json})?"
        waits.request_input(state, events, s.INPUT_KIND_APPROVAL, prompt, step=step, tool_call=call)
        return Outcome.PAUSED
    elif tool is not None and tool.sign_in_attempts:
        waits.require_authorization(state, events, call, tool.sign_in_attempts, step)
        return Outcome.PAUSED
    return None


def safe_error(exc: BaseException) -> str:
    """What a public event may say about a failure of authored code: the
    exception's type and a bounded prefix of its message."""
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def model_failed(progress: StepProgress, exc: Exception) -> None:
    """The step's model call failed (authored code): the turn fails, saying
    why; a model that refused the request says so by its reason."""
    progress.error = safe_error(exc)
    if isinstance(exc, ModelRejected):
        progress.reason = Reason.MODEL_REJECTED


def child_work_done(
    progress: StepProgress, index: int, call: s.ToolCall, outcome: ChildWork | Refusal
) -> None:
    """The call `index` gave a child its work (`apply_step` records the
    handle), or could not (the call's error result says why)."""
    if isinstance(outcome, ChildWork):
        progress.children[index] = outcome
    else:
        progress.results[index] = s.ToolResult(
            tool_call_id=call.id, name=call.name, output=outcome.output(), is_error=True
        )


def aliases_claimed(state: SessionState, tokens: Sequence[str]) -> None:
    """A tool claimed an alias: `tokens` are the session's tokens now (the
    claim is durable; the step's commit records them)."""
    del state.snapshot.hooks[:]
    state.snapshot.hooks.extend(tokens)
