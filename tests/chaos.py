"""A chaos run with a history check (docs/design.md §9, issue 16).

The production topology on loopback, as real processes: a three-member etcd
cluster, two hooks and two anchors, and two deployments, each with two owners
and two ingresses. Sessions are created through random ingresses; several
gateway senders per session send through random ingresses of either
deployment (so sessions move between deployments while they are idle),
re-sending with the same delivery id on every retryable error. One follower
per session reads its stream live, resuming from its cursor. Meanwhile one
fault every few seconds, drawn from a seeded generator:

- kill -9 of the etcd leader, then its restart;
- kill -9 of a hooks, anchor or owner replica, then its restart;
- SIGSTOP of an owner past its lease, then SIGCONT (it exits on the lost
  lease and is started again);
- SIGTERM of an ingress, then its restart.

When the faults stop, every process is started again and SERVING, and the
run waits (bounded) until every accepted delivery has been received. Then
every session's whole stream is checked: every accepted delivery received
exactly once with its receipt's inbox seq and text, inbox order and
per-sender order kept, gapless seqs, owner runs never interleaved, no
delivery id received twice, followers saw the stored stream exactly; and
the etcd members' hashes agree at a common revision.

`python -m tests.chaos --seconds 720` runs it by hand (the slow test runs a
long version, the default suite a short one); the seed is printed with the
command that replays the run (`--seed` and the run's options).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.etcd_check import members_consistent
from baton_runtime.cli.system.etcd_process import EtcdCluster
from baton_runtime.cli.system.processes import ServiceProcess, free_port, wait_serving
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.tls import Security
from tests import certs
from tests.certs import TEST_PREFIX
from tests.procs import API_KEY, SLACK, check_history, eventually
from tests.stack import public_channel

K = s.EventKind
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    # An ingress stopping cancels calls still in flight after its grace.
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
FAULT_KINDS = (
    "etcd_leader_kill",
    "hooks_kill",
    "anchor_kill",
    "owner_kill",
    "owner_pause",
    "ingress_term",
)


# What an idle session may commit after session.waiting: a move without a
# trigger (an adoption, a drain) says session.handed_off with the
# successor's first commit and nothing more (docs/handoff.md), and automatic
# compaction is its own commit after the turn settles (docs/design.md §16).
IDLE_COMMITS = (K.EVENT_KIND_SESSION_HANDED_OFF, K.EVENT_KIND_CONTEXT_COMPACTED)


def waits_again(events: list[s.Event]) -> bool:
    """Whether a session's last turn settled and nothing started since: its
    stream's last session.waiting is followed by idle commits only."""
    for event in reversed(events):
        if event.kind == K.EVENT_KIND_SESSION_WAITING:
            return True
        if event.kind not in IDLE_COMMITS:
            return False
    return False


