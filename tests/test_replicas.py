"""Hooks and anchor replicas share nothing but etcd (docs/design.md §13).

Every cache a hooks process keeps is tried here with a second replica
changing etcd behind its back:
- the per-session inbox head and owner record (group commit, parking bells):
  an append compares both, so a stale copy costs a retry, never a gap, a
  duplicate, a missed bell or a receipt naming a former owner;
- the token index: an append compares the token's entry; LookupHook reads
  etcd, because nothing would ever tell this replica that another one
  disposed the token or gave it to another session.
Anchor keeps no cache: two anchors serve one stream, a reader can move from
one to the other at its cursor. Owners and ingresses configured with both
replicas spread their calls over them.

In-process servers on loopback over the test etcd; real-process kills of
replicas are in tests/test_replicated_faults.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import aetcd
import grpc
import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.journal import Journal
from baton_runtime.anchor.server import create_server as create_anchor
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import NotFound
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.rpc.server import GrpcServer
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.tls import Security
from baton_runtime.hooks.rooms import HookRooms
from baton_runtime.hooks.server import create_server as create_hooks
from baton_runtime.ingress.api_keys import ApiKeys
from baton_runtime.ingress.config import IngressConfig
from baton_runtime.ingress.server import create_server as create_ingress
from baton_runtime.owner.config import OwnerConfig
from baton_runtime.owner.server import create_server as create_owner
from tests.stack import API_KEYS, Stack, anchor_config, hooks_config, public_channel
from tests.test_inbox import assert_admitted_once_in_order, read_until_idle, received

GHOST_DEPLOYMENT = "dep-ghost"  # no owner runs it: sessions stay as the test leaves them


def count(app: object, method: str, counts: Counter[str], label: str) -> None:
    """Count calls of `method` of a server's domain object under `label`."""
    original: Callable[..., Any] = getattr(app, method)
    if asyncio.iscoroutinefunction(original):

        async def counted(*args: Any, **kwargs: Any) -> Any:
            counts[label] += 1
            return await original(*args, **kwargs)

        setattr(app, method, counted)
    else:

        def counted_gen(*args: Any, **kwargs: Any) -> Any:
            counts[label] += 1
            return original(*args, **kwargs)

        setattr(app, method, counted_gen)


class Replicated:
    """Two hooks and two anchors over the stack's etcd, and an owner and an
    ingress of another deployment that are given both of each."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.hooks: list[GrpcServer] = [stack.hooks]
        self.anchors: list[GrpcServer] = [stack.anchor]
        self.counts: Counter[str] = Counter()
        self.ingress_stub: ingress_pb2_grpc.IngressServiceStub | None = None
        self._channel: grpc.aio.Channel | None = None

    def addrs(self, servers: list[GrpcServer]) -> str:
        return ",".join(self.stack.addr(server) for server in servers)

    async def start(self, deployment_id: str = "dep-r") -> Replicated:
        stack = self.stack
        hooks = await create_hooks(hooks_config(stack.etcd, stack.pki))
        anchor = await create_anchor(anchor_config(stack.etcd, stack.pki))
        for server in (hooks, anchor):
            await server.start()
            stack.extra.append(server)
        self.hooks.append(hooks)
        self.anchors.append(anchor)
        for i, server in enumerate(self.hooks):
            rooms = server.app
            assert isinstance(rooms, HookRooms)
            count(rooms.inbox, "append", self.counts, f"hooks{i}.append")
        for i, server in enumerate(self.anchors):
            journal = server.app
            assert isinstance(journal, Journal)
            count(journal, "commit", self.counts, f"anchor{i}.commit")
            count(journal.events, "read", self.counts, f"anchor{i}.read")
        owner = await create_owner(
            OwnerConfig(
                listen="127.0.0.1:0",
                deployment_id=deployment_id,
                instance_id=f"{deployment_id}-i1",
                hooks=self.addrs(self.hooks),
                anchor=self.addrs(self.anchors),
                tls=stack.security(Role.OWNER, deployment_id),
            )
        )
        await owner.start()
        stack.extra.insert(0, owner)
        ingress = await create_ingress(
            IngressConfig(
                listen="127.0.0.1:0",
                deployment_id=deployment_id,
                api_keys=ApiKeys.of(API_KEYS),
                hooks=self.addrs(self.hooks),
                anchor=self.addrs(self.anchors),
                owner=stack.addr(owner),
                tls=stack.security(Role.INGRESS, deployment_id),
            )
        )
        await ingress.start()
        stack.extra.insert(0, ingress)
        self._channel = public_channel(stack.addr(ingress), stack.pki)
        self.ingress_stub = ingress_pb2_grpc.IngressServiceStub(self._channel)
        return self

    def as_stack(self) -> Stack:
        """The stack seen through the replicated deployment's ingress."""
        assert self.ingress_stub is not None and self._channel is not None
        return Stack(
            etcd=self.stack.etcd,
            deployment_id="dep-r",
            hooks=self.hooks[0],
            anchor=self.anchors[0],
            owner=self.stack.owner,
            ingress=self.stack.ingress,
            channel=self._channel,
            ingress_stub=self.ingress_stub,
            pki=self.stack.pki,
        )

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


