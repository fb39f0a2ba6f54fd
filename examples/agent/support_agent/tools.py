"""The order desk's tools: plain async functions of their JSON arguments and
a `ToolContext`. A tool that raises gives the model an error result (the
exception's type and message: "LookupError: there is no order 99") and the
turn goes on."""

from __future__ import annotations

from typing import Any

from baton_runtime.owner.agents.api import Tool, ToolContext

ORDERS = {"42": "shipped on 2026-11-28", "7": "being packed"}

_ORDER_ID = {
    "type": "object",
    "properties": {"order_id": {"type": "string", "description": "the order's number"}},
    "required": ["order_id"],
}


async def lookup_order(arguments: dict[str, Any], ctx: ToolContext) -> str:
    order_id = str(arguments.get("order_id", ""))
    status = ORDERS.get(order_id)
    if status is None:
        raise LookupError(f"there is no order {order_id}")
    return f"order {order_id}: {status}"


async def refund(arguments: dict[str, Any], ctx: ToolContext) -> str:
    # Runs only after a person approved this very call (needs_approval).
    return f"refunded order {arguments.get('order_id', '')}"


TOOLS = (
    Tool("lookup_order", "Look an order up by its number.", _ORDER_ID, lookup_order),
    Tool(
        "refund",
        "Refund an order. A person approves each refund before it runs.",
        _ORDER_ID,
        refund,
        needs_approval=True,
    ),
)
