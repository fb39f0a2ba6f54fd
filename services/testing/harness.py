"""Run an agent's conversation through the real runtime, in a test.

    async with AgentHarness(build_agent, model=ScriptedModel([reply("hi")])) as harness:
        turn = await harness.send("hello")
        assert turn.answer == "hi"

The harness starts a plaintext etcd on loopback (or uses one it is given),
then hooks, anchor, and an owner and an ingress for the agent's deployment,
in this process, as `baton up --plaintext` would run them: the agent's
turns, tools, approvals, child sessions and commits are the runtime's own,
not a simulation. Each `send` (or answer) is a real delivery through the
ingress; it returns the `Turn`: the stream's events from the delivery until
the session settles (waits for the next message), pauses (asks for input or
a sign-in) or ends.

`add_version` runs another deployment (the next version of the agent, its
own code) beside the first; a message sent `via` it moves the idle session
there (a handoff), so a test can check that the new code reads what the old
one left (docs/agents.md, "What crosses a handoff").

The agent's factory is registered by deployment id for the owner of this
process (`registered_agent`), so two harnesses running at once need
different deployment ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.config import AnchorConfig
from baton_runtime.anchor.server import create_server as create_anchor
from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.config import EtcdConfig
from baton_runtime.common.rpc.server import GrpcServer
from baton_runtime.common.security.tls import Security
from baton_runtime.hooks.config import HooksConfig
from baton_runtime.hooks.server import create_server as create_hooks
from baton_runtime.ingress.api_keys import ApiKeys
from baton_runtime.ingress.config import IngressConfig
from baton_runtime.ingress.server import create_server as create_ingress
from baton_runtime.owner.agents.api import Agent, ModelAdapter
from baton_runtime.owner.config import OwnerConfig
from baton_runtime.owner.server import create_server as create_owner

AgentFactory = Callable[[str], Agent]

CHANNEL = "test"
API_KEY = "agent-harness-key-0001"
REGISTERED = f"{__name__}:registered_agent"

_AGENTS: dict[str, AgentFactory] = {}
_PAUSES = frozenset({s.EVENT_KIND_INPUT_REQUESTED, s.EVENT_KIND_AUTHORIZATION_REQUIRED})
_ENDS = frozenset(
    {
        s.EVENT_KIND_SESSION_WAITING,
        s.EVENT_KIND_SESSION_COMPLETED,
        s.EVENT_KIND_SESSION_FAILED,
        s.EVENT_KIND_SESSION_STALLED,
    }
)


def registered_agent(deployment_id: str) -> Agent:
    """The owner's agent factory (BATON_AGENT) in a harness: the agent the
    harness registered for `deployment_id`."""
    factory = _AGENTS.get(deployment_id)
    if factory is None:
        raise LookupError(f"no agent is registered for deployment {deployment_id}")
    return factory(deployment_id)


def _with_model(factory: AgentFactory, model: ModelAdapter | None) -> AgentFactory:
    if model is None:
        return factory
    return lambda deployment_id: dataclasses.replace(factory(deployment_id), model=model)


@dataclass(frozen=True)
class Turn:
    """What one delivery led to: the stream's events from it until the
    session waits for the next message, pauses or ends."""

    events: tuple[s.Event, ...]

    def of(self, kind: s.EventKind.ValueType) -> list[s.Event]:
        return [e for e in self.events if e.kind == kind]

    @property
    def answer(self) -> str:
        """The last answer of the turn ("" when none)."""
        answers = self.of(s.EVENT_KIND_MESSAGE_COMPLETED)
        return answers[-1].text if answers else ""

    @property
    def answers(self) -> list[str]:
        return [e.text for e in self.of(s.EVENT_KIND_MESSAGE_COMPLETED)]

    @property
    def tool_calls(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, arguments) of each tool call the model asked for."""
        return [
            (e.tool_call.name, json.loads(e.tool_call.arguments_json or "{}"))
            for e in self.of(s.EVENT_KIND_TOOL_CALL_REQUESTED)
        ]

    @property
    def tool_results(self) -> list[tuple[str, str]]:
        """(name, output) of each tool result, an error's message included."""
        return [
            (e.tool_result.name, e.tool_result.output)
            for e in self.of(s.EVENT_KIND_TOOL_CALL_RESULT)
        ]

    @property
    def input_request(self) -> s.InputRequest | None:
        """What the turn paused for (an approval, a question), if it did."""
        asked = self.of(s.EVENT_KIND_INPUT_REQUESTED)
        return asked[-1].input_request if asked else None

    @property
    def error(self) -> s.ErrorDetail | None:
        """Why the turn failed (turn.failed, session.failed/stalled), if it did."""
        for event in reversed(self.events):
            if event.HasField("error") and event.kind != s.EVENT_KIND_COMMAND_REJECTED:
                return event.error
        return None

    @property
    def deployment_ids(self) -> list[str]:
        """The deployments that wrote the turn's events, in order, each once."""
        return list(dict.fromkeys(e.deployment_id for e in self.events if e.deployment_id))

    @property
    def handed_off(self) -> bool:
        """The session moved to another deployment for this turn."""
        return bool(self.of(s.EVENT_KIND_SESSION_HANDED_OFF))


