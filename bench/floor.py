"""The etcd floor of a one-step turn: the two fenced transactions a turn
needs (the inbox append and the fenced commit of 7 events, the snapshot and
2 history entries), shaped like the ones in services/hooks/inbox.py and
services/anchor/journal.py, run from the bench process with aetcd; back to
back, with the watches in between (the "one-step turn floor" of
docs/etcd.md), at a given snapshot size, and many sessions at once."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import Keys, TokenRecord, fence_value
from baton_runtime.common.etcd.ops import (
    cmp_absent,
    cmp_present,
    cmp_value,
    op_get,
    op_put,
    single_value,
)
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.watch import create_watch
from baton_runtime.common.security.tls import Security
from bench.measure import Dist
from bench.stack import BENCH_PREFIX, CHANNEL, DEPLOYMENT_ID

FLOOR_SESSION = "ses_" + "f" * 26
FLOOR_RUN = "run_floorbench"
EVENTS_PER_TURN = 7


# The events of a one-step echo turn, in the order its commits write them.
ONE_STEP_KINDS = (
    s.EVENT_KIND_TURN_STARTED,
    s.EVENT_KIND_MESSAGE_RECEIVED,
    s.EVENT_KIND_STEP_STARTED,
    s.EVENT_KIND_MESSAGE_COMPLETED,
    s.EVENT_KIND_STEP_COMPLETED,
    s.EVENT_KIND_TURN_COMPLETED,
    s.EVENT_KIND_SESSION_WAITING,
)


def _now() -> Any:
    from google.protobuf.timestamp_pb2 import Timestamp

    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


def turn_payloads(
    session_id: str, snapshot_bytes: int
) -> tuple[bytes, list[bytes], bytes, list[bytes]]:
    """An inbox entry, 7 events, a snapshot and the 2 history entries of a
    one-step turn, as the services build them (snapshot format 2: the history
    is appended as entries of its own; `snapshot_bytes` pads the snapshot's
    agent state to model a larger bounded state)."""
    delivery_id = "dlv_" + "x" * 26
    command = s.Command(
        delivery=s.DeliveryMetadata(
            delivery_id=delivery_id, channel=CHANNEL, accepted_deployment_id=DEPLOYMENT_ID
        ),
        send=s.SendCommand(text="bench turn 123", turn_policy=s.TURN_POLICY_STEER),
    )
    entry = s.InboxEntry(seq=123, command=command, accepted_at=_now()).SerializeToString()
    events = []
    for seq, kind in enumerate(ONE_STEP_KINDS, start=1000):
        event = s.Event(
            session_id=session_id,
            seq=seq,
            kind=kind,
            time=_now(),
            turn_id="turn_123",
            step=1,
            owner_run_id="run_" + "r" * 26,
            deployment_id=DEPLOYMENT_ID,
            inbox_seq=123,
            delivery_id=delivery_id,
            text="echo: bench turn 123",
            usage=s.Usage(input_tokens=40, output_tokens=4, model_calls=1),
        )
        events.append(event.SerializeToString())
    snapshot = s.SessionSnapshot(
        format_version=2,
        session_id=session_id,
        channel=CHANNEL,
        deployment_id=DEPLOYMENT_ID,
        next_event_seq=1007,
        inbox_next_seq=124,
        turn_count=123,
        hooks=[f"session:{session_id}"],
        status=s.SESSION_STATUS_ACTIVE,
        history_log=s.HistoryLog(next_index=246, context_bytes=5000),
    )
    padding = snapshot_bytes - snapshot.ByteSize()
    if padding > 0:
        snapshot.agent_state["padding"] = "p" * padding
    history = [
        s.ChatMessage(role=s.ROLE_USER, content="bench turn 123").SerializeToString(),
        s.ChatMessage(role=s.ROLE_ASSISTANT, content="echo: bench turn 123").SerializeToString(),
    ]
    return entry, events, snapshot.SerializeToString(), history


class FloorSession:
    """One session's keys on etcd, driven with the txn shapes the services use."""

    def __init__(self, store: Store, keys: Keys, session_id: str, snapshot_bytes: int) -> None:
        self.store = store
        self.keys = keys
        self.sid = session_id
        self.entry, self.events, self.snapshot, self.history = turn_payloads(
            session_id, snapshot_bytes
        )
        self.fence = fence_value(1, FLOOR_RUN)
        self.token = f"session:{session_id}"
        self.token_value = TokenRecord(session_id=session_id, channel=CHANNEL).encode()
        self.head = 0
        self.next_event = 1
        self.next_entry = 0

    async def setup(self) -> None:
        k, sid = self.keys, self.sid
        await self.store.txn(
            [],
            [
                op_put(k.fence(sid), self.fence),
                op_put(k.inbox_head(sid), b"0"),
                op_put(k.token(self.token), self.token_value),
                op_put(k.owner(sid), b'{"owner_run_id":"' + FLOOR_RUN.encode() + b'"}'),
                op_put(k.event(sid, 0), self.events[0]),
            ],
        )

    async def append(self) -> None:
        """services/hooks/inbox.py Inbox._commit_batch for one command."""
        k, sid, head = self.keys, self.sid, self.head
        delivery = f"dlv_floor_{head}"
        response = await self.store.txn(
            [
                cmp_value(k.inbox_head(sid), str(head).encode()),
                cmp_absent(k.closed(sid)),
                cmp_value(k.token(self.token), self.token_value),
                cmp_absent(k.delivery(sid, delivery)),
            ],
            [
                op_put(k.inbox_entry(sid, head), self.entry),
                op_put(k.delivery(sid, delivery), str(head).encode()),
                op_put(k.inbox_head(sid), str(head + 1).encode()),
                op_get(k.owner(sid)),
            ],
            [
                op_get(k.inbox_head(sid)),
                op_get(k.closed(sid)),
                op_get(k.owner(sid)),
                op_get(k.token(self.token)),
                op_get(k.delivery(sid, delivery)),
            ],
        )
        if not response.succeeded:
            raise RuntimeError("floor append failed its compare")
        self.head = head + 1

    async def commit(self) -> None:
        """services/anchor/journal.py commit: 7 events + 2 history entries + snapshot."""
        k, sid, first, index = self.keys, self.sid, self.next_event, self.next_entry
        response = await self.store.txn(
            [
                cmp_value(k.fence(sid), self.fence),
                cmp_absent(k.closed(sid)),
                cmp_absent(k.event(sid, first)),
                cmp_present(k.event(sid, first - 1)),
            ],
            [op_put(k.snapshot(sid), self.snapshot)]
            + [op_put(k.event(sid, first + i), raw) for i, raw in enumerate(self.events)]
            + [op_put(k.history_entry(sid, index + i), raw) for i, raw in enumerate(self.history)]
            + [op_put(k.commit_marker(sid), str(first + len(self.events) - 1).encode())],
            [
                op_get(k.fence(sid)),
                op_get(k.closed(sid)),
                op_get(k.snapshot(sid)),
                op_get(k.event(sid, first)),
            ],
        )
        if not response.succeeded:
            raise RuntimeError("floor commit failed its compare")
        self.next_event = first + len(self.events)
        self.next_entry = index + len(self.history)


