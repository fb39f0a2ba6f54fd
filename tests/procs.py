"""Baton as real processes, for recovery tests: hooks, anchor, ingress and N
owner instances of one deployment over a real etcd, with the means to kill,
pause and start them, and checks of the history invariants (docs/design.md §9).
Every process gets its role's certificate from the test PKI (TLS on every
hop and to etcd) and ingress reads its API keys from a file."""

from __future__ import annotations

import asyncio
import os
import signal
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
from baton_runtime.cli.system.processes import ServiceProcess, free_port, wait_serving
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError
from baton_runtime.common.etcd.keys import Keys, prefix_end, seq_of
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.tls import Security, tls_options
from tests import certs
from tests.certs import TEST_PREFIX
from tests.stack import SLACK_KEY, public_channel

API_KEY = SLACK_KEY
_PER_DEPLOYMENT = (Role.OWNER, Role.INGRESS)
SLACK = (("authorization", f"Bearer {API_KEY}"),)
K = s.EventKind
_T = TypeVar("_T")


async def eventually(
    probe: Callable[[], Awaitable[_T | None]], what: str, timeout: float = 30.0
) -> _T:
    """Poll `probe` until it returns something truthy, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = await probe()
            if result:
                return result
        except (BatonError, grpc.aio.AioRpcError) as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last!r})")


@dataclass
class ProcessStack:
    """hooks + anchor + ingress + owner instances of one deployment."""

    etcd_endpoint: str
    workdir: Path
    deployment_id: str = "dep-r"
    lease_ttl: int = 2
    park_after: float | None = None
    owner_env: dict[str, str] = field(default_factory=dict)  # every owner's extra env
    anchor_env: dict[str, str] = field(default_factory=dict)  # anchor's extra env
    env: dict[str, str] = field(default_factory=dict)  # every process's extra env
    prefix: str = field(default_factory=lambda: f"{TEST_PREFIX}p{uuid.uuid4().hex}/")
    hooks: ServiceProcess | None = None
    anchor: ServiceProcess | None = None
    ingress: ServiceProcess | None = None
    owners: dict[str, ServiceProcess] = field(default_factory=dict)
    ingresses: dict[str, ServiceProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    # With `serve_metrics`, every process serves Prometheus metrics on a port
    # of its own (`metrics_url`).
    serve_metrics: bool = False
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def metrics_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"

    def _env(self, security: Security, **extra: str) -> dict[str, str]:
        assert security.files is not None
        return {
            "BATON_TLS_CERT": security.files.cert,
            "BATON_TLS_KEY": security.files.key,
            "BATON_TLS_CA": security.files.ca,
            "PYTHONUNBUFFERED": "1",
            "BATON_LOG_LEVEL": os.environ.get("BATON_TEST_LOG_LEVEL", "info"),
            "BATON_ETCD_ENDPOINT": self.etcd_endpoint,
            "BATON_ETCD_PREFIX": self.prefix,
            "BATON_ETCD_TIMEOUT": "2",
            "BATON_HOOKS_ADDR": self.addr("hooks"),
            "BATON_ANCHOR_ADDR": self.addr("anchor"),
            "BATON_DEPLOYMENT_ID": self.deployment_id,
            "BATON_SHUTDOWN_GRACE": "1",
            **self.env,
            **extra,
        }

    def _spawn(self, name: str, module: str, **extra: str) -> ServiceProcess:
        self.ports.setdefault(name, free_port())
        deployment_id = extra.get("BATON_DEPLOYMENT_ID", self.deployment_id)
        role = Role(module)
        security = certs.security(role, deployment_id if role in _PER_DEPLOYMENT else "")
        if module == "ingress":
            extra.setdefault("BATON_API_KEYS_FILE", self._key_file())
        if self.serve_metrics:
            port = self.metrics_ports.setdefault(name, free_port())
            extra.setdefault("BATON_METRICS_LISTEN", f"127.0.0.1:{port}")
        proc = ServiceProcess(
            module,
            self.addr(name),
            self._env(security, **extra),
            log_path=str(self.workdir / f"{name}.log"),
        )
        return proc.start()

    def _key_file(self) -> str:
        path = self.workdir / "api-keys"
        if not path.exists():
            path.write_text(f"slack={API_KEY}\n")
        return str(path)

    def security(self, role: Role = Role.OWNER, deployment_id: str = "") -> Security:
        """A certificate of `role` (for owners and ingresses: of the stack's
        deployment unless named)."""
        if role in _PER_DEPLOYMENT:
            return certs.security(role, deployment_id or self.deployment_id)
        return certs.security(role)

    def start(self, owners: int = 2) -> ProcessStack:
        """Start everything and wait until it serves (owners registered)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name in ("hooks", "anchor", "ingress", *(f"o{i}" for i in range(1, owners + 1))):
            self.ports.setdefault(name, free_port())
        self.hooks = self._spawn("hooks", "hooks")
        self.anchor = self._spawn("anchor", "anchor", **self.anchor_env)
        for i in range(1, owners + 1):
            self.start_owner(f"o{i}", wait=False)
        self.ingress = self._spawn("ingress", "ingress", BATON_OWNER_ADDR=self.addr("o1"))
        for name in ("hooks", "anchor", "ingress", *self.owners):
            wait_serving(self.addr(name), self.probe)
        return self

    def start_deployments(
        self, owners: dict[str, tuple[str, str]], ingresses: dict[str, tuple[str, str]]
    ) -> ProcessStack:
        """Several deployments side by side. `owners`: instance id ->
        (deployment id, failpoints); `ingresses`: name -> (deployment id,
        the owner instance it creates sessions on)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name in ("hooks", "anchor", *ingresses, *owners):
            self.ports.setdefault(name, free_port())
        self.hooks = self._spawn("hooks", "hooks")
        self.anchor = self._spawn("anchor", "anchor", **self.anchor_env)
        for instance_id, (deployment_id, points) in owners.items():
            self.start_owner(
                instance_id, wait=False, deployment_id=deployment_id, failpoints=points
            )
        for name, (deployment_id, owner) in ingresses.items():
            self.ingresses[name] = self._spawn(
                name,
                "ingress",
                BATON_OWNER_ADDR=self.addr(owner),
                BATON_DEPLOYMENT_ID=deployment_id,
            )
        for name in ("hooks", "anchor", *ingresses, *owners):
            wait_serving(self.addr(name), self.probe)
        return self

    def start_ingress(
        self, name: str, deployment_id: str, owners: list[str], env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Another ingress, of `deployment_id`, creating sessions on `owners`."""
        self.ingresses[name] = proc = self._spawn(
            name,
            "ingress",
            BATON_OWNER_ADDR=",".join(self.addr(o) for o in owners),
            BATON_DEPLOYMENT_ID=deployment_id,
            **(env or {}),
        )
        wait_serving(self.addr(name), self.probe)
        return proc

    def start_owner(
        self,
        instance_id: str,
        *,
        wait: bool = True,
        deployment_id: str = "",
        failpoints: str = "",
        env: dict[str, str] | None = None,
    ) -> ServiceProcess:
        extra = {
            "BATON_INSTANCE_ID": instance_id,
            "BATON_OWNER_LEASE_TTL": str(self.lease_ttl),
            "BATON_OWNER_PARK_AFTER": str(self.park_after or 0),
            "BATON_DEPLOYMENT_ID": deployment_id or self.deployment_id,
            "BATON_FAILPOINTS": failpoints,
            **self.owner_env,
            **(env or {}),
        }
        self.owners[instance_id] = proc = self._spawn(instance_id, "owner", **extra)
        if wait:
            wait_serving(self.addr(instance_id), self.probe)
        return proc

    @property
    def probe(self) -> Security:
        """What health probes present: an operator's certificate."""
        return certs.operator()

    def kill(self, instance_id: str) -> None:
        """kill -9."""
        self.owners[instance_id].kill()

    def pause(self, instance_id: str) -> None:
        os.kill(self.owners[instance_id].pid, signal.SIGSTOP)

    def resume(self, instance_id: str) -> None:
        os.kill(self.owners[instance_id].pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill every process (SIGCONT first, in case one is paused)."""
        for proc in (
            *self.owners.values(),
            *self.ingresses.values(),
            self.ingress,
            self.anchor,
            self.hooks,
        ):
            if proc is None or proc.proc is None or proc.proc.poll() is not None:
                continue
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                continue
            proc.kill()

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


@dataclass
class ReplicatedStack:
    """`replicas` processes each of hooks, anchor, owner and ingress of one
    deployment, every client given all replicas of what it calls and every
    etcd member (`etcd_endpoint` may name several). Processes are named
    hooks1, hooks2, anchor1, ..., o1, o2, ..., ingress1, ingress2, ..."""

    etcd_endpoint: str
    workdir: Path
    replicas: int = 2
    deployment_id: str = "dep-r"
    lease_ttl: int = 5
    prefix: str = field(default_factory=lambda: f"{TEST_PREFIX}p{uuid.uuid4().hex}/")
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def names(self, kind: str) -> list[str]:
        return [f"{kind}{i}" for i in range(1, self.replicas + 1)]

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def addrs(self, kind: str) -> str:
        return ",".join(self.addr(name) for name in self.names(kind))

    def security(self, role: Role) -> Security:
        """A certificate of `role` (for owners and ingresses: of the stack's
        deployment)."""
        return certs.security(role, self.deployment_id if role in _PER_DEPLOYMENT else "")

    def _env(self, kind: str, name: str) -> dict[str, str]:
        files = self.security(Role({"o": "owner"}.get(kind, kind))).files
        assert files is not None
        env = {
            "BATON_TLS_CERT": files.cert,
            "BATON_TLS_KEY": files.key,
            "BATON_TLS_CA": files.ca,
            "PYTHONUNBUFFERED": "1",
            "BATON_LOG_LEVEL": "info",
            "BATON_SHUTDOWN_GRACE": "1",
        }
        if kind in ("hooks", "anchor"):
            return env | {
                "BATON_ETCD_ENDPOINT": self.etcd_endpoint,
                "BATON_ETCD_PREFIX": self.prefix,
                "BATON_ETCD_TIMEOUT": "2",
            }
        env |= {
            "BATON_HOOKS_ADDR": self.addrs("hooks"),
            "BATON_ANCHOR_ADDR": self.addrs("anchor"),
            "BATON_DEPLOYMENT_ID": self.deployment_id,
        }
        if kind == "o":
            return env | {
                "BATON_INSTANCE_ID": name,
                "BATON_OWNER_LEASE_TTL": str(self.lease_ttl),
                "BATON_OWNER_PARK_AFTER": "0",
            }
        keys = self.workdir / "api-keys"
        if not keys.exists():
            keys.write_text(f"slack={API_KEY}\n")
        return env | {"BATON_API_KEYS_FILE": str(keys), "BATON_OWNER_ADDR": self.addrs("o")}

    def start_process(self, name: str, *, wait: bool = True) -> ServiceProcess:
        """Start (or start again, on its port) the process called `name`."""
        kind = name.rstrip("0123456789")
        module = {"o": "owner"}.get(kind, kind)
        proc = ServiceProcess(
            module,
            self.addr(name),
            self._env(kind, name),
            log_path=str(self.workdir / f"{name}.log"),
        )
        self.procs[name] = proc.start()
        if wait:
            wait_serving(self.addr(name), certs.operator())
        return proc

    def start(self) -> ReplicatedStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tiers = [self.names(k) for k in ("hooks", "anchor", "o", "ingress")]
        for name in (n for tier in tiers for n in tier):
            self.ports[name] = free_port()
        for tier in tiers:
            for name in tier:
                self.start_process(name, wait=False)
            for name in tier:
                wait_serving(self.addr(name), certs.operator())
        return self

    def kill(self, name: str) -> None:
        """kill -9."""
        self.procs[name].kill()

    def stop_process(self, name: str) -> None:
        """SIGTERM: graceful shutdown."""
        self.procs[name].stop()

    def alive(self) -> dict[str, bool]:
        return {
            name: proc.proc is not None and proc.proc.poll() is None
            for name, proc in self.procs.items()
        }

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()


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
