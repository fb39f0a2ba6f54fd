"""Recovery that scales with the active sessions (issue 21), real processes.

After kill -9 of an owner holding many parked sessions, a successor claims
the active ones first (mid-turn, or parked with input that arrived while no
owner was live) and the quiet parked ones lazily: a paced sweep, and at once
a parked one woken by a message (its bell rings under the dead instance the
owner record still names). Every claim is the fenced takeover (epoch + 1,
first compare-and-swap wins): each session has one owner, each command is
answered once. A successor killed mid-sweep leaves the rest to the next one.

Deterministic: the failpoint `fleet.swept=sleep(...)` stalls each sweep
worker after its first claim, so the parked sessions left under the dead
instance are known while the wake path is tested.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.host.sweep import SWEEP_CONCURRENCY
from tests.procs import ProcessStack, StackClients, answered, check_history, eventually
from tests.scrape import scrape

K = s.EventKind
PARKED = 200
# Each sweep worker stalls after its first claim (for the test's lifetime).
STALL_SWEEP = "fleet.swept=sleep(3600000)"


@pytest.fixture
def stack(etcd_endpoint: str, tmp_path: Path) -> Iterator[ProcessStack]:
    stack = ProcessStack(etcd_endpoint, tmp_path, park_after=0.3, serve_metrics=True)
    try:
        yield stack.start(owners=1)
    finally:
        stack.stop()


def step_committed(step: int) -> Callable[[list[s.Event]], bool]:
    return lambda events: any(
        e.kind == K.EVENT_KIND_STEP_COMPLETED and e.step == step for e in events
    )


async def listed(c: StackClients, instance_id: str) -> dict[str, bool]:
    """The sessions indexed under `instance_id`: session id -> parked."""
    owned = await c.hooks.list_instance_sessions(c.stack.deployment_id, instance_id)
    return {o.fence.session_id: o.parked for o in owned}


async def create_many(c: StackClients, count: int) -> list[str]:
    created: list[str] = []
    for start in range(0, count, 20):
        created += await asyncio.gather(*(c.create() for _ in range(min(20, count - start))))
    return created


async def answer_all(
    c: StackClients, receipts: dict[str, list[int]], what: str
) -> dict[str, list[s.Event]]:
    histories = {}
    for sid, seqs in receipts.items():
        histories[sid] = await c.wait_events(
            sid, functools.partial(answered, count=len(seqs)), what, timeout=60
        )
        check_history(histories[sid], seqs)
    return histories


async def metric(c: StackClients, instance_id: str, name: str, **labels: str) -> float:
    return (await scrape(c.stack.metrics_url(instance_id))).total(name, **labels)


async def test_active_sessions_first_parked_ones_lazily_and_a_woken_one_once(
    stack: ProcessStack,
) -> None:
    c = stack.clients()
    try:
        await c.wait_registered("o1")
        sids = await create_many(c, PARKED + 5)
        busy, sent_while_dead, parked = sids[:3], sids[3:5], sids[5:]

        async def all_parked_on_o1() -> bool:
            now = await listed(c, "o1")
            return len(now) == len(sids) and all(now.values())

        await eventually(all_parked_on_o1, "every session parked on o1", 60)
        receipts: dict[str, list[int]] = {sid: [] for sid in sids}
        for sid in busy:
            receipts[sid].append((await c.send(sid, "sleep 3 300")).receipt.seq)
        for sid in busy:
            await c.wait_events(sid, step_committed(1), "a step of the long turn committed")
        stack.kill("o1")  # busy mid-turn, every other session parked
        for sid in sent_while_dead:
            receipts[sid].append((await c.send(sid, "while dead")).receipt.seq)
        stack.start_owner("o2", failpoints=STALL_SWEEP)

        # The active sessions are answered by o2 while its sweep of the
        # parked ones stalls after its first claims.
        active = {sid: receipts[sid] for sid in (*busy, *sent_while_dead)}
        await answer_all(c, active, "an active session answered by the successor")

        async def sweep_stalled() -> bool:
            swept = await metric(c, "o2", "baton_parked_claims_total", how="swept")
            return swept == SWEEP_CONCURRENCY

        await eventually(sweep_stalled, "the sweep's workers stalled after a claim each", 60)
        unclaimed = set(await listed(c, "o1"))
        assert len(unclaimed) == PARKED - SWEEP_CONCURRENCY
        assert unclaimed <= set(parked)
        assert await metric(c, "o2", "baton_parked_unclaimed_sessions") == len(unclaimed)

        # A message wakes a parked session still indexed under the dead o1:
        # o2 claims it at once (its bell rang under o1) and answers it once.
        woken = sorted(unclaimed)[0]
        receipts[woken].append((await c.send(woken, "wake up")).receipt.seq)
        (events,) = (await answer_all(c, {woken: receipts[woken]}, "woken and answered")).values()
        assert [e.text for e in events if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED] == [
            "echo: wake up"
        ]
        assert await metric(c, "o2", "baton_parked_claims_total", how="woken") == 1
        assert await metric(c, "o2", "baton_parked_unclaimed_sessions") == len(unclaimed) - 1
        assert set(await listed(c, "o1")) == unclaimed - {woken}
        epochs = {sid: (await c.hooks.get_owner(sid)).fence.epoch for sid in sids}

        # o2 dies mid-sweep; o3 takes over what is left of o1 and all of o2.
        stack.kill("o2")
        stack.start_owner("o3")

        async def all_on_o3() -> bool:
            return len(await listed(c, "o3")) == len(sids)

        await eventually(all_on_o3, "every session claimed by o3", 60)
        assert await listed(c, "o1") == {} and await listed(c, "o2") == {}
        # Each was taken over once more: by o3, from whichever instance held it.
        for sid in sids:
            assert (await c.hooks.get_owner(sid)).fence.epoch == epochs[sid] + 1, sid
        assert all(epochs[sid] == 1 for sid in unclaimed - {woken})

        # Every kind answers its next command once, under its new owner.
        sample = [*busy[:1], *sent_while_dead[:1], woken, *sorted(unclaimed - {woken})[:4]]
        sample += [sid for sid in parked if sid not in unclaimed][:2]  # swept by o2
        for sid in sample:
            receipts[sid].append((await c.send(sid, "again")).receipt.seq)
        await answer_all(c, {sid: receipts[sid] for sid in sample}, "answered after o3")
    finally:
        await c.close()
