"""What authored agent code provides: instructions, a model adapter, tools.

An agent belongs to a deployment: the owner builds it from its own code with
`load_agent(spec, deployment_id)`, where spec is `module:factory` and the
factory takes the deployment id.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from baton.session.v1 import session_pb2 as s


@dataclass(frozen=True)
class ToolContext:
    """What a tool may know about where it runs, and what it may ask for."""

    session_id: str
    deployment_id: str
    owner_run_id: str
    channel: str = ""
    add_alias: Callable[[str], Awaitable[None]] | None = None


@dataclass(frozen=True)
class Tool:
    """A named async function the model may call with JSON arguments."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[dict[str, Any], ToolContext], Awaitable[str]]
    needs_approval: bool = False
    """The user must approve each call before it runs (input.requested)."""
    sign_in_attempts: int = 0
    """Sign-in attempts that must report before the tool runs (authorization.required)."""


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


class ModelRejected(Exception):
    """The model endpoint refused the request as invalid (e.g. HTTP 400): the
    same request cannot succeed on retry, so the turn fails at once."""


class ModelAdapter(Protocol):
    async def complete(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> ModelReply: ...


@dataclass(frozen=True)
class Agent:
    """An agent definition of one deployment."""

    name: str
    deployment_id: str
    instructions: str
    model: ModelAdapter
    tools: Sequence[Tool] = ()
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
    tool_index: dict[str, Tool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_index", {t.name: t for t in self.tools})


def load_agent(spec: str, deployment_id: str) -> Agent:
    """Import `module:factory` and build the agent for `deployment_id`."""
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
