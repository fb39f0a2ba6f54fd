"""The test kit for agent authors (baton_runtime.testing): a scripted model
through the real runtime, a question answered, a script that runs out, and
what each model call was given. (The example agent's own tests use it too:
examples/agent/tests/.)"""

from __future__ import annotations

import dataclasses

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.agents.api import Agent, ModelReply, Tool, ToolContext
from baton_runtime.owner.agents.fixture import build_agent as build_fixture
from baton_runtime.testing import AgentHarness, ScriptedModel, ask, call, reply
from baton_runtime.testing.harness import registered_agent


async def test_a_scripted_conversation_with_a_question_and_a_tool() -> None:
    model = ScriptedModel([ask("Which city?")]).then(
        call("calculator", expression="6*7"),
        lambda history: reply(f"{history[-1].content} in {history[-3].content}"),
    )
    async with AgentHarness(build_fixture, model=model, deployment_id="kit-1") as harness:
        asked = await harness.send("How many, and where?")
        request = asked.input_request
        assert request is not None and request.kind == s.INPUT_KIND_QUESTION
        assert request.prompt == "Which city?" and asked.answer == "Which city?"
        done = await harness.answer("Paris")
        events = await harness.events()
        session = harness.session_id
    assert done.tool_calls == [("calculator", {"expression": "6*7"})]
    assert done.tool_results == [("calculator", "42")]
    assert done.answer == "42 in Paris" and done.deployment_ids == ["kit-1"]
    assert [e.session_id for e in events] == [session] * len(events)
    roles = [m.role for m in model.calls[-1].history]
    assert roles == [s.ROLE_USER, s.ROLE_ASSISTANT, s.ROLE_USER, s.ROLE_ASSISTANT, s.ROLE_TOOL]
    assert "calculator" in model.calls[0].tools and model.left == 0


async def test_a_script_that_runs_out_fails_the_turn_and_says_so() -> None:
    model = ScriptedModel([reply("only this")])
    async with AgentHarness(build_fixture, model=model, deployment_id="kit-2") as harness:
        assert (await harness.send("one")).answer == "only this"
        failed = await harness.send("two")
        assert failed.error is not None and failed.error.reason == "MODEL_ERROR"
        assert "no reply left for call 2" in failed.error.message
        model.then(reply("three"))
        assert (await harness.send("three?")).answer == "three"


async def test_a_tool_gets_where_it_runs() -> None:
    """ToolContext: the session, the deployment, the run and the call's id."""

    async def where(arguments: dict[str, object], ctx: ToolContext) -> str:
        return f"{ctx.session_id} {ctx.deployment_id} {ctx.tool_call_id} {ctx.channel}"

    def build(deployment_id: str) -> Agent:
        agent = build_fixture(deployment_id)
        return dataclasses.replace(agent, tools=(*agent.tools, Tool("where", "", {}, where)))

    model = ScriptedModel([call("where"), call("where"), reply("ok")])
    async with AgentHarness(build, model=model, deployment_id="kit-3") as harness:
        turn = await harness.send("where?")
        session = harness.session_id
    assert [output for _, output in turn.tool_results] == [
        f"{session} kit-3 call_1 test",
        f"{session} kit-3 call_2 test",
    ]


def test_the_registered_factory_names_a_missing_deployment() -> None:
    with pytest.raises(LookupError, match="no agent is registered for deployment nobody"):
        registered_agent("nobody")
    assert isinstance(build_fixture("x"), Agent)
    assert reply("a b").output_tokens == 2 and isinstance(ask("q?"), ModelReply)