@dataclass
class ChaosStack:
    """Every Baton process of the topology, by name: hooks1, hooks2,
    anchor1, anchor2, and per deployment d: {d}.o1, {d}.o2, {d}.in1, {d}.in2."""

    etcd: EtcdCluster
    workdir: Path
    deployments: tuple[str, ...] = ("dep-a", "dep-b")
    replicas: int = 2
    lease_ttl: int = 3
    park_after: float = 1.0
    prefix: str = field(default_factory=lambda: f"{TEST_PREFIX}c{uuid.uuid4().hex}/")
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def shared(self, kind: str) -> list[str]:
        return [f"{kind}{i}" for i in range(1, self.replicas + 1)]

    def owners(self, deployment: str) -> list[str]:
        return [f"{deployment}.o{i}" for i in range(1, self.replicas + 1)]

    def ingresses(self, deployment: str | None = None) -> list[str]:
        deps = [deployment] if deployment else list(self.deployments)
        return [f"{d}.in{i}" for d in deps for i in range(1, self.replicas + 1)]

    def all_owners(self) -> list[str]:
        return [name for d in self.deployments for name in self.owners(d)]

    def tiers(self) -> list[list[str]]:
        return [
            self.shared("hooks"),
            self.shared("anchor"),
            self.all_owners(),
            self.ingresses(),
        ]

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def addrs(self, names: list[str]) -> str:
        return ",".join(self.addr(name) for name in names)

    @staticmethod
    def kind(name: str) -> tuple[str, str]:
        """(module, deployment) of a process name."""
        if "." not in name:
            return name.rstrip("0123456789"), ""
        deployment, _, local = name.partition(".")
        return ("owner" if local.startswith("o") else "ingress"), deployment

    def _env(self, name: str) -> dict[str, str]:
        module, deployment = self.kind(name)
        files = certs.security(Role(module), deployment).files
        assert files is not None
        env = {
            "BATON_TLS_CERT": files.cert,
            "BATON_TLS_KEY": files.key,
            "BATON_TLS_CA": files.ca,
            "PYTHONUNBUFFERED": "1",
            "BATON_LOG_LEVEL": "info",
            "BATON_SHUTDOWN_GRACE": "1",
        }
        if module in ("hooks", "anchor"):
            return env | {
                "BATON_ETCD_ENDPOINT": self.etcd.endpoint,
                "BATON_ETCD_PREFIX": self.prefix,
                "BATON_ETCD_TIMEOUT": "2",
            }
        env |= {
            "BATON_HOOKS_ADDR": self.addrs(self.shared("hooks")),
            "BATON_ANCHOR_ADDR": self.addrs(self.shared("anchor")),
            "BATON_DEPLOYMENT_ID": deployment,
        }
        if module == "owner":
            return env | {
                "BATON_INSTANCE_ID": name.replace(".", "-"),
                "BATON_OWNER_LEASE_TTL": str(self.lease_ttl),
                "BATON_OWNER_PARK_AFTER": str(self.park_after),
            }
        keys = self.workdir / "api-keys"
        if not keys.exists():
            keys.write_text(f"slack={API_KEY}\n")
        return env | {
            "BATON_API_KEYS_FILE": str(keys),
            "BATON_OWNER_ADDR": self.addrs(self.owners(deployment)),
        }

    def start_process(self, name: str, *, wait: bool = True) -> None:
        module, _ = self.kind(name)
        proc = ServiceProcess(
            module, self.addr(name), self._env(name), log_path=str(self.workdir / f"{name}.log")
        )
        self.procs[name] = proc.start()
        if wait:
            wait_serving(self.addr(name), certs.operator(), timeout=60)

    def start(self) -> ChaosStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for tier in self.tiers():
            for name in tier:
                self.ports[name] = free_port()
        for tier in self.tiers():
            for name in tier:
                self.start_process(name, wait=False)
            for name in tier:
                wait_serving(self.addr(name), certs.operator(), timeout=60)
        return self

    def alive(self, name: str) -> bool:
        proc = self.procs[name].proc
        return proc is not None and proc.poll() is None

    def kill(self, name: str) -> None:
        self.procs[name].kill()

    def terminate(self, name: str) -> None:
        self.procs[name].stop()

    def signal(self, name: str, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[name].pid, signum)

    def revive(self) -> list[str]:
        """Start every Baton process that is not running; the names started."""
        dead = [name for tier in self.tiers() for name in tier if not self.alive(name)]
        for name in dead:
            self.start_process(name, wait=False)
        for name in dead:
            wait_serving(self.addr(name), certs.operator(), timeout=60)
        return dead

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.proc is not None and proc.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            proc.kill()


@dataclass
class Sent:
    sid: str
    seq: int
    text: str
    delivery_id: str
    sender: int
    accepted_at: float


@dataclass
class ChaosReport:
    seed: int
    accepted: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    longest_wait_s: float = 0.0
    sessions: int = 0
    handoffs: int = 0
    duration_s: float = 0.0
    etcd_revision: int = 0  # where the members' hashes were compared (equal)
    # Lost wake-ups the owners' reconcilers repaired (their log lines): late
    # answers, not lost ones, but each one a watch event some process lost.
    reconciled: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        faults = ", ".join(f"{kind} {n}" for kind, n in sorted(self.faults.items()))
        return (
            f"chaos seed={self.seed}: {self.accepted} commands accepted over {self.sessions} "
            f"sessions in {self.duration_s:.0f}s, {sum(self.faults.values())} faults ({faults}), "
            f"{self.handoffs} handoffs, longest wait receipt->received {self.longest_wait_s:.1f}s, "
            f"etcd members' hashes equal at revision {self.etcd_revision}, "
            f"reconciler repairs: woken {self.reconciled['woken']}, "
            f"taken over {self.reconciled['taken_over']}"
        )