@dataclass
class _Version:
    """One deployment: its owner and ingress, and the channel to the ingress."""

    owner: GrpcServer
    ingress: GrpcServer
    channel: grpc.aio.Channel
    stub: ingress_pb2_grpc.IngressServiceAsyncStub


@dataclass
class AgentHarness:
    """The runtime on loopback, running `factory`'s agent (its model
    replaced by `model` when given) on `deployment_id`."""

    factory: AgentFactory
    model: ModelAdapter | None = None
    deployment_id: str = "v1"
    # An etcd to use (plaintext, loopback); "" starts one for the harness.
    etcd_endpoint: str = ""
    # Seconds a turn may take to settle.
    timeout: float = 30.0
    session_id: str = ""
    _etcd: EtcdProcess | None = None
    _etcd_config: EtcdConfig | None = None
    _hooks: GrpcServer | None = None
    _anchor: GrpcServer | None = None
    _versions: dict[str, _Version] = field(default_factory=dict)
    _next_seq: int = 0

    async def __aenter__(self) -> AgentHarness:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        endpoint = self.etcd_endpoint
        if not endpoint:
            self._etcd = await asyncio.to_thread(EtcdProcess(compaction_retention="5m").start)
            endpoint = self._etcd.endpoint
        self._etcd_config = EtcdConfig(
            endpoint, f"/baton-harness/{uuid.uuid4().hex}/", 5, Security.plaintext()
        )
        plain = Security.plaintext()
        self._hooks = await create_hooks(
            HooksConfig(listen="127.0.0.1:0", etcd=self._etcd_config, tls=plain)
        )
        await self._hooks.start()
        self._anchor = await create_anchor(
            AnchorConfig(listen="127.0.0.1:0", etcd=self._etcd_config, tls=plain)
        )
        await self._anchor.start()
        await self.add_version(self.factory, self.deployment_id, model=self.model)

    async def add_version(
        self, factory: AgentFactory, deployment_id: str, *, model: ModelAdapter | None = None
    ) -> None:
        """Run `factory`'s agent as another deployment, beside the others."""
        assert self._hooks is not None and self._anchor is not None, "start the harness first"
        if deployment_id in self._versions or deployment_id in _AGENTS:
            raise ValueError(f"deployment {deployment_id} already runs")
        _AGENTS[deployment_id] = _with_model(factory, model)
        plain = Security.plaintext()
        hooks, anchor = f"127.0.0.1:{self._hooks.port}", f"127.0.0.1:{self._anchor.port}"
        owner = await create_owner(
            OwnerConfig(
                listen="127.0.0.1:0",
                deployment_id=deployment_id,
                instance_id=f"{deployment_id}-1",
                hooks=hooks,
                anchor=anchor,
                tls=plain,
                agent=REGISTERED,
                park_after=None,
            )
        )
        await owner.start()
        ingress = await create_ingress(
            IngressConfig(
                listen="127.0.0.1:0",
                deployment_id=deployment_id,
                api_keys=ApiKeys.of({API_KEY: CHANNEL}),
                hooks=hooks,
                anchor=anchor,
                owner=f"127.0.0.1:{owner.port}",
                tls=plain,
            )
        )
        await ingress.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{ingress.port}")
        stub: ingress_pb2_grpc.IngressServiceAsyncStub = ingress_pb2_grpc.IngressServiceStub(
            channel
        )
        self._versions[deployment_id] = _Version(owner, ingress, channel, stub)
        await self._registered(hooks, deployment_id)

    async def _registered(self, hooks_address: str, deployment_id: str) -> None:
        """Wait until the deployment's owner is in the registry (a handoff to
        it needs it there)."""
        hooks = HooksClient(hooks_address, security=Security.plaintext())
        deadline = time.monotonic() + self.timeout
        try:
            while not await hooks.list_instances(deployment_id):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the owner of {deployment_id} did not register")
                await asyncio.sleep(0.05)
        finally:
            await hooks.close()

    async def stop(self) -> None:
        for deployment_id, version in reversed(list(self._versions.items())):
            await version.channel.close()
            await version.ingress.stop(grace=0.5)
            await version.owner.stop(grace=0.5)
            _AGENTS.pop(deployment_id, None)
        self._versions.clear()
        for server in (self._anchor, self._hooks):
            if server is not None:
                await server.stop(grace=0.5)
        self._anchor = self._hooks = None
        if self._etcd is not None:
            await asyncio.to_thread(self._etcd.stop)
            self._etcd = None

    # -- the conversation ---------------------------------------------------------------

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {API_KEY}"),)

    @property
    def api_key(self) -> str:
        """The channel's API key (channel `test`), for a gateway under test."""
        return API_KEY

    def ingress_address(self, via: str | None = None) -> str:
        """host:port of a deployment's ingress (plaintext), for a gateway
        or an SDK client under test."""
        return f"127.0.0.1:{self._versions[via or self.deployment_id].ingress.port}"

    def _stub(self, via: str | None) -> ingress_pb2_grpc.IngressServiceAsyncStub:
        return self._versions[via or self.deployment_id].stub

    async def new_session(self, *, via: str | None = None, **create: Any) -> str:
        """Start a new conversation (the next sends go to it)."""
        created = await self._stub(via).CreateSession(
            pb.CreateSessionRequest(request_id=uuid.uuid4().hex, **create),
            metadata=self.metadata,
            timeout=10,
        )
        self.session_id, self._next_seq = created.session_id, 0
        return self.session_id

    async def send(self, text: str, *, via: str | None = None) -> Turn:
        """A message from the user, through `via`'s ingress (default: the
        first deployment's); the turn it leads to."""
        return await self._deliver(pb.SendMessageRequest(text=text), via)

    async def approve(self, request_id: str = "", *, via: str | None = None) -> Turn:
        """Approve the pending request (default: the latest one asked)."""
        return await self._respond(request_id, via, approved=True)

    async def deny(self, request_id: str = "", *, via: str | None = None) -> Turn:
        return await self._respond(request_id, via, approved=False)

    async def answer(self, text: str, request_id: str = "", *, via: str | None = None) -> Turn:
        """Answer the model's question (default: the latest one asked)."""
        return await self._respond(request_id, via, text=text)

    async def events(self) -> list[s.Event]:
        """The session's whole stream so far."""
        call = self._stub(None).StreamEvents(
            pb.StreamEventsRequest(session_id=self.session_id, start_seq=0),
            metadata=self.metadata,
            timeout=10,
        )
        return [e async for response in call for e in response.events]

    async def _respond(self, request_id: str, via: str | None, **answer: Any) -> Turn:
        if not request_id:
            asked = [e for e in await self.events() if e.kind == s.EVENT_KIND_INPUT_REQUESTED]
            if not asked:
                raise LookupError("nothing was asked in this session")
            request_id = asked[-1].input_request.request_id
        response = s.InputResponse(request_id=request_id, **answer)
        return await self._deliver(pb.SendMessageRequest(input_responses=[response]), via)

    async def _deliver(self, request: pb.SendMessageRequest, via: str | None) -> Turn:
        if not self.session_id:
            await self.new_session(via=via)
        request.session_id = self.session_id
        await self._stub(via).SendMessage(request, metadata=self.metadata, timeout=10)
        return await self._settle()

    async def _settle(self) -> Turn:
        """The events from the cursor until the session settles, pauses or ends."""
        seen: list[s.Event] = []
        request = pb.StreamEventsRequest(
            session_id=self.session_id, start_seq=self._next_seq, follow=True
        )
        call = self._stub(None).StreamEvents(request, metadata=self.metadata)
        try:
            async with asyncio.timeout(self.timeout):
                async for response in call:
                    seen.extend(response.events)
                    if _settled(seen):
                        break
        except TimeoutError:
            kinds = [s.EventKind.Name(e.kind) for e in seen]
            raise TimeoutError(f"the turn did not settle in {self.timeout:g}s: {kinds}") from None
        finally:
            call.cancel()
        if seen:
            self._next_seq = seen[-1].seq + 1
        return Turn(tuple(seen))


def _settled(events: Sequence[s.Event]) -> bool:
    """A turn is over for now: the session waits, pauses for input or a
    sign-in, or ends."""
    return any(e.kind in _ENDS or e.kind in _PAUSES for e in events)
