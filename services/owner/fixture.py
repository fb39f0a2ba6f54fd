"""The deterministic fixture agent used by tests and the demo.

Scripted behaviour of its model, by the last message it sees:
- a tool result            -> a final answer quoting it;
- "calc <expr>" / "what is <expr>" -> a `calculator` tool call;
- "whoami"                  -> a `deployment` tool call (reports the running deployment);
- "steps <n>"               -> n-1 `echo` tool calls, one per step, then an answer;
- "sleep <n> <ms>"          -> n-1 `sleep` tool calls, one per step, each sleeping <ms>
                               milliseconds (a step long enough to crash in), then an answer;
- "fail model"              -> the model raises (a failed turn);
- "wait <ms>"               -> the model call takes <ms> milliseconds, then echoes;
- "transfer <amount>"       -> a `transfer` tool call that needs the user's approval;
- "ask my name"             -> a question for the user; the answer is greeted;
- "read calendar"           -> a `calendar` tool call that needs two sign-in attempts;
- "alias <raw>"             -> an `add_alias` tool call claiming `<channel>:<raw>`;
- "big <kib>"               -> a `big` tool call whose result is <kib> KiB of text;
- "say <kib>"               -> an answer of <kib> KiB of text;
- compaction instructions   -> "<N> messages about: <first user message>".
Child sessions (docs/design.md §11):
- "ask <agent> <prompt>"    -> asks the subagent (`helper`, or `planner`, which
                               can ask `helper` itself; `nobody` names none); the
                               turn waits for the reply;
- "bg <agent> <prompt>"     -> the same in the background (a handle at once);
- "continue [<handle>] <message>" -> continues a parked subagent (the latest one
                               asked in this conversation, or the named handle);
- "task <ms> <text>"        -> the background tool `slow_task` (sleeps <ms>, then
                               "done: <text>");
- "workflow <ms> <text>"    -> the workflow tool `pipeline`: three durable steps
                               (fetch, transform, store), each sleeping <ms>;
- a child's result (as a tool result, or a background one as a message) ->
  "<name> says: <result>", "Started <name> as <handle>.", "<name> finished: <result>",
  or "<name> <failed|cancelled>: <error>".
- anything else             -> "echo: <text>".
Usage: prompt tokens are the words of the instructions and of the last message
plus one per earlier message; completion tokens are the words of the answer.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import json
import operator
import re
from collections.abc import Sequence
from typing import Any

from baton.session.v1 import session_pb2 as s
from services.owner.agent import (
    ASK_SUBAGENT,
    CONTINUE_TASK,
    Agent,
    ModelReply,
    RequestedCall,
    Tool,
    ToolContext,
    ToolMode,
    WorkflowStep,
)

_CALC = re.compile(r"^\s*(?:calc|what is)\s+(.+?)\??\s*$", re.IGNORECASE)
_STEPS = re.compile(r"^\s*steps\s+(\d+)\s*$", re.IGNORECASE)
_SLEEP = re.compile(r"^\s*sleep\s+(\d+)\s+(\d+)\s*$", re.IGNORECASE)
_WAIT = re.compile(r"^\s*wait\s+(\d+)\s*$", re.IGNORECASE)
_TRANSFER = re.compile(r"^\s*transfer\s+(\S+)\s*$", re.IGNORECASE)
_ALIAS = re.compile(r"^\s*alias\s+(\S+)\s*$", re.IGNORECASE)
_BIG = re.compile(r"^\s*big\s+(\d+)\s*$", re.IGNORECASE)
_SAY = re.compile(r"^\s*say\s+(\d+)\s*$", re.IGNORECASE)
_ASK = re.compile(r"^\s*(ask|bg)\s+(helper|planner|nobody)\s+(.+?)\s*$", re.IGNORECASE | re.DOTALL)
_CONTINUE = re.compile(r"^\s*continue\s+(?:(ses_[0-9a-z]{26})\s+)?(.+?)\s*$", re.DOTALL)
_TASK = re.compile(r"^\s*task\s+(\d+)\s+(.+?)\s*$", re.IGNORECASE | re.DOTALL)
_WORKFLOW = re.compile(r"^\s*workflow\s+(\d+)\s+(.+?)\s*$", re.IGNORECASE | re.DOTALL)
_QUESTION = "What is your name?"

_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate(expression: str) -> float | int:
    """Arithmetic only: numbers, + - * / // % **, parentheses."""

    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            right = walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            result: float | int = _OPS[type(node.op)](walk(node.left), right)
            return result
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            value: float | int = _OPS[type(node.op)](walk(node.operand))
            return value
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return walk(ast.parse(expression, mode="eval"))