class Gateway:
    """The channel gateways' side: one channel per ingress (sends and
    followers pick one at random, and move on when it fails)."""

    def __init__(self, stack: ChaosStack) -> None:
        self.stack = stack
        self.names = stack.ingresses()
        self.channels = {name: public_channel(stack.addr(name)) for name in self.names}
        self.stubs = {
            name: ingress_pb2_grpc.IngressServiceStub(channel)
            for name, channel in self.channels.items()
        }
        owner: Security = certs.owner(stack.deployments[0])
        hooks = stack.addrs(stack.shared("hooks"))
        anchor = stack.addrs(stack.shared("anchor"))
        self.hooks = HooksClient(hooks, timeout=5, security=owner)
        self.anchor = AnchorClient(anchor, timeout=10, security=owner)

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        await self.hooks.close()
        await self.anchor.close()

    async def create(self, rng: random.Random) -> str:
        request_id = uuid.uuid4().hex
        deadline = time.monotonic() + 120
        while True:
            stub = self.stubs[rng.choice(self.names)]
            try:
                response = await stub.CreateSession(
                    ingress_pb.CreateSessionRequest(request_id=request_id),
                    metadata=SLACK,
                    timeout=10,
                )
                return response.session_id
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline or exc.code() not in RETRYABLE:
                    raise
            await asyncio.sleep(0.1)

    async def send(
        self,
        rng: random.Random,
        sid: str,
        text: str,
        delivery_id: str,
        policy: s.TurnPolicy.ValueType = s.TURN_POLICY_UNSPECIFIED,
    ) -> int:
        """Send until accepted, always with the same delivery id, through a
        random ingress each try. Gives up (raises) after 300 s."""
        deadline = time.monotonic() + 300
        while True:
            stub = self.stubs[rng.choice(self.names)]
            try:
                response = await stub.SendMessage(
                    ingress_pb.SendMessageRequest(
                        session_id=sid,
                        text=text,
                        delivery_id=delivery_id,
                        turn_policy=policy,
                    ),
                    metadata=SLACK,
                    timeout=10,
                )
                return response.receipt.seq
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline or exc.code() not in RETRYABLE:
                    raise
            await asyncio.sleep(rng.uniform(0.05, 0.3))

    async def follow(
        self, rng: random.Random, sid: str, out: list[s.Event], seen_at: dict[int, float]
    ) -> None:
        """A live reader through random ingresses, resuming from its cursor."""
        while True:
            stub = self.stubs[rng.choice(self.names)]
            call = stub.StreamEvents(
                ingress_pb.StreamEventsRequest(session_id=sid, start_seq=len(out), follow=True),
                metadata=SLACK,
            )
            try:
                async for response in call:
                    now = time.monotonic()
                    for event in response.events:
                        if event.kind == K.EVENT_KIND_MESSAGE_RECEIVED:
                            seen_at.setdefault(event.inbox_seq, now)
                    out.extend(response.events)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
            finally:
                call.cancel()

    async def events(self, sid: str) -> list[s.Event]:
        return [e async for page in self.anchor.read_events(sid) for e in page]


