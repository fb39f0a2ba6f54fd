"""The inbox under contention: gapless seqs, exactly-once FIFO processing,
delivery-id deduplication (sequential, concurrent, across hooks instances)."""

from __future__ import annotations

import asyncio

import aetcd
import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import Reason
from baton_runtime.common.etcd.keys import Keys, prefix_end, seq_of
from baton_runtime.common.security.identity import Role
from baton_runtime.hooks.server import create_server as create_hooks
from baton_runtime.owner.agents.fixture import build_agent
from tests.stack import SLACK, Stack, hooks_config

K = s.EventKind
# The steps a turn of the stack's agent may take (a steered turn can reach it).
FIXTURE_STEP_LIMIT = build_agent("dep-a").max_steps_per_turn


def received(events: list[s.Event]) -> list[s.Event]:
    return [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED]


async def read_until_idle(
    stack: Stack, session_id: str, messages: int, timeout: float = 60
) -> list[s.Event]:
    """Follow the stream until `messages` messages were admitted and the
    session waits again; then return the whole stream as stored."""
    seen: list[s.Event] = []

    def idle() -> bool:
        return len(received(seen)) >= messages and seen[-1].kind == K.EVENT_KIND_SESSION_WAITING

    call = stack.ingress_stub.StreamEvents(
        ingress_pb.StreamEventsRequest(session_id=session_id, follow=True), metadata=SLACK
    )

    async def collect() -> None:
        async for response in call:
            for event in response.events:
                seen.append(event)
                if idle():
                    return

    try:
        await asyncio.wait_for(collect(), timeout)
    finally:
        call.cancel()
    return await stack.events(session_id, follow=False)


def assert_admitted_once_in_order(events: list[s.Event], texts_by_seq: dict[int, str]) -> None:
    """Every accepted inbox seq is admitted exactly once, in seq order, with
    its own text; every turn settles; the stream is gapless."""
    assert [e.seq for e in events] == list(range(len(events))), "stream has a gap or duplicate"
    got = received(events)
    assert [e.inbox_seq for e in got] == sorted(texts_by_seq), "not admitted once each in order"
    assert [e.text for e in got] == [texts_by_seq[e.inbox_seq] for e in got]
    kinds = [e.kind for e in events]
    listing = "\n".join(f"{e.seq} {K.Name(e.kind)} {e.turn_id} {e.inbox_seq}" for e in events)
    # Steered messages that keep arriving keep one turn going, a step per
    # boundary; on a loaded machine such a turn reached the agent's limit of
    # steps and failed with MAX_STEPS (CI: 9 turns started, 8 completed).
    # That is the step limit doing its job; any other failure is not.
    failed = [e for e in events if e.kind == K.EVENT_KIND_TURN_FAILED]
    for e in failed:
        assert e.error.reason == Reason.MAX_STEPS, listing
        steps = [
            x for x in events if x.kind == K.EVENT_KIND_STEP_STARTED and x.turn_id == e.turn_id
        ]
        assert len(steps) == FIXTURE_STEP_LIMIT, listing
    assert kinds.count(K.EVENT_KIND_TURN_STARTED) == (
        kinds.count(K.EVENT_KIND_TURN_COMPLETED) + len(failed)
    ), listing
    last_turn = next(e.turn_id for e in reversed(events) if e.kind == K.EVENT_KIND_TURN_STARTED)
    ended_by_limit = bool(failed) and failed[-1].turn_id == last_turn
    # The fixture model answers the latest user message it has seen: every
    # answer echoes the message admitted last before it, and the last message
    # is answered.
    latest = ""
    answered_last = False
    for e in events:
        if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED:
            latest, answered_last = e.text, False
        elif e.kind == K.EVENT_KIND_MESSAGE_COMPLETED:
            assert e.text == f"echo: {latest}", (e.seq, e.text, latest)
            answered_last = True
    assert answered_last or ended_by_limit, "the last message was not answered"


def assert_each_answered_in_own_turn(events: list[s.Event], texts_by_seq: dict[int, str]) -> None:
    """Queued messages: one turn per message, each answered with its echo."""
    assert_admitted_once_in_order(events, texts_by_seq)
    answers: dict[str, list[str]] = {}
    for e in events:
        if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED:
            answers.setdefault(e.turn_id, []).append(e.text)
    for e in received(events):
        assert answers.get(e.turn_id) == [f"echo: {e.text}"], (e.turn_id, answers.get(e.turn_id))
    assert len({e.turn_id for e in received(events)}) == len(texts_by_seq)


async def inbox_keys(client: aetcd.Client, keys: Keys, session_id: str) -> list[int]:
    prefix = keys.inbox_prefix(session_id)
    result = await client.get_range(prefix, prefix_end(prefix))
    return [seq_of(kv.key) for kv in result]


async def inbox_head(client: aetcd.Client, keys: Keys, session_id: str) -> int:
    got = await client.get(keys.inbox_head(session_id))
    assert got is not None
    return int(got.value)