@pytest.fixture
async def replicated(stack: Stack) -> AsyncIterator[Replicated]:
    running = await Replicated(stack).start()
    try:
        yield running
    finally:
        await running.close()


async def test_a_conversation_over_two_hooks_and_two_anchors(replicated: Replicated) -> None:
    """Concurrent senders on a few sessions, some deliveries repeated: every
    replica takes part, every inbox is gapless, every delivery appended once
    and every command admitted once in order."""
    stack = replicated.as_stack()
    sessions = [await stack.create() for _ in range(3)]
    per_session = 12

    async def converse(session_id: str) -> dict[int, str]:
        async def send(i: int) -> tuple[int, str]:
            text = f"{session_id[-4:]} m{i}"
            response = await stack.send(
                session_id, text, delivery_id=f"{session_id}-{i}", turn_policy=s.TURN_POLICY_QUEUE
            )
            return response.receipt.seq, text

        first = await asyncio.gather(*(send(i) for i in range(per_session)))
        again = await asyncio.gather(*(send(i) for i in range(0, per_session, 3)))
        assert set(again) <= set(first), "a repeated delivery got another seq"
        assert sorted(seq for seq, _ in first) == list(range(per_session))
        return dict(first)

    texts = await asyncio.gather(*(converse(sid) for sid in sessions))
    for session_id, by_seq in zip(sessions, texts, strict=True):
        events = await read_until_idle(stack, session_id, per_session)
        assert_admitted_once_in_order(events, by_seq)
        assert len(received(events)) == per_session
    for label in ("hooks0.append", "hooks1.append", "anchor0.commit", "anchor1.commit"):
        assert replicated.counts[label] > 0, f"{label} never called: {replicated.counts}"


async def ghost_session(client: HooksClient, aliases: list[str]) -> s.Fence:
    """A session created directly on hooks whose owner never runs."""
    owner = s.OwnerIdentity(
        owner_run_id=ids.new_run_id(), deployment_id=GHOST_DEPLOYMENT, instance_id="ghost"
    )
    response = await client.create_session(ids.new_session_id(), owner, "slack", aliases)
    return response.fence


def ghost(replicated: Replicated) -> Security:
    """The certificate of the ghost deployment's owner, which these tests
    play: owners act only on sessions of their own deployment."""
    return replicated.stack.security(Role.OWNER, GHOST_DEPLOYMENT)


def send(text: str) -> s.Command:
    return s.Command(send=s.SendCommand(text=text, turn_policy=s.TURN_POLICY_QUEUE))


async def test_a_token_moved_by_one_replica_is_seen_by_the_other(replicated: Replicated) -> None:
    one, two = (
        HooksClient(replicated.stack.addr(h), security=ghost(replicated)) for h in replicated.hooks
    )
    # Messages through an alias come from a gateway's ingress, in its channel.
    gateway = replicated.stack.security(Role.INGRESS, replicated.stack.deployment_id)
    via_one, via_two = (
        HooksClient(replicated.stack.addr(h), security=gateway) for h in replicated.hooks
    )
    try:
        alias = "slack:moving-thread"
        first = await ghost_session(one, [alias])
        # Both replicas resolve (and cache) the alias; one appends through it.
        for client in (one, two):
            assert (await client.lookup(alias)).session_id == first.session_id
        assert (
            await via_one.append(alias, send("to the first"), "slack")
        ).session_id == first.session_id
        # The other replica releases it and gives it to a new session.
        await two.dispose(first, [alias])
        with pytest.raises(NotFound):
            await one.lookup(alias)
        with pytest.raises(NotFound):
            await via_one.append(alias, send("to nobody"), "slack")
        second = await ghost_session(two, [alias])
        assert (await one.lookup(alias)).session_id == second.session_id
        receipt = await via_one.append(alias, send("to the second"), "slack")
        assert receipt.session_id == second.session_id and receipt.seq == 0
        # And back the other way round, with the replicas' roles swapped.
        await one.dispose(second, [alias])
        third = await ghost_session(one, [alias])
        receipt = await via_two.append(alias, send("to the third"), "slack")
        assert receipt.session_id == third.session_id and receipt.seq == 0
    finally:
        for client in (one, two, via_one, via_two):
            await client.close()