class Chaos:
    """One run: sessions, senders, followers, faults, then the checks."""

    def __init__(
        self,
        stack: ChaosStack,
        *,
        seed: int,
        sessions: int = 32,
        senders_per_session: int = 3,
        seconds: float = 60.0,
        fault_every: tuple[float, float] = (3.0, 8.0),
        settle_timeout: float = 900.0,
        stall_after: float = 60.0,
        think_s: float = 0.5,
        log: object = print,
    ) -> None:
        self.stack = stack
        self.seed = seed
        self.rng = random.Random(seed)
        self.sessions = sessions
        self.senders_per_session = senders_per_session
        self.seconds = seconds
        self.fault_every = fault_every
        self.settle_timeout = settle_timeout
        self.stall_after = stall_after
        self.report = ChaosReport(seed=seed, sessions=sessions)
        self.sent: dict[str, list[Sent]] = {}
        self.seen: dict[str, list[s.Event]] = {}
        self.seen_at: dict[str, dict[int, float]] = {}
        self._log = log
        self.think_s = think_s
        self._stop_sending = asyncio.Event()
        self._held: set[str] = set()

    def say(self, *parts: object) -> None:
        assert callable(self._log)
        self._log(f"[chaos {time.strftime('%H:%M:%S')}]", *parts)

    async def run(self) -> ChaosReport:
        started = time.monotonic()
        gateway = Gateway(self.stack)
        tasks: list[asyncio.Task[None]] = []
        followers: list[asyncio.Task[None]] = []
        try:
            sids = [await gateway.create(self.rng) for _ in range(self.sessions)]
            for sid in sids:
                self.sent[sid], self.seen[sid], self.seen_at[sid] = [], [], {}
                follower_rng = random.Random(self.rng.random())
                followers.append(
                    asyncio.create_task(
                        gateway.follow(follower_rng, sid, self.seen[sid], self.seen_at[sid])
                    )
                )
            for sid in sids:
                for sender in range(self.senders_per_session):
                    rng = random.Random(self.rng.random())
                    tasks.append(asyncio.create_task(self._sender(gateway, rng, sid, sender)))
            await self._faults()
            self._stop_sending.set()
            self.say("faults over; reviving every process")
            await asyncio.to_thread(self._revive_all)
            await asyncio.wait_for(asyncio.gather(*tasks), 360)
            self.report.accepted = sum(len(v) for v in self.sent.values())
            self.say(f"{self.report.accepted} accepted; waiting for every one to be received")
            await self._settle(gateway)
            await self._check(gateway)
            await self._check_etcd()
            self.report.reconciled = self._reconciler_repairs()
            self.report.duration_s = time.monotonic() - started
            return self.report
        finally:
            for task in (*tasks, *followers):
                task.cancel()
            await asyncio.gather(*tasks, *followers, return_exceptions=True)
            await gateway.close()

    async def _sender(self, gateway: Gateway, rng: random.Random, sid: str, sender: int) -> None:
        i = 0
        while not self._stop_sending.is_set():
            text = rng.choice([f"s{sender} m{i}"] * 8 + ["steps 2", "sleep 1 50"])
            delivery_id = f"{sid}-{sender}-{i}"
            policy = rng.choice([s.TURN_POLICY_UNSPECIFIED, s.TURN_POLICY_QUEUE])
            seq = await gateway.send(rng, sid, text, delivery_id, policy)
            self.sent[sid].append(Sent(sid, seq, text, delivery_id, sender, time.monotonic()))
            i += 1
            await asyncio.sleep(rng.uniform(0.0, self.think_s))

    # -- faults ------------------------------------------------------------------------

    def _revive_all(self) -> None:
        for member in self.stack.etcd.members:
            if member.proc is None or member.proc.poll() is not None:
                member.start(wait=False)
        self.stack.etcd.wait_healthy(60)
        for name in self.stack.all_owners():
            if self.stack.alive(name):
                self.stack.signal(name, signal.SIGCONT)
        started = self.stack.revive()
        if started:
            self.say("started again:", ", ".join(started))

    async def _faults(self) -> None:
        """One fault every `fault_every` seconds; faults overlap (each holds
        its victim for a while), and a supervisor starts every process that
        is down and held by no fault, as Kubernetes would."""
        deadline = time.monotonic() + self.seconds
        running: list[asyncio.Task[None]] = []
        supervisor = asyncio.create_task(self._supervise())
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(self.rng.uniform(*self.fault_every))
                if time.monotonic() >= deadline:
                    break
                kind = self.rng.choice(FAULT_KINDS)
                accepted = sum(len(v) for v in self.sent.values())
                fault = getattr(self, f"_{kind}")
                victim = self._victim(kind)
                if victim is None:
                    continue
                self.report.faults[kind] += 1
                self.say(f"fault {kind} {victim} (accepted so far {accepted})")
                running.append(asyncio.create_task(self._hold(victim, fault(victim))))
            await asyncio.gather(*running)
        finally:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)

    def _victim(self, kind: str) -> str | None:
        names = {
            "etcd_leader_kill": ["etcd"],
            "hooks_kill": self.stack.shared("hooks"),
            "anchor_kill": self.stack.shared("anchor"),
            "owner_kill": self.stack.all_owners(),
            "owner_pause": self.stack.all_owners(),
            "ingress_term": self.stack.ingresses(),
        }[kind]
        free = [name for name in names if name not in self._held]
        return self.rng.choice(free) if free else None

    async def _hold(self, victim: str, fault: Awaitable[None]) -> None:
        self._held.add(victim)
        try:
            await fault
        finally:
            self._held.discard(victim)

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            dead = [
                name
                for tier in self.stack.tiers()
                for name in tier
                if name not in self._held and not self.stack.alive(name)
            ]
            for name in dead:
                self.say(f"supervisor: starting {name} again")
                self.stack.start_process(name, wait=False)
            members = self.stack.etcd.members
            if "etcd" not in self._held:
                for member in members:
                    if member.proc is None or member.proc.poll() is not None:
                        self.say(f"supervisor: starting etcd member {member.name} again")
                        member.start(wait=False)

    async def _down_for(self, low: float, high: float) -> None:
        await asyncio.sleep(self.rng.uniform(low, high))

    async def _etcd_leader_kill(self, victim: str) -> None:
        cluster = self.stack.etcd
        leader = await asyncio.to_thread(cluster.leader, 30.0)
        cluster.members[leader].kill()
        await self._down_for(0.5, 4.0)
        # Held until it is healthy again: one etcd member down at a time. A
        # member that rejoins after minutes of load may replay a large WAL or
        # take a snapshot from the leader first (the slow run's one abort was
        # a restart that took over 60 s on a loaded 2-core machine).
        await asyncio.to_thread(cluster.members[leader].start, 240.0)

    async def _kill(self, victim: str) -> None:
        self.stack.kill(victim)
        await self._down_for(0.2, 4.0)

    _hooks_kill = _anchor_kill = _owner_kill = _kill

    async def _owner_pause(self, victim: str) -> None:
        self.stack.signal(victim, signal.SIGSTOP)
        await asyncio.sleep(self.stack.lease_ttl + self.rng.uniform(0.5, 3.0))
        self.stack.signal(victim, signal.SIGCONT)
        # It finds its lease lost and exits; the supervisor starts it again.

    async def _ingress_term(self, victim: str) -> None:
        await asyncio.to_thread(self.stack.terminate, victim)
        await self._down_for(0.2, 4.0)

    # -- the end ---------------------------------------------------------------------

    def _missing(self, sid: str, events: list[s.Event]) -> list[int]:
        received = {e.inbox_seq for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED}
        return sorted({sent.seq for sent in self.sent[sid]} - received)

    async def _settle(self, gateway: Gateway) -> None:
        """Wait until every accepted delivery was received and every session
        waits again; on a stall, say which sessions hold what, and fail."""
        deadline = time.monotonic() + self.settle_timeout
        pending = set(self.sent)
        last: dict[str, tuple[list[int], list[s.Event]]] = {}  # missing, stream's end
        heads: dict[str, tuple[int, float]] = {}  # stream length, when it last grew
        stalled: set[str] = set()
        while pending and time.monotonic() < deadline and not stalled:
            for sid in sorted(pending):
                try:
                    events = await gateway.events(sid)
                except BatonError:
                    continue
                missing = self._missing(sid, events)
                last[sid] = (missing, events[-3:])
                now = time.monotonic()
                if heads.get(sid, (-1, 0.0))[0] != len(events):
                    heads[sid] = (len(events), now)
                elif now - heads[sid][1] > self.stall_after:
                    stalled.add(sid)
                if not missing and waits_again(events):
                    pending.discard(sid)
            if pending:
                await asyncio.sleep(1.0)
        if pending:
            lines = []
            for sid in sorted(pending):
                try:
                    owner = await gateway.hooks.get_owner(sid)
                    where = repr(owner)[:300]
                except BatonError as exc:
                    where = f"(owner unknown: {exc.reason})"
                missing, end = last.get(sid, ([], []))
                ends = ", ".join(f"#{e.seq} {K.Name(e.kind)}" for e in end)
                lines.append(
                    f"{sid}: {len(missing)} of {len(self.sent[sid])} accepted never received "
                    f"(first {missing[:3]}); the stream ends [{ends}]; owner {where}"
                )
            raise AssertionError(
                f"seed {self.seed}: {len(pending)} sessions not settled (every accepted command "
                f"received and session.waiting again; {len(stalled)} with no new event for "
                f"{self.stall_after:.0f}s):\n" + "\n".join(lines)
            )

    def _reconciler_repairs(self) -> Counter[str]:
        """What the owners' reconcilers repaired, from their JSON logs (each
        process appends to its log across restarts)."""
        repairs: Counter[str] = Counter()
        for path in self.stack.workdir.glob("*.o*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if "no bell reached it" not in line and "taken over again" not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if "no bell reached it" in record.get("event", ""):
                    repairs["woken"] += 1
                elif "taken over again" in record.get("event", ""):
                    repairs["taken_over"] += int(record.get("sessions", 1))
        return repairs

    async def _check_etcd(self) -> None:
        """The members hold the same data: their KV hashes at one revision."""
        report = await asyncio.to_thread(
            members_consistent, self.stack.etcd.endpoint, certs.etcd_tls().root
        )
        assert report.consistent, f"seed {self.seed}: etcd members disagree:\n{report.text()}"
        self.report.etcd_revision = report.revision

    async def _check(self, gateway: Gateway) -> None:
        longest = 0.0
        for sid, sent in self.sent.items():
            events = await gateway.events(sid)
            receipts = [x.seq for x in sent]
            assert len(set(receipts)) == len(receipts), f"{sid}: two deliveries got one seq"
            check_history(events, receipts)
            by_seq = {x.seq: x for x in sent}
            received = [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED]
            for event in received:
                x = by_seq[event.inbox_seq]
                assert (event.text, event.delivery_id) == (x.text, x.delivery_id), (
                    f"{sid}: seq {event.inbox_seq} received {event.delivery_id!r}, "
                    f"accepted {x.delivery_id!r}"
                )
            ids_ = [e.delivery_id for e in received]
            assert len(ids_) == len(set(ids_)), f"{sid}: a delivery id received twice"
            for sender in range(self.senders_per_session):
                mine = [x.seq for x in sent if x.sender == sender]
                assert mine == sorted(mine), f"{sid}: sender {sender}'s order not kept"
            self.report.handoffs += sum(
                1 for e in events if e.kind == K.EVENT_KIND_SESSION_HANDED_OFF
            )

            async def caught_up(sid: str = sid, n: int = len(events)) -> bool:
                return len(self.seen[sid]) >= n

            await eventually(caught_up, f"{sid}'s follower to catch up", timeout=60)
            assert [e.SerializeToString() for e in self.seen[sid][: len(events)]] == [
                e.SerializeToString() for e in events
            ], f"{sid}: a follower saw a gap or a repeat"
            for x in sent:
                at = self.seen_at[sid].get(x.seq)
                if at is not None:
                    longest = max(longest, at - x.accepted_at)
        self.report.longest_wait_s = longest


async def run_chaos(
    workdir: Path,
    *,
    seed: int | None = None,
    seconds: float = 60.0,
    sessions: int = 32,
    senders_per_session: int = 3,
    fault_every: tuple[float, float] = (3.0, 8.0),
    **options: object,
) -> ChaosReport:
    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 30)
    replay = replay_command(seed, seconds, sessions, senders_per_session, fault_every)
    print(f"[chaos] seed {seed} (replay: {replay})", flush=True)
    cluster = certs.start_etcd_cluster(3, log_dir=str(workdir))
    stack = ChaosStack(cluster, workdir)
    try:
        await asyncio.to_thread(stack.start)
        chaos = Chaos(
            stack,
            seed=seed,
            seconds=seconds,
            sessions=sessions,
            senders_per_session=senders_per_session,
            fault_every=fault_every,
            **options,  # type: ignore[arg-type]
        )
        report = await chaos.run()
        print(report.summary(), flush=True)
        return report
    finally:
        stack.stop()
        cluster.stop()


def replay_command(
    seed: int, seconds: float, sessions: int, senders: int, fault_every: tuple[float, float]
) -> str:
    """The command that runs the same chaos again: the seed draws the
    faults, the senders' texts and their pauses, so every option that
    shapes the run must be the same too (the short test's seed replayed
    with the long run's options is another run)."""
    low, high = fault_every
    return (
        f"python -m tests.chaos --seed {seed} --seconds {seconds:g} --sessions {sessions} "
        f"--senders {senders} --fault-every {low:g} {high:g}"
    )


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--seconds", type=float, default=720.0)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--senders", type=int, default=3)
    parser.add_argument(
        "--fault-every", type=float, nargs=2, default=[3.0, 8.0], metavar=("LOW", "HIGH")
    )
    parser.add_argument("--workdir", default="")
    return parser


def main() -> None:
    args = arguments().parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="baton-chaos-"))
    print(f"[chaos] logs in {workdir}", flush=True)
    asyncio.run(
        run_chaos(
            workdir,
            seed=args.seed,
            seconds=args.seconds,
            sessions=args.sessions,
            senders_per_session=args.senders,
            fault_every=(args.fault_every[0], args.fault_every[1]),
        )
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
