"""`baton demo`: one short conversation through the public ingress API.

Creates a session, follows its event stream in a background task, sends the
demo messages one at a time and prints every event as it arrives. Each message
is sent once the previous one's turn has settled (its `session.waiting`
event), so every message gets its own turn. Every RPC has a deadline. One
message asks the fixture's `helper` subagent: a child session answers inside
the turn (`task.started` ... `task.completed` between the turn's own events),
which the demo checks and reports.

With upgrade ingresses (ingresses of other deployments), the demo then sends
`UPGRADE_MESSAGE` through each in turn: the idle session hands off to that
deployment mid-conversation, and that deployment's code answers (under
`baton up`, the fixture's version 2: "[v2] The result is dep-2."). The
demo checks that each move happened (the turn's first event is
`session.handed_off` from the previous deployment, and the whole turn ran on
the new one) and that the one follower stream, opened on the first ingress
before the first message, read every seq from 0 in order with no gap, no
duplicate and no reconnect.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands.event_text import format_event
from baton_runtime.cli.system.launch_settings import DEMO_API_KEY

DEFAULT_INGRESS = "127.0.0.1:50051"
# The calculator message makes the fixture agent call a tool and answer
# "The result is 35."; the "ask helper" message makes it ask its `helper`
# subagent (a child session, which uses the calculator) and answer
# "helper says: The result is 42."; "whoami" makes it report its deployment id.
DEFAULT_MESSAGES = ("hello", "calc (2+3)*7", "ask helper what is 6*7", "whoami")
# Sent through each upgrade ingress; the fixture agent answers with the
# deployment that ran the turn ("The result is dep-2.").
UPGRADE_MESSAGE = "whoami"
RPC_TIMEOUT = 10.0

_TERMINAL = frozenset({s.EVENT_KIND_SESSION_COMPLETED, s.EVENT_KIND_SESSION_FAILED})


class DemoError(Exception):
    """The demo could not finish; the message says why."""


@dataclass
class TurnTracker:
    """Which deliveries have been received by the session, and which of them
    a `session.waiting` event has since settled; every event seen, checked to
    be the next seq of the stream."""

    events: list[s.Event] = field(default_factory=list)
    received: set[str] = field(default_factory=set)
    settled: set[str] = field(default_factory=set)
    terminal: s.Event | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def next_seq(self) -> int:
        return len(self.events)

    @property
    def deployment_id(self) -> str:
        """The deployment that wrote the latest event."""
        return self.events[-1].deployment_id if self.events else ""

    def observe(self, event: s.Event) -> None:
        if event.seq != self.next_seq:
            raise DemoError(
                f"the stream is not gapless: expected #{self.next_seq}, got #{event.seq}"
            )
        self.events.append(event)
        if event.kind == s.EVENT_KIND_MESSAGE_RECEIVED and event.delivery_id:
            self.received.add(event.delivery_id)
        elif event.kind == s.EVENT_KIND_SESSION_WAITING:
            self.settled |= self.received
        elif event.kind in _TERMINAL:
            self.terminal = event
        self.changed.set()

    async def wait_settled(self, delivery_id: str) -> None:
        while delivery_id not in self.settled:
            if self.terminal is not None:
                raise DemoError(f"session ended early: {format_event(self.terminal)}")
            self.changed.clear()
            await self.changed.wait()


def check_moved(turn: Sequence[s.Event], source: str, target: str) -> s.Event:
    """The events of a turn sent through `target`'s ingress to a session idle
    on `source`: the first is the handoff from `source`, and every one was
    written by `target`. Returns the handoff event; raises DemoError."""
    if not turn:
        raise DemoError("the upgrade turn wrote no events")
    first = turn[0]
    ran_on = sorted({e.deployment_id for e in turn})
    if first.kind != s.EVENT_KIND_SESSION_HANDED_OFF:
        raise DemoError(
            f"the session did not move to {target}: the turn ran on {', '.join(ran_on)} "
            f"(first event {format_event(first)}); is an owner of {target} running?"
        )
    if first.text != source or first.deployment_id != target:
        raise DemoError(
            f"unexpected handoff: {format_event(first)} (expected {source} -> {target})"
        )
    if ran_on != [target]:
        raise DemoError(f"the upgrade turn ran on {', '.join(ran_on)}, not only on {target}")
    return first


def check_children(turn: Sequence[s.Event]) -> list[str]:
    """The child sessions a settled turn gave work to: each must have
    answered inside the turn. Returns a line per child; raises DemoError."""
    lines = []
    for started in (e for e in turn if e.kind == s.EVENT_KIND_TASK_STARTED):
        child = started.child_session_id
        done = [
            e
            for e in turn
            if e.child_session_id == child
            and e.kind in (s.EVENT_KIND_TASK_COMPLETED, s.EVENT_KIND_TASK_FAILED)
        ]
        if started.task.tool_call_id and (not done or done[-1].turn_id != started.turn_id):
            raise DemoError(f"child session {child} did not answer inside {started.turn_id}")
        if done and done[-1].kind == s.EVENT_KIND_TASK_COMPLETED:
            lines.append(
                f"subagent: {started.task.name} (child session {child}) answered inside "
                f"{started.turn_id} at #{done[-1].seq}: {json.dumps(done[-1].text)}"
            )
    return lines


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, DemoError):
        return str(exc)
    return repr(exc)


def _trusting(ca_cert: str) -> grpc.ChannelCredentials:
    """TLS credentials trusting the CA bundle at `ca_cert` (no client cert:
    gateways authenticate with API keys)."""
    try:
        return grpc.ssl_channel_credentials(Path(ca_cert).read_bytes())
    except OSError as exc:
        raise DemoError(f"cannot read the CA certificate {ca_cert}: {exc.strerror}") from exc


async def run_demo(
    ingress: str = DEFAULT_INGRESS,
    api_key: str = DEMO_API_KEY,
    messages: Sequence[str] = DEFAULT_MESSAGES,
    *,
    upgrade_ingresses: Sequence[str] = (),
    time_limit: float = 60.0,
    out: TextIO | None = None,
    ca_cert: str = "",
    server_name: str = "",
) -> str:
    """Run the demo conversation; returns the session id. Raises DemoError.
    Talks TLS to the ingresses, trusting the CA in `ca_cert` (verifying
    their certificates against `server_name` when given, e.g. through a
    port-forward); plaintext when `ca_cert` is empty (a `baton up
    --plaintext` system)."""
    dialer = _Dialer(_trusting(ca_cert) if ca_cert else None, server_name)
    demo = _Conversation(ingress, (("authorization", f"Bearer {api_key}"),), dialer, out)
    async with dialer.connect(ingress) as channel:
        stub = ingress_pb2_grpc.IngressServiceStub(channel)
        await demo.create(stub)
        demo.follow(stub, time_limit)
        try:
            await asyncio.wait_for(demo.converse(stub, messages, upgrade_ingresses), time_limit)
        except TimeoutError as exc:
            raise DemoError(f"demo did not finish within {time_limit:g}s") from exc
        finally:
            await demo.stop_following()
    if upgrade_ingresses:
        demo.write(
            f"follower: one StreamEvents call on {ingress} read #0..#{demo.tracker.next_seq - 1} "
            "in order: no gap, no duplicate, no reconnect"
        )
    demo.write(f"demo finished: session {demo.session_id}")
    return demo.session_id


@dataclass(frozen=True)
class _Dialer:
    """Channels to the ingresses: TLS trusting the demo's CA (verified
    against `server_name` when given), or plaintext."""

    credentials: grpc.ChannelCredentials | None
    server_name: str

    def connect(self, address: str) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address)
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.aio.secure_channel(address, self.credentials, options=options)


class _Conversation:
    """One demo session: created on the first ingress, its stream followed
    there by one call for the whole demo, messages sent and awaited one
    turn at a time, then moved through each upgrade ingress."""

    def __init__(
        self,
        ingress: str,
        metadata: tuple[tuple[str, str], ...],
        dialer: _Dialer,
        out: TextIO | None,
    ) -> None:
        self.ingress = ingress
        self.metadata = metadata
        self.dialer = dialer
        self.out = out or sys.stdout
        self.tracker = TurnTracker()
        self.session_id = ""
        self.deployment_id = ""
        self._call: grpc.aio.UnaryStreamCall[Any, Any] | None = None
        self._follower: asyncio.Task[None] | None = None

    def write(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    async def create(self, stub: ingress_pb2_grpc.IngressServiceAsyncStub) -> None:
        try:
            created = await stub.CreateSession(
                ingress_pb.CreateSessionRequest(request_id=f"demo-{uuid.uuid4().hex}"),
                metadata=self.metadata,
                timeout=RPC_TIMEOUT,
            )
        except grpc.RpcError as exc:
            raise DemoError(f"CreateSession at {self.ingress} failed: {_describe(exc)}") from exc
        self.session_id = created.session_id
        self.deployment_id = created.deployment_id
        self.write(f"session {self.session_id} on deployment {self.deployment_id}")

    def follow(self, stub: ingress_pb2_grpc.IngressServiceAsyncStub, time_limit: float) -> None:
        """The one and only read of the stream: from seq 0, following, on the
        first ingress, for the whole demo (whatever deployment runs the
        session meanwhile). It is never reopened: an end or an error fails
        the demo."""
        call = stub.StreamEvents(
            ingress_pb.StreamEventsRequest(session_id=self.session_id, start_seq=0, follow=True),
            metadata=self.metadata,
            timeout=time_limit,
        )
        self._call = call

        async def read() -> None:
            async for response in call:
                for event in response.events:
                    self.write(format_event(event))
                    self.tracker.observe(event)
            self.tracker.changed.set()

        self._follower = asyncio.create_task(read())

    async def stop_following(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)

    async def converse(
        self,
        stub: ingress_pb2_grpc.IngressServiceAsyncStub,
        messages: Sequence[str],
        upgrade_ingresses: Sequence[str],
    ) -> None:
        """Each message, one settled turn at a time (checking the children a
        turn gave work to), then one move per upgrade ingress."""
        for text in messages:
            self.write(f"> {text}")
            first_seq = self.tracker.next_seq
            sent = await self._send(stub, text, self.ingress)
            await self._settle(sent.delivery_id)
            for line in check_children(self.tracker.events[first_seq:]):
                self.write(line)
        for address in upgrade_ingresses:
            await self._upgrade(address)
        if self._following_ended():
            raise DemoError("the event stream ended during the demo")

    async def _upgrade(self, address: str) -> None:
        """Send `UPGRADE_MESSAGE` through another deployment's ingress and
        check that the session moved there between two turns."""
        source = self.tracker.deployment_id or self.deployment_id
        first_seq = self.tracker.next_seq
        self.write(f"> {UPGRADE_MESSAGE}   (via the ingress at {address})")
        async with self.dialer.connect(address) as other:
            stub = ingress_pb2_grpc.IngressServiceStub(other)
            sent = await self._send(stub, UPGRADE_MESSAGE, address)
        target = sent.accepted_deployment_id
        if target == source:
            raise DemoError(
                f"the ingress at {address} accepts for deployment {target}, which already "
                "runs the session: an upgrade ingress must serve another deployment"
            )
        await self._settle(sent.delivery_id)
        turn = self.tracker.events[first_seq:]
        handed = check_moved(turn, source, target)
        self.write(
            f"upgraded: session {self.session_id} moved from {source} to {target} at "
            f"#{handed.seq}, between two turns"
        )
        answers = [e.text for e in turn if e.kind == s.EVENT_KIND_MESSAGE_COMPLETED]
        if answers:
            self.write(f"answered by {target}'s code: {json.dumps(answers[-1])}")

    async def _send(
        self, stub: ingress_pb2_grpc.IngressServiceAsyncStub, text: str, where: str
    ) -> ingress_pb.SendMessageResponse:
        try:
            sent: ingress_pb.SendMessageResponse = await stub.SendMessage(
                ingress_pb.SendMessageRequest(session_id=self.session_id, text=text),
                metadata=self.metadata,
                timeout=RPC_TIMEOUT,
            )
        except grpc.RpcError as exc:
            raise DemoError(f"SendMessage at {where} failed: {_describe(exc)}") from exc
        return sent

    async def _settle(self, delivery_id: str) -> None:
        """Wait until a `session.waiting` settles `delivery_id`'s turn; the
        stream failing or ending first fails the demo."""
        assert self._follower is not None
        follower = self._follower
        settled = asyncio.create_task(self.tracker.wait_settled(delivery_id))
        done, _ = await asyncio.wait({settled, follower}, return_when=asyncio.FIRST_COMPLETED)
        if settled not in done:
            settled.cancel()
            error = follower.exception()
            if error is not None:
                raise DemoError(f"event stream failed: {_describe(error)}") from error
            raise DemoError("event stream ended before the turn settled")
        settled.result()

    def _following_ended(self) -> bool:
        return self._follower is None or self._follower.done()