async def test_parking_and_takeover_on_one_replica_are_seen_by_the_other(
    replicated: Replicated, etcd: aetcd.Client
) -> None:
    """The append txn rings the owner's bell exactly while the owner record
    says parked; a replica whose cached record is stale must still get the
    bell and the current owner right."""
    one, two = (
        HooksClient(replicated.stack.addr(h), security=ghost(replicated)) for h in replicated.hooks
    )
    keys = Keys(replicated.stack.etcd.prefix)
    try:
        fence = await ghost_session(one, [])
        sid = fence.session_id
        token = ids.inbox_token(sid)
        assert (await one.append(token, send("m0"))).seq == 0  # `one` caches: unparked
        assert await two.set_parked(fence, True, inbox_next_seq=1) == 1
        assert (await one.append(token, send("m1"))).seq == 1
        bell = await etcd.get(keys.bell("ghost", sid))
        assert bell is not None and bell.value == b"2", "the stale replica missed the bell"
        await two.set_parked(fence, False)
        assert await etcd.get(keys.bell("ghost", sid)) is None
        assert (await one.append(token, send("m2"))).seq == 2  # `one` caches: parked
        assert await etcd.get(keys.bell("ghost", sid)) is None, "a bell for an unparked session"
        # A takeover through `two`: `one` must name the new owner run.
        successor = s.OwnerIdentity(
            owner_run_id=ids.new_run_id(), deployment_id=GHOST_DEPLOYMENT, instance_id="ghost2"
        )
        moved = await two.take_over_session(fence, "ghost", successor)
        receipt = await one.append(token, send("m3"))
        assert receipt.seq == 3 and receipt.owner_run_id == successor.owner_run_id
        # Parking by the new owner through `one` itself, then an append through
        # `two`, which last saw the session unparked under the old owner.
        assert await one.set_parked(moved.fence, True, inbox_next_seq=4) == 4
        assert (await two.append(token, send("m4"))).seq == 4
        bell = await etcd.get(keys.bell("ghost2", sid))
        assert bell is not None and bell.value == b"5"
    finally:
        await one.close()
        await two.close()


async def test_concurrent_appends_through_both_replicas_dedup_across_them(
    replicated: Replicated, etcd: aetcd.Client
) -> None:
    """Both replicas group-commit into one session at once; every delivery id
    is sent through both. One seq per delivery, gapless, nothing twice."""
    one, two = (
        HooksClient(replicated.stack.addr(h), security=ghost(replicated)) for h in replicated.hooks
    )
    balanced = HooksClient(replicated.addrs(replicated.hooks), security=ghost(replicated))
    try:
        fence = await ghost_session(one, [])
        token = ids.inbox_token(fence.session_id)

        def command(i: int) -> s.Command:
            cmd = send(f"m{i}")
            cmd.delivery.delivery_id = f"dup-{i}"
            return cmd

        calls = [client.append(token, command(i)) for i in range(60) for client in (one, two)]
        calls += [balanced.append(token, command(i)) for i in range(0, 60, 2)]
        receipts = await asyncio.gather(*calls)
        seqs: dict[str, set[int]] = {}
        for i, receipt in enumerate(receipts):
            delivery = f"dup-{i // 2}" if i < 120 else f"dup-{(i - 120) * 2}"
            seqs.setdefault(delivery, set()).add(receipt.seq)
        assert all(len(v) == 1 for v in seqs.values()), "one delivery, two seqs"
        assert sorted(next(iter(v)) for v in seqs.values()) == list(range(60))
        assert sum(not r.duplicate for r in receipts) == 60
        keys = Keys(replicated.stack.etcd.prefix)
        head = await etcd.get(keys.inbox_head(fence.session_id))
        assert head is not None and head.value == b"60"
    finally:
        for client in (one, two, balanced):
            await client.close()


async def test_two_anchors_serve_one_stream(replicated: Replicated) -> None:
    """Commits go through both anchors; readers on either see the same
    gapless stream, and a reader moving from one to the other at its cursor
    neither misses nor repeats an event."""
    stack = replicated.as_stack()
    security = stack.security(Role.OWNER, "dep-r")
    one, two = (
        AnchorClient(replicated.stack.addr(a), security=security) for a in replicated.anchors
    )
    try:
        session_id = await stack.create()
        on_one: list[s.Event] = []
        on_two: list[s.Event] = []

        async def follow(client: AnchorClient, out: list[s.Event], stop: int) -> None:
            async for page in client.read_events(session_id, len(out), follow=True):
                out.extend(page)
                if len(received(out)) >= stop and out[-1].kind == s.EVENT_KIND_SESSION_WAITING:
                    return

        readers = [
            asyncio.create_task(follow(one, on_one, 8)),
            asyncio.create_task(follow(two, on_two, 8)),
        ]
        moving: list[s.Event] = []
        for i in range(8):
            await stack.send(session_id, f"m{i}", turn_policy=s.TURN_POLICY_QUEUE)
            if i == 3:
                await read_until_idle(stack, session_id, 4)
                await follow(one, moving, 4)  # up to the 4th answer on anchor one…
        await follow(two, moving, 8)  # …then the rest on anchor two, from its cursor
        await asyncio.wait_for(asyncio.gather(*readers), 30)
        stored = await stack.events(session_id, follow=False)
        assert [e.seq for e in stored] == list(range(len(stored)))
        for seen in (on_one, on_two, moving):
            assert len(received(seen)) == 8
            assert [e.SerializeToString() for e in seen] == [
                e.SerializeToString() for e in stored[: len(seen)]
            ]
        assert replicated.counts["anchor0.commit"] and replicated.counts["anchor1.commit"]
    finally:
        await one.close()
        await two.close()