async def _calculator(arguments: dict[str, Any], ctx: ToolContext) -> str:
    result = evaluate(str(arguments.get("expression", "")))
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


async def _deployment(arguments: dict[str, Any], ctx: ToolContext) -> str:
    return ctx.deployment_id


async def _transfer(arguments: dict[str, Any], ctx: ToolContext) -> str:
    return f"transferred {arguments.get('amount', '')}"


async def _calendar(arguments: dict[str, Any], ctx: ToolContext) -> str:
    return "3 meetings today"


async def _add_alias(arguments: dict[str, Any], ctx: ToolContext) -> str:
    token = f"{ctx.channel}:{arguments.get('raw', '')}"
    if ctx.add_alias is None:
        raise RuntimeError("aliases cannot be added here")
    await ctx.add_alias(token)
    return f"alias {token} added"


async def _sleep(arguments: dict[str, Any], ctx: ToolContext) -> str:
    await asyncio.sleep(int(arguments.get("ms", 0)) / 1000)
    return f"slept {arguments.get('step', '')}"


async def _echo(arguments: dict[str, Any], ctx: ToolContext) -> str:
    return str(arguments.get("text", ""))


async def _big(arguments: dict[str, Any], ctx: ToolContext) -> str:
    return "x" * (int(arguments.get("kib", 0)) * 1024)


async def _slow_task(arguments: dict[str, Any], ctx: ToolContext) -> str:
    """The background tool: runs in a child session of its own."""
    await asyncio.sleep(int(arguments.get("ms", 0) or 0) / 1000)
    text = str(arguments.get("text") or arguments.get("input") or "")
    if text == "fail":
        raise RuntimeError("the task was asked to fail")
    return f"done: {text}"


def _pipeline_step(name: str, verb: str) -> WorkflowStep:
    async def step(arguments: dict[str, Any], ctx: ToolContext) -> str:
        await asyncio.sleep(int(arguments.get("ms", 0) or 0) / 1000)
        previous = str(arguments.get("previous", "")) or str(arguments.get("text", ""))
        return f"{verb} {previous}"

    return WorkflowStep(name, step)


def _words(text: str) -> int:
    return len(text.split())


class FixtureModel:
    """A scripted, deterministic model adapter."""

    async def complete(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> ModelReply:
        # Deterministic and O(1) per call: instructions, the last message, and
        # one token per earlier message.
        prompt_tokens = _words(instructions) + _words(history[-1].content) + len(history) - 1
        if instructions.startswith("Summarize"):
            first = next((m.content for m in history if m.role == s.ROLE_USER), "")
            text = f"{len(history)} messages about: {first}"
            return ModelReply(text=text, input_tokens=prompt_tokens, output_tokens=_words(text))
        last = history[-1]
        if last.role == s.ROLE_TOOL and (answer := _child_answer(last.content)):
            return ModelReply(text=answer, input_tokens=prompt_tokens, output_tokens=_words(answer))
        if last.role == s.ROLE_USER and (answer := _background_answer(last.content)):
            return ModelReply(text=answer, input_tokens=prompt_tokens, output_tokens=_words(answer))
        if last.role == s.ROLE_TOOL:
            step, ms = _next_sleep_step(history)
            if step:
                return ModelReply(
                    tool_calls=[RequestedCall("sleep", {"ms": ms, "step": step})],
                    input_tokens=prompt_tokens,
                )
            pending = _pending_echo_steps(history)
            if pending > 0:
                return ModelReply(
                    tool_calls=[RequestedCall("echo", {"text": f"step {pending}"})],
                    input_tokens=prompt_tokens,
                )
            text = f"The result is {last.content}."
            return ModelReply(text=text, input_tokens=prompt_tokens, output_tokens=_words(text))
        if last.role == s.ROLE_USER and len(history) >= 2 and history[-2].role == s.ROLE_ASSISTANT:
            asked = history[-2].content
            if asked == _QUESTION and not history[-2].tool_calls:
                text = f"Nice to meet you, {last.content}."
                return ModelReply(text=text, input_tokens=prompt_tokens, output_tokens=_words(text))
        user = last.content
        command = user.strip().lower()
        if call := _child_call(user, history, tools):
            return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)
        if match := _WAIT.match(user):
            await asyncio.sleep(int(match.group(1)) / 1000)
            text = f"echo: {user}"
            return ModelReply(text=text, input_tokens=prompt_tokens, output_tokens=_words(text))
        if match := _TRANSFER.match(user):
            call = RequestedCall("transfer", {"amount": match.group(1)})
            return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)
        if command == "ask my name":
            return ModelReply(question=_QUESTION, input_tokens=prompt_tokens, output_tokens=5)
        if command == "read calendar":
            call = RequestedCall("calendar", {})
            return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)
        if match := _ALIAS.match(user):
            call = RequestedCall("add_alias", {"raw": match.group(1)})
            return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)
        if match := _BIG.match(user):
            call = RequestedCall("big", {"kib": int(match.group(1))})
            return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)
        if match := _SAY.match(user):
            text = "y" * (int(match.group(1)) * 1024)
            return ModelReply(text=text, input_tokens=prompt_tokens, output_tokens=1)
        if command == "fail model":
            raise RuntimeError("fixture model failure requested")
        if match := _CALC.match(user):
            call = RequestedCall("calculator", {"expression": match.group(1)})
            return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)
        if user.strip().lower() == "whoami":
            call = RequestedCall("deployment", {})
            return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)
        if (match := _SLEEP.match(user)) and int(match.group(1)) > 1:
            call = RequestedCall("sleep", {"ms": int(match.group(2)), "step": 1})
            return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)
        if (match := _STEPS.match(user)) and int(match.group(1)) > 1:
            call = RequestedCall("echo", {"text": "step 1"})
            return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)
        text = f"echo: {user}"
        return ModelReply(text=text, input_tokens=prompt_tokens, output_tokens=_words(text))


