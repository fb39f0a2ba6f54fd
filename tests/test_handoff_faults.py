"""Handoffs under crashes: real processes per deployment (owners a1, a2 of
dep-a; b1, b2 of dep-b; an ingress per deployment; hooks; anchor; a real
etcd), with a process killed (SIGKILL, at a failpoint or by the test) at each
step of the protocol, a lost transfer response, and deliveries racing the
transfer.

Every scenario checks the invariants (docs/design.md §9): the stream is gapless;
every accepted command is processed once, in FIFO order; no model or tool
step runs twice; owner runs follow one another, each on one deployment; the
alias resolves to the same session throughout.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.etcd.keys import Keys
from tests import certs
from tests.procs import (
    SLACK,
    ProcessStack,
    StackClients,
    answered,
    check_history,
    eventually,
    received_seqs,
)
from tests.stack import public_channel

K = s.EventKind
ALIAS = "fault-7"


@dataclass
class Run:
    stack: ProcessStack
    clients: StackClients
    b_channel: grpc.aio.Channel
    a: ingress_pb2_grpc.IngressServiceStub
    b: ingress_pb2_grpc.IngressServiceStub
    session_id: str = ""

    async def send(
        self, via: ingress_pb2_grpc.IngressServiceStub, text: str, caller: str = ""
    ) -> int:
        response = await via.SendMessage(
            ingress_pb.SendMessageRequest(session_id=self.session_id, text=text, caller=caller),
            metadata=SLACK,
            timeout=10,
        )
        return response.receipt.seq

    def log_has(self, instance_id: str, text: str) -> bool:
        path = self.stack.workdir / f"{instance_id}.log"
        return path.exists() and text in path.read_text(errors="replace")


async def start(etcd_endpoint: str, workdir: Path, a1: str = "", b: str = "") -> Run:
    stack = ProcessStack(etcd_endpoint, workdir, deployment_id="dep-a", lease_ttl=2)
    stack.start_deployments(
        owners={
            "a1": ("dep-a", a1),
            "a2": ("dep-a", ""),
            "b1": ("dep-b", b),
            "b2": ("dep-b", b),
        },
        ingresses={"ingress": ("dep-a", "a1"), "ingress-b": ("dep-b", "b1")},
    )
    clients = stack.clients()
    b_channel = public_channel(stack.addr("ingress-b"))
    run = Run(
        stack,
        clients,
        b_channel,
        clients.ingress,
        ingress_pb2_grpc.IngressServiceStub(b_channel),
    )

    async def registered() -> bool:
        a = await clients.hooks.list_instances("dep-a")
        b_live = await clients.hooks.list_instances("dep-b")
        return len(a) == 2 and len(b_live) == 2

    await eventually(registered, "four owners registered", 30)
    created = await run.a.CreateSession(
        ingress_pb.CreateSessionRequest(aliases=[ALIAS]), metadata=SLACK, timeout=10
    )
    run.session_id = created.session_id
    return run


async def stop(run: Run) -> None:
    await run.b_channel.close()
    await run.clients.close()
    run.stack.stop()


async def settle(run: Run, receipts: list[int], timeout: float = 45.0) -> list[s.Event]:
    """Wait until every receipt was admitted and the session waits again."""

    def done(events: list[s.Event]) -> bool:
        received = {e.inbox_seq for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED}
        return (
            set(receipts) <= received
            and bool(events)
            and events[-1].kind == K.EVENT_KIND_SESSION_WAITING
        )

    return await run.clients.wait_events(run.session_id, done, "all receipts answered", timeout)


class AliasWatch:
    """Resolves the alias every 50 ms while a scenario runs."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.seen: set[str] = set()
        self.lookups = 0
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                found = await self.run.clients.hooks.lookup(f"slack:{ALIAS}")
                self.seen.add(found.session_id)
                self.lookups += 1
            except Exception:  # noqa: BLE001 - hooks is never killed here; count only answers
                pass
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        assert self.seen == {self.run.session_id}, f"alias resolved to {self.seen}"
        assert self.lookups > 0


async def begin(run: Run, caller: str = "") -> tuple[AliasWatch, list[int], int]:
    """Watch the alias, answer one turn on A, then send the trigger through
    B's ingress. Returns the watch, the receipts so far and the trigger's seq."""
    watch = AliasWatch(run)
    receipts = [await run.send(run.a, "hello")]
    await settle(run, receipts)
    trigger = await run.send(run.b, "whoami", caller=caller)
    receipts.append(trigger)
    return watch, receipts, trigger


def check(events: list[s.Event], receipts: list[int]) -> None:
    check_history(events, receipts)
    deployments: dict[str, set[str]] = {}
    for event in events:
        deployments.setdefault(event.owner_run_id, set()).add(event.deployment_id)
    assert all(len(d) == 1 for d in deployments.values()), f"a run spans deployments: {deployments}"


