"""A test kit for agent authors (docs/agents.md, "Testing an agent"): a
scripted model (`ScriptedModel`, with `reply`, `call` and `ask`) and a
harness (`AgentHarness`) that runs an agent's conversation through the real
runtime on loopback (its own etcd, hooks, anchor, an owner and an ingress
per version), turn by turn."""

from baton_runtime.testing.harness import AgentHarness, Turn
from baton_runtime.testing.scripted import ModelCall, ScriptedModel, ask, call, reply

__all__ = ["AgentHarness", "ModelCall", "ScriptedModel", "Turn", "ask", "call", "reply"]
