"""Fencing and commit integrity: stale owners write nothing, the stream stays
gapless, retries are recognised, and hook operations are fenced too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc
import pytest
from aetcd import rpc

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.anchor.v1 import anchor_pb2_grpc
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2_grpc
from baton_runtime._proto.baton.owner.v1 import owner_pb2 as owner_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.errors import BatonError, Fenced, Reason
from baton_runtime.common.etcd.keys import Keys, fence_value, parse_fence, prefix_end
from baton_runtime.common.rpc.status_map import from_rpc_error
from baton_runtime.owner.agents.api import Agent, ModelReply, RequestedCall, Tool, ToolContext
from baton_runtime.owner.config import OwnerConfig
from baton_runtime.owner.host.host import OwnerHost
from baton_runtime.owner.server import create_server as create_owner
from tests import certs
from tests.stack import Stack

K = s.EventKind


# -- fixtures and helpers ------------------------------------------------------


@dataclass
class Env:
    stack: Stack
    etcd: aetcd.Client
    keys: Keys
    hooks: HooksClient
    anchor: AnchorClient
    anchor_stub: anchor_pb2_grpc.AnchorServiceStub
    hooks_stub: hooks_pb2_grpc.HookRegistryServiceStub
    # The same as an owner of the stack's deployment: the stale owner of the
    # stack's own sessions.
    stack_anchor_stub: anchor_pb2_grpc.AnchorServiceStub
    stack_hooks_stub: hooks_pb2_grpc.HookRegistryServiceStub


# The test's own sessions run on this deployment, which has no owner process;
# the test acts as its owner (certificate included). Its stale fences of the
# stack's sessions are refused as FENCED by the journal.
OWN_DEPLOYMENT = "dep-t"


@pytest.fixture
async def env(stack: Stack) -> AsyncIterator[Env]:
    async with open_env(stack) as opened:
        yield opened


@contextlib.asynccontextmanager
async def open_env(stack: Stack) -> AsyncIterator[Env]:
    client = await certs.etcd_client(stack.etcd.endpoint)
    hooks = stack.hooks_client(certs.owner(OWN_DEPLOYMENT))
    anchor = stack.anchor_client(certs.owner(OWN_DEPLOYMENT))
    stack_hooks, stack_anchor = stack.hooks_client(), stack.anchor_client()
    try:
        yield Env(
            stack=stack,
            etcd=client,
            keys=Keys(stack.etcd.prefix),
            hooks=hooks,
            anchor=anchor,
            anchor_stub=anchor.stub,
            hooks_stub=hooks.stub,
            stack_anchor_stub=stack_anchor.stub,
            stack_hooks_stub=stack_hooks.stub,
        )
    finally:
        for closing in (hooks, anchor, stack_hooks, stack_anchor):
            await closing.close()
        await client.close()


Dump = list[tuple[bytes, bytes, int]]


async def dump(env: Env) -> Dump:
    """Every session key and token-index entry under the stack's prefix, with
    its mod revision: a put (even of the same value) or a delete changes it.
    (Owner instances register and renew under other prefixes in the
    background, so the global store revision alone is no witness.)"""
    root = env.keys.root.encode()
    out: Dump = []
    for start in (root + b"s/", root + b"t/"):
        result = await env.etcd.get_range(start, prefix_end(start))
        out += [(kv.key, kv.value, kv.mod_revision) for kv in result]
    return out


async def store_revision(env: Env) -> int:
    root = env.keys.root.encode()
    request = rpc.RangeRequest(key=root, range_end=prefix_end(root), count_only=True)
    response = await env.etcd.kvstub.Range(request, timeout=5)
    revision: int = response.header.revision
    return revision


async def writes_since(env: Env, revision: int) -> list[bytes]:
    """Session and token keys modified after `revision`."""
    return [key for key, _, mod in await dump(env) if mod > revision]


async def session_state(env: Env, session_id: str) -> list[tuple[bytes, bytes, int]]:
    """A session's journal, inbox, fence and claims, and the token index: what a
    fenced-out write could touch. (The owner record is left out: an idle owner
    may legitimately park the session.)"""
    prefix = env.keys.session_prefix(session_id)
    tokens = f"{env.keys.root}t/".encode()
    out = []
    for start in (prefix, tokens):
        result = await env.etcd.get_range(start, prefix_end(start))
        out += [(kv.key, kv.value, kv.mod_revision) for kv in result]
    return [kv for kv in out if kv[0] != env.keys.owner(session_id)]


async def current_fence(env: Env, session_id: str) -> s.Fence:
    got = await env.etcd.get(env.keys.fence(session_id))
    assert got is not None
    epoch, run = parse_fence(got.value)
    return s.Fence(session_id=session_id, owner_run_id=run, epoch=epoch)


async def stream(env: Env, session_id: str) -> list[s.Event]:
    return [e async for page in env.anchor.read_events(session_id) for e in page]  # type: ignore[attr-defined]


async def expect_error(call: Any, code: grpc.StatusCode, reason: str) -> BatonError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    err = from_rpc_error(info.value)
    assert err.reason == reason, err
    return err


def event(session_id: str, seq: int, kind: s.EventKind.ValueType, text: str = "") -> s.Event:
    return s.Event(session_id=session_id, seq=seq, kind=kind, text=text, deployment_id="dep-t")


def commit_request(
    fence: s.Fence,
    events: Sequence[s.Event],
    snapshot: s.SessionSnapshot,
    close: bool = False,
) -> anchor_pb.CommitStepRequest:
    snap = s.SessionSnapshot()
    snap.CopyFrom(snapshot)
    if events:
        snap.next_event_seq = events[-1].seq + 1
    return anchor_pb.CommitStepRequest(
        fence=fence, events=list(events), snapshot=snap, close_stream=close
    )


async def own_session(env: Env) -> tuple[s.Fence, s.SessionSnapshot]:
    """A session owned by the test itself (no owner run competes), with
    session.started committed at seq 0."""
    session_id = ids.new_session_id()
    # A deployment without an owner fleet (none would take the session over);
    # the test's clients hold its owner certificate.
    deployment_id = OWN_DEPLOYMENT
    owner = s.OwnerIdentity(
        owner_run_id=ids.new_run_id(), deployment_id=deployment_id, instance_id="t1"
    )
    created = await env.hooks.create_session(session_id, owner, "slack", [])
    fence = created.fence
    snapshot = s.SessionSnapshot(
        format_version=1,
        session_id=session_id,
        channel="slack",
        deployment_id=deployment_id,
        hooks=list(created.hooks),
        status=s.SESSION_STATUS_ACTIVE,
    )
    request = commit_request(fence, [event(session_id, 0, K.EVENT_KIND_SESSION_STARTED)], snapshot)
    response = await env.anchor_stub.CommitStep(request, timeout=10)
    assert not response.replayed
    return fence, request.snapshot


async def take_over(env: Env, session_id: str) -> tuple[s.Fence, int]:
    """Simulate a successor: move the fence to epoch+1 with a new run."""
    old = await current_fence(env, session_id)
    new = s.Fence(session_id=session_id, owner_run_id=ids.new_run_id(), epoch=old.epoch + 1)
    put = await env.etcd.put(env.keys.fence(session_id), fence_value(new.epoch, new.owner_run_id))
    return new, put.header.revision


async def wait_until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- stale fences on anchor ----------------------------------------------------------


@pytest.mark.parametrize("stale", ["future-epoch", "wrong-run", "superseded"])
async def test_stale_fence_commit_is_fenced_and_writes_nothing(env: Env, stale: str) -> None:
    stack = env.stack
    session_id = await stack.create()
    await stack.send(session_id, "hello")
    await stack.events(session_id, until=1)
    fence = await current_fence(env, session_id)
    assert fence.epoch == 1 and fence.owner_run_id
    if stale == "future-epoch":
        fence.epoch += 1
    elif stale == "wrong-run":
        fence.owner_run_id = ids.new_run_id()
    else:  # a successor took over; the old run's fence is dead
        await take_over(env, session_id)

    before = await session_state(env, session_id)
    snapshot = await env.anchor.snapshot(session_id)
    events_before = await stream(env, session_id)
    head = snapshot.next_event_seq
    assert head == len(events_before)
    forged = s.SessionSnapshot()
    forged.CopyFrom(snapshot)
    forged.inbox_next_seq += 5
    request = commit_request(
        fence, [event(session_id, head, K.EVENT_KIND_MESSAGE_COMPLETED, "forged")], forged
    )
    await expect_error(
        env.stack_anchor_stub.CommitStep(request, timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.FENCED,
    )
    # A closing commit by a stale owner is fenced the same way.
    closing = commit_request(
        fence, [event(session_id, head, K.EVENT_KIND_SESSION_COMPLETED)], forged, close=True
    )
    await expect_error(
        env.stack_anchor_stub.CommitStep(closing, timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.FENCED,
    )
    assert await session_state(env, session_id) == before
    assert await env.anchor.snapshot(session_id) == snapshot
    assert await stream(env, session_id) == events_before

    if stale != "superseded":  # the real owner is unaffected
        await stack.send(session_id, "still mine")
        events = await stack.events(session_id, until=2)
        answers = [e.text for e in events if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED]
        assert answers == ["echo: hello", "echo: still mine"]


async def test_stale_fence_commit_writes_nothing_after_its_revision(env: Env) -> None:
    fence, snapshot = await own_session(env)
    sid = fence.session_id
    before = await dump(env)
    revision = await store_revision(env)
    for stale in stale_fences(fence):
        request = commit_request(stale, [event(sid, 1, K.EVENT_KIND_TURN_STARTED)], snapshot)
        await expect_error(
            env.anchor_stub.CommitStep(request, timeout=10),
            grpc.StatusCode.FAILED_PRECONDITION,
            Reason.FENCED,
        )
        # Fencing is checked before anything else: a stale owner learns it is
        # fenced even when its seqs are also wrong.
        gap = commit_request(stale, [event(sid, 5, K.EVENT_KIND_TURN_STARTED)], snapshot)
        await expect_error(
            env.anchor_stub.CommitStep(gap, timeout=10),
            grpc.StatusCode.FAILED_PRECONDITION,
            Reason.FENCED,
        )
    assert await writes_since(env, revision) == [], "a fenced commit wrote to etcd"
    assert await dump(env) == before


# An agent whose tool blocks until the test releases it: a step in flight.
GATES: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}


class GateModel:
    async def complete(
        self, instructions: str, history: Sequence[s.ChatMessage], tools: Sequence[Tool]
    ) -> ModelReply:
        last = history[-1]
        if last.role == s.ROLE_TOOL:
            return ModelReply(text=f"done: {last.content}")
        return ModelReply(tool_calls=[RequestedCall("gate", {})])


async def _gate(arguments: dict[str, Any], ctx: ToolContext) -> str:
    entered, release = GATES[ctx.session_id]
    entered.set()
    await release.wait()
    return "released"


def build_gate_agent(deployment_id: str) -> Agent:
    return Agent(
        name="gate",
        deployment_id=deployment_id,
        instructions="Gate.",
        model=GateModel(),
        tools=(Tool("gate", "Block until released.", {"type": "object"}, _gate),),
    )


def owner_host(server: Any) -> OwnerHost:
    for callback in server.on_stop:
        host = getattr(callback, "__self__", None)
        if isinstance(host, OwnerHost):
            return host
    raise AssertionError("no OwnerHost behind this server")


async def test_superseded_owner_step_in_flight_writes_nothing(env: Env) -> None:
    """The dead owner's late step commit is fenced out: nothing it produced after
    the takeover reaches etcd, and its run ends."""
    stack = env.stack
    owner = await create_owner(
        OwnerConfig(
            listen="127.0.0.1:0",
            deployment_id="dep-gate",
            instance_id="dep-gate-i1",
            hooks=stack.addr(stack.hooks),
            anchor=stack.addr(stack.anchor),
            tls=certs.owner("dep-gate"),
            agent=f"{__name__}:build_gate_agent",
        )
    )
    await owner.start()
    stack.extra.append(owner)
    host = owner_host(owner)
    client = OwnerClient(stack.addr(owner), security=certs.ingress("dep-gate"))
    gateway = HooksClient(stack.addr(stack.hooks), security=certs.ingress("dep-gate"))
    session_id = ids.new_session_id()
    entered, release = asyncio.Event(), asyncio.Event()
    GATES[session_id] = (entered, release)
    try:
        await client.start_session(
            owner_pb.StartSessionRequest(
                session_id=session_id, deployment_id="dep-gate", channel="slack"
            )
        )
        command = s.Command(
            delivery=s.DeliveryMetadata(delivery_id="gate-1", channel="slack"),
            send=s.SendCommand(text="open the gate"),
        )
        await gateway.append(ids.inbox_token(session_id), command, "slack")
        await asyncio.wait_for(entered.wait(), 10)

        _, takeover_revision = await take_over(env, session_id)
        snapshot_before = await env.anchor.snapshot(session_id)
        release.set()
        await wait_until(lambda: session_id not in host.runs, what="the fenced run to exit")

        prefix = env.keys.session_prefix(session_id)
        kvs = list(await env.etcd.get_range(prefix, prefix_end(prefix)))
        late = [kv.key for kv in kvs if kv.mod_revision > takeover_revision]
        assert late == [], f"a fenced owner wrote after the takeover: {late}"
        assert await env.anchor.snapshot(session_id) == snapshot_before
        assert [e.kind for e in await stream(env, session_id)] == [K.EVENT_KIND_SESSION_STARTED]
        # The inbox still accepts: the session's inbox outlives any run.
        later = s.Command(
            delivery=s.DeliveryMetadata(delivery_id="gate-2"), send=s.SendCommand(text="later")
        )
        receipt = await gateway.append(ids.inbox_token(session_id), later, "slack")
        assert receipt.seq == 1
    finally:
        release.set()
        GATES.pop(session_id, None)
        await client.close()
        await gateway.close()


# -- seq integrity and replay -----------------------------------------------------------


async def test_commit_with_a_seq_gap_is_rejected(env: Env) -> None:
    fence, snapshot = await own_session(env)
    sid = fence.session_id
    before = await dump(env)
    for first in (2, 7):
        gap = commit_request(fence, [event(sid, first, K.EVENT_KIND_TURN_STARTED)], snapshot)
        await expect_error(
            env.anchor_stub.CommitStep(gap, timeout=10),
            grpc.StatusCode.ABORTED,
            Reason.SEQ_CONFLICT,
        )
    assert await dump(env) == before
    assert [e.seq for e in await stream(env, sid)] == [0]


async def test_commit_reusing_an_existing_seq_is_rejected(env: Env) -> None:
    fence, snapshot = await own_session(env)
    sid = fence.session_id
    ok = commit_request(
        fence,
        [event(sid, 1, K.EVENT_KIND_TURN_STARTED), event(sid, 2, K.EVENT_KIND_MESSAGE_RECEIVED)],
        snapshot,
    )
    await env.anchor_stub.CommitStep(ok, timeout=10)
    before = await dump(env)
    events_before = await stream(env, sid)
    for events in (
        [event(sid, 0, K.EVENT_KIND_TURN_STARTED, "overwrite 0")],
        [event(sid, 2, K.EVENT_KIND_TURN_STARTED, "overwrite 2")],
        [
            event(sid, 2, K.EVENT_KIND_TURN_STARTED, "overlap"),
            event(sid, 3, K.EVENT_KIND_TURN_STARTED),
        ],
    ):
        reuse = commit_request(fence, events, ok.snapshot)
        await expect_error(
            env.anchor_stub.CommitStep(reuse, timeout=10),
            grpc.StatusCode.ABORTED,
            Reason.SEQ_CONFLICT,
        )
    assert await dump(env) == before
    assert await stream(env, sid) == events_before


async def test_identical_retry_is_replayed_not_written_twice(env: Env) -> None:
    fence, snapshot = await own_session(env)
    sid = fence.session_id
    step = commit_request(
        fence,
        [
            event(sid, 1, K.EVENT_KIND_TURN_STARTED),
            event(sid, 2, K.EVENT_KIND_MESSAGE_COMPLETED, "a"),
        ],
        snapshot,
    )
    first = await env.anchor_stub.CommitStep(step, timeout=10)
    assert not first.replayed
    before = await dump(env)
    again = await env.anchor_stub.CommitStep(step, timeout=10)
    assert again.replayed
    assert await dump(env) == before, "a replayed commit wrote to etcd"
    assert [e.seq for e in await stream(env, sid)] == [0, 1, 2]

    # A delayed retry of an older step, after a newer one, is refused and
    # writes nothing: the newer snapshot stays.
    newer = commit_request(fence, [event(sid, 3, K.EVENT_KIND_TURN_COMPLETED)], step.snapshot)
    newer.snapshot.inbox_next_seq = 1
    await env.anchor_stub.CommitStep(newer, timeout=10)
    before = await dump(env)
    await expect_error(
        env.anchor_stub.CommitStep(step, timeout=10), grpc.StatusCode.ABORTED, Reason.SEQ_CONFLICT
    )
    assert await dump(env) == before
    assert await env.anchor.snapshot(sid) == newer.snapshot


async def _not_a_replay(env: Env, make: Callable[[s.Fence, s.SessionSnapshot], Any]) -> None:
    fence, snapshot = await own_session(env)
    sid = fence.session_id
    step = commit_request(fence, [event(sid, 1, K.EVENT_KIND_TURN_STARTED)], snapshot)
    await env.anchor_stub.CommitStep(step, timeout=10)
    before = await dump(env)
    await expect_error(
        env.anchor_stub.CommitStep(make(fence, snapshot), timeout=10),
        grpc.StatusCode.ABORTED,
        Reason.SEQ_CONFLICT,
    )
    assert await dump(env) == before
    assert [e.seq for e in await stream(env, sid)] == [0, 1]


async def test_longer_commit_sharing_the_first_event_is_not_a_replay(env: Env) -> None:
    """`replayed` promises the whole request is durable. A request whose first
    event equals a stored one but which carries more events is a different
    request: SEQ_CONFLICT, never a success that silently drops seq 2."""

    def longer(fence: s.Fence, snapshot: s.SessionSnapshot) -> anchor_pb.CommitStepRequest:
        sid = fence.session_id
        events = [
            event(sid, 1, K.EVENT_KIND_TURN_STARTED),
            event(sid, 2, K.EVENT_KIND_TURN_COMPLETED),
        ]
        return commit_request(fence, events, snapshot)

    await _not_a_replay(env, longer)


async def test_commit_with_another_snapshot_is_not_a_replay(env: Env) -> None:
    """Same events, different snapshot: not the committed request either; the
    caller must not believe its snapshot is durable."""

    def other(fence: s.Fence, snapshot: s.SessionSnapshot) -> anchor_pb.CommitStepRequest:
        request = commit_request(
            fence, [event(fence.session_id, 1, K.EVENT_KIND_TURN_STARTED)], snapshot
        )
        request.snapshot.inbox_next_seq = 9
        return request

    await _not_a_replay(env, other)


async def test_delayed_snapshot_only_commit_cannot_roll_the_snapshot_back(env: Env) -> None:
    """A commit with no events still carries a snapshot. Arriving late (after a
    newer step), it must not replace the newer snapshot: a rolled-back inbox
    position or event head would make a recovering owner redo committed work."""
    fence, snapshot = await own_session(env)
    sid = fence.session_id
    bare = commit_request(fence, [], snapshot)
    bare.snapshot.inbox_next_seq = 1
    await env.anchor_stub.CommitStep(bare, timeout=10)
    newer = commit_request(fence, [event(sid, 1, K.EVENT_KIND_TURN_COMPLETED)], bare.snapshot)
    newer.snapshot.inbox_next_seq = 2
    await env.anchor_stub.CommitStep(newer, timeout=10)
    before = await dump(env)
    try:
        response = await env.anchor_stub.CommitStep(bare, timeout=10)
    except grpc.aio.AioRpcError as exc:  # refusing the stale snapshot is fine
        assert exc.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION), exc
    else:
        assert await env.anchor.snapshot(sid) == newer.snapshot, "the snapshot was rolled back"
        assert response.replayed, "a retried commit was written again"
    assert await env.anchor.snapshot(sid) == newer.snapshot
    assert await dump(env) == before


async def test_commit_after_the_stream_closed_is_refused(env: Env) -> None:
    fence, snapshot = await own_session(env)
    sid = fence.session_id
    closing = commit_request(
        fence, [event(sid, 1, K.EVENT_KIND_SESSION_COMPLETED)], snapshot, close=True
    )
    await env.anchor_stub.CommitStep(closing, timeout=10)
    before = await dump(env)
    after = commit_request(fence, [event(sid, 2, K.EVENT_KIND_TURN_STARTED)], closing.snapshot)
    await expect_error(
        env.anchor_stub.CommitStep(after, timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.SESSION_FINALIZED,
    )
    # Closing twice (a second terminal event) is refused the same way.
    again = commit_request(
        fence, [event(sid, 2, K.EVENT_KIND_SESSION_FAILED)], closing.snapshot, close=True
    )
    await expect_error(
        env.anchor_stub.CommitStep(again, timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.SESSION_FINALIZED,
    )
    assert await dump(env) == before


async def test_malformed_commits_are_invalid_and_write_nothing(env: Env) -> None:
    fence, snapshot = await own_session(env)
    sid = fence.session_id
    before = await dump(env)
    not_consecutive = commit_request(
        fence,
        [event(sid, 1, K.EVENT_KIND_TURN_STARTED), event(sid, 3, K.EVENT_KIND_TURN_COMPLETED)],
        snapshot,
    )
    other_session = commit_request(
        fence, [event(ids.new_session_id(), 1, K.EVENT_KIND_TURN_STARTED)], snapshot
    )
    terminal_not_closing = commit_request(
        fence, [event(sid, 1, K.EVENT_KIND_SESSION_COMPLETED)], snapshot
    )
    close_without_terminal = commit_request(
        fence, [event(sid, 1, K.EVENT_KIND_TURN_STARTED)], snapshot, close=True
    )
    wrong_head = commit_request(fence, [event(sid, 1, K.EVENT_KIND_TURN_STARTED)], snapshot)
    wrong_head.snapshot.next_event_seq = 5
    for request in (
        not_consecutive,
        other_session,
        terminal_not_closing,
        close_without_terminal,
        wrong_head,
    ):
        await expect_error(
            env.anchor_stub.CommitStep(request, timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
            Reason.INVALID_FIELD,
        )
    no_fence = anchor_pb.CommitStepRequest(snapshot=snapshot)
    await expect_error(
        env.anchor_stub.CommitStep(no_fence, timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.MISSING_FIELD,
    )
    assert await dump(env) == before


async def test_commit_for_an_unknown_session_is_not_found(env: Env) -> None:
    sid = ids.new_session_id()
    fence = s.Fence(session_id=sid, owner_run_id=ids.new_run_id(), epoch=1)
    before = await dump(env)
    request = commit_request(
        fence, [event(sid, 0, K.EVENT_KIND_SESSION_STARTED)], s.SessionSnapshot(session_id=sid)
    )
    await expect_error(
        env.anchor_stub.CommitStep(request, timeout=10),
        grpc.StatusCode.NOT_FOUND,
        Reason.SESSION_NOT_FOUND,
    )
    assert await dump(env) == before


# -- fenced hook operations ------------------------------------------------------------


def stale_fences(fence: s.Fence) -> list[s.Fence]:
    future = s.Fence(
        session_id=fence.session_id, owner_run_id=fence.owner_run_id, epoch=fence.epoch + 1
    )
    wrong_run = s.Fence(
        session_id=fence.session_id, owner_run_id=ids.new_run_id(), epoch=fence.epoch
    )
    return [future, wrong_run]


async def test_stream_inbox_with_a_stale_fence_is_fenced(env: Env) -> None:
    session_id = await env.stack.create()
    await env.stack.send(session_id, "in the inbox")
    fence = await current_fence(env, session_id)
    for stale in stale_fences(fence):
        call = env.hooks_stub.StreamInbox(hooks_pb.StreamInboxRequest(fence=stale, from_seq=0))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                raise AssertionError(f"a stale fence received inbox entries: {response}")
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert from_rpc_error(info.value).reason == Reason.FENCED
    # The typed client surfaces the same as the Fenced domain error.
    with pytest.raises(Fenced):
        async for _ in env.hooks.stream_inbox(stale_fences(fence)[0], 0):
            pass


async def test_live_inbox_stream_ends_fenced_when_ownership_moves(env: Env) -> None:
    fence, _ = await own_session(env)
    sid = fence.session_id
    token = ids.inbox_token(sid)
    seen: list[int] = []
    first_seen = asyncio.Event()

    async def follow() -> None:
        async for page in env.hooks.stream_inbox(fence, 0):
            seen.extend(e.seq for e in page)
            first_seen.set()

    reader = asyncio.get_running_loop().create_task(follow())
    try:
        command = s.Command(
            delivery=s.DeliveryMetadata(delivery_id="live-1"), clear=s.ClearCommand()
        )
        await env.hooks.append(token, command)
        await asyncio.wait_for(first_seen.wait(), 10)
        await take_over(env, sid)
        with pytest.raises(Fenced):
            await asyncio.wait_for(reader, 10)
        assert seen == [0]
    finally:
        reader.cancel()


async def test_claim_and_dispose_with_a_stale_fence_are_fenced(env: Env) -> None:
    session_id = await env.stack.create(aliases=["keep-me"])
    fence = await current_fence(env, session_id)
    before = await session_state(env, session_id)
    for stale in stale_fences(fence):
        await expect_error(
            env.stack_hooks_stub.ClaimHooks(
                hooks_pb.ClaimHooksRequest(fence=stale, tokens=["slack:claim-me"]), timeout=10
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            Reason.FENCED,
        )
        for tokens in ([], ["slack:keep-me"]):
            await expect_error(
                env.stack_hooks_stub.DisposeHooks(
                    hooks_pb.DisposeHooksRequest(fence=stale, tokens=tokens), timeout=10
                ),
                grpc.StatusCode.FAILED_PRECONDITION,
                Reason.FENCED,
            )
    assert await session_state(env, session_id) == before
    assert (await env.hooks.lookup("slack:keep-me")).session_id == session_id
    with pytest.raises(BatonError) as info:
        await env.hooks.lookup("slack:claim-me")
    assert info.value.reason == Reason.TOKEN_NOT_FOUND

    # A superseded run is fenced the same way.
    await take_over(env, session_id)
    before = await session_state(env, session_id)
    await expect_error(
        env.stack_hooks_stub.ClaimHooks(
            hooks_pb.ClaimHooksRequest(fence=fence, tokens=["slack:claim-me"]), timeout=10
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.FENCED,
    )
    await expect_error(
        env.stack_hooks_stub.DisposeHooks(hooks_pb.DisposeHooksRequest(fence=fence), timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.FENCED,
    )
    assert await session_state(env, session_id) == before


async def test_fenced_hook_calls_need_a_fence(env: Env) -> None:
    before = await dump(env)
    await expect_error(
        env.hooks_stub.ClaimHooks(hooks_pb.ClaimHooksRequest(tokens=["slack:x"]), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.MISSING_FIELD,
    )
    await expect_error(
        env.hooks_stub.DisposeHooks(hooks_pb.DisposeHooksRequest(), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.MISSING_FIELD,
    )
    assert await dump(env) == before
