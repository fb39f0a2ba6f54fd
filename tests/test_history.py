"""Sessions without a size limit (docs/design.md §4): the model history is appended
as entries of its own by the commits that add them, the snapshot stays
bounded, what the model sees is compacted over the agent's context budget,
retired entries are deleted, a commit that can never succeed fails its turn
(and the next message is answered), and a finalized session's keys are
deleted after its retention. Real etcd, real gRPC, in-process services."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.journal import Journal
from baton_runtime.common import ids, limits
from baton_runtime.common.errors import FailedPrecondition, Reason
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.observability import metrics
from baton_runtime.common.rpc.status_map import error_reason
from tests import certs
from tests.procs import eventually
from tests.scrape import in_process
from tests.stack import SLACK, Stack, start_stack, stop_stack
from tests.test_turns import (
    ANSWERED,
    CLEARED,
    COMPACTED,
    STEP_COMPLETED,
    TURN_FAILED,
    TURN_STARTED,
    WAITING,
    follow_until,
    kinds,
    of,
    read_all,
    waits,
)

K = s.EventKind
SMALL_CONTEXT = "baton_runtime.owner.agents.fixture:build_small_context_agent"


@pytest.fixture
async def small(etcd_endpoint: str) -> AsyncIterator[Stack]:
    """A stack whose agent has a 16 KiB context budget, whose anchor deletes a
    finalized session 0.5 s after it closed."""
    stack = await start_stack(
        etcd_endpoint,
        anchor_options={"retention_seconds": 0.5, "retention_sweep_seconds": 0.2},
        agent=SMALL_CONTEXT,
    )
    try:
        yield stack
    finally:
        await stop_stack(stack)


async def snapshot(
    stack: Stack, raw: aetcd.Client, session_id: str
) -> tuple[s.SessionSnapshot, int]:
    kv = await raw.get(Keys(stack.etcd.prefix).snapshot(session_id))
    assert kv is not None
    return s.SessionSnapshot.FromString(kv.value), len(kv.value)


async def history_keys(stack: Stack, raw: aetcd.Client, session_id: str) -> list[int]:
    keys = Keys(stack.etcd.prefix)
    found = await raw.get_prefix(keys.history_prefix(session_id))
    return sorted(int(kv.key[-20:]) for kv in found)


async def history(stack: Stack, raw: aetcd.Client, session_id: str) -> list[s.ChatMessage]:
    keys = Keys(stack.etcd.prefix)
    found = await raw.get_prefix(keys.history_prefix(session_id))
    return [s.ChatMessage.FromString(kv.value) for kv in sorted(found, key=lambda kv: kv.key)]


async def converse(stack: Stack, session_id: str, texts: list[str], start: int = 0) -> int:
    """Send each text and wait for its turn to settle; returns the next seq."""
    for text in texts:
        await stack.send(session_id, text)
        events = await follow_until(stack, session_id, waits(1), start_seq=start)
        start = events[-1].seq + 1
    return start


async def test_history_is_appended_and_the_snapshot_stays_bounded(
    stack: Stack, raw: aetcd.Client
) -> None:
    sid = await stack.create()
    start = await converse(stack, sid, [f"hello {i}" for i in range(5)])
    early, early_size = await snapshot(stack, raw, sid)
    await converse(stack, sid, [f"hello {i}" for i in range(5, 60)], start)
    late, late_size = await snapshot(stack, raw, sid)
    # Nothing of the conversation is inline; the head moved by two per turn.
    assert not early.history and not late.history
    assert early.format_version == late.format_version == 2
    assert (early.history_log.next_index, late.history_log.next_index) == (10, 120)
    assert late.history_log.context_start == 0
    assert abs(late_size - early_size) <= 16, (early_size, late_size)
    entries = await history(stack, raw, sid)
    assert len(entries) == 120
    assert [(m.role, m.content) for m in entries[:2]] == [
        (s.ROLE_USER, "hello 0"),
        (s.ROLE_ASSISTANT, "echo: hello 0"),
    ]
    assert entries[-1].content == "echo: hello 59"
    assert late.history_log.context_bytes == sum(m.ByteSize() for m in entries)


@pytest.mark.parametrize("poison", ["big 300", "say 300"])
async def test_a_step_over_the_entry_limit_fails_its_turn_and_the_next_is_answered(
    stack: Stack, raw: aetcd.Client, poison: str
) -> None:
    """A tool result / an answer of 300 KiB is over the history entry limit:
    its commit can never succeed. The turn fails with the reason, nothing of
    the step is written, the command is consumed, and the run goes on."""
    sid = await stack.create()
    start = await converse(stack, sid, ["hello"])
    head_before = (await snapshot(stack, raw, sid))[0].history_log.next_index
    receipt = await stack.send(sid, poison)
    failed = await follow_until(stack, sid, waits(1), start_seq=start)
    assert kinds(failed) == ["TURN_STARTED", "TURN_FAILED", "SESSION_WAITING"]
    error = of(failed, TURN_FAILED)[0].error
    assert error.reason == "HISTORY_ENTRY_TOO_LARGE", error
    assert str(limits.MAX_HISTORY_ENTRY_BYTES) in error.message
    assert of(failed, TURN_STARTED)[0].turn_id == of(failed, TURN_FAILED)[0].turn_id
    after, _ = await snapshot(stack, raw, sid)
    assert after.history_log.next_index == head_before, "the refused step wrote history"
    assert after.inbox_next_seq == receipt.receipt.seq + 1, "the poison command was not consumed"
    assert not after.HasField("open_turn")
    await stack.send(sid, "hello again")
    answered = await follow_until(stack, sid, waits(1), start_seq=failed[-1].seq + 1)
    assert [e.text for e in of(answered, ANSWERED)] == ["echo: hello again"]
    # One run throughout: the failure did not restart it.
    everything = await read_all(stack, sid)
    assert len({e.owner_run_id for e in everything}) == 1
    assert len(of(everything, TURN_FAILED)) == 1


async def test_clear_and_compact_retire_history_and_bound_what_the_model_sees(
    stack: Stack, raw: aetcd.Client
) -> None:
    sid = await stack.create()
    start = await converse(stack, sid, [f"hello {i}" for i in range(10)])
    await stack.ingress_stub.SendControl(
        ingress_pb.SendControlRequest(session_id=sid, kind=ingress_pb.CONTROL_KIND_CLEAR),
        metadata=SLACK,
        timeout=10,
    )
    cleared = await follow_until(stack, sid, lambda ev: bool(of(ev, CLEARED)), start_seq=start)
    change = of(cleared, CLEARED)[0].context_change
    assert (change.before_entries, change.after_entries, change.after_bytes) == (20, 0, 0)
    assert change.before_bytes > 0 and not change.automatic

    async def retired() -> bool:
        return await history_keys(stack, raw, sid) == []

    await eventually(retired, "cleared history retired", 10)
    start = cleared[-1].seq + 1
    start = await converse(stack, sid, [f"again {i}" for i in range(5)], start)
    await stack.ingress_stub.SendControl(
        ingress_pb.SendControlRequest(session_id=sid, kind=ingress_pb.CONTROL_KIND_COMPACT),
        metadata=SLACK,
        timeout=10,
    )
    compacted = await follow_until(stack, sid, lambda ev: bool(of(ev, COMPACTED)), start_seq=start)
    event = of(compacted, COMPACTED)[0]
    assert event.text == "10 messages about: again 0"
    assert event.usage.model_calls == 1
    assert (event.context_change.before_entries, event.context_change.after_entries) == (10, 1)

    async def only_summary() -> bool:
        return await history_keys(stack, raw, sid) == [30]

    await eventually(only_summary, "compacted history retired", 10)
    # The model sees the summary and the new message: the fixture counts one
    # prompt token per earlier message.
    await stack.send(sid, "hello")
    answer = await follow_until(stack, sid, waits(1), start_seq=compacted[-1].seq + 1)
    step = of(answer, STEP_COMPLETED)[0]
    words = len("You are Baton's deterministic fixture agent.".split())
    assert step.usage.input_tokens == words + 1 + 1
    # The retired mark is persisted by the next commit.
    snap, _ = await snapshot(stack, raw, sid)
    assert snap.history_log.context_start == 30 and snap.history_log.retired_below == 30


async def test_the_owner_compacts_on_its_own_over_the_context_budget(
    small: Stack, raw: aetcd.Client
) -> None:
    """Turns of ~4 KiB (a 2 KiB message and its echo) against a 16 KiB
    budget: the owner compacts at turn boundaries, says so on the stream, and
    the stored history stays bounded."""
    sid = await small.create()
    start = 0
    for i in range(12):
        start = await converse(small, sid, [f"{i} " + "z" * 2048], start)
    events = await read_all(small, sid)
    automatic = [e for e in of(events, COMPACTED) if e.context_change.automatic]
    assert len(automatic) >= 2, kinds(events)
    for event in automatic:
        change = event.context_change
        assert change.before_bytes > 16 * 1024 > change.after_bytes
        assert change.after_entries == 1 and event.usage.model_calls == 1
        assert not event.error.reason
        # At a turn boundary: right after a turn settled.
        before = events[event.seq - 1]
        assert before.kind == WAITING, kinds(events[event.seq - 3 : event.seq + 1])
    snap, _ = await snapshot(small, raw, sid)
    assert snap.history_log.context_bytes <= 20 * 1024

    async def bounded() -> bool:
        kept = await history_keys(small, raw, sid)
        return kept == list(range(snap.history_log.context_start, snap.history_log.next_index))

    await eventually(bounded, "only the context is stored", 10)


async def test_retention_deletes_every_key_of_a_finalized_session(
    small: Stack, raw: aetcd.Client
) -> None:
    sid = await small.create(aliases=["keepme"])
    start = await converse(small, sid, ["hello", "calc 1+2"])
    await small.ingress_stub.SendControl(
        ingress_pb.SendControlRequest(session_id=sid, kind=ingress_pb.CONTROL_KIND_RESET),
        metadata=SLACK,
        timeout=10,
    )
    closed = await small.events(sid, start_seq=start)
    assert closed[-1].kind == K.EVENT_KIND_SESSION_COMPLETED
    keys = Keys(small.etcd.prefix)

    async def gone() -> bool:
        left = await raw.get_prefix(keys.session_prefix(sid))
        token = await raw.get(keys.token(ids.inbox_token(sid)))
        owned = await raw.get_prefix(f"{small.etcd.prefix}i/".encode())
        mine = [kv for kv in owned if kv.key.endswith(sid.encode())]
        due = await raw.get_prefix(keys.retention_prefix())
        return not left and token is None and not mine and not due

    await eventually(gone, "every key of the finalized session deleted", 15)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await small.events(sid, follow=False)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason(info.value) == "SESSION_NOT_FOUND"
    with pytest.raises(grpc.aio.AioRpcError) as sent:
        await small.send(sid, "hello?")
    assert sent.value.code() == grpc.StatusCode.NOT_FOUND


async def test_long_streams_are_read_in_pages_from_any_cursor(stack: Stack) -> None:
    """More events than one page: a reader from 0, one from the middle and a
    follower see each seq once, in order."""
    sid = await stack.create()
    start = 0
    for i in range(20):
        start = await converse(stack, sid, [f"steps {3 + i % 3}"], start)
    assert start > 4 * limits.READ_PAGE_EVENTS
    everything = await read_all(stack, sid)
    assert [e.seq for e in everything] == list(range(start))
    middle = await read_all(stack, sid, start_seq=start // 2 + 1)
    assert [e.seq for e in middle] == list(range(start // 2 + 1, start))
    await stack.send(sid, "hello")
    followed = await follow_until(stack, sid, waits(21), start_seq=0)
    assert [e.seq for e in followed] == list(range(len(followed)))
    assert of(followed, ANSWERED)[-1].text == "echo: hello"


READS = "baton_etcd_txn_seconds_count"


@pytest.mark.parametrize(
    ("entries", "context_start", "missing", "reads"),
    [
        (3, 0, None, 1),  # the context fits in the snapshot's read
        (64, 0, None, 1),  # exactly one page
        (200, 150, None, 1),  # older entries not yet retired: the newest page holds it
        (65, 0, None, 2),  # one entry more than a page: the first is read after
        (300, 20, None, 4),  # most of it paged (pages of 64, 128, 24), the newest carried
        (100, 0, 90, 4),  # a gap in the newest page: refused, never a context with a hole
        (100, 0, 10, 2),  # a gap below the newest page: refused as well
    ],
)
async def test_a_load_reads_its_exact_context_carrying_the_newest_page_in_the_snapshot_read(
    etcd_endpoint: str, entries: int, context_start: int, missing: int | None, reads: int
) -> None:
    """LoadSession's snapshot read carries the newest page of history
    entries (EtcdHistory.read_newest): a context that fits costs no second
    read, a longer one is paged up to what the page holds, and the entries
    are exactly [context start, next index) in order, or HISTORY_INCOMPLETE."""
    client = make_client(etcd_endpoint, 5, certs.etcd_security())
    await client.connect()
    keys = Keys(f"{certs.TEST_PREFIX}load/{uuid.uuid4().hex}/")
    journal = Journal(Store(client, 5), keys)
    sid = ids.new_session_id()
    try:
        snap = s.SessionSnapshot(session_id=sid)
        snap.history_log.next_index = entries
        snap.history_log.context_start = context_start
        await client.put(keys.snapshot(sid), snap.SerializeToString())
        for index in range(entries):
            if index != missing:
                entry = s.ChatMessage(role=s.ROLE_USER, content=f"entry {index}")
                await client.put(keys.history_entry(sid, index), entry.SerializeToString())
        before = in_process(metrics.ETCD_TXN_SECONDS, READS, op="txn_read")
        loaded: list[s.ChatMessage] = []

        async def load() -> None:
            async for part in journal.load(sid):
                if isinstance(part, list):
                    loaded.extend(s.ChatMessage.FromString(raw) for raw in part)

        if missing is None:
            await load()
            want = [f"entry {index}" for index in range(context_start, entries)]
            assert [entry.content for entry in loaded] == want
        else:
            with pytest.raises(FailedPrecondition) as refused:
                await load()
            assert refused.value.reason == Reason.HISTORY_INCOMPLETE
        assert in_process(metrics.ETCD_TXN_SECONDS, READS, op="txn_read") - before == reads
    finally:
        await client.close()