async def measure_floor(
    endpoint: str, iterations: int, warmup: int, snapshot_bytes: int, security: Security
) -> dict[str, Any]:
    """Sequential append+commit txns; then the same with watches in between."""
    keys = Keys(f"{BENCH_PREFIX}floor/{uuid.uuid4().hex[:12]}/")
    store = Store(make_client(endpoint, 5.0, security), 5.0)
    await store.connect()
    try:
        session = FloorSession(store, keys, FLOOR_SESSION, snapshot_bytes)
        await session.setup()
        append, commit, both = Dist(), Dist(), Dist()
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            await session.append()
            t1 = time.perf_counter()
            await session.commit()
            t2 = time.perf_counter()
            if i >= warmup:
                append.samples.append(t1 - t0)
                commit.samples.append(t2 - t1)
                both.samples.append(t2 - t0)
        pipeline = await _floor_pipeline(
            endpoint, keys, iterations, warmup, snapshot_bytes, security
        )
        return {
            "sizes_bytes": {
                "inbox_entry": len(session.entry),
                "event_avg": round(sum(map(len, session.events)) / len(session.events)),
                "snapshot": len(session.snapshot),
            },
            "append": append,
            "commit": commit,
            "two_txns": both,
            "pipeline": pipeline,
        }
    finally:
        await store.close()


