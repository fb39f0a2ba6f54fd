"""What authored agent code provides: instructions, a model adapter, tools,
and the child sessions it may start (docs/design.md §11).

An agent belongs to a deployment: the owner builds it from its own code with
`load_agent(spec, deployment_id)`, where spec is `module:factory` and the
factory takes the deployment id.

Child sessions, as authored:
- `Agent.subagents`: other agents of the same deployment, by name, with their
  own instructions, model and tools. The model asks one with the built-in
  `ask_subagent` tool (the turn waits for the reply, or with `background`
  the call returns a handle at once) and continues a parked conversation
  with `continue_task`.
- a `Tool` with `mode=ToolMode.BACKGROUND` runs as a child session: the call
  returns a handle at once, the result arrives later as a message.
- a `Tool` with `mode=ToolMode.WORKFLOW` and `steps`: its steps run as a child
  session, each committed (a crash resumes at the next step); the calling
  turn waits for its result.
Each child is a session of its own; `AgentCatalog` says which authored code
runs a child session (by its parent link).
"""

from __future__ import annotations

import enum
import importlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from baton_runtime._proto.baton.session.v1 import session_pb2 as s


@dataclass(frozen=True)
class ToolContext:
    """What a tool may know about where it runs, and what it may ask for."""

    session_id: str
    deployment_id: str
    owner_run_id: str
    channel: str = ""
    add_alias: Callable[[str], Awaitable[None]] | None = None
    """Claim `<channel>:<raw>` as another address of the session (durably,
    before the step commits)."""
    tool_call_id: str = ""
    """The call's id (`call_<n>`), unique in the session. The step in flight
    when an owner dies runs again, and numbers its calls the same: key a
    side effect by (session_id, tool_call_id) to make it once."""
    progress: Callable[[str], None] | None = None
    """Report progress while the tool runs: followers of the session that
    asked for live items see `text` at once (docs/design.md "Live items").
    Never kept, never waits; each report is cut to 1 KiB and a call's
    reports over 20 a second are dropped. None where nobody could see it."""


ToolFunction = Callable[[dict[str, Any], ToolContext], Awaitable[str]]


class ToolMode(enum.Enum):
    """Where a tool runs."""

    INLINE = "inline"
    """Inside the step that calls it."""
    BACKGROUND = "background"
    """As a child session: the call returns a handle at once; the result
    arrives later and joins the turn, or starts one."""
    WORKFLOW = "workflow"
    """Its `steps` as a child session, each committed; the turn waits."""


@dataclass(frozen=True)
class WorkflowStep:
    """One durable step of a workflow tool. It gets the call's arguments plus
    `previous`: the output of the step before (\"\" for the first)."""

    name: str
    run: ToolFunction


@dataclass(frozen=True)
class Tool:
    """A named async function the model may call with JSON arguments."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: ToolFunction
    needs_approval: bool = False
    """The user must approve each call before it runs (input.requested)."""
    sign_in_attempts: int = 0
    """Sign-in attempts that must report before the tool runs (authorization.required)."""
    mode: ToolMode = ToolMode.INLINE
    """INLINE, or a child session (BACKGROUND, WORKFLOW)."""
    steps: Sequence[WorkflowStep] = ()
    """WORKFLOW: the steps, in order (BACKGROUND runs `run` as its one step)."""

    @property
    def starts_child(self) -> bool:
        return self.mode is not ToolMode.INLINE


@dataclass(frozen=True)
class RequestedCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ModelReply:
    """One model call's answer: final text, or tool calls to run first."""

    text: str = ""
    tool_calls: Sequence[RequestedCall] = ()
    question: str = ""
    """A question for the user: the turn pauses until it is answered."""
    input_tokens: int = 0
    output_tokens: int = 0
    cost_micros: int = 0
    model_calls: int = 1
    """0 for the scripted "model" of a background or workflow tool."""


@dataclass(frozen=True)
class TextDelta:
    """Model text as it forms: continues the text before it."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A tool call as it forms: `index` says which call of the reply (from
    0); `name` once known; `arguments` continues that call's JSON."""

    index: int
    name: str = ""
    arguments: str = ""


ModelDelta = TextDelta | ToolCallDelta


class ModelRejected(Exception):
    """The model endpoint refused the request as invalid (e.g. HTTP 400): the
    same request cannot succeed on retry, so the turn fails at once."""


