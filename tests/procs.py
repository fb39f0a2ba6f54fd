"""Baton as real processes, for recovery tests: hooks, anchor, ingress and N
owner instances of one deployment over a real etcd (`ProcessStack`, the
package's `ServiceStack` on the test PKI), replicas of each
(`ReplicatedStack`), their clients, and checks of the history invariants
(docs/design.md §9). Every process is started by the one launcher
(services/cli/system/service_launcher.py) with its role's certificate from
the test PKI (TLS on every hop and to etcd); ingress reads its API keys from
a file."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.processes import ServiceProcess
from baton_runtime.cli.system.service_env import wiring_env
from baton_runtime.cli.system.service_launcher import ServiceLauncher
from baton_runtime.cli.system.service_stack import ServiceStack
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.etcd.keys import Keys, prefix_end, seq_of
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security, tls_options
from bench.stack import eventually as poll_until
from tests import certs
from tests.certs import TEST_PREFIX
from tests.stack import SLACK_KEY, public_channel

API_KEY = SLACK_KEY
SLACK = (("authorization", f"Bearer {API_KEY}"),)
K = s.EventKind
_T = TypeVar("_T")


async def eventually(
    probe: Callable[[], Awaitable[_T | None]], what: str, timeout: float = 30.0
) -> _T:
    """Poll `probe` until it returns something truthy; past `timeout`, the
    test fails (bench.stack's poll, its timeout an assertion)."""
    try:
        return await poll_until(probe, what, within=timeout)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


@dataclass
class ProcessStack(ServiceStack):
    """hooks + anchor + ingress + owner instances of one deployment
    (services/cli/system/service_stack.py), on the test PKI, under a unique
    key prefix of the test etcd's, its ingresses granting the suite's key."""

    pki: LocalPki | None = field(default_factory=certs.pki)
    prefix: str = field(default_factory=lambda: f"{TEST_PREFIX}p{uuid.uuid4().hex}/")
    api_key: str = API_KEY
    log_level: str = field(default_factory=lambda: os.environ.get("BATON_TEST_LOG_LEVEL", "info"))

    def start(self, owners: int = 2) -> ProcessStack:
        super().start(owners)
        return self

    def start_deployments(
        self, owners: dict[str, tuple[str, str]], ingresses: dict[str, tuple[str, str]]
    ) -> ProcessStack:
        super().start_deployments(owners, ingresses)
        return self

    # -- clients -----------------------------------------------------------------

    def clients(self) -> StackClients:
        return StackClients(self)


class StackClients:
    """gRPC clients of a ProcessStack (close them)."""

    def __init__(self, stack: ProcessStack) -> None:
        self.stack = stack
        self.channel = public_channel(stack.addr("ingress"))
        self.ingress = ingress_pb2_grpc.IngressServiceStub(self.channel)
        # As an owner of the stack's deployment (lists its instances and sessions).
        self.hooks = HooksClient(stack.addr("hooks"), timeout=5, security=stack.security())
        self.anchor = AnchorClient(stack.addr("anchor"), timeout=5, security=stack.security())
        # As an operator: looks at any deployment.
        self.operator_hooks = HooksClient(stack.addr("hooks"), timeout=5, security=stack.probe)

    async def close(self) -> None:
        await self.channel.close()
        await self.hooks.close()
        await self.operator_hooks.close()
        await self.anchor.close()

    async def wait_registered(self, *instance_ids: str, timeout: float = 30.0) -> None:
        async def registered() -> bool:
            live = await self.hooks.list_instances(self.stack.deployment_id)
            return set(instance_ids) <= {i.instance_id for i in live}

        await eventually(registered, f"instances {instance_ids} registered", timeout)

    async def create(self, timeout_seconds: int = 0) -> str:
        response = await self.ingress.CreateSession(
            ingress_pb.CreateSessionRequest(timeout_seconds=timeout_seconds),
            metadata=SLACK,
            timeout=10,
        )
        return response.session_id

    async def send(
        self, session_id: str, text: str, *, delivery_id: str = "", queue: bool = True
    ) -> ingress_pb.SendMessageResponse:
        return await self.ingress.SendMessage(
            ingress_pb.SendMessageRequest(
                session_id=session_id,
                text=text,
                delivery_id=delivery_id,
                turn_policy=s.TURN_POLICY_QUEUE if queue else s.TURN_POLICY_STEER,
            ),
            metadata=SLACK,
            timeout=10,
        )

    async def events(self, session_id: str) -> list[s.Event]:
        return [e async for page in self.anchor.read_events(session_id) for e in page]

    async def wait_events(
        self,
        session_id: str,
        done: Callable[[list[s.Event]], bool],
        what: str,
        timeout: float = 30.0,
    ) -> list[s.Event]:
        async def probe() -> list[s.Event] | None:
            events = await self.events(session_id)
            return events if done(events) else None

        return await eventually(probe, what, timeout)

    async def owner_of(self, session_id: str) -> str:
        """The instance whose index holds the session ("" if none listed)."""
        for instance_id in self.stack.owners:
            owned = await self.hooks.list_instance_sessions(self.stack.deployment_id, instance_id)
            if any(o.fence.session_id == session_id for o in owned):
                return instance_id
        return ""


# -- history checks --------------------------------------------------------------


async def inbox_entries_left(endpoint: str, prefix: str, session_id: str) -> list[int]:
    """The seqs of the session's stored inbox entries: once every command is
    answered, none (each was deleted by the commit that consumed it)."""
    client = await certs.etcd_client(endpoint)
    try:
        inbox = Keys(prefix).inbox_prefix(session_id)
        return [seq_of(kv.key) for kv in await client.get_range(inbox, prefix_end(inbox))]
    finally:
        await client.close()


def received_seqs(events: list[s.Event]) -> list[int]:
    return [e.inbox_seq for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED]


def answered(events: list[s.Event], count: int) -> bool:
    """The first `count` inbox seqs were admitted and the session waits again."""
    return (
        received_seqs(events)[-1:] == [count - 1]
        and bool(events)
        and events[-1].kind == K.EVENT_KIND_SESSION_WAITING
    )


def check_history(events: list[s.Event], receipts: list[int]) -> None:
    """The invariants every recovery must keep, over one session's stream."""
    assert [e.seq for e in events] == list(range(len(events))), "stream has a gap or duplicate"
    starts = [e for e in events if e.kind == K.EVENT_KIND_SESSION_STARTED]
    assert len(starts) == 1, "session.started committed more than once"
    # Every accepted command processed exactly once, in FIFO order.
    assert received_seqs(events) == sorted(receipts), "inbox not processed once each in order"
    assert sorted(receipts) == list(range(len(receipts))), "receipt seqs have gaps"
    # No committed step runs again: a tool call id and a (turn, step) appear once.
    calls = [e.tool_call.id for e in events if e.kind == K.EVENT_KIND_TOOL_CALL_REQUESTED]
    assert len(calls) == len(set(calls)), f"a tool call ran twice: {calls}"
    steps = [(e.turn_id, e.step) for e in events if e.kind == K.EVENT_KIND_STEP_COMPLETED]
    assert len(steps) == len(set(steps)), f"a step committed twice: {steps}"
    # One owner run per epoch: runs follow one another and never come back.
    runs: list[str] = []
    for event in events:
        if not runs or runs[-1] != event.owner_run_id:
            assert event.owner_run_id not in runs, (
                f"run {event.owner_run_id} wrote after its successor"
            )
            runs.append(event.owner_run_id)


# -- the replicated topology ---------------------------------------------------------


class Launched:
    """A stack on the one launcher (services/cli/system/service_launcher.py),
    its processes by name."""

    launcher: ServiceLauncher

    @staticmethod
    def test_launcher(workdir: Path) -> ServiceLauncher:
        """The launcher on the test PKI, its services given 1 s to stop."""
        return ServiceLauncher(workdir, certs.pki(), env={"BATON_SHUTDOWN_GRACE": "1"})

    @property
    def procs(self) -> dict[str, ServiceProcess]:
        return self.launcher.processes

    @property
    def ports(self) -> dict[str, int]:
        return self.launcher.ports

    def addr(self, name: str) -> str:
        return self.launcher.addr(name)


@dataclass
class ReplicatedStack(Launched):
    """`replicas` processes each of hooks, anchor, owner and ingress of one
    deployment, every client given all replicas of what it calls and every
    etcd member (`etcd_endpoint` may name several). Processes are named
    hooks1, hooks2, anchor1, ..., o1, o2, ..., ingress1, ingress2, ...
    A configuration of the launcher (services/cli/system/service_launcher.py)."""

    etcd_endpoint: str
    workdir: Path
    replicas: int = 2
    deployment_id: str = "dep-r"
    lease_ttl: int = 5
    prefix: str = field(default_factory=lambda: f"{TEST_PREFIX}p{uuid.uuid4().hex}/")
    launcher: ServiceLauncher = field(init=False)

    def __post_init__(self) -> None:
        self.launcher = self.test_launcher(self.workdir)

    def names(self, kind: str) -> list[str]:
        return [f"{kind}{i}" for i in range(1, self.replicas + 1)]

    def addrs(self, kind: str) -> str:
        return self.launcher.addrs(self.names(kind))

    def security(self, role: Role) -> Security:
        """A certificate of `role` (for owners and ingresses: of the stack's
        deployment)."""
        return self.launcher.security(role, self.deployment_id)

    def _env(self, module: str, name: str) -> dict[str, str]:
        keys = self.workdir / "api-keys"
        if module == "ingress" and not keys.exists():
            keys.write_text(f"slack={API_KEY}\n")
        env = wiring_env(
            module,
            etcd=self.etcd_endpoint,
            prefix=self.prefix,
            hooks=self.addrs("hooks"),
            anchor=self.addrs("anchor"),
            deployment_id=self.deployment_id,
            owners=self.addrs("o"),
            api_keys_file=str(keys),
        )
        if module == "anchor":
            # The replicas share one object store, as they share etcd.
            env["BATON_OBJECT_STORE"] = f"file://{self.workdir / 'objects'}"
        if module in ("hooks", "anchor"):
            env["BATON_ETCD_TIMEOUT"] = "2"
        if module == "owner":
            env |= {
                "BATON_INSTANCE_ID": name,
                "BATON_OWNER_LEASE_TTL": str(self.lease_ttl),
                "BATON_OWNER_PARK_AFTER": "0",
            }
        return env

    def start_process(self, name: str, *, wait: bool = True) -> ServiceProcess:
        """Start (or start again, on its port) the process called `name`."""
        module = {"o": "owner"}.get(name.rstrip("0123456789"), name.rstrip("0123456789"))
        return self.launcher.start(
            name, module, self._env(module, name), deployment_id=self.deployment_id, wait=wait
        )

    def start(self) -> ReplicatedStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tiers = [self.names(k) for k in ("hooks", "anchor", "o", "ingress")]
        for name in (n for tier in tiers for n in tier):
            self.addr(name)
        for tier in tiers:
            for name in tier:
                self.start_process(name, wait=False)
            self.launcher.wait_serving(tier)
        return self

    def kill(self, name: str) -> None:
        """kill -9."""
        self.launcher.kill(name)

    def stop_process(self, name: str) -> None:
        """SIGTERM: graceful shutdown."""
        self.launcher.terminate(name)

    def alive(self) -> dict[str, bool]:
        return {name: self.launcher.alive(name) for name in self.procs}

    def stop(self) -> None:
        self.launcher.stop(graceful=False)


class ReplicatedClients:
    """A gateway's view: one balanced channel over every ingress (a send is
    retried with its delivery id until accepted), one channel per ingress for
    readers, and balanced internal clients for checks."""

    def __init__(self, stack: ReplicatedStack) -> None:
        self.stack = stack
        target = f"ipv4:{stack.addrs('ingress')}"
        self.channel = public_channel(
            target, options=tls_options(target, [("grpc.lb_policy_name", "round_robin")])
        )
        self.ingress = ingress_pb2_grpc.IngressServiceStub(self.channel)
        self.channels = {name: public_channel(stack.addr(name)) for name in stack.names("ingress")}
        self.ingresses = {
            name: ingress_pb2_grpc.IngressServiceStub(channel)
            for name, channel in self.channels.items()
        }
        owner = stack.security(Role.OWNER)
        self.hooks = HooksClient(stack.addrs("hooks"), timeout=5, security=owner)
        self.anchor = AnchorClient(stack.addrs("anchor"), timeout=5, security=owner)

    async def close(self) -> None:
        for channel in (self.channel, *self.channels.values()):
            await channel.close()
        await self.hooks.close()
        await self.anchor.close()

    async def wait_registered(self, timeout: float = 30.0) -> None:
        async def registered() -> bool:
            live = await self.hooks.list_instances(self.stack.deployment_id)
            return set(self.stack.names("o")) <= {i.instance_id for i in live}

        await eventually(registered, "every owner registered", timeout)

    async def create(self) -> str:
        request_id = uuid.uuid4().hex  # a retry finds the session the first try made

        async def created() -> str:
            response = await self.ingress.CreateSession(
                ingress_pb.CreateSessionRequest(request_id=request_id),
                metadata=SLACK,
                timeout=10,
            )
            return response.session_id

        return await eventually(created, "a session created")

    async def send_until_accepted(self, sid: str, text: str, delivery_id: str) -> int:
        """Retry with the same delivery id until accepted (a retry of a send
        that was accepted but not answered returns its first receipt)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                response = await self.ingress.SendMessage(
                    ingress_pb.SendMessageRequest(
                        session_id=sid,
                        text=text,
                        delivery_id=delivery_id,
                        turn_policy=s.TURN_POLICY_QUEUE,
                    ),
                    metadata=SLACK,
                    timeout=10,
                )
                return response.receipt.seq
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline or exc.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    # An ingress stopping cancels calls still in flight after
                    # its grace (1 s here): a gateway sends again (docs/grpcurl.md).
                    grpc.StatusCode.CANCELLED,
                ):
                    raise
            await asyncio.sleep(0.1)

    async def follow(self, sid: str, out: list[s.Event], via: list[str] | None = None) -> None:
        """A live reader: reads through the ingresses in `via` (default all,
        in order), moving to the next one whenever its stream breaks, and
        always resuming from its cursor (the events it has)."""
        names = via or list(self.ingresses)
        turn = 0
        while True:
            stub = self.ingresses[names[turn % len(names)]]
            call = stub.StreamEvents(
                ingress_pb.StreamEventsRequest(session_id=sid, start_seq=len(out), follow=True),
                metadata=SLACK,
            )
            try:
                async for response in call:
                    out.extend(response.events)
            except grpc.aio.AioRpcError:
                turn += 1
                await asyncio.sleep(0.1)
            finally:
                call.cancel()

    async def events(self, session_id: str) -> list[s.Event]:
        return [e async for page in self.anchor.read_events(session_id) for e in page]
