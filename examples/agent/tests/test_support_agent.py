"""The order desk's tests, through the real runtime on loopback
(baton_runtime.testing: its own etcd, hooks, anchor, owner and ingress).
Copy this file with the package; it needs an etcd on PATH (docs/etcd.md)."""

from __future__ import annotations

import support_agent
from support_agent import v2

from baton_runtime.testing import AgentHarness, ScriptedModel, call, reply


async def test_an_order_is_looked_up_with_the_stand_in_model() -> None:
    async with AgentHarness(support_agent.build_agent) as harness:
        turn = await harness.send("Where is order 42?")
    assert turn.tool_calls == [("lookup_order", {"order_id": "42"})]
    assert turn.tool_results == [("lookup_order", "order 42: shipped on 2026-11-28")]
    assert turn.answer == "Done: order 42: shipped on 2026-11-28."


async def test_a_refund_waits_for_a_person_to_approve_it() -> None:
    model = ScriptedModel([call("refund", order_id="42"), reply("Order 42 is refunded.")])
    async with AgentHarness(support_agent.build_agent, model=model) as harness:
        asked = await harness.send("Please refund order 42.")
        request = asked.input_request
        assert request is not None and request.tool_call.name == "refund"
        assert asked.tool_results == []  # nothing ran yet
        done = await harness.approve(request.request_id)
    assert done.tool_results == [("refund", "refunded order 42")]
    assert done.answer == "Order 42 is refunded."
    # What the model was given: the instructions, the user's message, then the result.
    first, second = model.calls
    assert first.instructions == support_agent.INSTRUCTIONS
    assert first.last.content == "Please refund order 42."
    assert first.tools == ("lookup_order", "refund")
    assert second.last.content == "refunded order 42"


async def test_a_refused_refund_and_a_failing_tool_reach_the_model() -> None:
    model = ScriptedModel(
        [
            call("refund", order_id="7"),
            reply("No refund, then."),
            call("lookup_order", order_id="99"),
            reply("I cannot find that order."),
        ]
    )
    async with AgentHarness(support_agent.build_agent, model=model) as harness:
        await harness.send("refund 7")
        denied = await harness.deny()
        missing = await harness.send("where is 99?")
    assert denied.tool_results == [("refund", "the user denied this call")]
    assert missing.tool_results == [("lookup_order", "LookupError: there is no order 99")]
    assert missing.answer == "I cannot find that order." and model.left == 0


async def test_version_2_takes_over_a_conversation_of_version_1() -> None:
    """Version 2 reads what version 1 left (its history, its tool calls)
    when a message through version 2's ingress moves the idle session."""
    async with AgentHarness(support_agent.build_agent, deployment_id="desk-1") as harness:
        first = await harness.send("Where is order 42?")
        await harness.add_version(v2.build_agent, "desk-2")
        moved = await harness.send("Where is order 7?", via="desk-2")
    assert first.deployment_ids == ["desk-1"] and not first.handed_off
    assert moved.handed_off and moved.deployment_ids == ["desk-2"]
    assert moved.answer == "[v2] Done: order 7: being packed."
