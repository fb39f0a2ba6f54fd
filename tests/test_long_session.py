"""Long-lived sessions with real processes (docs/design.md §4, §5, §6, §9).

- A session of 2,000 turns with messages of 4-30 KiB (tens of MB of history)
  keeps answering: its history is appended and compacted, never rewritten;
  then its owner is killed with -9 mid-step and another instance takes it
  over (the context is loaded at the snapshot's revision); then it is handed
  off to another deployment. The whole stream passes the history checks.
- A run that crashes every time it loads (authored code raising) spends its
  restart budget, says so on the stream, keeps every accepted command, and
  is run again once an instance with working code takes it over.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import aetcd
import grpc
import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.etcd.keys import Keys
from tests.certs import etcd_client
from tests.procs import SLACK, ProcessStack, check_history
from tests.stack import public_channel

K = s.EventKind
CRASHING = "baton_runtime.owner.agents.fixture:build_crash_on_load_agent"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def of(events: list[s.Event], kind: int) -> list[s.Event]:
    return [e for e in events if e.kind == kind]


async def test_a_crashing_run_spends_its_budget_stalls_and_loses_nothing(
    etcd_endpoint: str, workdir: Path, stacks: list[ProcessStack]
) -> None:
    stack = ProcessStack(
        etcd_endpoint,
        workdir,
        owner_env={"BATON_AGENT": CRASHING, "BATON_OWNER_RESTART_BUDGET": "2"},
    )
    stacks.append(stack)
    stack.start(owners=1)
    c = stack.clients()
    try:
        await c.wait_registered("o1")
        sid = await c.create()
        receipts = [(await c.send(sid, f"hello {i}")).receipt.seq for i in range(3)]
        stalled = await c.wait_events(
            sid, lambda ev: bool(of(ev, K.EVENT_KIND_SESSION_STALLED)), "session.stalled", 30
        )
        event = of(stalled, K.EVENT_KIND_SESSION_STALLED)[0]
        assert event.error.reason == "RESTART_BUDGET_SPENT"
        assert "3 runs in a row failed" in event.error.message
        assert "refuses to load" in event.error.message
        assert not of(stalled, K.EVENT_KIND_MESSAGE_RECEIVED), "a stalled session ran"
        # Accepted while stalled, too.
        receipts.append((await c.send(sid, "hello 3")).receipt.seq)
        log = await asyncio.to_thread((workdir / "o1.log").read_text)
        assert log.count("run failed; restarting it") == 2, "restarted more than its budget"
        # The operator replaces the broken build's instance: another instance
        # (working code) takes the session over and processes every command.
        stack.kill("o1")
        stack.start_owner(
            "o2", env={"BATON_AGENT": "baton_runtime.owner.agents.fixture:build_agent"}
        )
        events = await c.wait_events(
            sid,
            lambda ev: (
                len(of(ev, K.EVENT_KIND_MESSAGE_COMPLETED)) == 4
                and ev[-1].kind == K.EVENT_KIND_SESSION_WAITING
            ),
            "every accepted command answered",
            stack.lease_ttl + 30,
        )
        check_history(events, receipts)
        answers = [e.text for e in of(events, K.EVENT_KIND_MESSAGE_COMPLETED)]
        assert answers == [f"echo: hello {i}" for i in range(4)]
    finally:
        await c.close()


async def raw_client(endpoint: str) -> aetcd.Client:
    return await etcd_client(endpoint, timeout=10)


class Follower:
    """One StreamEvents call through an ingress, read as turns settle."""

    def __init__(self, address: str, session_id: str) -> None:
        self.channel = public_channel(
            address, options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)]
        )
        stub = ingress_pb2_grpc.IngressServiceStub(self.channel)
        self.call = stub.StreamEvents(
            ingress_pb.StreamEventsRequest(session_id=session_id, follow=True),
            metadata=SLACK,
        )
        self.events: list[s.Event] = []
        self.waits = 0

    async def until_waits(self, count: int, timeout: float = 30.0) -> None:
        await self.until(lambda: self.waits >= count, f"{count} turns settled", timeout)

    async def until(self, done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} within {timeout}s ({self.waits} turns settled)")
            response = await self.call.read()
            assert response is not grpc.aio.EOF, "the follow stream ended"
            for event in response.events:
                self.events.append(event)
                if event.kind == K.EVENT_KIND_SESSION_WAITING:
                    self.waits += 1

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


async def long_session(
    etcd_endpoint: str, workdir: Path, stacks: list[ProcessStack], turns: int
) -> None:
    stack = ProcessStack(etcd_endpoint, workdir, deployment_id="dep-a", lease_ttl=2)
    stacks.append(stack)
    stack.start_deployments(
        owners={"o1": ("dep-a", ""), "o2": ("dep-a", ""), "b1": ("dep-b", "")},
        ingresses={"ingress": ("dep-a", "o1"), "ingress-b": ("dep-b", "b1")},
    )
    c = stack.clients()
    raw = await raw_client(etcd_endpoint)
    keys = Keys(stack.prefix)
    rng = random.Random(8)
    try:
        await c.wait_registered("o1", "o2")
        sid = await c.create()
        follower = Follower(stack.addr("ingress"), sid)
        receipts: list[int] = []
        sizes: list[int] = []
        started = time.monotonic()
        try:
            for turn in range(turns):
                size = rng.randint(4 * 1024, 30 * 1024)
                sizes.append(size)
                text = f"t{turn} " + "m" * size
                receipts.append((await c.send(sid, text)).receipt.seq)
                await follower.until_waits(turn + 1)
            took = time.monotonic() - started
            snapshot = await c.anchor.snapshot(sid)
            stored = await raw.get_prefix(keys.history_prefix(sid))
            log = snapshot.history_log
            print(
                f"{turns} turns, {sum(sizes) / 1e6:.1f} MB of messages in {took:.1f}s; "
                f"history head {log.next_index}, context [{log.context_start}, "
                f"{log.next_index}) of {log.context_bytes} bytes; {len(stored)} entries stored"
            )
            assert not snapshot.history and log.next_index >= 2 * turns
            assert log.context_bytes <= 256 * 1024 + 2 * 31 * 1024
            assert len(stored) <= (log.next_index - log.context_start) + 64, "history not retired"
            compactions = of(follower.events, K.EVENT_KIND_CONTEXT_COMPACTED)
            assert compactions and all(e.context_change.automatic for e in compactions)

            # kill -9 mid-step: the other instance takes over from the last
            # commit, loading the context at the snapshot's revision.
            receipts.append((await c.send(sid, "sleep 3 800")).receipt.seq)
            await follower.until(
                lambda: _step_committed(1)(follower.events), "step 1 of the long turn committed"
            )
            stack.kill("o1")
            await follower.until_waits(turns + 1, timeout=stack.lease_ttl + 30)
            # A handoff of the long session: the context crosses, not its age.
            channel = public_channel(stack.addr("ingress-b"))
            ingress_b = ingress_pb2_grpc.IngressServiceStub(channel)
            try:
                sent = await ingress_b.SendMessage(
                    ingress_pb.SendMessageRequest(session_id=sid, text="whoami"),
                    metadata=SLACK,
                    timeout=10,
                )
            finally:
                await channel.close()
            receipts.append(sent.receipt.seq)
            await follower.until_waits(turns + 2)
        finally:
            await follower.close()
        events = await c.events(sid)
        check_history(events, receipts)
        tail = events[-12:]
        assert of(tail, K.EVENT_KIND_SESSION_HANDED_OFF), "the session did not move to dep-b"
        assert of(tail, K.EVENT_KIND_TOOL_CALL_RESULT)[-1].tool_result.output == "dep-b"
        runs = list(dict.fromkeys(e.owner_run_id for e in events))
        assert len(runs) == 3, f"expected the first run, its successor and dep-b's: {runs}"
        answered = [e.text for e in of(events, K.EVENT_KIND_MESSAGE_COMPLETED)]
        assert answered[-2:] == ["The result is slept 2.", "The result is dep-b."]
        assert len(answered) == turns + 2
    finally:
        await raw.close()
        await c.close()


def _step_committed(step: int) -> Callable[[list[s.Event]], bool]:
    return lambda events: any(
        e.kind == K.EVENT_KIND_STEP_COMPLETED and e.step == step for e in events[-12:]
    )


async def test_a_2000_turn_session_survives_takeover_and_handoff(
    etcd_endpoint: str, workdir: Path, stacks: list[ProcessStack]
) -> None:
    await long_session(etcd_endpoint, workdir, stacks, turns=2000)