class ModelAdapter(Protocol):
    async def complete(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> ModelReply: ...


class StreamingModelAdapter(ModelAdapter, Protocol):
    """A model adapter that may also stream: `stream` yields deltas as the
    model produces them and ends with the same ModelReply `complete` would
    answer (its last item; the deltas are a preview, the reply is what
    counts). The owner uses `stream` when an adapter has it; the deltas
    reach the session's followers as live items (docs/design.md "Live
    items")."""

    def stream(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> AsyncIterator[ModelDelta | ModelReply]: ...


async def streamed_reply(
    model: ModelAdapter,
    instructions: str,
    history: Sequence[s.ChatMessage],
    tools: Sequence[Tool],
    on_delta: Callable[[ModelDelta], None],
) -> ModelReply:
    """The model's reply, through `stream` when the adapter has one (each
    delta to `on_delta`), else `complete`. A stream that ends without a
    reply is an error of the adapter."""
    stream = getattr(model, "stream", None)
    if stream is None:
        return await model.complete(instructions, history, tools)
    reply: ModelReply | None = None
    async for item in stream(instructions, history, tools):
        if isinstance(item, ModelReply):
            reply = item
        else:
            on_delta(item)
    if reply is None:
        raise RuntimeError("the model's stream ended without a reply")
    return reply


@dataclass(frozen=True)
class Agent:
    """An agent definition of one deployment."""

    name: str
    deployment_id: str
    instructions: str
    model: ModelAdapter
    tools: Sequence[Tool] = ()
    version: str = ""
    """The author's name for this version of the code ("2", "2026-11-30"):
    logged when an owner loads it and shown per instance by `baton
    deployments describe`. Free text; it decides nothing."""
    max_steps_per_turn: int = 8
    compaction_instructions: str = (
        "Summarize the conversation so far in a few sentences; keep facts and open tasks."
    )
    context_budget_bytes: int = 256 * 1024
    """What the model sees is bounded: when the history since the last
    compaction exceeds this (serialized bytes), the owner compacts it at the
    next turn boundary. 0 turns automatic compaction off."""
    context_budget_entries: int = 1000
    """The same bound in history entries (many short messages)."""
    on_load: Callable[[s.SessionSnapshot], None] | None = None
    """Called with the snapshot whenever a run of a session starts (created,
    recovered, woken, taken over, handed off). If it raises, the run fails
    and counts against the owner's restart budget."""
    subagents: Sequence[Agent] = ()
    """Agents this one may ask (by name) as child sessions."""
    fail_on_tool_error: bool = False
    """A tool call that fails fails the turn (the agent of a background or
    workflow tool: a failed step fails the task)."""
    all_tools: Sequence[Tool] = field(init=False, repr=False)
    """`tools`, plus the built-in child tools when the agent can start children."""
    tool_index: dict[str, Tool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tools = list(self.tools)
        if self.subagents:
            tools.append(ASK_SUBAGENT_TOOL)
        if self.subagents or any(t.starts_child for t in self.tools):
            tools.append(CONTINUE_TASK_TOOL)
        object.__setattr__(self, "all_tools", tuple(tools))
        object.__setattr__(self, "tool_index", {t.name: t for t in tools})

    def subagent(self, name: str) -> Agent | None:
        return next((a for a in self.subagents if a.name == name), None)


# -- the built-in child tools (handled by the session, never run as functions) --------

ASK_SUBAGENT = "ask_subagent"
CONTINUE_TASK = "continue_task"


async def _handled_by_the_session(arguments: dict[str, Any], ctx: ToolContext) -> str:
    raise RuntimeError("child tools are run by the session, not called")


ASK_SUBAGENT_TOOL = Tool(
    ASK_SUBAGENT,
    "Ask a subagent (by name) as a child session. The turn waits for its reply, "
    "unless background is true: then the call returns its handle at once and the "
    "reply arrives later as a message. Its conversation can be continued by handle.",
    {
        "type": "object",
        "properties": {
            "agent": {"type": "string"},
            "prompt": {"type": "string"},
            "background": {"type": "boolean"},
        },
        "required": ["agent", "prompt"],
    },
    _handled_by_the_session,
)
CONTINUE_TASK_TOOL = Tool(
    CONTINUE_TASK,
    "Give more work to a parked subagent or an available task, by its handle: a "
    "message for a subagent, JSON arguments for a task. The turn waits for the "
    "result unless background is true.",
    {
        "type": "object",
        "properties": {
            "handle": {"type": "string"},
            "message": {"type": "string"},
            "background": {"type": "boolean"},
        },
        "required": ["handle", "message"],
    },
    _handled_by_the_session,
)


# -- which authored code runs a child session ----------------------------------------


class StepsModel:
    """The "model" of a background or workflow tool's child session: it calls
    the tool's steps one after the other (one per step, so each is committed
    on its own) with the task's arguments and the previous step's output, then
    answers with the last output. No tokens, no model calls."""

    def __init__(self, steps: Sequence[str]) -> None:
        self.steps = tuple(steps)

    async def complete(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> ModelReply:
        outputs: list[str] = []
        text = ""
        for message in reversed(history):
            if message.role == s.ROLE_USER:
                text = message.content
                break
            if message.role == s.ROLE_TOOL:
                outputs.append(message.content)
        outputs.reverse()
        if len(outputs) >= len(self.steps):
            return ModelReply(text=outputs[-1] if outputs else "", model_calls=0)
        try:
            arguments = json.loads(text)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            arguments = {"input": text}
        arguments["previous"] = outputs[-1] if outputs else ""
        call = RequestedCall(self.steps[len(outputs)], arguments)
        return ModelReply(tool_calls=[call], model_calls=0)


def task_agent(tool: Tool, deployment_id: str) -> Agent:
    """The agent of a child session that runs a background or workflow tool."""
    steps = tuple(tool.steps) or (WorkflowStep(tool.name, tool.run),)
    return Agent(
        name=f"tool:{tool.name}",
        deployment_id=deployment_id,
        instructions="",
        model=StepsModel([step.name for step in steps]),
        tools=tuple(Tool(step.name, "", {}, step.run) for step in steps),
        max_steps_per_turn=len(steps) + 1,
        fail_on_tool_error=True,
    )


class AgentCatalog:
    """Which authored code of this deployment runs a session: the root agent,
    or, for a child session, the subagent or tool its parent link names
    (looked up in the whole tree of agents)."""

    def __init__(self, root: Agent) -> None:
        self.root = root
        self._subagents: dict[str, Agent] = {}
        self._tools: dict[str, Tool] = {}
        self._task_agents: dict[str, Agent] = {}
        pending = [root]
        seen: set[int] = set()
        while pending:
            agent = pending.pop(0)
            if id(agent) in seen:
                continue
            seen.add(id(agent))
            for tool in agent.tools:
                if tool.starts_child:
                    self._tools.setdefault(tool.name, tool)
            for sub in agent.subagents:
                self._subagents.setdefault(sub.name, sub)
                pending.append(sub)

    @property
    def subagent_names(self) -> frozenset[str]:
        """Every subagent's name, anywhere in the tree of agents."""
        return frozenset(self._subagents)

    def agent_for(self, parent: s.ParentLink | None) -> Agent:
        """The agent of a session with this parent link (None: a root
        session). Raises LookupError for a name this deployment lacks."""
        if parent is None or not parent.parent_session_id:
            return self.root
        if parent.kind == s.TASK_KIND_SUBAGENT:
            agent = self._subagents.get(parent.name)
            if agent is None:
                raise LookupError(f"this deployment has no subagent {parent.name!r}")
            return agent
        cached = self._task_agents.get(parent.name)
        if cached is None:
            tool = self._tools.get(parent.name)
            if tool is None:
                raise LookupError(f"this deployment has no child tool {parent.name!r}")
            cached = self._task_agents[parent.name] = task_agent(tool, self.root.deployment_id)
        return cached


def load_agent(spec: str, deployment_id: str) -> Agent:
    """Import `module:factory` and build the agent for `deployment_id` (an
    owner does it once, at start: BATON_AGENT)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"agent spec {spec!r} must be module:factory")
    factory = getattr(importlib.import_module(module_name), attr)
    agent = factory(deployment_id)
    if not isinstance(agent, Agent):
        raise TypeError(f"{spec} returned {type(agent).__name__}, not an Agent")
    if agent.deployment_id != deployment_id:
        raise ValueError(f"{spec} built an agent for {agent.deployment_id}, not {deployment_id}")
    return agent


def dumps_arguments(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"))
