"""Faults on the replicated topology, with real processes (docs/design.md §13).

Two hooks, two anchors, two owners and two ingresses of one deployment, each
client given every replica; sessions converse under load (every send retried
by the "gateway" with its delivery id until accepted) while followers read
every stream live through the ingresses, resuming from their cursor when a
stream breaks. Then:
- etcd (three members): kill -9 of the leader, a restart of that member;
- kill -9 of one hooks replica and one anchor replica mid-conversation;
- one ingress stopped while followers read through it: they go on through
  the other from their cursor.

Each run checks every session's whole history (`check_history`): gapless
stream, every accepted command processed once in FIFO order, no step or tool
call twice, owner runs that follow one another; and every follower saw the
stored stream exactly, without a gap or a repeat. Longer versions with more
rounds are marked slow.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.etcd_process import EtcdCluster
from tests import certs
from tests.procs import (
    ReplicatedClients,
    ReplicatedStack,
    answered,
    check_history,
    eventually,
)

Fault = Callable[[], Awaitable[None]]


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    running = certs.start_etcd_cluster(3)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def stacks(tmp_path: Path) -> Iterator[list[ReplicatedStack]]:
    made: list[ReplicatedStack] = []
    try:
        yield made
    finally:
        for stack in made:
            stack.stop()


def start_stack(stacks: list[ReplicatedStack], endpoint: str, workdir: Path) -> ReplicatedStack:
    stack = ReplicatedStack(endpoint, workdir)
    stacks.append(stack)
    return stack.start()


@dataclass
class Conversation:
    """Sessions conversing under load with live followers, and faults
    injected at given fractions of the accepted sends."""

    clients: ReplicatedClients
    sessions: int
    messages: int
    follow_via: list[str] | None = None
    seed: int = 1
    sids: list[str] = field(default_factory=list)
    receipts: dict[str, list[int]] = field(default_factory=dict)
    seen: dict[str, list[s.Event]] = field(default_factory=dict)
    progress: int = 0

    def text(self, rng: random.Random, i: int) -> str:
        # Plain echoes, multi-step turns and tool calls that take a while.
        return rng.choice([f"m{i}", "steps 2", "sleep 2 80"])

    async def run(self, faults: Sequence[tuple[float, Fault]]) -> None:
        c = self.clients
        await c.wait_registered()
        self.sids = [await c.create() for _ in range(self.sessions)]
        self.receipts = {sid: [] for sid in self.sids}
        self.seen = {sid: [] for sid in self.sids}
        followers = [
            asyncio.create_task(c.follow(sid, self.seen[sid], self.follow_via)) for sid in self.sids
        ]
        rng = random.Random(self.seed)
        texts = {sid: [self.text(rng, i) for i in range(self.messages)] for sid in self.sids}

        async def sender(sid: str) -> None:
            for i, text in enumerate(texts[sid]):
                seq = await c.send_until_accepted(sid, text, f"{sid}-{i}")
                self.receipts[sid].append(seq)
                self.progress += 1

        senders = [asyncio.create_task(sender(sid)) for sid in self.sids]
        try:
            total = self.sessions * self.messages
            for fraction, fault in faults:
                target = int(total * fraction)

                async def reached(target: int = target) -> bool:
                    return self.progress >= target

                await eventually(reached, f"{target} sends accepted", timeout=90)
                await fault()
            await asyncio.wait_for(asyncio.gather(*senders), 120)
            await self.check()
        finally:
            for task in (*senders, *followers):
                task.cancel()
            await asyncio.gather(*senders, *followers, return_exceptions=True)

    async def check(self) -> None:
        c = self.clients
        for sid in self.sids:
            events = await eventually(
                lambda sid=sid: self._answered(sid), "every message answered", timeout=90
            )
            check_history(events, sorted(set(self.receipts[sid])))
            assert len(set(self.receipts[sid])) == self.messages

            async def caught_up(sid: str = sid, n: int = len(events)) -> bool:
                return len(self.seen[sid]) >= n

            await eventually(caught_up, "the follower to catch up", timeout=60)
            assert [e.SerializeToString() for e in self.seen[sid][: len(events)]] == [
                e.SerializeToString() for e in events
            ], "a follower saw a gap or a repeat"
        del c

    async def _answered(self, sid: str) -> list[s.Event] | None:
        events = await self.clients.events(sid)
        return events if answered(events, self.messages) else None


def in_thread(action: Callable[[], object]) -> Fault:
    async def fault() -> None:
        await asyncio.to_thread(action)

    return fault


def assert_alive(stack: ReplicatedStack, except_: Sequence[str] = ()) -> None:
    dead = [name for name, up in stack.alive().items() if not up and name not in except_]
    assert not dead, f"exited: {dead}"


# -- etcd members ------------------------------------------------------------------


async def etcd_leader_faults(
    stacks: list[ReplicatedStack],
    cluster: EtcdCluster,
    tmp_path: Path,
    *,
    sessions: int,
    messages: int,
    rounds: int,
) -> None:
    stack = start_stack(stacks, cluster.endpoint, tmp_path / "stack")
    c = ReplicatedClients(stack)
    killed: list[int] = []

    def kill_leader() -> None:
        leader = cluster.leader()
        cluster.members[leader].kill()
        killed.append(leader)

    def restart() -> None:
        cluster.restart(killed[-1])

    faults: list[tuple[float, Fault]] = []
    for r in range(rounds):
        faults.append(((2 * r + 1) / (2 * rounds + 1), in_thread(kill_leader)))
        faults.append(((2 * r + 2) / (2 * rounds + 1), in_thread(restart)))
    try:
        await Conversation(c, sessions, messages).run(faults)
        assert len(killed) == rounds
        assert_alive(stack)
    finally:
        await c.close()


async def test_etcd_leader_kill9_and_member_restart_under_load(
    stacks: list[ReplicatedStack], cluster: EtcdCluster, tmp_path: Path
) -> None:
    await etcd_leader_faults(stacks, cluster, tmp_path, sessions=3, messages=12, rounds=1)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_etcd_leader_kills_slow(
    stacks: list[ReplicatedStack], cluster: EtcdCluster, tmp_path: Path
) -> None:
    await etcd_leader_faults(stacks, cluster, tmp_path, sessions=8, messages=60, rounds=4)


# -- hooks and anchor replicas -------------------------------------------------------


async def replica_kills(
    stacks: list[ReplicatedStack],
    etcd_endpoint: str,
    tmp_path: Path,
    *,
    sessions: int,
    messages: int,
    rounds: int,
) -> None:
    """Kill -9 a hooks replica, then an anchor replica; in later rounds the
    killed ones come back and the other replica of each is killed."""
    stack = start_stack(stacks, etcd_endpoint, tmp_path / "stack")
    c = ReplicatedClients(stack)
    faults: list[tuple[float, Fault]] = []
    steps = 2 * rounds + 1
    for r in range(rounds):
        hooks, anchor = (f"hooks{1 + r % 2}", f"anchor{1 + r % 2}")

        def kill(hooks: str = hooks, r: int = r) -> None:
            if r:  # the one killed last round serves again first
                stack.start_process(f"hooks{1 + (r - 1) % 2}")
            stack.kill(hooks)

        def kill_anchor(anchor: str = anchor, r: int = r) -> None:
            if r:
                stack.start_process(f"anchor{1 + (r - 1) % 2}")
            stack.kill(anchor)

        faults.append(((2 * r + 1) / steps, in_thread(kill)))
        faults.append(((2 * r + 2) / steps, in_thread(kill_anchor)))
    try:
        await Conversation(c, sessions, messages, seed=2).run(faults)
        last = rounds - 1
        assert_alive(stack, except_=[f"hooks{1 + last % 2}", f"anchor{1 + last % 2}"])
    finally:
        await c.close()


async def test_kill9_of_a_hooks_and_an_anchor_replica_mid_conversation(
    stacks: list[ReplicatedStack], etcd_endpoint: str, tmp_path: Path
) -> None:
    await replica_kills(stacks, etcd_endpoint, tmp_path, sessions=3, messages=12, rounds=1)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_repeated_replica_kills_slow(
    stacks: list[ReplicatedStack], etcd_endpoint: str, tmp_path: Path
) -> None:
    await replica_kills(stacks, etcd_endpoint, tmp_path, sessions=8, messages=60, rounds=4)


# -- ingress -------------------------------------------------------------------------


async def ingress_stops(
    stacks: list[ReplicatedStack],
    etcd_endpoint: str,
    tmp_path: Path,
    *,
    sessions: int,
    messages: int,
    rounds: int,
) -> None:
    """Followers read through ingress1 first; it is stopped (SIGTERM, then
    in later rounds kill -9 of whichever ingress they are on) and they go on
    through the other one from their cursor."""
    stack = start_stack(stacks, etcd_endpoint, tmp_path / "stack")
    c = ReplicatedClients(stack)
    faults: list[tuple[float, Fault]] = []
    for r in range(rounds):
        name = f"ingress{1 + r % 2}"

        def stop(name: str = name, r: int = r) -> None:
            if r:
                stack.start_process(f"ingress{1 + (r - 1) % 2}")
            if r % 2:
                stack.kill(name)
            else:
                stack.stop_process(name)

        faults.append(((r + 1) / (rounds + 1), in_thread(stop)))
    try:
        conversation = Conversation(
            c, sessions, messages, follow_via=["ingress1", "ingress2"], seed=3
        )
        await conversation.run(faults)
        assert_alive(stack, except_=[f"ingress{1 + (rounds - 1) % 2}"])
    finally:
        await c.close()


async def test_an_ingress_stopped_while_followers_read_through_it(
    stacks: list[ReplicatedStack], etcd_endpoint: str, tmp_path: Path
) -> None:
    await ingress_stops(stacks, etcd_endpoint, tmp_path, sessions=3, messages=10, rounds=1)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_repeated_ingress_stops_slow(
    stacks: list[ReplicatedStack], etcd_endpoint: str, tmp_path: Path
) -> None:
    await ingress_stops(stacks, etcd_endpoint, tmp_path, sessions=8, messages=50, rounds=4)
