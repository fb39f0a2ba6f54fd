"""An order desk: looks orders up, and refunds them once a person approves.

Version 1 of the agent. Run it with `baton up --agent support_agent:build_agent`
from this directory (docs/agents.md); version 2 is `support_agent.v2`.
"""

from __future__ import annotations

import os

from baton_runtime.owner.agents.api import Agent, ModelAdapter
from support_agent.rules import RuleModel
from support_agent.tools import TOOLS

INSTRUCTIONS = (
    "You are the order desk of a small shop. Look orders up with lookup_order before you "
    "say anything about one; refund only when asked to, with refund (a person approves "
    "each refund). Answer in one or two sentences."
)


def model_for(deployment_id: str, mark: str = "") -> ModelAdapter:
    """An OpenAI-compatible endpoint when one is configured
    (BATON_OPENAI_BASE_URL, BATON_OPENAI_MODEL), else the rule-following
    stand-in, so that the agent runs anywhere."""
    if os.environ.get("BATON_OPENAI_BASE_URL"):
        from baton_runtime.owner.agents.openai_model import build_agent as openai_agent

        return openai_agent(deployment_id).model
    return RuleModel(mark)


def build_agent(deployment_id: str) -> Agent:
    """The factory an owner calls (BATON_AGENT=support_agent:build_agent)."""
    return Agent(
        name="order-desk",
        deployment_id=deployment_id,
        instructions=INSTRUCTIONS,
        model=model_for(deployment_id),
        tools=TOOLS,
        version="1",
        max_steps_per_turn=6,
    )
