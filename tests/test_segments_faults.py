"""Sealing under kill -9 (issue 34): real processes, a file:// object store.

An anchor killed at each step of sealing (before its object is written,
after it, after the transaction that records it) loses and duplicates
nothing: restarted, it seals on from what etcd says, every event reads back
once and in order, and an object it wrote and never recorded is collected
by the sweep after the grace period. An owner killed while its session's
context is sealed: the instance that takes it over gives the model the same
context."""

from __future__ import annotations

import functools
from pathlib import Path

import aetcd
import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.segments import index as ix
from baton_runtime.anchor.segments.format import LOG_NAMES, ObjectNames
from baton_runtime.common.etcd.keys import Keys
from tests.certs import etcd_client
from tests.procs import ProcessStack, StackClients, answered, check_history, eventually

GRACE = "2"


async def referenced(raw: aetcd.Client, keys: Keys, sid: str) -> set[str]:
    """The object paths the session's indexes name (no directories here:
    a short session)."""
    names = ObjectNames.of(keys.root)
    paths: set[str] = set()
    for log, name in LOG_NAMES.items():
        kv = await raw.get(keys.segment_index(sid, name))
        index = ix.parse_index(kv.value if kv is not None else None)
        assert not index.HasField("directory")
        paths.update(names.segment(sid, log, ref) for ref in ix.live(index.recent, 0))
    return paths


def stored(stack: ProcessStack, keys: Keys, sid: str) -> set[str]:
    """The object paths in the stack's file:// store under the session."""
    root = stack.workdir / "objects"
    top = root / ObjectNames.of(keys.root).session_prefix(sid)
    return {str(p.relative_to(root)) for p in top.rglob("*") if p.is_file()}


class Conversation:
    """Turns through a ProcessStack's ingress, each read to its end."""

    def __init__(self, clients: StackClients, sid: str) -> None:
        self.clients = clients
        self.sid = sid
        self.seen: list[s.Event] = []
        self.receipts: list[int] = []

    async def _answered(self, seq: int) -> list[s.Event] | None:
        start = self.seen[-1].seq + 1 if self.seen else 0
        got = [e async for page in self.clients.anchor.read_events(self.sid, start) for e in page]
        return got if answered(self.seen + got, seq + 1) else None

    async def turns(self, count: int, timeout: float = 30.0) -> None:
        for _ in range(count):
            seq = (await self.clients.send(self.sid, f"turn {len(self.receipts)}")).receipt.seq
            self.receipts.append(seq)
            self.seen.extend(
                await eventually(functools.partial(self._answered, seq), f"seq {seq}", timeout)
            )

    async def prompt_tokens(self, text: str, timeout: float = 30.0) -> int:
        """One turn; the model call's prompt tokens (one per earlier message)."""
        seq = (await self.clients.send(self.sid, text)).receipt.seq
        self.receipts.append(seq)
        got = await eventually(functools.partial(self._answered, seq), f"seq {seq}", timeout)
        self.seen.extend(got)
        steps = [e for e in got if e.kind == s.EVENT_KIND_STEP_COMPLETED]
        return steps[-1].usage.input_tokens


async def sealed_whole(raw: aetcd.Client, keys: Keys, sid: str, head: int) -> None:
    """Both tails sealed: the stream's but its last event, the history's all."""

    async def probe() -> bool:
        events = await raw.get_prefix(keys.events_prefix(sid))
        entries = await raw.get_prefix(keys.history_prefix(sid))
        kv = await raw.get(keys.segment_index(sid, "ev"))
        index = ix.parse_index(kv.value if kv is not None else None)
        return len(events) == 1 and not entries and index.sealed_below == head - 1

    await eventually(probe, "both tails sealed", timeout=30)


@pytest.mark.parametrize("point", ["seal.before_put", "seal.after_put", "seal.after_txn"])
async def test_a_kill_at_each_step_of_sealing_loses_and_duplicates_nothing(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack], point: str
) -> None:
    fast = {
        "BATON_SEAL_IDLE": "0.3",
        "BATON_OBJECT_ORPHAN_GRACE": GRACE,
        "BATON_RETENTION_SWEEP": "0.2",
    }
    stack = ProcessStack(
        etcd_endpoint, tmp_path, anchor_env={**fast, "BATON_FAILPOINTS": f"{point}=kill"}
    )
    stacks.append(stack)
    stack.start(owners=1)
    clients = stack.clients()
    raw = await etcd_client(etcd_endpoint)
    keys = Keys(stack.prefix)
    try:
        await clients.wait_registered("o1")
        sid = await clients.create()
        talk = Conversation(clients, sid)
        await talk.turns(3)
        before_kill = list(talk.seen)
        # Quiet for 0.3 s, the session's tails are sealed: anchor dies there.
        assert stack.anchor is not None and stack.anchor.proc is not None
        anchor = stack.anchor.proc

        async def died() -> bool:
            return anchor.poll() is not None

        await eventually(died, f"anchor killed at {point}", timeout=20)
        left = stored(stack, keys, sid)
        if point == "seal.before_put":
            assert not left
        else:
            assert left, "the object was written before the kill"
        stack.restart_anchor({"BATON_FAILPOINTS": ""})
        await talk.turns(3)
        head = talk.seen[-1].seq + 1
        await sealed_whole(raw, keys, sid, head)
        # Every event once, in order, the same as read before the kill.
        events = await clients.events(sid)
        check_history(events, talk.receipts)
        assert [e.SerializeToString() for e in events[: len(before_kill)]] == [
            e.SerializeToString() for e in before_kill
        ]
        assert [e.SerializeToString() for e in events] == [e.SerializeToString() for e in talk.seen]
        # What was written and never recorded is collected; nothing else.
        recorded = await referenced(raw, keys, sid)

        async def only_recorded() -> bool:
            return stored(stack, keys, sid) == recorded

        await eventually(only_recorded, "the orphan swept, the recorded objects kept", 20)
        if point == "seal.after_put":
            assert left - recorded, "the kill left an object no index names"
    finally:
        await clients.close()
        await raw.close()


async def test_a_takeover_after_kill_gives_the_model_the_sealed_context(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    stack = ProcessStack(etcd_endpoint, tmp_path, anchor_env={"BATON_SEAL_IDLE": "0.3"})
    stacks.append(stack)
    stack.start(owners=2)
    clients = stack.clients()
    raw = await etcd_client(etcd_endpoint)
    keys = Keys(stack.prefix)
    try:
        await clients.wait_registered("o1", "o2")
        sid = await clients.create()
        talk = Conversation(clients, sid)
        await talk.turns(12)
        before = await talk.prompt_tokens("turn 12")
        await sealed_whole(raw, keys, sid, talk.seen[-1].seq + 1)
        first = await clients.owner_of(sid)
        stack.kill(first)
        after = await talk.prompt_tokens("turn 13", timeout=60)
        assert await clients.owner_of(sid) not in ("", first)
        assert after == before + 2, (before, after)
        check_history(await clients.events(sid), talk.receipts)
    finally:
        await clients.close()
        await raw.close()
