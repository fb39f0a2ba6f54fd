"""A chaos run with a history check (docs/design.md §9, issues 16 and 38).

The production topology on loopback, as real processes: a three-member etcd
cluster, two hooks and two anchors, and two deployments, each with two owners
and two ingresses. Every link between them goes through a fault-injecting
proxy of its own (tests/netfaults.py): the gateway to each ingress, each
ingress to hooks, anchor and its deployment's owners, each owner to hooks
and anchor (and the other owners to it, for handoffs), hooks and anchor to
each etcd member, and each etcd member to each other.

Sessions are created through random ingresses; several gateway senders per
session send through random ingresses of either deployment (so sessions
move between deployments while they are idle), re-sending with the same
delivery id on every retryable error. One follower per session reads its
stream live, resuming from its cursor. Meanwhile one fault every few
seconds, every kind in turn in an order drawn from a seeded generator, the
faults overlapping:

- processes: kill -9 of the etcd leader, then its restart; kill -9 of a
  hooks, anchor or owner replica, then its restart; SIGSTOP of an owner
  past its lease, then SIGCONT (it exits on the lost lease and is started
  again); SIGTERM of an ingress, then its restart;
- the network: an owner partitioned from hooks past its lease while it
  still reaches anchor; an owner's commits cut (the reply lost after the
  commit, or the request cut part-way); hooks or anchor cut from the etcd
  leader; the etcd leader partitioned from the other members; an ingress's
  appends done and their replies lost; the gateway's replies lost; a link
  1-3 lease TTLs slow; a link flapping; one direction of a link lost.

When the faults stop, the links heal, every process is running and SERVING
(the supervisor starts what is down until the end: an owner may still lose
its lease to the last faults), and the run waits (bounded) until every
accepted delivery has been received. Then every session's whole stream is checked: every accepted
delivery received exactly once with its receipt's inbox seq and text, inbox
order and per-sender order kept, gapless seqs, owner runs never
interleaved, no delivery id received twice, followers saw the stored stream
exactly; every event was written while the session's fence named its run
(`FenceLog`: no commit accepted from a run once another took the session
over); and the etcd members' hashes agree at a common revision.

`python -m tests.chaos` runs the slow test's run by hand (the default suite
runs a short one; `--no-network` runs without the fault layer, `--faults`
only some kinds); the seed is printed with the command that replays the
run (`--seed` and the run's options).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import logging
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
from typing import Any

import aetcd
import grpc
import structlog

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.etcd_check import members_consistent
from baton_runtime.cli.system.etcd_process import EtcdCluster
from baton_runtime.cli.system.processes import wait_serving
from baton_runtime.cli.system.service_env import wiring_env
from baton_runtime.cli.system.service_launcher import ServiceLauncher
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError
from baton_runtime.common.etcd.client import EtcdClient
from baton_runtime.common.etcd.keys import Keys, parse_fence
from baton_runtime.common.etcd.watch import follow_range
from baton_runtime.common.security.tls import Security
from tests import certs
from tests.certs import TEST_PREFIX
from tests.netfaults import DOWN, UP, Network, Route, route_name
from tests.procs import API_KEY, SLACK, Launched, check_history, eventually
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
# A gateway notices a silent connection (a partition) as the services do.
GATEWAY_OPTIONS = (
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
)
FAULT_KINDS = (
    "etcd_leader_kill",
    "hooks_kill",
    "anchor_kill",
    "owner_kill",
    "owner_pause",
    "ingress_term",
)
# The fault layer's (tests/netfaults.py), drawn beside the process faults.
NETWORK_FAULT_KINDS = (
    "owner_hooks_partition",
    "owner_anchor_cut",
    "etcd_client_cut",
    "etcd_leader_partition",
    "ingress_reply_loss",
    "gateway_reply_loss",
    "link_latency",
    "link_flap",
    "one_way_loss",
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
class ChaosStack(Launched):
    """Every Baton process of the topology, by name: hooks1, hooks2,
    anchor1, anchor2, and per deployment d: {d}.o1, {d}.o2, {d}.in1, {d}.in2."""

    etcd: EtcdCluster
    workdir: Path
    deployments: tuple[str, ...] = ("dep-a", "dep-b")
    replicas: int = 2
    lease_ttl: int = 3
    park_after: float = 1.0
    prefix: str = field(default_factory=lambda: f"{TEST_PREFIX}c{uuid.uuid4().hex}/")
    # With a fault layer, every process dials every other through a proxy
    # of its own (`dial`); the test's own probes and checks dial directly.
    network: Network | None = None
    proxies: dict[tuple[str, str], int] = field(default_factory=dict)  # (client, server) -> port
    launcher: ServiceLauncher = field(init=False)

    def __post_init__(self) -> None:
        self.launcher = self.test_launcher(self.workdir)

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

    def addrs(self, names: list[str]) -> str:
        return self.launcher.addrs(names)

    def dial(self, client: str, servers: list[str]) -> str:
        """The addresses `client` reaches `servers` at: their proxies' for
        it, with a fault layer; else their own."""
        if self.network is None:
            return self.addrs(servers)
        return ",".join(f"127.0.0.1:{self.proxies[client, server]}" for server in servers)

    def etcd_members(self) -> list[str]:
        return [member.name for member in self.etcd.members]

    def plan_ports(self) -> None:
        for tier in self.tiers():
            for name in tier:
                self.addr(name)

    async def wire(self, network: Network) -> None:
        """A proxy on every link of the topology: hooks and anchor to each
        etcd member, owners to hooks and anchor (and one in front of each
        owner for the others' handoffs), ingresses to hooks, anchor and
        their deployment's owners, and the gateway to each ingress."""
        self.network = network
        self.plan_ports()
        members = {member.name: member.client_port for member in self.etcd.members}
        links: list[tuple[str, str, int]] = []
        for name in (*self.shared("hooks"), *self.shared("anchor")):
            links += [(name, member, port) for member, port in members.items()]
        for name in (*self.all_owners(), *self.ingresses()):
            links += [(name, server, self.ports[server]) for server in self.shared("hooks")]
            links += [(name, server, self.ports[server]) for server in self.shared("anchor")]
        for deployment in self.deployments:
            for name in self.ingresses(deployment):
                links += [(name, owner, self.ports[owner]) for owner in self.owners(deployment)]
        links += [("peers", owner, self.ports[owner]) for owner in self.all_owners()]
        links += [("gateway", name, self.ports[name]) for name in self.ingresses()]
        for client, server, port in links:
            self.proxies[client, server] = await network.link(client, server, port)

    @staticmethod
    def kind(name: str) -> tuple[str, str]:
        """(module, deployment) of a process name."""
        if "." not in name:
            return name.rstrip("0123456789"), ""
        deployment, _, local = name.partition(".")
        return ("owner" if local.startswith("o") else "ingress"), deployment

    def _env(self, name: str) -> dict[str, str]:
        """`name`'s wiring (its identity is the launcher's)."""
        module, deployment = self.kind(name)
        keys = self.workdir / "api-keys"
        if module == "ingress" and not keys.exists():
            keys.write_text(f"slack={API_KEY}\n")
        shared = module in ("hooks", "anchor")
        etcd = self.etcd.endpoint
        if shared and self.network is not None:
            etcd = self.dial(name, self.etcd_members())
        env = wiring_env(
            module,
            etcd=etcd,
            prefix=self.prefix,
            hooks="" if shared else self.dial(name, self.shared("hooks")),
            anchor="" if shared else self.dial(name, self.shared("anchor")),
            deployment_id=deployment,
            owners=self.dial(name, self.owners(deployment)) if module == "ingress" else "",
            api_keys_file=str(keys),
        )
        if shared:
            env["BATON_ETCD_TIMEOUT"] = "2"
        if module == "anchor":
            # One object store for the replicas; sealing soon after a
            # session goes quiet, and orphans (of anchors killed while
            # sealing) swept soon, so faults land on every step of both.
            env |= {
                "BATON_OBJECT_STORE": f"file://{self.workdir / 'objects'}",
                "BATON_SEAL_IDLE": "1",
                "BATON_OBJECT_ORPHAN_GRACE": "10",
            }
        if module == "owner":
            env |= {
                "BATON_INSTANCE_ID": name.replace(".", "-"),
                "BATON_OWNER_LEASE_TTL": str(self.lease_ttl),
                "BATON_OWNER_PARK_AFTER": str(self.park_after),
                # Other owners (handoffs) reach it through its proxy.
                "BATON_OWNER_ADVERTISE": self.dial("peers", [name]),
            }
        return env

    def start_process(self, name: str, *, wait: bool = True) -> None:
        module, deployment = self.kind(name)
        self.launcher.start(
            name, module, self._env(name), deployment_id=deployment, wait=wait, timeout=60
        )

    def start(self) -> ChaosStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.plan_ports()
        for tier in self.tiers():
            for name in tier:
                self.start_process(name, wait=False)
            self.launcher.wait_serving(tier, timeout=60)
        return self

    def alive(self, name: str) -> bool:
        return self.launcher.alive(name)

    def kill(self, name: str) -> None:
        self.launcher.kill(name)

    def terminate(self, name: str) -> None:
        self.launcher.terminate(name)

    def signal(self, name: str, signum: int) -> None:
        self.launcher.signal(name, signum)

    def stop(self) -> None:
        self.launcher.stop(graceful=False)


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
    longest_wait_of: str = ""  # which command, accepted when (to find its faults in the log)
    sessions: int = 0
    handoffs: int = 0
    duration_s: float = 0.0
    etcd_revision: int = 0  # where the members' hashes were compared (equal)
    # Lost wake-ups the owners' reconcilers repaired (their log lines): late
    # answers, not lost ones, but each one a watch event some process lost.
    reconciled: Counter[str] = field(default_factory=Counter)
    # The fault layer's work: calls whose answer it lost, connections it reset.
    replies_lost: int = 0
    resets: int = 0
    # Runs that ended because they were fenced (the owners' "fenced; run
    # ends"), and the fence check: commits checked against the fence of
    # their revision, commits written where the fence log was blind.
    fenced_runs: int = 0
    fence_changes: int = 0
    commits_checked: int = 0
    commits_unchecked: int = 0
    # CPU seconds of the test's own process: the gateway, the checker and
    # the fault layer's proxies (they share its event loop).
    test_cpu_s: float = 0.0

    @property
    def network_faults(self) -> int:
        return sum(n for kind, n in self.faults.items() if kind in NETWORK_FAULT_KINDS)

    def summary(self) -> str:
        faults = ", ".join(f"{kind} {n}" for kind, n in sorted(self.faults.items()))
        return (
            f"chaos seed={self.seed}: {self.accepted} commands accepted over {self.sessions} "
            f"sessions in {self.duration_s:.0f}s, {sum(self.faults.values())} faults "
            f"({self.network_faults} in the network; {faults}), "
            f"{self.replies_lost} replies lost and {self.resets} connections reset by the "
            f"fault layer, {self.handoffs} handoffs, "
            f"longest wait receipt->received {self.longest_wait_s:.1f}s "
            f"({self.longest_wait_of}), "
            f"etcd members' hashes equal at revision {self.etcd_revision}, "
            f"{self.commits_checked} commits each under its run's fence "
            f"({self.fence_changes} fence changes, {self.commits_unchecked} unchecked), "
            f"{self.fenced_runs} runs ended fenced, "
            f"{self.test_cpu_s:.0f} CPU s in the test process (gateway, checker, fault layer), "
            f"reconciler repairs: woken {self.reconciled['woken']}, "
            f"taken over {self.reconciled['taken_over']}"
        )


@dataclass(frozen=True)
class KeyValue:
    revision: int  # the etcd revision that wrote it
    value: bytes
    version: int = 0  # the key's etcd version: its puts so far (0: not known)


@dataclass
class KeyLog:
    """Every value one key took, with the revision that wrote it; `blind`:
    revision windows where a value may be missing (the watch resumed past
    a compaction)."""

    values: list[KeyValue] = field(default_factory=list)
    blind: list[tuple[int, int]] = field(default_factory=list)
    after_gap: set[int] = field(default_factory=set)  # values read after a blind window

    def record(self, revision: int, value: bytes, version: int = 0) -> None:
        if not self.values or revision > self.values[-1].revision:
            self.values.append(KeyValue(revision, value, version))

    def read_after_gap(self, start: int, revision: int, value: bytes, version: int = 0) -> None:
        """Record the value a read found after the watch, followed from
        `start`, resumed past a compaction: values written after the last
        one logged (or from `start`, when none was) and before `revision`
        may be missing, unless the key's version says the read value is
        the very next put (a watch resumed from an old value's revision,
        the key changed once meanwhile). Else the read value is flagged:
        what it dates may belong to a value missed."""
        last = self.values[-1] if self.values else None
        if last is not None and revision <= last.revision:
            return  # logged already
        next_put = version != 0 and version == (last.version if last else 0) + 1
        logged = last.revision if last else start - 1
        if not next_put and revision > logged + 1:
            self.blind.append((logged, revision))
            self.after_gap.add(len(self.values))
        self.record(revision, value, version)

    def revisions(self) -> list[int]:
        return [v.revision for v in self.values]

    def blind_at(self, revision: int) -> bool:
        return any(low < revision < high for low, high in self.blind)


class FenceLog:
    """What each session's fence and commit marker were, revision by
    revision, from watches of the two keys straight to etcd (the checker's
    own, outside the fault layer) from the session's creation on; and the
    check that every event of its stream was committed while the fence
    named the run the event names.

    A commit puts the commit marker (`evm`, its last event's seq) in its
    own transaction, so the marker's log dates every event: an event
    belongs to the first commit whose marker reaches its seq. (The events'
    own keys would date them too, but anchor moves old events out of etcd
    into segments.) That is the fence's promise (docs/design.md §9): once
    another run took the session over (a new fence), nothing the old run
    commits is accepted, neither after its successor's first commit nor
    before it."""

    def __init__(self, endpoint: str, prefix: str) -> None:
        self.endpoint = endpoint
        self.keys = Keys(prefix)
        self.client: EtcdClient | None = None
        self.fences: dict[str, KeyLog] = {}
        self.markers: dict[str, KeyLog] = {}
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> FenceLog:
        self.client = await certs.etcd_client(self.endpoint, timeout=30)
        return self

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    def follow(self, sid: str) -> None:
        """Log the session's fence and commit marker from its creation."""
        self.fences[sid], self.markers[sid] = KeyLog(), KeyLog()
        self.tasks.append(asyncio.create_task(self._follow(sid)))

    async def _follow(self, sid: str) -> None:
        created = 0
        while not created:  # the creating transaction wrote the fence
            for kv in (await self._read(self.keys.fence(sid))).kvs:
                created = kv.create_revision
            if not created:
                await asyncio.sleep(0.2)
        await asyncio.gather(
            self._follow_key(self.keys.fence(sid), created, self.fences[sid]),
            self._follow_key(self.keys.commit_marker(sid), created, self.markers[sid]),
        )

    async def _read(self, key: bytes) -> Any:
        assert self.client is not None
        while True:
            try:
                return await self.client.get_prefix(key)
            except aetcd.ClientError:
                await asyncio.sleep(0.2)

    async def _follow_key(self, key: bytes, created: int, log: KeyLog) -> None:
        """Every put of `key` (a prefix matching it alone) from the
        session's creation (deletions are no values: a session deleted
        ends its log)."""
        assert self.client is not None
        start = created
        while True:
            try:
                async for event in follow_range(self.client, key, start, puts_only=True):
                    log.record(event.kv.mod_revision, event.kv.value, event.kv.version)
                return
            except BatonError:  # the watch's position was compacted
                read = await self._read(key)
                for kv in read.kvs:
                    log.read_after_gap(created, kv.mod_revision, kv.value, kv.version)
                start = read.header.revision + 1

    async def caught_up(self, sid: str, timeout: float = 120.0) -> None:
        """Wait until both logs hold the keys' current values (their watches
        may lag behind a read): what is checked then is every value so far."""
        deadline = time.monotonic() + timeout
        for key, log in (
            (self.keys.fence(sid), self.fences[sid]),
            (self.keys.commit_marker(sid), self.markers[sid]),
        ):
            while True:
                now = [kv.mod_revision for kv in (await self._read(key)).kvs]
                if not now or (log.values and log.values[-1].revision >= now[0]):
                    break
                assert time.monotonic() < deadline, f"{sid}: the log of {key!r} fell behind"
                await asyncio.sleep(0.2)

    def check(self, sid: str, events: list[s.Event], seed: int) -> tuple[int, int]:
        """(commits checked, commits not checked: dated inside a blind
        window) of the session's stream `events`."""
        fences, markers = self.fences[sid], self.markers[sid]
        assert fences.values, f"seed {seed}: {sid}: no fence seen"
        values = [parse_fence(v.value) for v in fences.values]
        epochs = [epoch for epoch, _ in values]
        assert all(a < b for a, b in itertools.pairwise(epochs)), (
            f"seed {seed}: {sid}: the fence's epoch did not grow with each change: {epochs}"
        )
        fence_revisions = fences.revisions()
        last_seqs = [int(v.value) for v in markers.values]
        assert all(a < b for a, b in itertools.pairwise(last_seqs)), (
            f"seed {seed}: {sid}: the commit marker went back: {last_seqs}"
        )
        checked: set[int] = set()
        unchecked: set[int] = set()
        for event in events:
            at = bisect.bisect_left(last_seqs, event.seq)
            assert at < len(last_seqs), (
                f"seed {seed}: {sid}: event {event.seq} is past every commit marker seen"
            )
            revision = markers.values[at].revision
            # After a blind window, the commit may be one whose marker was missed.
            if at in markers.after_gap or fences.blind_at(revision):
                unchecked.add(revision)
                continue
            fence_at = bisect.bisect_right(fence_revisions, revision) - 1
            fence = values[fence_at] if fence_at >= 0 else None
            assert fence is not None and fence[1] == event.owner_run_id, (
                f"seed {seed}: {sid}: event {event.seq} ({K.Name(event.kind)}) of run "
                f"{event.owner_run_id} was committed at revision {revision}, when the fence "
                f"was {fence!r}: a commit accepted from a run that no longer held the session"
            )
            checked.add(revision)
        return len(checked), len(unchecked)


class Gateway:
    """The channel gateways' side: one channel per ingress (sends and
    followers pick one at random, and move on when it fails), through the
    fault layer when there is one; the hooks and anchor clients are the
    checker's, and dial directly."""

    def __init__(self, stack: ChaosStack) -> None:
        self.stack = stack
        self.names = stack.ingresses()
        self.channels = {
            name: public_channel(stack.dial("gateway", [name]), options=GATEWAY_OPTIONS)
            for name in self.names
        }
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

    async def events(self, sid: str, patience: float = 120.0) -> list[s.Event]:
        """The session's whole stored stream, read again while anchor or
        etcd answers a retryable error (a long stream read on a loaded
        machine may outlast etcd's timeout), for up to `patience` seconds."""
        deadline = time.monotonic() + patience
        while True:
            try:
                return [e async for page in self.anchor.read_events(sid) for e in page]
            except BatonError as exc:
                if not exc.retryable or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(1.0)


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
        kinds: tuple[str, ...] = (),
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
        # The fault kinds drawn from (empty: every process fault, and every
        # network fault when there is a fault layer).
        unknown = set(kinds) - set(FAULT_KINDS + NETWORK_FAULT_KINDS)
        if unknown:
            raise ValueError(f"no such fault kind: {', '.join(sorted(unknown))}")
        self.kinds = kinds
        self._stop_sending = asyncio.Event()
        self._held: set[str] = set()

    def say(self, *parts: object) -> None:
        assert callable(self._log)
        self._log(f"[chaos {time.strftime('%H:%M:%S')}]", *parts)

    async def run(self) -> ChaosReport:
        started = time.monotonic()
        cpu_started = time.process_time()
        gateway = Gateway(self.stack)
        tasks: list[asyncio.Task[None]] = []
        followers: list[asyncio.Task[None]] = []
        fences = await FenceLog(self.stack.etcd.endpoint, self.stack.prefix).start()
        # Starts what is down and held by no fault, as Kubernetes would, until
        # the end: an owner that loses its lease after the last fault too.
        supervisor = asyncio.create_task(self._supervise())
        try:
            sids = [await gateway.create(self.rng) for _ in range(self.sessions)]
            for sid in sids:
                fences.follow(sid)
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
            if self.stack.network is not None:
                self.stack.network.heal()
            self.say("faults over; waiting for every process to serve")
            await self._all_serving()
            await asyncio.wait_for(asyncio.gather(*tasks), 360)
            self.report.accepted = sum(len(v) for v in self.sent.values())
            self.say(f"{self.report.accepted} accepted; waiting for every one to be received")
            await self._settle(gateway)
            await self._check(gateway, fences)
            await self._check_etcd()
            self.report.reconciled, self.report.fenced_runs = self._owner_log_counts()
            if self.stack.network is not None:
                self.report.replies_lost = self.stack.network.replies_lost()
                self.report.resets = self.stack.network.resets()
            self.report.duration_s = time.monotonic() - started
            self.report.test_cpu_s = time.process_time() - cpu_started
            return self.report
        finally:
            for task in (*tasks, *followers, supervisor):
                task.cancel()
            await asyncio.gather(*tasks, *followers, supervisor, return_exceptions=True)
            await gateway.close()
            await fences.close()

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

    async def _all_serving(self, timeout: float = 240.0) -> None:
        """Every paused owner continued, then every process running (the
        supervisor, which runs until the end, starts what is down) and
        SERVING, and every etcd member healthy."""
        for name in self.stack.all_owners():
            if self.stack.alive(name):
                self.stack.signal(name, signal.SIGCONT)
        deadline = time.monotonic() + timeout
        names = [name for tier in self.stack.tiers() for name in tier]
        while True:
            down = [name for name in names if not self.stack.alive(name)]
            members = self.stack.etcd.members
            down += [m.name for m in members if m.proc is None or m.proc.poll() is not None]
            if not down:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"seed {self.seed}: still down after the faults: {down}")
            await asyncio.sleep(0.5)
        await asyncio.to_thread(self.stack.etcd.wait_healthy, timeout)
        for name in names:
            await asyncio.to_thread(
                wait_serving, self.stack.addr(name), certs.operator(), timeout=timeout
            )

    async def _faults(self) -> None:
        """One fault every `fault_every` seconds, of every kind in turn (in an
        order the seed draws anew each round); faults overlap (each holds
        its victims for a while: a process, a link), and the supervisor
        starts every process that is down and held by no fault."""
        deadline = time.monotonic() + self.seconds
        running: list[asyncio.Task[None]] = []
        kinds = self.kinds or FAULT_KINDS + (NETWORK_FAULT_KINDS if self.stack.network else ())
        bag: list[str] = []
        while time.monotonic() < deadline:
            await asyncio.sleep(self.rng.uniform(*self.fault_every))
            if time.monotonic() >= deadline:
                break
            if not bag:  # every kind once per round, in a seeded order
                bag = self.rng.sample(kinds, len(kinds))
            kind = bag.pop()
            accepted = sum(len(v) for v in self.sent.values())
            fault = getattr(self, f"_{kind}")
            victims = self._victims(kind)
            if victims is None:
                continue
            self.report.faults[kind] += 1
            self.say(f"fault {kind} {victims[0]} (accepted so far {accepted})")
            held = victims if kind in FAULT_KINDS else victims[1:]
            running.append(asyncio.create_task(self._hold(held, fault(victims[0]))))
        await asyncio.gather(*running)

    def _victims(self, kind: str) -> list[str] | None:
        """What the fault takes, by name: its victim (what the fault is
        told: a process, a link, "etcd") first, then the links it faults;
        None when every choice is held by another fault. A process fault
        holds the process; a network fault holds only links, so the two
        overlap on one process."""
        stack = self.stack
        hooks, anchors = stack.shared("hooks"), stack.shared("anchor")
        members = stack.etcd_members()

        def through(client: str, servers: list[str]) -> list[str]:
            return [client, *(route_name(client, server) for server in servers)]

        choices: list[list[str]] = {
            "etcd_leader_kill": [["etcd"]],
            "hooks_kill": [[name] for name in hooks],
            "anchor_kill": [[name] for name in anchors],
            "owner_kill": [[name] for name in stack.all_owners()],
            "owner_pause": [[name] for name in stack.all_owners()],
            "ingress_term": [[name] for name in stack.ingresses()],
            "owner_hooks_partition": [through(o, hooks) for o in stack.all_owners()],
            "owner_anchor_cut": [through(o, anchors) for o in stack.all_owners()],
            "etcd_client_cut": [through(name, members) for name in hooks + anchors],
            # One etcd fault at a time (with the leader kills): a quorum stays.
            "etcd_leader_partition": [
                ["etcd", "etcd", *(route_name(a, b) for a in members for b in members if a != b)]
            ],
            "ingress_reply_loss": [through(name, hooks) for name in stack.ingresses()],
            "gateway_reply_loss": [
                [name, route_name("gateway", name)] for name in stack.ingresses()
            ],
            "link_latency": [[name, name] for name in self._links()],
            "link_flap": [[name, name] for name in self._links()],
            "one_way_loss": [[name, name] for name in self._links()],
        }[kind]
        process_fault = kind in FAULT_KINDS
        free = [
            names
            for names in choices
            if not self._held.intersection(names if process_fault else names[1:])
        ]
        if not free:
            return None
        return self.rng.choice(free)

    def _links(self) -> list[str]:
        """Every link a random network fault may take, by route name."""
        assert self.stack.network is not None
        return sorted(route.name for route in self.stack.network.routes_of())

    async def _hold(self, victims: list[str], fault: Awaitable[None]) -> None:
        self._held.update(victims)
        try:
            await fault
        finally:
            self._held.difference_update(victims)

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

    # -- network faults (tests/netfaults.py) -------------------------------------------

    def _routes(self, client: str, servers: list[str]) -> list[Route]:
        assert self.stack.network is not None
        return [self.stack.network.route(client, server) for server in servers]

    def _route(self, name: str) -> Route:
        client, _, server = name.partition(">")
        return self._routes(client, [server])[0]

    def _end(self, routes: list[Route]) -> None:
        """The fault ends: the links heal, half the time with every
        connection on them reset (else what was held flows again)."""
        if self.rng.random() < 0.5:
            for route in routes:
                route.reset()
        for route in routes:
            route.heal()

    async def _owner_hooks_partition(self, victim: str) -> None:
        """The owner reaches anchor but not hooks, past its lease: its
        lease expires, another owner takes its sessions over, and whatever
        it still commits to anchor must be refused by the fence."""
        routes = self._routes(victim, self.stack.shared("hooks"))
        for route in routes:
            route.hold()
        await asyncio.sleep(self.stack.lease_ttl * self.rng.uniform(1.3, 3.0))
        self._end(routes)

    async def _owner_anchor_cut(self, victim: str) -> None:
        """The owner's commits to anchor cut: either each request goes
        through and its answer is lost (the connection reset after), or the
        connection is reset part-way through a request."""
        routes = self._routes(victim, self.stack.shared("anchor"))
        cut = self.rng.randint(50, 20_000)
        lose = self.rng.random() < 0.5
        for route in routes:
            if lose:
                route.lose_replies = True
            else:
                route.cut_after(UP, cut)
        await asyncio.sleep(self.rng.uniform(1.0, 4.0))
        self._end(routes)

    async def _etcd_client_cut(self, victim: str) -> None:
        """hooks or anchor cut from the etcd leader (it reaches the others)."""
        cluster = self.stack.etcd
        leader = await asyncio.to_thread(cluster.leader, 30.0)
        routes = self._routes(victim, [cluster.members[leader].name])
        for route in routes:
            route.hold()
        await asyncio.sleep(self.rng.uniform(2.0, 8.0))
        self._end(routes)

    async def _etcd_leader_partition(self, victim: str) -> None:
        """The etcd leader cut from both other members (its clients still
        reach it): the majority elects another leader; what the old one is
        asked meanwhile must fail or wait, never answer from stale data."""
        cluster = self.stack.etcd
        leader = cluster.members[await asyncio.to_thread(cluster.leader, 30.0)].name
        others = [name for name in self.stack.etcd_members() if name != leader]
        routes = self._routes(leader, others) + [
            route for other in others for route in self._routes(other, [leader])
        ]
        for route in routes:
            route.hold()
        await asyncio.sleep(self.rng.uniform(3.0, 10.0))
        self._end(routes)
        # Held until the cluster is whole again, as after a leader kill.
        await asyncio.to_thread(cluster.wait_healthy, 240.0)

    async def _ingress_reply_loss(self, victim: str) -> None:
        """An ingress's appends reach hooks and are done, and their answers
        are lost: the gateway's retry with the same delivery id must get the
        first receipt."""
        routes = self._routes(victim, self.stack.shared("hooks"))
        for route in routes:
            route.lose_replies = True
        await asyncio.sleep(self.rng.uniform(2.0, 6.0))
        self._end(routes)

    async def _gateway_reply_loss(self, victim: str) -> None:
        """The gateway's calls to one ingress done, their answers lost."""
        routes = self._routes("gateway", [victim])
        for route in routes:
            route.lose_replies = True
        await asyncio.sleep(self.rng.uniform(2.0, 6.0))
        self._end(routes)

    async def _link_latency(self, victim: str) -> None:
        """One link slower than the lease: 1-3 lease TTLs each way (or one way)."""
        route = self._route(victim)
        delay = self.stack.lease_ttl * self.rng.uniform(1.0, 3.0)
        one_way = self.rng.choice([None, UP, DOWN])
        route.set_delay(up=delay if one_way != DOWN else 0.0, down=delay if one_way != UP else 0.0)
        await asyncio.sleep(delay + self.rng.uniform(2.0, 6.0))
        route.heal()

    async def _link_flap(self, victim: str) -> None:
        """One link down and up again every fraction of a second, for a while."""
        route = self._route(victim)
        deadline = time.monotonic() + self.rng.uniform(4.0, 10.0)
        while time.monotonic() < deadline:
            route.hold()
            await asyncio.sleep(self.rng.uniform(0.2, 1.5))
            if self.rng.random() < 0.3:
                route.reset()
            route.heal()
            await asyncio.sleep(self.rng.uniform(0.2, 1.5))

    async def _one_way_loss(self, victim: str) -> None:
        """One direction of one link lost (the other still flows)."""
        route = self._route(victim)
        if self.rng.random() < 0.5:
            route.hold(up=True, down=False)
        else:
            route.hold(up=False, down=True)
        await asyncio.sleep(self.rng.uniform(2.0, 8.0))
        self._end([route])

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
                    events = await gateway.events(sid, patience=0)
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

    def _owner_log_counts(self) -> tuple[Counter[str], int]:
        """What the owners' reconcilers repaired, and how many runs ended
        fenced, from their JSON logs (each process appends to its log
        across restarts)."""
        repairs: Counter[str] = Counter()
        fenced = 0
        wanted = ("no bell reached it", "taken over again", "fenced; run ends")
        for path in self.stack.workdir.glob("*.o*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if not any(text in line for text in wanted):
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                event = record.get("event", "")
                if "no bell reached it" in event:
                    repairs["woken"] += 1
                elif "taken over again" in event:
                    repairs["taken_over"] += int(record.get("sessions", 1))
                elif event == "fenced; run ends":
                    fenced += 1
        return repairs, fenced

    async def _check_etcd(self) -> None:
        """The members hold the same data: their KV hashes at one revision."""
        report = await asyncio.to_thread(
            members_consistent, self.stack.etcd.endpoint, certs.etcd_tls().root
        )
        assert report.consistent, f"seed {self.seed}: etcd members disagree:\n{report.text()}"
        self.report.etcd_revision = report.revision

    async def _check(self, gateway: Gateway, fences: FenceLog) -> None:
        longest = 0.0
        for sid, sent in self.sent.items():
            events = await gateway.events(sid)
            receipts = [x.seq for x in sent]
            assert len(set(receipts)) == len(receipts), f"{sid}: two deliveries got one seq"
            check_history(events, receipts)
            await fences.caught_up(sid)
            checked, unchecked = fences.check(sid, events, self.seed)
            self.report.commits_checked += checked
            self.report.commits_unchecked += unchecked
            self.report.fence_changes += len(fences.fences[sid].values) - 1
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
                    if at - x.accepted_at > longest:
                        longest = at - x.accepted_at
                        accepted = time.time() - (time.monotonic() - x.accepted_at)
                        self.report.longest_wait_of = (
                            f"{sid} inbox seq {x.seq}, accepted at "
                            f"{time.strftime('%H:%M:%S', time.localtime(accepted))}"
                        )
        self.report.longest_wait_s = longest


async def run_chaos(
    workdir: Path,
    *,
    seed: int | None = None,
    seconds: float = 60.0,
    sessions: int = 32,
    senders_per_session: int = 3,
    fault_every: tuple[float, float] = (3.0, 8.0),
    network: bool = True,
    kinds: tuple[str, ...] = (),
    **options: object,
) -> ChaosReport:
    """A chaos run; with `network` (the default), every link goes through
    the fault layer and network faults join the process faults. `kinds`:
    only these faults (default: all)."""
    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 30)
    replay = replay_command(
        seed, seconds, sessions, senders_per_session, fault_every, network, kinds
    )
    print(f"[chaos] seed {seed} (replay: {replay})", flush=True)
    net = Network() if network else None
    cluster: EtcdCluster | None = None
    stack: ChaosStack | None = None
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    try:
        cluster = await start_etcd(workdir, net)
        stack = ChaosStack(cluster, workdir)
        if net is not None:
            await stack.wire(net)
        await asyncio.to_thread(stack.start)
        chaos = Chaos(
            stack,
            seed=seed,
            seconds=seconds,
            sessions=sessions,
            senders_per_session=senders_per_session,
            fault_every=fault_every,
            kinds=kinds,
            **options,  # type: ignore[arg-type]
        )
        report = await chaos.run()
        print(report.summary(), flush=True)
        return report
    finally:
        if stack is not None:
            stack.stop()
        if cluster is not None:
            await asyncio.to_thread(cluster.stop)
        if net is not None:
            await net.close()


