"""The SDK's follower and sends across an ingress kill -9 and restart, with
Baton as real processes (tests/procs.py): the follower resumes from its
cursor and sees the stored stream exactly (no gap, no duplicate), a send
made while the ingress is down is retried with its delivery id until the
restarted ingress accepts it, once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import baton_client
from baton_client import AsyncClient, RetryPolicy, Settings
from baton_client.types import Event

from baton_runtime.cli.system.processes import wait_serving
from tests import certs
from tests.procs import API_KEY, ProcessStack, answered, check_history

K = baton_client.EventKind


async def test_a_follower_and_a_send_survive_an_ingress_kill9_and_restart(
    stacks: list[ProcessStack], etcd_endpoint: str, tmp_path: Path
) -> None:
    stack = ProcessStack(etcd_endpoint, tmp_path / "stack", deployment_id="dep-s")
    stacks.append(stack)
    stack.start(owners=1)
    assert stack.ingress is not None
    settings = Settings(
        target=stack.addr("ingress"),
        api_key=API_KEY,
        ca_cert=certs.files(certs.OPERATOR).ca,
        # An ingress process restarts in a few seconds; under load, more.
        retry=RetryPolicy(max_attempts=200, max_backoff=1.0, budget=90.0),
    )
    checks = stack.clients()
    retried = asyncio.Event()

    async def sleep(seconds: float) -> None:
        """The client's backoff: a call (or the follower) failed and waits."""
        retried.set()
        await asyncio.sleep(seconds)

    async with AsyncClient(settings, sleep=sleep) as client:
        await checks.wait_registered("o1")
        sid = (await client.create_session()).session_id
        queue = baton_client.TurnPolicy.Value("TURN_POLICY_QUEUE")

        async def send(i: int) -> baton_client.Receipt:
            return await client.send(sid, f"what is {i}*7", delivery_id=f"m{i}", turn_policy=queue)

        seen: list[Event] = []
        answered_first = asyncio.Event()

        async def follow() -> None:
            async for event in client.follow(sid):
                seen.append(event)
                if event.kind == K.EVENT_KIND_MESSAGE_COMPLETED:
                    answered_first.set()
                if answered(seen, 6):
                    return

        receipts = [await send(0)]
        reader = asyncio.create_task(follow())
        async with asyncio.timeout(30):
            await answered_first.wait()  # the follower reads live
        receipts += [await send(i) for i in (1, 2, 3)]
        # kill -9 mid-follow; the owner goes on committing the queued turns.
        stack.ingress.kill()
        late = asyncio.create_task(send(5))
        async with asyncio.timeout(30):
            await retried.wait()  # refused by the dead ingress at least once
        stack.ingress.start()
        await asyncio.to_thread(wait_serving, stack.addr("ingress"), stack.probe)
        receipts.append(await late)
        receipts.append(await send(4))
        async with asyncio.timeout(60):
            await reader
        again = await send(5)
        assert again.duplicate and again.seq == receipts[4].seq
    stored = await checks.events(sid)
    await checks.close()
    # Everything the follower saw is the stored stream, from 0, once each.
    assert seen == stored[: len(seen)]
    check_history(seen, [r.seq for r in receipts])
    answers = [e.text for e in seen if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED]
    assert sorted(answers) == sorted(f"The result is {i * 7}." for i in range(6))
