"""Version 2 of the order desk, shipped as a deployment of its own
(`baton up --agent desk-2=support_agent.v2:build_agent`). A session moves to
it when a message for it arrives through version 2's ingress while it is
idle, with its history written by version 1 (docs/agents.md, "What crosses
a handoff"): so version 2 keeps version 1's tool names and argument shapes,
and only adds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from baton_runtime.owner.agents.api import Agent, Tool, ToolContext
from support_agent import build_agent as build_v1
from support_agent import model_for
from support_agent.tools import ORDERS, TOOLS


async def cancel_order(arguments: dict[str, Any], ctx: ToolContext) -> str:
    order_id = str(arguments.get("order_id", ""))
    if ORDERS.get(order_id) != "being packed":
        raise ValueError(f"order {order_id} cannot be cancelled any more")
    return f"cancelled order {order_id}"


CANCEL = Tool(
    "cancel_order",
    "Cancel an order that has not shipped yet.",
    {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
    cancel_order,
    needs_approval=True,
)


def build_agent(deployment_id: str) -> Agent:
    """Version 1's agent, with a new tool and a model whose answers say
    "[v2]" (with the stand-in model)."""
    return dataclasses.replace(
        build_v1(deployment_id),
        model=model_for(deployment_id, mark="[v2]"),
        tools=(*TOOLS, CANCEL),
        version="2",
    )