QUEUE = s.TURN_POLICY_QUEUE
STEER = s.TURN_POLICY_STEER


@pytest.mark.parametrize("policy", [QUEUE, STEER], ids=["queue", "steer"])
async def test_concurrent_senders_get_gapless_seqs_processed_once_in_order(
    stack: Stack, etcd: aetcd.Client, policy: s.TurnPolicy.ValueType
) -> None:
    senders, per_sender = 8, 10
    session_id = await stack.create()

    async def sender(n: int) -> list[tuple[int, str, str]]:
        out = []
        for i in range(per_sender):
            text = f"sender{n} message{i}"
            response = await stack.send(session_id, text, caller=f"user{n}", turn_policy=policy)
            assert response.receipt.session_id == session_id
            assert not response.receipt.duplicate
            out.append((response.receipt.seq, text, response.delivery_id))
        return out

    results = await asyncio.gather(*(sender(n) for n in range(senders)))
    total = senders * per_sender
    receipts = [r for per in results for r in per]
    assert sorted(seq for seq, _, _ in receipts) == list(range(total)), (
        "receipt seqs are not distinct and gapless"
    )
    for per in results:  # one sender's sequential sends keep their order
        assert [seq for seq, _, _ in per] == sorted(seq for seq, _, _ in per)

    events = await read_until_idle(stack, session_id, total)
    texts = {seq: text for seq, text, _ in receipts}
    if policy == QUEUE:
        assert_each_answered_in_own_turn(events, texts)
    else:
        assert_admitted_once_in_order(events, texts)
    delivery_by_seq = {seq: d for seq, _, d in receipts}
    assert [e.delivery_id for e in received(events)] == [delivery_by_seq[i] for i in range(total)]

    keys = Keys(stack.etcd.prefix)
    # Every entry consumed, and deleted by the commit that consumed it.
    assert await inbox_keys(etcd, keys, session_id) == []
    assert await inbox_head(etcd, keys, session_id) == total


async def test_fully_concurrent_burst_with_duplicates(stack: Stack) -> None:
    """80 calls in flight at once, 20 of them repeats of another's delivery id."""
    session_id = await stack.create()
    fresh = [(f"d-{i:03d}", f"burst {i}") for i in range(60)]
    repeats = [fresh[i * 3] for i in range(20)]
    calls = fresh + repeats
    responses = await asyncio.gather(
        *(stack.send(session_id, t, delivery_id=d, turn_policy=QUEUE) for d, t in calls)
    )
    by_delivery: dict[str, set[int]] = {}
    for (delivery_id, _), response in zip(calls, responses, strict=True):
        by_delivery.setdefault(delivery_id, set()).add(response.receipt.seq)
    assert all(len(v) == 1 for v in by_delivery.values()), "one delivery id, two seqs"
    assert sorted(min(v) for v in by_delivery.values()) == list(range(60))
    assert sum(not r.receipt.duplicate for r in responses) == 60, (
        "each delivery id has exactly one non-duplicate receipt"
    )

    events = await read_until_idle(stack, session_id, 60)
    texts = {r.receipt.seq: t for (_, t), r in zip(calls, responses, strict=True)}
    assert_each_answered_in_own_turn(events, texts)


async def test_duplicate_delivery_id_returns_first_receipt_and_runs_once(stack: Stack) -> None:
    session_id = await stack.create()
    first = await stack.send(session_id, "only once", delivery_id="webhook-42")
    again = await stack.send(session_id, "only once", delivery_id="webhook-42")
    assert not first.receipt.duplicate
    assert again.receipt.duplicate
    assert again.receipt.seq == first.receipt.seq == 0
    assert again.delivery_id == first.delivery_id == "webhook-42"

    await read_until_idle(stack, session_id, 1)
    # A repeat after the turn completed is still a repeat, even with other text.
    late = await stack.send(session_id, "different text", delivery_id="webhook-42")
    assert late.receipt.duplicate and late.receipt.seq == first.receipt.seq
    nxt = await stack.send(session_id, "next one")
    assert nxt.receipt.seq == first.receipt.seq + 1 and not nxt.receipt.duplicate

    events = await read_until_idle(stack, session_id, 2)
    assert_each_answered_in_own_turn(events, {0: "only once", 1: "next one"})
    assert [e.delivery_id for e in received(events)] == ["webhook-42", nxt.delivery_id]


async def test_duplicate_via_alias_and_session_id_is_one_delivery(stack: Stack) -> None:
    session_id = await stack.create(aliases=["thread-7"])
    by_id = await stack.send(session_id, "hi", delivery_id="dup-any-address")
    by_alias = await stack.send(alias="thread-7", text="hi", delivery_id="dup-any-address")
    assert by_alias.receipt.session_id == session_id
    assert by_alias.receipt.duplicate and by_alias.receipt.seq == by_id.receipt.seq
    events = await read_until_idle(stack, session_id, 1)
    assert_admitted_once_in_order(events, {0: "hi"})


