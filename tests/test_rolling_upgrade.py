"""A rolling upgrade as an operator does it (docs/deploy.md), with real
processes, while 50 sessions converse, some busy and some idle:

1. dep-1 (two owners, an ingress) serves every session;
2. dep-2 comes up next to it (two owners, an ingress);
3. traffic moves to dep-2's ingress (idle sessions move at their next message);
4. `baton deployments drain dep-1 --to dep-2` moves every session still there;
5. dep-1's owners are stopped once nothing is left on dep-1;
6. every session answers a message afterwards.

Each session's history is checked: gapless stream, every accepted command
processed once in FIFO order, no step twice, runs never come back, and it
ends on dep-2.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands import deployments
from tests.procs import ProcessStack, check_history, eventually
from tests.test_drain import Ingress, of, settled

K = s.EventKind


async def rolling_upgrade(
    etcd_endpoint: str, workdir: Path, stacks: list[ProcessStack], sessions: int, rounds: int
) -> None:
    stack = ProcessStack(etcd_endpoint, workdir, deployment_id="dep-1", park_after=1.0)
    stacks.append(stack)
    stack.start_deployments(
        owners={"a1": ("dep-1", ""), "a2": ("dep-1", "")},
        ingresses={"ingress": ("dep-1", "a1")},
    )
    c = stack.clients()
    old = Ingress(stack.addr("ingress"))
    rng = random.Random(17)
    public: list[Ingress] = [old]  # where the gateways send
    receipts: dict[str, list[int]] = {}
    new: Ingress | None = None
    try:
        sids = await asyncio.gather(*(old.create() for _ in range(sessions)))
        for sid in sids:
            receipts[sid] = []

        async def converse(sid: str, turns: int) -> None:
            for turn in range(turns):
                # Some turns are long (busy sessions), most are short.
                text = "sleep 2 400" if rng.random() < 0.2 else f"hello {turn}"
                receipts[sid].append((await public[-1].send(sid, text)).receipt.seq)
                await asyncio.sleep(rng.uniform(0.05, 0.4))

        talking = asyncio.gather(*(converse(sid, rounds) for sid in sids))
        await asyncio.sleep(1.0)
        # 2. the new build comes up next to the old one.
        for instance_id in ("b1", "b2"):
            stack.start_owner(instance_id, deployment_id="dep-2")
        stack.start_ingress("ingress-2", "dep-2", ["b1", "b2"])
        new = Ingress(stack.addr("ingress-2"))
        # 3. the public entry points at it.
        public.append(new)
        await talking
        # 4. drain what is still on dep-1 (idle ones that got no message, busy ones).
        lines: list[str] = []
        code = await deployments.drain(
            stack.addr("hooks"),
            "dep-1",
            "dep-2",
            stack.probe,
            wait_s=120,
            poll_s=0.2,
            write=lines.append,
        )
        assert code == deployments.EXIT_DRAINED, "\n".join(lines)
        for instance_id in ("a1", "a2"):
            assert not await c.hooks.list_instance_sessions("dep-1", instance_id)
        # 5. scale the old fleet to zero.
        for instance_id in ("a1", "a2"):
            stack.owners[instance_id].stop()

        async def old_gone() -> bool:
            return not await c.hooks.list_instances("dep-1")

        await eventually(old_gone, "dep-1's fleet gone", 20)
        # 6. every session answers afterwards.
        for sid in sids:
            receipts[sid].append((await new.send(sid, "after the upgrade")).receipt.seq)
        for sid in sids:
            count = len(receipts[sid])
            events = await c.wait_events(
                sid,
                lambda ev, n=count: (
                    len(of(ev, K.EVENT_KIND_MESSAGE_RECEIVED)) == n and settled(ev, 1)
                ),
                f"{sid} answered after the upgrade",
                60,
            )
            check_history(events, receipts[sid])
            assert of(events, K.EVENT_KIND_MESSAGE_COMPLETED)[-1].deployment_id == "dep-2"
            assert of(events, K.EVENT_KIND_SESSION_HANDED_OFF), f"{sid} never moved"
    finally:
        await old.close()
        if new is not None:
            await new.close()
        await c.close()


async def test_a_rolling_upgrade_while_50_sessions_converse(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    await rolling_upgrade(etcd_endpoint, tmp_path, stacks, sessions=50, rounds=4)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_rolling_upgrade_while_50_sessions_converse_slow(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    await rolling_upgrade(etcd_endpoint, tmp_path, stacks, sessions=50, rounds=20)
