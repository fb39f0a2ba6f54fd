"""The fixture agent's tools (fixture.py): inline tools (an approval, a
sign-in, an alias, arithmetic, the running deployment, sleep, echo, a big
result) and the child-session tools (a background task, a three-step
workflow). Deterministic; `evaluate` does arithmetic only.
"""

from __future__ import annotations

import ast
import asyncio
import operator
from typing import Any

from baton_runtime.owner.agents.api import Tool, ToolContext, ToolMode, WorkflowStep

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


async def _progress(arguments: dict[str, Any], ctx: ToolContext) -> str:
    """Report progress `count` times, `ms` milliseconds apart (live items),
    after `lead_ms` milliseconds of silence."""
    count = min(int(arguments.get("count", 0) or 0), 10_000)
    pause = int(arguments.get("ms", 0) or 0) / 1000
    await asyncio.sleep(min(int(arguments.get("lead_ms", 0) or 0), 60_000) / 1000)
    for index in range(1, count + 1):
        if ctx.progress is not None:
            ctx.progress(f"{index}/{count}")
        await asyncio.sleep(pause)
    return f"reported {count}"


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
    Tool(
        "progress",
        "Report progress <count> times, <ms> milliseconds apart, after <lead_ms> of silence.",
        {
            "type": "object",
            "properties": {
                "count": {"type": "integer"},
                "ms": {"type": "integer"},
                "lead_ms": {"type": "integer"},
            },
        },
        _progress,
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
