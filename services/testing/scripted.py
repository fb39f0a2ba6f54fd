"""A model adapter that answers from a script, for an agent's tests: each
model call takes the next reply, and what the model was given (instructions,
history, tools) is kept for the test to check."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.agents.api import ModelReply, RequestedCall, Tool

Scripted = ModelReply | Callable[[Sequence[s.ChatMessage]], ModelReply]
"""A reply, or a function of the history that makes one."""


def reply(text: str) -> ModelReply:
    """A final answer."""
    return ModelReply(text=text, input_tokens=1, output_tokens=len(text.split()))


def call(name: str, **arguments: Any) -> ModelReply:
    """A call of the tool `name` with these arguments (the turn runs it and
    calls the model again with its result)."""
    return ModelReply(tool_calls=[RequestedCall(name, arguments)], input_tokens=1)


def ask(question: str) -> ModelReply:
    """A question for the user: the turn pauses until it is answered."""
    return ModelReply(question=question, input_tokens=1, output_tokens=len(question.split()))


@dataclass(frozen=True)
class ModelCall:
    """What one model call was given."""

    instructions: str
    history: tuple[s.ChatMessage, ...]
    tools: tuple[str, ...]

    @property
    def last(self) -> s.ChatMessage:
        """The latest message the model saw (a user message or a tool result)."""
        return self.history[-1]


class ScriptedModel:
    """Answers each call with the next scripted reply; a call past the end
    of the script fails the turn (MODEL_ERROR) with a message saying so.
    `calls` is every call's input, in order."""

    def __init__(self, script: Iterable[Scripted] = ()) -> None:
        self._script = list(script)
        self.calls: list[ModelCall] = []

    def then(self, *replies: Scripted) -> ScriptedModel:
        """Add replies to the end of the script (for the next turns)."""
        self._script.extend(replies)
        return self

    @property
    def left(self) -> int:
        """Replies not used yet."""
        return len(self._script)

    async def complete(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> ModelReply:
        self.calls.append(ModelCall(instructions, tuple(history), tuple(t.name for t in tools)))
        if not self._script:
            raise RuntimeError(
                f"the scripted model has no reply left for call {len(self.calls)} "
                f"(the last message: {history[-1].content[:80]!r})"
            )
        step = self._script.pop(0)
        return step(history) if callable(step) else step