def _child_call(
    user: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
) -> RequestedCall | None:
    """The child-session behaviours (only for agents that have those tools)."""
    names = {t.name for t in tools}
    if (match := _ASK.match(user)) and ASK_SUBAGENT in names:
        arguments: dict[str, Any] = {"agent": match.group(2), "prompt": match.group(3)}
        if match.group(1).lower() == "bg":
            arguments["background"] = True
        return RequestedCall(ASK_SUBAGENT, arguments)
    if (match := _CONTINUE.match(user)) and CONTINUE_TASK in names:
        handle = match.group(1) or _latest_subagent(history)
        return RequestedCall(CONTINUE_TASK, {"handle": handle, "message": match.group(2)})
    if (match := _TASK.match(user)) and "slow_task" in names:
        return RequestedCall("slow_task", {"ms": int(match.group(1)), "text": match.group(2)})
    if (match := _WORKFLOW.match(user)) and "pipeline" in names:
        return RequestedCall("pipeline", {"ms": int(match.group(1)), "text": match.group(2)})
    return None


def _as_report(content: str) -> dict[str, Any] | None:
    if not content.startswith("{"):
        return None
    try:
        body = json.loads(content)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _child_answer(content: str) -> str:
    """The answer to a child-tool result ("" when it is not one)."""
    body = _as_report(content)
    if body is None or "handle" not in body:
        return ""
    name, status = body.get("name", "?"), body.get("status", "")
    if status == "running":
        return f"Started {name} as {body['handle']}."
    if status == "completed":
        return f"{name} says: {body.get('result', '')}"
    return f"{name} {status}: {body.get('error', '')}"


def _background_answer(content: str) -> str:
    body = _as_report(content)
    report = body.get("task_result") if body else None
    if not isinstance(report, dict):
        return ""
    name = report.get("name", "?")
    if report.get("status") == "completed":
        return f"{name} finished: {report.get('result', '')}"
    return f"{name} {report.get('status', 'failed')}: {report.get('error', '')}"


def _latest_subagent(history: Sequence[s.ChatMessage]) -> str:
    """The handle of the latest subagent this conversation heard from."""
    for message in reversed(history):
        body = _as_report(message.content)
        if body and body.get("task_result"):
            body = body["task_result"]
        if body and body.get("kind") == "subagent" and body.get("handle"):
            return str(body["handle"])
    return ""


def _pending_echo_steps(history: Sequence[s.ChatMessage]) -> int:
    """For `steps N`: how many echo steps remain after the latest user message."""
    done = 0
    for message in reversed(history):
        if message.role == s.ROLE_USER:
            match = _STEPS.match(message.content)
            return max(0, int(match.group(1)) - 1 - done) if match else 0
        if message.role == s.ROLE_TOOL:
            done += 1
    return 0


def _next_sleep_step(history: Sequence[s.ChatMessage]) -> tuple[int, int]:
    """For `sleep N MS`: the next sleep step (1-based; 0 when done) and MS."""
    done = 0
    for message in reversed(history):
        if message.role == s.ROLE_USER:
            match = _SLEEP.match(message.content)
            if not match or done + 1 >= int(match.group(1)):
                return 0, 0
            return done + 1, int(match.group(2))
        if message.role == s.ROLE_TOOL:
            done += 1
    return 0, 0