async def start_etcd(workdir: Path, net: Network | None) -> EtcdCluster:
    """Three etcd members; with a fault layer, each dialled by the others
    through a proxy in front of its peer port (routes named by member)."""
    if net is None:
        return await asyncio.to_thread(certs.start_etcd_cluster, 3, log_dir=str(workdir))
    return await certs.start_etcd_cluster_behind(net, 3, log_dir=str(workdir))


def replay_command(
    seed: int,
    seconds: float,
    sessions: int,
    senders: int,
    fault_every: tuple[float, float],
    network: bool = True,
    kinds: tuple[str, ...] = (),
) -> str:
    """The command that runs the same chaos again: the seed draws the
    faults, the senders' texts and their pauses, so every option that
    shapes the run must be the same too (the short test's seed replayed
    with the long run's options is another run)."""
    low, high = fault_every
    return (
        f"python -m tests.chaos --seed {seed} --seconds {seconds:g} --sessions {sessions} "
        f"--senders {senders} --fault-every {low:g} {high:g}"
        + ("" if network else " --no-network")
        + (f" --faults {','.join(kinds)}" if kinds else "")
    )


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--seconds", type=float, default=1320.0)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--senders", type=int, default=3)
    parser.add_argument(
        "--fault-every", type=float, nargs=2, default=[3.5, 7.5], metavar=("LOW", "HIGH")
    )
    parser.add_argument(
        "--no-network",
        dest="network",
        action="store_false",
        help="no fault layer: processes dial each other directly, process faults only",
    )
    parser.add_argument(
        "--faults",
        default="",
        help="only these fault kinds, comma-separated (default: all): "
        + ", ".join(FAULT_KINDS + NETWORK_FAULT_KINDS),
    )
    parser.add_argument("--workdir", default="")
    return parser


def main() -> None:
    args = arguments().parse_args()
    # The checker's own etcd watches (FenceLog) say each resume; errors only.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
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
            network=args.network,
            kinds=tuple(kind for kind in args.faults.split(",") if kind),
        )
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
