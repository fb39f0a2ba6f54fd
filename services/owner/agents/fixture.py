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
- "stream <n> <ms> [<bytes>]" -> an answer streamed as <n> text deltas over <ms>
                               milliseconds (`FixtureModel.stream`), each "<i>," or
                               <bytes> bytes of one letter; the answer is their
                               concatenation (live items, docs/design.md);
- "progress <n> <ms> [<lead>]" -> a `progress` tool call reporting progress <n>
                               times, <ms> milliseconds apart, after <lead>
                               milliseconds of silence (0 if left out);
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
`build_agent_v2` is version 2 of the same agent: every final answer starts
with "[v2] " (a second deployment's code, visibly).
The tools are fixture_tools.py's. Usage: prompt tokens are the words of the
instructions and of the last message plus one per earlier message;
completion tokens are the words of the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.agents.api import (
    ASK_SUBAGENT,
    CONTINUE_TASK,
    Agent,
    ModelAdapter,
    ModelDelta,
    ModelReply,
    RequestedCall,
    TextDelta,
    Tool,
)
from baton_runtime.owner.agents.fixture_tools import CHILD_TOOLS, TOOLS

_CALC = re.compile(r"^\s*(?:calc|what is)\s+(.+?)\??\s*$", re.IGNORECASE)
_STEPS = re.compile(r"^\s*steps\s+(\d+)\s*$", re.IGNORECASE)
_SLEEP = re.compile(r"^\s*sleep\s+(\d+)\s+(\d+)\s*$", re.IGNORECASE)
_WAIT = re.compile(r"^\s*wait\s+(\d+)\s*$", re.IGNORECASE)
_TRANSFER = re.compile(r"^\s*transfer\s+(\S+)\s*$", re.IGNORECASE)
_ALIAS = re.compile(r"^\s*alias\s+(\S+)\s*$", re.IGNORECASE)
_BIG = re.compile(r"^\s*big\s+(\d+)\s*$", re.IGNORECASE)
_SAY = re.compile(r"^\s*say\s+(\d+)\s*$", re.IGNORECASE)
_STREAM = re.compile(r"^\s*stream\s+(\d+)\s+(\d+)(?:\s+(\d+))?\s*$", re.IGNORECASE)
_PROGRESS = re.compile(r"^\s*progress\s+(\d+)\s+(\d+)(?:\s+(\d+))?\s*$", re.IGNORECASE)
_ASK = re.compile(r"^\s*(ask|bg)\s+(helper|planner|nobody)\s+(.+?)\s*$", re.IGNORECASE | re.DOTALL)
_CONTINUE = re.compile(r"^\s*continue\s+(?:(ses_[0-9a-z]{26})\s+)?(.+?)\s*$", re.DOTALL)
_TASK = re.compile(r"^\s*task\s+(\d+)\s+(.+?)\s*$", re.IGNORECASE | re.DOTALL)
_WORKFLOW = re.compile(r"^\s*workflow\s+(\d+)\s+(.+?)\s*$", re.IGNORECASE | re.DOTALL)
_QUESTION = "What is your name?"


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
            return _answer(f"{len(history)} messages about: {first}", prompt_tokens)
        last = history[-1]
        if last.role == s.ROLE_TOOL and (answer := _child_answer(last.content)):
            return _answer(answer, prompt_tokens)
        if last.role == s.ROLE_USER and (answer := _background_answer(last.content)):
            return _answer(answer, prompt_tokens)
        if last.role == s.ROLE_TOOL:
            return _after_tool(history, prompt_tokens)
        if _answers_question(history):
            return _answer(f"Nice to meet you, {last.content}.", prompt_tokens)
        user = last.content
        if call := _child_call(user, history, tools):
            return _call(call, prompt_tokens)
        if match := _WAIT.match(user):
            await asyncio.sleep(int(match.group(1)) / 1000)
            return _answer(f"echo: {user}", prompt_tokens)
        return _scripted(user, prompt_tokens)

    async def stream(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> AsyncIterator[ModelDelta | ModelReply]:
        """ "stream <n> <ms> [<bytes>]" streamed; any other reply as one."""
        last = history[-1]
        match = _STREAM.match(last.content) if last.role == s.ROLE_USER else None
        if match is None or instructions.startswith("Summarize"):
            yield await self.complete(instructions, history, tools)
            return
        count, ms = min(int(match.group(1)), 100_000), int(match.group(2))
        size = int(match.group(3) or 0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        parts = []
        for index in range(count):
            # Paced against the start, so n deltas take about ms in all.
            await asyncio.sleep(max(0.0, start + ms / 1000 * index / count - loop.time()))
            part = chr(ord("a") + index % 26) * size if size else f"{index},"
            parts.append(part)
            yield TextDelta(part)
        text = "".join(parts)
        prompt_tokens = _words(instructions) + _words(last.content) + len(history) - 1
        yield ModelReply(text=text, input_tokens=prompt_tokens, output_tokens=count)


def _answer(text: str, prompt_tokens: int) -> ModelReply:
    return ModelReply(text=text, input_tokens=prompt_tokens, output_tokens=_words(text))


def _call(call: RequestedCall, prompt_tokens: int) -> ModelReply:
    return ModelReply(tool_calls=[call], input_tokens=prompt_tokens, output_tokens=1)


def _after_tool(history: Sequence[s.ChatMessage], prompt_tokens: int) -> ModelReply:
    """After a tool result: the next step of "sleep <n>" or "steps <n>",
    or a final answer quoting the result."""
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
    return _answer(f"The result is {history[-1].content}.", prompt_tokens)


def _answers_question(history: Sequence[s.ChatMessage]) -> bool:
    """The last message is the user's answer to the fixture's question."""
    if len(history) < 2 or history[-1].role != s.ROLE_USER:
        return False
    asked = history[-2]
    return asked.role == s.ROLE_ASSISTANT and asked.content == _QUESTION and not asked.tool_calls


def _scripted(user: str, prompt_tokens: int) -> ModelReply:
    """The scripted commands of a user message (the module doc's list)."""
    command = user.strip().lower()
    if match := _TRANSFER.match(user):
        return _call(RequestedCall("transfer", {"amount": match.group(1)}), prompt_tokens)
    if command == "ask my name":
        return ModelReply(question=_QUESTION, input_tokens=prompt_tokens, output_tokens=5)
    if command == "read calendar":
        return _call(RequestedCall("calendar", {}), prompt_tokens)
    if match := _ALIAS.match(user):
        return _call(RequestedCall("add_alias", {"raw": match.group(1)}), prompt_tokens)
    if match := _BIG.match(user):
        return _call(RequestedCall("big", {"kib": int(match.group(1))}), prompt_tokens)
    if match := _SAY.match(user):
        text = "y" * (int(match.group(1)) * 1024)
        return ModelReply(text=text, input_tokens=prompt_tokens, output_tokens=1)
    if match := _PROGRESS.match(user):
        arguments = {"count": int(match.group(1)), "ms": int(match.group(2))}
        if match.group(3):
            arguments["lead_ms"] = int(match.group(3))
        return _call(RequestedCall("progress", arguments), prompt_tokens)
    if command == "fail model":
        raise RuntimeError("fixture model failure requested")
    if match := _CALC.match(user):
        return _call(RequestedCall("calculator", {"expression": match.group(1)}), prompt_tokens)
    if command == "whoami":
        return _call(RequestedCall("deployment", {}), prompt_tokens)
    if (match := _SLEEP.match(user)) and int(match.group(1)) > 1:
        return _call(RequestedCall("sleep", {"ms": int(match.group(2)), "step": 1}), prompt_tokens)
    if (match := _STEPS.match(user)) and int(match.group(1)) > 1:
        return _call(RequestedCall("echo", {"text": "step 1"}), prompt_tokens)
    return _answer(f"echo: {user}", prompt_tokens)


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


class SignedModel:
    """The fixture model of a later version of the fixture agent: its final
    answers start with its mark (`[v2] echo: hello`), so a conversation
    shows which version's code answered each turn."""

    def __init__(self, mark: str) -> None:
        self.mark = mark
        self._inner = FixtureModel()

    async def complete(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> ModelReply:
        reply = await self._inner.complete(instructions, history, tools)
        if not reply.text or reply.tool_calls or instructions.startswith("Summarize"):
            return reply
        return dataclasses.replace(reply, text=f"{self.mark} {reply.text}")


def _fixture(deployment_id: str, version: str, model: Callable[[], ModelAdapter]) -> Agent:
    """The fixture agent and its subagents (`helper`, `planner`), each with
    its own instance of `model`."""
    helper = Agent(
        name="helper",
        deployment_id=deployment_id,
        instructions="You are the helper subagent.",
        model=model(),
        tools=TOOLS,
        version=version,
    )
    planner = Agent(
        name="planner",
        deployment_id=deployment_id,
        instructions="You are the planner subagent; you may ask the helper.",
        model=model(),
        tools=TOOLS,
        subagents=(helper,),
        version=version,
    )
    return Agent(
        name="fixture",
        deployment_id=deployment_id,
        instructions="You are Baton's deterministic fixture agent.",
        model=model(),
        tools=TOOLS + CHILD_TOOLS,
        subagents=(helper, planner),
        version=version,
    )


def build_agent(deployment_id: str) -> Agent:
    """The fixture agent, version 1."""
    return _fixture(deployment_id, "1", FixtureModel)


def build_agent_v2(deployment_id: str) -> Agent:
    """Version 2 of the fixture agent: the same behaviours, and every final
    answer starts with `[v2]` (`baton up` runs it on every deployment but
    the first, so a session that moves to one of them shows the new code
    answering)."""
    return _fixture(deployment_id, "2", lambda: SignedModel("[v2]"))


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


REFUSE_DIR_ENV = "BATON_FIXTURE_REFUSE_DIR"
"""The directory of `build_refuse_load_while_marked_agent`'s marks."""
EVERY_SESSION = "every-session"
"""The mark that refuses every session's load."""


def _refuse_to_load_while_marked(snapshot: s.SessionSnapshot) -> None:
    marks = os.environ.get(REFUSE_DIR_ENV, "")
    if marks and any((Path(marks) / m).exists() for m in (snapshot.session_id, EVERY_SESSION)):
        _refuse_to_load(snapshot)


def build_refuse_load_while_marked_agent(deployment_id: str) -> Agent:
    """The fixture agent whose sessions fail to load while a file named after
    the session (or `EVERY_SESSION`) exists in the directory
    BATON_FIXTURE_REFUSE_DIR: the
    `LoadRefusal` of tests whose owners are processes of their own (a
    session is stalled by marking it, and the cause fixed by removing the
    mark)."""
    return dataclasses.replace(build_agent(deployment_id), on_load=_refuse_to_load_while_marked)