TOOLS = (
    Tool(
        "transfer",
        "Move money; the user must approve.",
        {"type": "object", "properties": {"amount": {"type": "string"}}},
        _transfer,
        needs_approval=True,
    ),
    Tool(
        "calendar",
        "Read the calendar; needs sign-in.",
        {"type": "object"},
        _calendar,
        sign_in_attempts=2,
    ),
    Tool(
        "add_alias",
        "Add an address for this session.",
        {"type": "object", "properties": {"raw": {"type": "string"}}},
        _add_alias,
    ),
    Tool(
        "calculator",
        "Evaluate an arithmetic expression.",
        {"type": "object", "properties": {"expression": {"type": "string"}}},
        _calculator,
    ),
    Tool(
        "deployment", "Report the deployment running this agent.", {"type": "object"}, _deployment
    ),
    Tool(
        "sleep",
        "Sleep some milliseconds.",
        {"type": "object", "properties": {"ms": {"type": "integer"}, "step": {"type": "integer"}}},
        _sleep,
    ),
    Tool(
        "echo",
        "Return the given text.",
        {"type": "object", "properties": {"text": {"type": "string"}}},
        _echo,
    ),
    Tool(
        "big",
        "Return <kib> KiB of text.",
        {"type": "object", "properties": {"kib": {"type": "integer"}}},
        _big,
    ),
)


CHILD_TOOLS = (
    Tool(
        "slow_task",
        "Run a slow job in the background: sleeps <ms>, then reports done.",
        {"type": "object", "properties": {"ms": {"type": "integer"}, "text": {"type": "string"}}},
        _slow_task,
        mode=ToolMode.BACKGROUND,
    ),
    Tool(
        "pipeline",
        "A durable three-step workflow (fetch, transform, store); the turn waits.",
        {"type": "object", "properties": {"ms": {"type": "integer"}, "text": {"type": "string"}}},
        _slow_task,
        mode=ToolMode.WORKFLOW,
        steps=(
            _pipeline_step("fetch", "fetched"),
            _pipeline_step("transform", "transformed"),
            _pipeline_step("store", "stored"),
        ),
    ),
)


def build_helper(deployment_id: str) -> Agent:
    """The `helper` subagent: the fixture model with the inline tools."""
    return Agent(
        name="helper",
        deployment_id=deployment_id,
        instructions="You are the helper subagent.",
        model=FixtureModel(),
        tools=TOOLS,
    )


def build_agent(deployment_id: str) -> Agent:
    helper = build_helper(deployment_id)
    planner = Agent(
        name="planner",
        deployment_id=deployment_id,
        instructions="You are the planner subagent; you may ask the helper.",
        model=FixtureModel(),
        tools=TOOLS,
        subagents=(helper,),
    )
    return Agent(
        name="fixture",
        deployment_id=deployment_id,
        instructions="You are Baton's deterministic fixture agent.",
        model=FixtureModel(),
        tools=TOOLS + CHILD_TOOLS,
        subagents=(helper, planner),
    )


def build_small_context_agent(deployment_id: str) -> Agent:
    """The fixture agent with a 16 KiB context budget: long sessions compact
    on their own every few turns."""
    return dataclasses.replace(build_agent(deployment_id), context_budget_bytes=16 * 1024)


def _refuse_to_load(snapshot: s.SessionSnapshot) -> None:
    raise RuntimeError(f"fixture agent refuses to load session {snapshot.session_id}")


def build_crash_on_load_agent(deployment_id: str) -> Agent:
    """The fixture agent whose authored code raises whenever a session loads:
    every run fails until the restart budget is spent."""
    return dataclasses.replace(build_agent(deployment_id), on_load=_refuse_to_load)


class LoadRefusal:
    """The cause of a stall that an operator can fix (tests of
    `baton sessions resume`): while `refusing`, the agent of
    `build_refuse_load_until_fixed_agent` raises on every load, as
    `build_crash_on_load_agent` does; set it False to fix the cause."""

    refusing = True


def _refuse_to_load_until_fixed(snapshot: s.SessionSnapshot) -> None:
    if LoadRefusal.refusing:
        _refuse_to_load(snapshot)


def build_refuse_load_until_fixed_agent(deployment_id: str) -> Agent:
    """The fixture agent whose sessions fail to load until
    `LoadRefusal.refusing` is set False (in the owner's process)."""
    return dataclasses.replace(build_agent(deployment_id), on_load=_refuse_to_load_until_fixed)
