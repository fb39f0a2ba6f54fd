"""A stand-in for a language model, for running the order desk without a
model endpoint: it reads the last message of the history and follows a few
rules. (A test scripts its model instead: baton_runtime.testing.)"""

from __future__ import annotations

import re
from collections.abc import Sequence

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.agents.api import ModelReply, RequestedCall, Tool

_REFUND = re.compile(r"\brefund\D*(\d+)", re.IGNORECASE)
_ORDER = re.compile(r"\border\D*(\d+)", re.IGNORECASE)
HELP = "I can look an order up ('where is order 42?') or refund one ('refund order 42')."


class RuleModel:
    """A tool result is answered; a message naming an order calls a tool;
    anything else gets the help text. `mark` starts every answer (a later
    version's, so that a conversation shows which code answered)."""

    def __init__(self, mark: str = "") -> None:
        self.mark = mark

    async def complete(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> ModelReply:
        last = history[-1]
        if instructions.startswith("Summarize"):  # the runtime compacting the history
            return self._say(f"{len(history)} messages about orders")
        if last.role == s.ROLE_TOOL:
            return self._say(f"Done: {last.content}.")
        for pattern, tool in ((_REFUND, "refund"), (_ORDER, "lookup_order")):
            if (match := pattern.search(last.content)) and tool in {t.name for t in tools}:
                return ModelReply(tool_calls=[RequestedCall(tool, {"order_id": match[1]})])
        return self._say(HELP)

    def _say(self, text: str) -> ModelReply:
        text = f"{self.mark} {text}" if self.mark else text
        return ModelReply(text=text, output_tokens=len(text.split()))