async def test_concurrent_duplicates_are_appended_once(stack: Stack, etcd: aetcd.Client) -> None:
    session_id = await stack.create()
    responses = await asyncio.gather(
        *(stack.send(session_id, "same webhook", delivery_id="retry-storm") for _ in range(5))
    )
    assert {r.receipt.seq for r in responses} == {0}
    assert sorted(r.receipt.duplicate for r in responses) == [False, True, True, True, True]
    follow_up = await stack.send(session_id, "after the storm")
    assert follow_up.receipt.seq == 1

    keys = Keys(stack.etcd.prefix)
    assert await inbox_head(etcd, keys, session_id) == 2
    events = await read_until_idle(stack, session_id, 2)
    assert_admitted_once_in_order(events, {0: "same webhook", 1: "after the storm"})
    assert await inbox_keys(etcd, keys, session_id) == []


async def test_sequential_sends_are_processed_in_send_order(stack: Stack) -> None:
    session_id = await stack.create()
    texts = [f"step-{i} {'x' * i}" for i in range(12)]
    seqs = [(await stack.send(session_id, t)).receipt.seq for t in texts]
    assert seqs == list(range(len(texts)))
    events = await read_until_idle(stack, session_id, len(texts))
    assert [e.text for e in received(events)] == texts
    assert_admitted_once_in_order(events, dict(zip(seqs, texts, strict=True)))


def send_command(text: str, delivery_id: str) -> s.Command:
    return s.Command(
        delivery=s.DeliveryMetadata(
            delivery_id=delivery_id, channel="slack", accepted_deployment_id="dep-a"
        ),
        send=s.SendCommand(text=text, turn_policy=QUEUE),
    )


async def test_two_hooks_instances_append_gaplessly_and_dedup(
    stack: Stack, etcd: aetcd.Client
) -> None:
    """Two hooks processes on the same etcd: the inbox-head CAS, not the
    in-process group commit, has to keep seqs gapless and deliveries unique."""
    second = await create_hooks(hooks_config(stack.etcd))
    await second.start()
    stack.extra.append(second)
    clients = [
        stack.hooks_client(),
        HooksClient(stack.addr(second), security=stack.owner_security()),
    ]
    try:
        session_id = await stack.create()
        token = ids.inbox_token(session_id)
        calls = [(clients[i % 2], f"x{i}", f"two hooks {i}") for i in range(40)]
        # The same deliveries again, through the other instance.
        calls += [(clients[(i + 1) % 2], f"x{i}", f"two hooks {i}") for i in range(0, 40, 4)]
        receipts = await asyncio.gather(
            *(c.append(token, send_command(t, d), "slack") for c, d, t in calls)
        )
        seq_of_delivery: dict[str, set[int]] = {}
        for (_, d, _), r in zip(calls, receipts, strict=True):
            seq_of_delivery.setdefault(d, set()).add(r.seq)
        assert all(len(v) == 1 for v in seq_of_delivery.values())
        assert sorted(min(v) for v in seq_of_delivery.values()) == list(range(40))
        assert sum(not r.duplicate for r in receipts) == 40

        keys = Keys(stack.etcd.prefix)
        assert await inbox_head(etcd, keys, session_id) == 40
        texts = {r.seq: t for (_, _, t), r in zip(calls, receipts, strict=True)}
        events = await read_until_idle(stack, session_id, 40)
        assert_each_answered_in_own_turn(events, texts)
        assert await inbox_keys(etcd, keys, session_id) == []
    finally:
        for client in clients:
            await client.close()


async def test_a_long_backlog_streams_in_pages(stack: Stack) -> None:
    """An owner reading a backlog of 700 commands gets them in pages (no one
    message holds the whole backlog), every seq once and in order, then the
    live ones."""
    # A session whose owner never runs: nothing consumes (and so deletes)
    # its backlog while the test reads it.
    hooks = stack.hooks_client(stack.security(Role.OWNER, "dep-ghost"), timeout=10)
    try:
        ghost = s.OwnerIdentity(
            owner_run_id=ids.new_run_id(), deployment_id="dep-ghost", instance_id="ghost"
        )
        sid = ids.new_session_id()
        created = await hooks.create_session(sid, ghost, "slack", [])
        for i in range(700):
            command = s.Command(
                delivery=s.DeliveryMetadata(delivery_id=f"b{i}"),
                send=s.SendCommand(text=f"m{i}", turn_policy=s.TURN_POLICY_QUEUE),
            )
            await hooks.append(ids.inbox_token(sid), command)
        # Read as the owner does (its own run also reads; both are allowed).
        pages: list[int] = []
        seqs: list[int] = []
        stream = hooks.stream_inbox(created.fence, 0)
        async for page in stream:
            pages.append(len(page))
            seqs.extend(e.seq for e in page)
            if len(seqs) >= 700:
                break
        assert seqs == list(range(700))
        assert len(pages) > 3 and max(pages) <= 256, pages
    finally:
        await hooks.close()