async def _floor_pipeline(
    endpoint: str,
    keys: Keys,
    iterations: int,
    warmup: int,
    snapshot_bytes: int,
    security: Security,
) -> Dist:
    """append -> inbox watch sees it -> fenced commit -> events watch sees the last event.

    Two clients, like hooks (append, inbox watch) and anchor (commit, events watch)."""
    sid = "ses_" + "p" * 26
    hooks_store = Store(make_client(endpoint, 5.0, security), 5.0)
    anchor_store = Store(make_client(endpoint, 5.0, security), 5.0)
    await hooks_store.connect()
    await anchor_store.connect()
    inbox_seen: asyncio.Queue[bytes] = asyncio.Queue()
    events_seen: asyncio.Queue[bytes] = asyncio.Queue()
    appender = FloorSession(hooks_store, keys, sid, snapshot_bytes)
    committer = FloorSession(anchor_store, keys, sid, snapshot_bytes)
    await appender.setup()
    watches: list[Any] = []
    both_started = asyncio.Event()

    async def pump(store: Store, prefix: bytes, out: asyncio.Queue[bytes]) -> None:
        watch = await create_watch(store.client, prefix)
        watches.append(watch)
        if len(watches) == 2:
            both_started.set()
        async for event in watch:
            out.put_nowait(event.kv.key)

    tasks = [
        asyncio.create_task(pump(hooks_store, keys.control_prefix(sid), inbox_seen)),
        asyncio.create_task(pump(anchor_store, keys.events_prefix(sid), events_seen)),
    ]
    try:
        await asyncio.wait_for(both_started.wait(), 10)
        await asyncio.sleep(0.1)
        dist = Dist()
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            entry_key = keys.inbox_entry(sid, appender.head)
            await appender.append()
            while await inbox_seen.get() != entry_key:
                pass
            last_key = keys.event(sid, committer.next_event + EVENTS_PER_TURN - 1)
            await committer.commit()
            while await events_seen.get() != last_key:
                pass
            if i >= warmup:
                dist.samples.append(time.perf_counter() - t0)
        return dist
    finally:
        for watch in watches:
            with contextlib.suppress(Exception):
                await watch.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await hooks_store.close()
        await anchor_store.close()


async def commit_floor_at(
    endpoint: str, iterations: int, warmup: int, snapshot_bytes: int, security: Security
) -> Dist:
    """The fenced commit alone with a snapshot of the given size."""
    keys = Keys(f"{BENCH_PREFIX}floor/{uuid.uuid4().hex[:12]}/")
    store = Store(make_client(endpoint, 5.0, security), 5.0)
    await store.connect()
    try:
        session = FloorSession(store, keys, "ses_" + "g" * 26, snapshot_bytes)
        await session.setup()
        dist = Dist()
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            await session.commit()
            if i >= warmup:
                dist.samples.append(time.perf_counter() - t0)
        return dist
    finally:
        await store.close()


async def measure_floor_throughput(
    endpoint: str, sessions: int, total: int, snapshot_bytes: int, security: Security
) -> dict[str, Any]:
    """etcd alone: `sessions` concurrent append+commit pairs over one client, no watches."""
    keys = Keys(f"{BENCH_PREFIX}floor/{uuid.uuid4().hex[:12]}/")
    store = Store(make_client(endpoint, 5.0, security), 5.0)
    await store.connect()
    try:
        floor_sessions = [
            FloorSession(store, keys, "ses_" + str(n).zfill(26), snapshot_bytes)
            for n in range(sessions)
        ]
        await asyncio.gather(*(f.setup() for f in floor_sessions))
        shares = [total // sessions + (1 if n < total % sessions else 0) for n in range(sessions)]

        async def worker(session: FloorSession, count: int) -> None:
            for _ in range(count):
                await session.append()
                await session.commit()

        await asyncio.gather(*(worker(f, 2) for f in floor_sessions))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker(f, c) for f, c in zip(floor_sessions, shares, strict=True)))
        elapsed = time.perf_counter() - start
        return {
            "sessions": sessions,
            "pairs": total,
            "elapsed_s": elapsed,
            "pairs_per_s": total / elapsed,
        }
    finally:
        await store.close()


async def snapshot_size(endpoint: str, prefix: str, session_id: str, security: Security) -> int:
    store = Store(make_client(endpoint, 5.0, security), 5.0)
    await store.connect()
    try:
        response = await store.txn([], [op_get(Keys(prefix).snapshot(session_id))])
        value = single_value(response.responses[0])
        return len(value) if value else 0
    finally:
        await store.close()
