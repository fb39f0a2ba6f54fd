"""A live session's per-command keys are bounded by policy, not by its age
(issue 20): consumed inbox entries (`c/in/`) are deleted by the commit that
consumed them; delivery ids (`dlv/`) and handoff records (`xfer/`) expire
after the deduplication window (`--dedupe-window`, etcd leases per time
bucket: services/hooks/expiry.py).

Real etcd, real gRPC (in-process servers); the keys are counted with etcd
range reads under the session's prefix. Takeover after kill -9 and park +
wake are checked in tests/test_recovery.py and tests/test_parking.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import NotFound, Reason
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import Keys, prefix_end
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.observability import metrics
from baton_runtime.common.security.identity import Role
from baton_runtime.hooks.expiry import ExpiryLeases, bucket_width, lease_ttl
from baton_runtime.hooks.rooms import HookRooms
from baton_runtime.hooks.server import create_server as create_hooks
from baton_runtime.ingress.rates import ChannelLimits
from tests.certs import etcd_client
from tests.procs import eventually
from tests.stack import (
    Stack,
    add_deployment,
    hooks_config,
    start_stack,
    stop_deployment,
    stop_stack,
)
from tests.test_inbox import assert_admitted_once_in_order, read_until_idle, received
from tests.test_stream_retention import below_horizon_of

WINDOW = 2.0  # seconds: a key lives between WINDOW and lease_ttl(WINDOW)
K = s.EventKind


@pytest.fixture
async def short(etcd_endpoint: str) -> AsyncIterator[Stack]:
    """A stack whose hooks remember delivery ids for WINDOW seconds."""
    running = await start_stack(etcd_endpoint, hooks_options={"dedupe_window_seconds": WINDOW})
    try:
        yield running
    finally:
        await stop_stack(running)


@pytest.fixture
async def raw(short: Stack) -> AsyncIterator[aetcd.Client]:
    client = await etcd_client(short.etcd.endpoint)
    try:
        yield client
    finally:
        await client.close()


async def count(client: aetcd.Client, stack: Stack, session_id: str, part: str) -> int:
    """Keys under `s/{sid}/{part}` (one etcd range read)."""
    prefix = Keys(stack.etcd.prefix).session_prefix(session_id) + part.encode()
    return len(await client.get_range(prefix, prefix_end(prefix)))


async def gone(
    client: aetcd.Client, stack: Stack, session_id: str, part: str, window: float = WINDOW
) -> None:
    async def empty() -> bool:
        return await count(client, stack, session_id, part) == 0

    # etcd revokes an expired lease within about a second of its TTL.
    await eventually(empty, f"{part} keys expired", timeout=lease_ttl(window) + 8)


def value(counter: object, *labels: str) -> float:
    metric = counter.labels(*labels) if labels else counter  # type: ignore[attr-defined]
    return float(metric._value.get())


async def test_a_live_sessions_inbox_and_delivery_keys_stay_bounded(
    short: Stack, raw: aetcd.Client
) -> None:
    """Rounds of short turns with delivery ids: after each, no inbox entry
    is left (every one consumed and deleted by its commit), and the delivery
    ids vanish once the window has passed; every round leaves the session
    with the keys the first left."""
    deleted_before = value(metrics.INBOX_ENTRIES_DELETED)
    rotated_before = value(metrics.DEDUPE_LEASES_GRANTED, "rotated")
    sid = await short.create()
    texts: dict[int, str] = {}
    left: list[tuple[int, int]] = []
    for round_ in range(3):
        for i in range(12):
            text = f"r{round_} m{i}"
            receipt = await short.send(
                sid, text, delivery_id=f"d-{round_}-{i}", turn_policy=s.TURN_POLICY_QUEUE
            )
            assert not receipt.receipt.duplicate
            texts[receipt.receipt.seq] = text
        await read_until_idle(short, sid, len(texts))
        assert await count(raw, short, sid, "c/in/") == 0, "a consumed inbox entry was kept"
        assert 0 < await count(raw, short, sid, "dlv/") <= 12
        await gone(raw, short, sid, "dlv/")
        left.append((await count(raw, short, sid, "c/"), await count(raw, short, sid, "dlv/")))
    assert left == [left[0]] * 3, left
    events = await short.events(sid, follow=False)
    assert_admitted_once_in_order(events, texts)
    assert value(metrics.INBOX_ENTRIES_DELETED) - deleted_before >= len(texts)
    # One lease per bucket while the replica writes keys, never one per key.
    granted = value(metrics.DEDUPE_LEASES_GRANTED, "rotated") - rotated_before
    assert 1 <= granted < len(texts)


async def test_a_long_sessions_keys_and_bytes_stay_flat_under_every_policy(
    etcd_endpoint: str,
) -> None:
    """The short version of the long test below (CI runs it): a 50-event
    horizon, a 2 s window, quiet after 80 and after 200 turns (by 80 both the
    stream and the model history have sealed a segment)."""
    await a_long_session_stays_bounded(etcd_endpoint, keep=50, window=WINDOW, points=(80, 200))


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_three_thousand_turns_keep_the_keys_and_bytes_of_three_hundred_slow(
    etcd_endpoint: str,
) -> None:
    """Issue 20's long test: `--stream-retention-events 200 --dedupe-window
    5`, quiet after 300 and after 3,000 short turns."""
    await a_long_session_stays_bounded(etcd_endpoint, keep=200, window=5.0, points=(300, 3000))


async def a_long_session_stays_bounded(
    etcd_endpoint: str, *, keep: int, window: float, points: tuple[int, int]
) -> None:
    """Everything a live session keeps is set by policy: a stream horizon of
    `keep` events, a dedupe window of `window` seconds, a 16 KiB context
    budget. Quiet after each of `points` short turns (each with a delivery
    id), the session holds the same keys and, within a constant, the same
    bytes, but for the model history, which the context budget bounds in
    bytes. At the end: a read from 0 answers OUT_OF_RANGE naming the earliest
    seq kept, reading from there is gapless to the head, and a repeated
    delivery id is a duplicate inside the window and a new command after it."""
    running = await start_stack(
        etcd_endpoint,
        anchor_options={
            "stream_retention_events": keep,
            "stream_retention_seconds": 0.0,
            "retention_sweep_seconds": 0.2,
        },
        hooks_options={"dedupe_window_seconds": window},
        agent="baton_runtime.owner.agents.fixture:build_small_context_agent",
        # Storage is measured here, not the channel's send budget: 3,000
        # short turns back to back outrun 200 sends a second.
        limits=ChannelLimits(sends_per_second=0),
    )
    client = await etcd_client(running.etcd.endpoint)
    try:
        sid = await running.create()
        prefix = Keys(running.etcd.prefix).session_prefix(sid)
        sent = 0
        sizes: list[tuple[int, int]] = []
        shapes: list[dict[str, int]] = []

        async def snapshot() -> s.SessionSnapshot | None:
            raw = await client.get(prefix + b"snap")
            return s.SessionSnapshot.FromString(raw.value) if raw else None

        async def settled(n: int) -> None:
            async def done() -> bool:
                snap = await snapshot()
                return (
                    snap is not None and snap.inbox_next_seq == n and not snap.HasField("open_turn")
                )

            await eventually(done, f"{n} turns settled", timeout=30 + n / 20)

        for target in points:
            while sent < target:
                await running.send(
                    sid, f"turn {sent}", delivery_id=f"t-{sent}", turn_policy=s.TURN_POLICY_QUEUE
                )
                sent += 1
            await settled(sent)
            await gone(client, running, sid, "dlv/", window)

            async def trimmed() -> bool:
                kept = await client.get_range(*_range(prefix + b"ev/"))
                return len(kept) <= keep

            await eventually(trimmed, "the stream trimmed to its horizon", timeout=10)

            async def sealed_once() -> bool:
                # Each log's segment index is one key, put when the log first
                # seals (the history at 128 entries): from then on it stays.
                indexes = [await client.get(prefix + b"sg/" + log) for log in (b"ev", b"h")]
                return all(indexes)

            await eventually(sealed_once, "both logs sealed into the object store", timeout=10)
            kvs = await client.get_range(*_range(prefix))
            history = await client.get_range(*_range(prefix + b"h/"))
            history_bytes = sum(len(kv.value) for kv in history)
            # The model history's bytes are bounded by the context budget.
            assert history_bytes <= 17 * 1024, history_bytes
            # The stream's events in etcd: at most the horizon's (the rest are
            # sealed into the object store, so how many of the kept events
            # are still in etcd depends on where the last segment ended).
            events = await client.get_range(*_range(prefix + b"ev/"))
            assert len(events) <= keep, len(events)
            assert sum(len(kv.value) for kv in events) <= keep * 512
            logs = len(history) + len(events)
            log_bytes = history_bytes + sum(len(kv.value) for kv in events)
            sizes.append((len(kvs) - logs, sum(len(kv.value) for kv in kvs) - log_bytes))
            shapes.append(_kinds(kvs, prefix))
            assert await count(client, running, sid, "c/in/") == 0
        (keys_early, bytes_early), (keys_late, bytes_late) = sizes
        # The same keys, but for the logs bounded above: one of each singleton
        # kind, and the pages that date the stream's events (50 events lie on
        # one 64-seq page or two, so a page key comes and goes with the
        # alignment).
        early, late = shapes
        pages = keep // 64 + 2
        fixed = [
            {k: n for k, n in kinds.items() if k not in ("pg/", "h/", "ev/")} for kinds in shapes
        ]
        assert fixed[0] == fixed[1], shapes
        assert late.get("pg/", 0) <= pages and early.get("pg/", 0) <= pages, shapes
        assert abs(keys_late - keys_early) <= pages, sizes
        # Seqs, counters and turn numbers grew digits (and varint bytes): a
        # few bytes.
        assert abs(bytes_late - bytes_early) <= 256 + 4 * keep, sizes

        # The stream: below the horizon a reader is told where it starts,
        # from there it is gapless to the head.
        snap = await snapshot()
        assert snap is not None
        head = snap.next_event_seq
        with pytest.raises(grpc.aio.AioRpcError) as below:
            await running.events(sid, start_seq=0, follow=False)
        earliest = below_horizon_of(below.value)
        assert head - keep <= earliest < head
        kept = await running.events(sid, start_seq=earliest, follow=False)
        assert [e.seq for e in kept] == list(range(earliest, head))

        # A delivery id: a duplicate inside the window, a new command after it.
        first = (await running.send(sid, "again", delivery_id="repeat")).receipt
        repeat = (await running.send(sid, "again", delivery_id="repeat")).receipt
        assert not first.duplicate and repeat.duplicate and repeat.seq == first.seq
        await settled(sent + 1)
        await gone(client, running, sid, "dlv/", window)
        later = (await running.send(sid, "again", delivery_id="repeat")).receipt
        assert not later.duplicate and later.seq == first.seq + 1
        await settled(sent + 2)
        tail = await running.events(sid, start_seq=head, follow=False)
        assert [(e.inbox_seq, e.delivery_id) for e in received(tail)] == [
            (first.seq, "repeat"),
            (later.seq, "repeat"),
        ]
    finally:
        await client.close()
        await stop_stack(running)


def _kinds(kvs: list, prefix: bytes) -> dict[str, int]:
    """How many keys of each kind (the name without its seq) a session holds."""
    kinds: dict[str, int] = {}
    for kv in kvs:
        name = kv.key[len(prefix) :].decode()
        head, _, tail = name.rpartition("/")
        kind = head + "/" if tail.isdigit() else name
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _range(prefix: bytes) -> tuple[bytes, bytes]:
    return prefix, prefix_end(prefix)


async def test_a_repeat_inside_the_window_is_a_duplicate_and_after_it_a_new_command(
    short: Stack, raw: aetcd.Client
) -> None:
    sid = await short.create()
    first = (await short.send(sid, "webhook", delivery_id="gw-1")).receipt
    again = (await short.send(sid, "webhook", delivery_id="gw-1")).receipt
    assert again.duplicate and again.seq == first.seq
    await read_until_idle(short, sid, 1)
    await gone(raw, short, sid, "dlv/")
    later = (await short.send(sid, "webhook", delivery_id="gw-1")).receipt
    assert not later.duplicate and later.seq == first.seq + 1
    events = await read_until_idle(short, sid, 2)
    assert [(e.inbox_seq, e.delivery_id) for e in received(events)] == [
        (first.seq, "gw-1"),
        (later.seq, "gw-1"),
    ]
    assert await count(raw, short, sid, "c/in/") == 0


async def test_a_delivery_id_repeated_through_two_replicas_and_a_restart_is_appended_once(
    stack: Stack, etcd: aetcd.Client
) -> None:
    """Inside the window a repeat is a duplicate whichever replica it
    reaches, also one started after the first append (a restarted replica
    has no lease or cache of its predecessor's: the key is etcd's)."""
    window = {"dedupe_window_seconds": 600.0}
    replicas = []
    for _ in range(2):
        server = await create_hooks(hooks_config(stack.etcd, stack.pki, **window))
        await server.start()
        stack.extra.append(server)
        replicas.append(server)
    ghost_security = stack.security(Role.OWNER, "dep-ghost")
    one, two = (HooksClient(stack.addr(h), security=ghost_security) for h in replicas)
    try:
        ghost = s.OwnerIdentity(
            owner_run_id=ids.new_run_id(), deployment_id="dep-ghost", instance_id="ghost"
        )
        sid = ids.new_session_id()
        await one.create_session(sid, ghost, "slack", [])
        token = ids.inbox_token(sid)

        def command(i: int) -> s.Command:
            return s.Command(
                delivery=s.DeliveryMetadata(delivery_id=f"twice-{i}"),
                send=s.SendCommand(text=f"m{i}", turn_policy=s.TURN_POLICY_QUEUE),
            )

        receipts = await asyncio.gather(
            *(client.append(token, command(i)) for i in range(20) for client in (one, two))
        )
        seqs = {}
        for i in range(20):
            a, b = receipts[2 * i], receipts[2 * i + 1]
            assert a.seq == b.seq and sorted([a.duplicate, b.duplicate]) == [False, True]
            seqs[i] = a.seq
        assert sorted(seqs.values()) == list(range(20))
        await one.close()
        await replicas[0].stop(grace=0.5)  # the first replica goes away ...
        restarted = await create_hooks(hooks_config(stack.etcd, stack.pki, **window))
        await restarted.start()  # ... and a new one starts
        stack.extra.append(restarted)
        three = HooksClient(stack.addr(restarted), security=ghost_security)
        try:
            for i in range(20):
                again = await three.append(token, command(i))
                assert again.duplicate and again.seq == seqs[i]
        finally:
            await three.close()
        head = await etcd.get(Keys(stack.etcd.prefix).inbox_head(sid))
        assert head is not None and int(head.value) == 20
    finally:
        await two.close()


async def test_a_handoff_record_expires_with_the_window(short: Stack, raw: aetcd.Client) -> None:
    """After a handoff, GetTransfer answers from the record for the window;
    then NOT_FOUND (TRANSFER_NOT_FOUND), and the session goes on."""
    b = await add_deployment(short, "dep-b")
    hooks = short.hooks_client(timeout=5)
    try:

        async def ready() -> bool:
            return bool(await hooks.list_instances("dep-b"))

        await eventually(ready, "dep-b registered", 15)
        sid = await short.create()
        await short.send(sid, "hello")
        await read_until_idle(short, sid, 1)
        moved = await b.send(sid, "whoami")
        events = await read_until_idle(short, sid, 2)
        handed = [e for e in events if e.kind == K.EVENT_KIND_SESSION_HANDED_OFF]
        assert len(handed) == 1 and handed[0].deployment_id == "dep-b"
        assert received(events)[-1].inbox_seq == moved.receipt.seq
        found = await hooks.get_transfer(sid, handed[0].handoff_id)
        assert found.successor.deployment_id == "dep-b"
        assert await count(raw, short, sid, "c/in/") == 0
        await gone(raw, short, sid, "xfer/")
        with pytest.raises(NotFound) as refused:
            await hooks.get_transfer(sid, handed[0].handoff_id)
        assert refused.value.reason == Reason.TRANSFER_NOT_FOUND
        await b.send(sid, "still here")
        after = await read_until_idle(short, sid, 3)
        assert received(after)[-1].text == "still here"
        assert {e.deployment_id for e in after[len(events) :]} == {"dep-b"}
    finally:
        await hooks.close()
        await stop_deployment(b)


async def test_a_lease_etcd_forgot_is_granted_anew_and_nothing_is_lost(
    short: Stack, raw: aetcd.Client
) -> None:
    """An operator revokes the replica's current lease (or etcd lost it with
    a restored backup): the next append naming it fails with LeaseNotFound
    inside hooks, which grants a new lease and appends once."""
    rooms = short.hooks.app
    assert isinstance(rooms, HookRooms)
    missing_before = value(metrics.DEDUPE_LEASES_GRANTED, "missing")
    sid = await short.create()
    first = (await short.send(sid, "one", delivery_id="lease-1")).receipt
    await raw.revoke_lease(await rooms.leases.current())
    second = (await short.send(sid, "two", delivery_id="lease-2")).receipt
    assert not second.duplicate and second.seq == first.seq + 1
    assert value(metrics.DEDUPE_LEASES_GRANTED, "missing") == missing_before + 1
    again = (await short.send(sid, "two", delivery_id="lease-2")).receipt
    assert again.duplicate and again.seq == second.seq
    events = await read_until_idle(short, sid, 2)
    assert_admitted_once_in_order(events, {first.seq: "one", second.seq: "two"})


async def test_one_lease_per_bucket_by_the_monotonic_clock(stack: Stack) -> None:
    """A replica's keys share its current lease until a bucket width has
    passed on its monotonic clock; the appenders that need one at a bucket
    change cause one grant; a forgotten lease is replaced."""
    config = stack.etcd
    store = Store(make_client(config.endpoint, config.timeout, config.security), config.timeout)
    await store.connect()
    now = [1000.0]
    leases = ExpiryLeases(store, 16.0, clock=lambda: now[0])  # buckets of 1 s, TTL 18 s
    try:
        first = await leases.current()
        now[0] += 0.9
        assert await leases.current() == first
        now[0] += 0.1
        at_once = await asyncio.gather(*(leases.current() for _ in range(20)))
        assert len(set(at_once)) == 1 and at_once[0] != first
        leases.forget(first)  # not the current one: nothing changes
        assert await leases.current() == at_once[0]
        leases.forget(at_once[0])
        assert await leases.current() not in (first, at_once[0])
        assert leases.ttl == 18
    finally:
        await store.close()


def test_the_window_sets_the_bucket_width_and_the_lease_ttl() -> None:
    assert bucket_width(86_400) == 5_400 and lease_ttl(86_400) == 86_400 + 2 * 5_400
    assert bucket_width(2) == 1.0 and lease_ttl(2) == 4