def trigger_ran_on(events: list[s.Event], seq: int) -> str:
    received = [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED and e.inbox_seq == seq]
    assert len(received) == 1, f"trigger {seq} admitted {len(received)} times"
    return received[0].deployment_id


async def transfers(run: Run) -> int:
    keys = Keys(run.stack.prefix)
    client = await certs.etcd_client(run.stack.etcd_endpoint)
    try:
        return len(await client.get_prefix(keys.transfer(run.session_id, "")))
    finally:
        await client.close()


async def wait_log(run: Run, instances: tuple[str, ...], text: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for instance_id in instances:
            if run.log_has(instance_id, text):
                return instance_id
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {instances} log says {text!r} within {timeout}s")


# Each case: failpoints for a1 and for both B instances (the one A asks hits
# it), and where the trigger must end up being processed.
CASES = {
    # A dies before asking B: a2 takes the session over after A's lease, finds
    # the trigger idle at the inbox head, and hands it off itself.
    "kill A before asking B": ("handoff.before_accept=kill", "", "dep-b"),
    # B dies before or after validating the checkpoint, before the transfer:
    # A's call fails, A settles it with a fenced commit (it succeeds) and
    # processes the trigger.
    "kill B before prepare": ("", "handoff.prepare=kill", "dep-a"),
    "kill B after prepare": ("", "handoff.before_transfer=kill", "dep-a"),
    # B dies after the transfer committed, before its first commit: A's
    # settling commit is FENCED, A's run ends; the other B instance takes the
    # session over after B's lease and processes the trigger.
    "kill B after transfer": ("", "handoff.after_transfer=kill", "dep-b"),
    # The transfer's answer to B is lost: B replays it and gets the recorded
    # outcome.
    "lost transfer response": ("", "handoff.transfer_response=once:error", "dep-b"),
    # B's answer to A is lost: A settles it (FENCED: it moved).
    "lost accept response": ("handoff.accept_response=once:error", "", "dep-b"),
}
LOGS = {
    "lost transfer response": (("b1", "b2"), "transfer outcome settled by a replay"),
    "lost accept response": (("a1",), "handoff settled: the session moved"),
    "kill B before prepare": (("a1",), "handoff settled: the session stays"),
    "kill B after prepare": (("a1",), "handoff settled: the session stays"),
    "kill B after transfer": (("a1",), "handoff settled: the session moved"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_handoff_survives_a_crash_at_each_step(
    case: str, etcd_endpoint: str, tmp_path: Path
) -> None:
    a1_points, b_points, expected = CASES[case]
    run = await start(etcd_endpoint, tmp_path, a1=a1_points, b=b_points)
    try:
        watch, receipts, trigger = await begin(run)
        events = await settle(run, receipts)
        # One more turn through each ingress: the session works on.
        receipts.append(await run.send(run.b, "what is 3*3"))
        receipts.append(await run.send(run.a, "hello again"))
        events = await settle(run, receipts)
        await watch.stop()
        check(events, receipts)
        assert trigger_ran_on(events, trigger) == expected, case
        results = [e.tool_result.output for e in events if e.kind == K.EVENT_KIND_TOOL_CALL_RESULT]
        assert results[0] == expected, "the tool reports another deployment than its owner"
        if expected == "dep-b":
            assert await transfers(run) >= 1
        # The fault really happened where the case says.
        if a1_points.endswith("kill"):
            assert run.stack.owners["a1"].proc.poll() == -9, "a1 was not killed at its failpoint"
        if b_points.endswith("kill"):
            killed = [i for i in ("b1", "b2") if run.stack.owners[i].proc.poll() == -9]
            assert len(killed) == 1, f"B instances killed at the failpoint: {killed}"
        if case in LOGS:
            instances, text = LOGS[case]
            assert any(run.log_has(i, text) for i in instances), f"no {text!r} in {instances}"
    finally:
        await stop(run)


@pytest.mark.parametrize(
    ("b_points", "step"),
    [
        ("handoff.before_transfer=sleep(1500)", "handoff checkpoint validated"),
        ("handoff.after_transfer=sleep(1000)", "session transferred here"),
    ],
    ids=["while B validates", "after the transfer"],
)
async def test_a_dies_while_b_takes_the_session(
    b_points: str, step: str, etcd_endpoint: str, tmp_path: Path
) -> None:
    """A is killed while B is between steps: B finishes (or, if A's fleet
    took the session over first, the transfer is FENCED and a2 hands off
    again); either way the trigger runs once, on B."""
    run = await start(etcd_endpoint, tmp_path, b=b_points)
    try:
        watch, receipts, trigger = await begin(run)
        await wait_log(run, ("b1", "b2"), step)
        run.stack.kill("a1")
        events = await settle(run, receipts)
        receipts.append(await run.send(run.a, "hello again"))
        events = await settle(run, receipts)
        await watch.stop()
        check(events, receipts)
        assert trigger_ran_on(events, trigger) == "dep-b"
    finally:
        await stop(run)


async def test_deliveries_racing_the_transfer_keep_a_in_charge_in_fifo(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    run = await start(etcd_endpoint, tmp_path, b="handoff.before_transfer=sleep(1000)")
    try:
        watch, receipts, trigger = await begin(run, caller="u1")
        await wait_log(run, ("b1", "b2"), "handoff checkpoint validated")
        # Both ingresses keep accepting (no retry loop, one session).
        receipts.append(await run.send(run.a, "what is 1+1", caller="u2"))
        receipts.append(await run.send(run.b, "what is 2+2", caller="u3"))
        events = await settle(run, receipts)
        await watch.stop()
        check(events, receipts)
        assert trigger_ran_on(events, trigger) == "dep-a"
        assert {e.deployment_id for e in events} == {"dep-a"}
        assert await transfers(run) == 0
        assert run.log_has("a1", "handoff refused; processing here")
    finally:
        await stop(run)


# -- chaos: traffic through both deployments while owners die -------------------------


async def _follow(run: Run, sid: str, out: list[s.Event], broke: list[str]) -> None:
    """A live reader on A's ingress; it must never be cut off."""
    call = run.a.StreamEvents(
        ingress_pb.StreamEventsRequest(session_id=sid, follow=True), metadata=SLACK
    )
    try:
        async for response in call:
            out.extend(response.events)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            broke.append(f"{sid}: {exc.code().name}")
    finally:
        call.cancel()


async def handoff_chaos(
    etcd_endpoint: str, workdir: Path, *, sessions: int, rounds: int, seed: int
) -> None:
    """Rounds of sends to random sessions through random ingresses (so
    sessions hop between deployments, or stay when busy), each round killing
    (-9) a random owner instance and starting a replacement in its deployment."""
    rng = random.Random(seed)
    run = await start(etcd_endpoint, workdir)
    followers: list[asyncio.Task[None]] = []
    try:
        sids = [run.session_id]
        for _ in range(sessions - 1):
            created = await run.a.CreateSession(
                ingress_pb.CreateSessionRequest(), metadata=SLACK, timeout=10
            )
            sids.append(created.session_id)
        seen: dict[str, list[s.Event]] = {sid: [] for sid in sids}
        broke: list[str] = []
        followers = [asyncio.create_task(_follow(run, sid, seen[sid], broke)) for sid in sids]
        receipts: dict[str, list[int]] = {sid: [] for sid in sids}
        deployments = {"a1": "dep-a", "a2": "dep-a", "b1": "dep-b", "b2": "dep-b"}
        spare = 3
        for round_ in range(rounds):
            for sid in sids:
                run.session_id = sid
                for _ in range(rng.choice([1, 1, 2])):
                    via = rng.choice([run.a, run.b])
                    text = rng.choice(["whoami", "steps 2", f"hello {round_}", "sleep 2 150"])
                    receipts[sid].append(await run.send(via, text))
            live = [i for i, p in run.stack.owners.items() if p.proc and p.proc.poll() is None]
            victim = rng.choice(live)
            deployment = deployments[victim]
            run.stack.kill(victim)
            replacement = f"{deployment[-1]}{spare}"
            spare += 1
            deployments[replacement] = deployment
            run.stack.start_owner(replacement, deployment_id=deployment)
            for sid in sids:
                count = len(receipts[sid])
                await run.clients.wait_events(
                    sid, lambda ev, n=count: answered(ev, n), "round answered", timeout=90
                )
        moves = 0
        for sid in sids:
            events = await run.clients.events(sid)
            moves += sum(e.kind == K.EVENT_KIND_SESSION_HANDED_OFF for e in events)
            check(events, receipts[sid])
            assert received_seqs(events) == list(range(len(receipts[sid])))
            # The deployment tool reports the deployment of the run that called it.
            for event in events:
                if (
                    event.kind == K.EVENT_KIND_TOOL_CALL_RESULT
                    and event.tool_result.name == "deployment"
                ):
                    assert event.tool_result.output == event.deployment_id
            live_view = seen[sid][: len(events)]
            assert [e.seq for e in live_view] == list(range(len(live_view)))
        assert not broke, f"live readers were cut off: {broke}"
        assert moves > 0, "no session ever moved between deployments"
    finally:
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        await stop(run)


async def test_handoff_chaos(etcd_endpoint: str, tmp_path: Path) -> None:
    await handoff_chaos(etcd_endpoint, tmp_path, sessions=4, rounds=2, seed=11)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_handoff_chaos_slow(etcd_endpoint: str, tmp_path: Path) -> None:
    await handoff_chaos(etcd_endpoint, tmp_path, sessions=10, rounds=10, seed=12)
