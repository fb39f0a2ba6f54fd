"""The owner's bound on calls in flight (services/common/clients/call_slots.py):
the slots themselves, and, over real processes, an owner whose bound is one
call serving a burst of sessions: every message answered once, in order,
the bound engaged, nothing deadlocked (a code path that held a slot while it
waited for another would hang here)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.call_slots import CallSlots
from tests.procs import ProcessStack, eventually
from tests.scrape import scrape

K = s.EventKind


async def _occupy(slots: CallSlots, log: list[str], name: str, release: asyncio.Event) -> None:
    async with slots.held():
        log.append(name)
        await release.wait()


async def test_at_most_the_limit_is_in_flight_and_the_rest_wait_in_arrival_order() -> None:
    slots = CallSlots(2, "test-order")
    log: list[str] = []
    gates = {n: asyncio.Event() for n in "abcde"}
    tasks = [asyncio.create_task(_occupy(slots, log, n, gates[n])) for n in "abcde"]
    await asyncio.sleep(0.01)
    assert log == ["a", "b"] and slots.in_flight == 2 and slots.waiting == 3
    gates["b"].set()
    await asyncio.sleep(0.01)
    assert log == ["a", "b", "c"] and slots.in_flight == 2 and slots.waiting == 2
    for n in "acde":
        gates[n].set()
    await asyncio.gather(*tasks)
    assert log == list("abcde") and slots.in_flight == 0 and slots.waiting == 0


async def test_a_cancelled_waiter_leaves_no_slot_taken_or_lost() -> None:
    slots = CallSlots(1, "test-cancel")
    log: list[str] = []
    hold, never = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(_occupy(slots, log, "first", hold))
    waiting = asyncio.create_task(_occupy(slots, log, "cancelled", never))
    last = asyncio.create_task(_occupy(slots, log, "last", asyncio.Event()))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.sleep(0.01)
    assert slots.waiting == 1
    hold.set()
    await asyncio.sleep(0.01)
    assert log == ["first", "last"] and slots.in_flight == 1
    last.cancel()
    await asyncio.gather(first, waiting, last, return_exceptions=True)
    assert slots.in_flight == 0 and slots.waiting == 0


async def test_a_waiter_cancelled_as_it_is_handed_a_slot_passes_it_on() -> None:
    slots = CallSlots(1, "test-handover")
    log: list[str] = []
    hold = asyncio.Event()
    first = asyncio.create_task(_occupy(slots, log, "first", hold))
    handed = asyncio.create_task(_occupy(slots, log, "handed", asyncio.Event()))
    after = asyncio.create_task(_occupy(slots, log, "after", hold))
    await asyncio.sleep(0.01)
    hold.set()  # `first` leaves: its slot is handed to `handed` ...
    await asyncio.sleep(0)
    handed.cancel()  # ... which is cancelled before it runs
    await asyncio.gather(first, handed, after, return_exceptions=True)
    assert log == ["first", "after"] and slots.in_flight == 0 and slots.waiting == 0


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        CallSlots(0, "test-zero")


SESSIONS = 24


async def test_an_owner_bound_to_one_call_in_flight_answers_a_burst_in_order(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    """One call in flight to hooks and one to anchor: 24 sessions started at
    once; a message to each at once; once all are parked, a second message
    to each at once (every session woken).
    Every message gets exactly one answer, in order, from the one owner
    (alive: its lease held); its scrape shows calls waited for a slot, and
    none waits at the end."""
    stack = ProcessStack(
        etcd_endpoint,
        tmp_path,
        park_after=0.3,
        serve_metrics=True,
        owner_env={"BATON_OWNER_MAX_CALLS_IN_FLIGHT": "1"},
    )
    stacks.append(stack)
    stack.start(owners=1)
    clients = stack.clients()
    try:
        await clients.wait_registered("o1")
        sids = await asyncio.gather(*(clients.create() for _ in range(SESSIONS)))

        def answered(count: int) -> Callable[[], Awaitable[list[list[str]] | None]]:
            async def probe() -> list[list[str]] | None:
                replies = []
                for sid in sids:
                    events = await clients.events(sid)
                    done = [e.text for e in events if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED]
                    if len(done) < count:
                        return None
                    replies.append(done)
                return replies

            return probe

        async def all_parked() -> bool:
            owned = await clients.hooks.list_instance_sessions(stack.deployment_id, "o1")
            return len(owned) == SESSIONS and all(o.parked for o in owned)

        await asyncio.gather(*(clients.send(sid, "first") for sid in sids))
        await eventually(answered(1), "every first message answered", timeout=60)
        await eventually(all_parked, "every session parked", timeout=30)
        await asyncio.gather(*(clients.send(sid, "second") for sid in sids))  # wakes each
        replies = await eventually(answered(2), "every second message answered", timeout=60)
        assert all(done == ["echo: first", "echo: second"] for done in replies), replies
        owner = await scrape(stack.metrics_url("o1"))
        waited = sum(
            owner.total("baton_rpc_client_slot_wait_seconds_count", target=t)
            for t in ("hooks", "anchor")
        )
        assert waited > 0
        for target in ("hooks", "anchor"):
            assert owner.total("baton_rpc_client_calls_waiting", target=target) == 0
        assert stack.owners["o1"].proc is not None and stack.owners["o1"].proc.poll() is None
        assert {await clients.owner_of(sid) for sid in sids} == {"o1"}
    finally:
        await clients.close()
