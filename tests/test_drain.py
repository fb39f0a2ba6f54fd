"""Retiring a deployment strands nothing (docs/design.md §13, issue 12), with
real processes: two deployments side by side, each with its own owner and
ingress, sharing hooks, anchor and etcd.

- Drain: `baton deployments drain dep-1 --to dep-2` moves every session held
  by dep-1's owner (parked ones are woken for it, busy ones move when next
  idle) through the ordinary handoff, while messages arrive for some.
- Adoption: dep-1's only owner is stopped; a message for a session that was
  idle on dep-1, sent through dep-2's ingress, is answered by dep-2.
- A fleet that vanished mid-step: the session is not adopted (it was not
  settled), nothing is lost, and it completes when an owner of dep-1 returns.
Each checks the session histories (gapless stream, every receipt processed
once in order, no step twice, runs never come back).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.owner.v1 import owner_pb2 as owner_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands import deployments
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.errors import FailedPrecondition
from baton_runtime.common.security.identity import Role
from tests.procs import SLACK, ProcessStack, StackClients, check_history, eventually
from tests.scrape import scrape
from tests.stack import public_channel

K = s.EventKind


def two_deployments(
    etcd_endpoint: str, workdir: Path, stacks: list[ProcessStack], **kwargs: object
) -> ProcessStack:
    stack = ProcessStack(etcd_endpoint, workdir, deployment_id="dep-1", **kwargs)  # type: ignore[arg-type]
    stacks.append(stack)
    return stack.start_deployments(
        owners={"o1": ("dep-1", ""), "b1": ("dep-2", "")},
        ingresses={"ingress": ("dep-1", "o1"), "ingress-2": ("dep-2", "b1")},
    )


class Ingress:
    """A client of one ingress process."""

    def __init__(self, address: str) -> None:
        self.channel = public_channel(address)
        self.stub = ingress_pb2_grpc.IngressServiceStub(self.channel)

    async def create(self) -> str:
        response = await self.stub.CreateSession(
            ingress_pb.CreateSessionRequest(), metadata=SLACK, timeout=20
        )
        return str(response.session_id)

    async def send(self, session_id: str, text: str) -> ingress_pb.SendMessageResponse:
        return await self.stub.SendMessage(
            ingress_pb.SendMessageRequest(session_id=session_id, text=text),
            metadata=SLACK,
            timeout=20,
        )

    async def close(self) -> None:
        await self.channel.close()


def of(events: list[s.Event], kind: int) -> list[s.Event]:
    return [e for e in events if e.kind == kind]


def settled(events: list[s.Event], answers: int) -> bool:
    """`answers` answers, and the session waited after the last one (a drain
    may add session.handed_off after that)."""
    kinds = [e.kind for e in events]
    if len(of(events, K.EVENT_KIND_MESSAGE_COMPLETED)) < answers:
        return False
    last = len(kinds) - 1 - kinds[::-1].index(K.EVENT_KIND_MESSAGE_COMPLETED)
    return K.EVENT_KIND_SESSION_WAITING in kinds[last:]


async def owned(c: StackClients, deployment_id: str, instance_id: str) -> dict[str, bool]:
    """Session -> parked, for the sessions an instance owns."""
    listed = await c.operator_hooks.list_instance_sessions(deployment_id, instance_id)
    return {o.fence.session_id: o.parked for o in listed}


async def test_a_stopped_fleets_idle_session_is_adopted_by_the_accepting_deployment(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    stack = two_deployments(etcd_endpoint, tmp_path, stacks)
    c = stack.clients()
    first, second = Ingress(stack.addr("ingress")), Ingress(stack.addr("ingress-2"))
    try:
        sid = await first.create()
        receipts = [(await first.send(sid, "calc 2+3")).receipt.seq]
        await c.wait_events(sid, lambda ev: settled(ev, 1), "the first turn")
        stack.owners["o1"].stop()  # SIGTERM: dep-1 has no owner left
        await eventually(
            lambda: _no_instances(c, "dep-1"), "dep-1's lease released", stack.lease_ttl + 10
        )
        # A drain has no owner of dep-1 to ask: it says what is left there.
        # (The command an operator types, as a process.)
        files = stack.probe.files
        assert files is not None
        env = {
            **os.environ,
            "BATON_TLS_CERT": files.cert,
            "BATON_TLS_KEY": files.key,
            "BATON_TLS_CA": files.ca,
        }
        drain_command = [sys.executable, "-m", "baton_runtime.cli", "deployments", "drain"]
        drain_command += ["dep-1", "--to", "dep-2", "--hooks", stack.addr("hooks"), "--wait", "5"]
        ran = await asyncio.to_thread(
            subprocess.run, drain_command, env=env, capture_output=True, text=True, timeout=60
        )
        lines = ran.stdout.splitlines()
        assert ran.returncode == deployments.EXIT_LEFT, (ran.stdout, ran.stderr)
        assert "1 session(s) are left" in lines[0] and sid in lines[1], lines
        receipts.append((await second.send(sid, "whoami")).receipt.seq)
        events = await c.wait_events(sid, lambda ev: settled(ev, 2), "answered by dep-2", 30)
        check_history(events, receipts)
        handed = of(events, K.EVENT_KIND_SESSION_HANDED_OFF)
        assert len(handed) == 1 and handed[0].text == "dep-1"
        assert handed[0].deployment_id == "dep-2" and handed[0].handoff_id.startswith("adopt_")
        assert of(events, K.EVENT_KIND_TOOL_CALL_RESULT)[-1].tool_result.output == "dep-2"
        assert sid in await owned(c, "dep-2", "b1")
        found = await c.hooks.get_transfer(sid, handed[0].handoff_id)
        assert found.reason == s.TRANSFER_REASON_ADOPTION and found.fence.epoch == 2
        lines = []
        code = await deployments.drain(
            stack.addr("hooks"), "dep-1", "dep-2", stack.probe, wait_s=5, write=lines.append
        )
        assert code == deployments.EXIT_DRAINED and "holds no session" in lines[0], lines
    finally:
        await first.close()
        await second.close()
        await c.close()


async def _no_instances(c: StackClients, deployment_id: str) -> bool:
    return not await c.hooks.list_instances(deployment_id)


async def test_a_session_left_mid_step_waits_for_its_own_deployment(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    stack = two_deployments(etcd_endpoint, tmp_path, stacks)
    c = stack.clients()
    first, second = Ingress(stack.addr("ingress")), Ingress(stack.addr("ingress-2"))
    try:
        sid = await first.create()
        receipts = [(await first.send(sid, "sleep 3 1500")).receipt.seq]

        def step_one(events: list[s.Event]) -> bool:
            return any(e.kind == K.EVENT_KIND_STEP_COMPLETED for e in events)

        await c.wait_events(sid, step_one, "step 1 committed")
        stack.kill("o1")  # kill -9 mid-step: the turn is open in the last commit
        receipts.append((await second.send(sid, "hello")).receipt.seq)
        log = tmp_path / "ingress-2.log"

        async def refused() -> bool:
            text = await asyncio.to_thread(log.read_text)
            return "orphaned session waits for its own deployment" in text

        await eventually(refused, "the adoption refused as not settled", stack.lease_ttl + 20)
        assert sid not in await owned(c, "dep-2", "b1"), "an unsettled session was adopted"
        # An owner of dep-1 comes back: it takes the session over and finishes
        # the turn, which admits the message that waited (a steer).
        stack.start_owner("o2", deployment_id="dep-1")
        events = await c.wait_events(
            sid,
            lambda ev: settled(ev, 1) and len(of(ev, K.EVENT_KIND_MESSAGE_RECEIVED)) == 2,
            "both processed on dep-1",
            stack.lease_ttl + 40,
        )
        check_history(events, receipts)
        assert {e.deployment_id for e in events} == {"dep-1"}
        assert not of(events, K.EVENT_KIND_SESSION_HANDED_OFF)
    finally:
        await first.close()
        await second.close()
        await c.close()


async def drain_parked_sessions(
    etcd_endpoint: str, workdir: Path, stacks: list[ProcessStack], count: int, messaged: int
) -> None:
    stack = two_deployments(etcd_endpoint, workdir, stacks, park_after=0.3)
    c = stack.clients()
    first, second = Ingress(stack.addr("ingress")), Ingress(stack.addr("ingress-2"))
    rng = random.Random(12)
    try:
        created: list[str] = []
        for start in range(0, count, 50):
            batch = await asyncio.gather(*(first.create() for _ in range(min(50, count - start))))
            created.extend(batch)

        async def all_parked() -> bool:
            held = await owned(c, "dep-1", "o1")
            return len(held) == count and all(held.values())

        await eventually(all_parked, f"{count} sessions parked on dep-1", 120)
        chosen = rng.sample(created, messaged)
        receipts: dict[str, list[int]] = {sid: [] for sid in chosen}
        lines: list[str] = []

        async def messages() -> None:
            # Through both ingresses while the drain runs: each is answered
            # once, wherever the session is at that moment.
            for n, sid in enumerate(chosen):
                ingress = first if n % 2 else second
                receipts[sid].append((await ingress.send(sid, f"hello {n}")).receipt.seq)
                await asyncio.sleep(0)

        drained, _ = await asyncio.gather(
            deployments.drain(
                stack.addr("hooks"),
                "dep-1",
                "dep-2",
                stack.probe,  # an operator's certificate
                wait_s=240,
                poll_s=0.2,
                write=lines.append,
            ),
            messages(),
        )
        assert drained == deployments.EXIT_DRAINED, "\n".join(lines)
        assert lines[-1].startswith("drained: nothing left on dep-1"), lines
        on_dep_2 = await owned(c, "dep-2", "b1")
        assert set(created) <= set(on_dep_2), "a session was left behind"
        assert not await owned(c, "dep-1", "o1")
        for sid in chosen:
            events = await c.wait_events(sid, lambda ev: settled(ev, 1), f"{sid} answered", 60)
            check_history(events, receipts[sid])
        sample = rng.sample(created, 20)
        for sid in sample:
            # A session counts as moved once its transfer is done; the
            # successor's first commit (session.handed_off) may land just after.
            events = await c.wait_events(
                sid, lambda ev: bool(of(ev, K.EVENT_KIND_SESSION_HANDED_OFF)), f"{sid} moved", 30
            )
            handed = of(events, K.EVENT_KIND_SESSION_HANDED_OFF)
            assert len(handed) == 1 and handed[0].text == "dep-1", sid
        # Safe to repeat: nothing left, nothing moves.
        again: list[str] = []
        code = await deployments.drain(
            stack.addr("hooks"), "dep-1", "dep-2", stack.probe, wait_s=5, write=again.append
        )
        assert code == deployments.EXIT_DRAINED, again
    finally:
        await first.close()
        await second.close()
        await c.close()


async def test_drain_of_parked_sessions_while_messages_arrive(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    await drain_parked_sessions(etcd_endpoint, tmp_path, stacks, count=1000, messaged=40)


async def _cli(stack: ProcessStack, *args: str) -> subprocess.CompletedProcess[str]:
    """`baton ARGS` as an operator types it, with the operator certificate."""
    files = stack.probe.files
    assert files is not None
    env = {
        **os.environ,
        "BATON_TLS_CERT": files.cert,
        "BATON_TLS_KEY": files.key,
        "BATON_TLS_CA": files.ca,
        "BATON_HOOKS_ADDR": stack.addr("hooks"),
    }
    command = [sys.executable, "-m", "baton_runtime.cli", *args]
    return await asyncio.to_thread(
        subprocess.run, command, env=env, capture_output=True, text=True, timeout=60
    )


async def _drain_announced(c: StackClients, deployment_id: str, target: str) -> bool:
    """Every live instance of `deployment_id` names `target` in its registry entry."""
    live = await c.operator_hooks.list_instances(deployment_id)
    return bool(live) and all(i.drain_to == target for i in live)


async def test_a_drained_deployment_is_not_a_handoff_target_until_undrained(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    """A session drained from dep-1 to dep-2 used to move back to dep-1 (and
    run dep-1's code again) on the next message dep-1's ingress accepted.
    Now a deployment being drained is no handoff target: the message is
    answered where the session is, and the skip is logged and counted with
    its reason; dep-1 itself refuses an offer while it drains. `baton
    deployments undrain dep-1` makes it a target again."""
    stack = two_deployments(etcd_endpoint, tmp_path, stacks, serve_metrics=True)
    c = stack.clients()
    first, second = Ingress(stack.addr("ingress")), Ingress(stack.addr("ingress-2"))
    try:
        sid = await first.create()
        receipts = [(await first.send(sid, "hello")).receipt.seq]
        await c.wait_events(sid, lambda ev: settled(ev, 1), "the first turn")
        ran = await _cli(stack, "deployments", "drain", "dep-1", "--to", "dep-2", "--wait", "30")
        assert ran.returncode == deployments.EXIT_DRAINED, (ran.stdout, ran.stderr)
        assert sid in await owned(c, "dep-2", "b1")
        await eventually(
            lambda: _drain_announced(c, "dep-1", "dep-2"), "dep-1's drain in the registry"
        )

        # Through dep-1's ingress: answered on dep-2, where the session is.
        receipts.append((await first.send(sid, "whoami")).receipt.seq)
        events = await c.wait_events(sid, lambda ev: settled(ev, 2), "answered on dep-2")
        check_history(events, receipts)
        assert of(events, K.EVENT_KIND_TOOL_CALL_RESULT)[-1].tool_result.output == "dep-2"
        assert len(of(events, K.EVENT_KIND_SESSION_HANDED_OFF)) == 1  # the drain's only
        assert sid in await owned(c, "dep-2", "b1")
        log = (tmp_path / "b1.log").read_text()
        skipped = [
            line
            for line in log.splitlines()
            if "the target deployment is being drained" in line and sid in line
        ]
        assert len(skipped) == 1 and "DEPLOYMENT_DRAINING" in skipped[0], log[-3000:]
        metrics = await scrape(stack.metrics_url("b1"))
        assert metrics.total("baton_handoff_skips_total", why="target_draining") == 1

        # dep-1's own answer while it drains, whoever asks: it takes no session.
        owner = OwnerClient(stack.addr("o1"), security=stack.security(Role.OWNER, "dep-2"))
        fence = (await c.operator_hooks.get_owner(sid)).fence
        try:
            with pytest.raises(FailedPrecondition) as refused:
                await owner.accept_handoff(
                    owner_pb.AcceptHandoffRequest(
                        handoff_id="ho_probe",
                        fence=fence,
                        deployment_id="dep-1",
                        from_owner=s.OwnerIdentity(
                            owner_run_id=fence.owner_run_id,
                            deployment_id="dep-2",
                            instance_id="b1",
                        ),
                        snapshot_revision=1,
                        trigger=s.InboxEntry(seq=99),
                    )
                )
        finally:
            await owner.close()
        assert refused.value.reason == "DEPLOYMENT_DRAINING"

        # Undrained: dep-1 takes handoffs again, and the session moves back.
        ran = await _cli(stack, "deployments", "undrain", "dep-1")
        assert ran.returncode == 0, (ran.stdout, ran.stderr)
        assert ran.stdout.splitlines() == [
            "undrained: o1 (dep-1) no longer drains to dep-2 (1 moved there stay there; "
            "0 held here stay here)",
            "deployment dep-1 takes handoffs again",
        ]
        await eventually(lambda: _drain_announced(c, "dep-1", ""), "dep-1's drain cleared")
        ran = await _cli(stack, "deployments", "undrain", "dep-1", "-o", "json")
        assert ran.returncode == 0, ran.stderr
        (again,) = json.loads(ran.stdout)
        assert again["was_to_deployment_id"] == "" and again["instance_id"] == "o1"
        receipts.append((await first.send(sid, "whoami")).receipt.seq)
        events = await c.wait_events(sid, lambda ev: settled(ev, 3), "answered on dep-1")
        check_history(events, receipts)
        handed = of(events, K.EVENT_KIND_SESSION_HANDED_OFF)
        assert len(handed) == 2 and handed[-1].deployment_id == "dep-1"
        assert of(events, K.EVENT_KIND_TOOL_CALL_RESULT)[-1].tool_result.output == "dep-1"

        # Nothing to undrain: an unknown deployment is NOT_FOUND.
        ran = await _cli(stack, "deployments", "undrain", "dep-9")
        assert ran.returncode == 3 and "DEPLOYMENT_NOT_FOUND" in ran.stderr, ran
    finally:
        await first.close()
        await second.close()
        await c.close()
