"""Child sessions under crashes, with real processes: owners a1 and a2 of
dep-a (a parent on a1 starts its children on a2, the other live instance),
hooks, anchor, ingress and a real etcd. The child's owner, the parent's
owner, or both are killed (-9) while the child works and while its result is
being delivered (at failpoints in the report delivery and in the parent's
application of it); a handoff whose AcceptHandoff answer is lost races a
child's report.

Every scenario checks the history (docs/design.md §9, §11): each stream gapless;
every accepted command processed once, in FIFO order; every result applied
once; no committed step run twice; the owner runs of each session follow one
another and never come back; the child stays on its deployment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands import deployments
from baton_runtime.common.clients.owner import OwnerClient
from tests.procs import SLACK, ProcessStack, StackClients, eventually, received_seqs
from tests.stack import public_channel

K = s.EventKind
WAITING = K.EVENT_KIND_SESSION_WAITING
ANSWERED = K.EVENT_KIND_MESSAGE_COMPLETED
OUTCOMES = (K.EVENT_KIND_TASK_COMPLETED, K.EVENT_KIND_TASK_FAILED)


@dataclass
class Run:
    stack: ProcessStack
    clients: StackClients
    session_id: str = ""

    async def send(self, text: str, via: ingress_pb2_grpc.IngressServiceStub | None = None) -> int:
        response = await (via or self.clients.ingress).SendMessage(
            ingress_pb.SendMessageRequest(session_id=self.session_id, text=text),
            metadata=SLACK,
            timeout=10,
        )
        return response.receipt.seq

    def log_has(self, instance_id: str, text: str) -> bool:
        path = self.stack.workdir / f"{instance_id}.log"
        return path.exists() and text in path.read_text(errors="replace")

    def dead(self, instance_id: str) -> bool:
        proc = self.stack.owners[instance_id].proc
        return proc is not None and proc.poll() is not None


async def start(
    etcd_endpoint: str,
    workdir: Path,
    owners: dict[str, tuple[str, str]],
    ingresses: dict[str, tuple[str, str]] | None = None,
) -> Run:
    """`owners`: instance -> (deployment, failpoints); `ingresses`: besides
    dep-a's "ingress" (sessions start on a1), name -> (deployment, owner)."""
    stack = ProcessStack(etcd_endpoint, workdir, deployment_id="dep-a", lease_ttl=2)
    stack.start_deployments(
        owners=owners, ingresses={"ingress": ("dep-a", "a1"), **(ingresses or {})}
    )
    clients = stack.clients()
    run = Run(stack, clients)
    deployments = {d for d, _ in owners.values()}

    async def registered() -> bool:
        for deployment in deployments:
            live = await clients.hooks.list_instances(deployment)
            expected = sum(1 for d, _ in owners.values() if d == deployment)
            if len(live) != expected:
                return False
        return True

    await eventually(registered, "owners registered", 30)
    created = await clients.ingress.CreateSession(
        ingress_pb.CreateSessionRequest(), metadata=SLACK, timeout=10
    )
    run.session_id = created.session_id
    return run


def settled(count: int) -> Callable[[list[s.Event]], bool]:
    """`count` turns settled (session.waiting) and nothing open after the last."""

    def done(events: list[s.Event]) -> bool:
        waits = sum(e.kind == WAITING for e in events)
        return waits >= count and events[-1].kind == WAITING

    return done


async def children_of(run: Run) -> list[str]:
    events = await run.clients.events(run.session_id)
    return list(
        dict.fromkeys(e.child_session_id for e in events if e.kind == K.EVENT_KIND_TASK_STARTED)
    )


def check_stream(events: list[s.Event]) -> None:
    """What every session's stream must keep, whatever crashed."""
    assert [e.seq for e in events] == list(range(len(events))), "stream has a gap or duplicate"
    assert sum(e.kind == K.EVENT_KIND_SESSION_STARTED for e in events) == 1
    applied = (K.EVENT_KIND_MESSAGE_RECEIVED, *OUTCOMES, K.EVENT_KIND_COMMAND_REJECTED)
    consumed = [e.inbox_seq for e in events if e.kind in applied and e.delivery_id]
    assert len(consumed) == len(set(consumed)), f"an inbox entry applied twice: {consumed}"
    assert received_seqs(events) == sorted(received_seqs(events)), "messages out of FIFO order"
    calls = [e.tool_call.id for e in events if e.kind == K.EVENT_KIND_TOOL_CALL_REQUESTED]
    assert len(calls) == len(set(calls)), f"a tool call was committed twice: {calls}"
    steps = [(e.turn_id, e.step) for e in events if e.kind == K.EVENT_KIND_STEP_COMPLETED]
    assert len(steps) == len(set(steps)), f"a step committed twice: {steps}"
    runs: list[str] = []
    for event in events:
        if not runs or runs[-1] != event.owner_run_id:
            assert event.owner_run_id not in runs, f"run {event.owner_run_id} came back"
            runs.append(event.owner_run_id)


async def check(run: Run, receipts: list[int], deployment: str = "dep-a") -> list[s.Event]:
    events = await run.clients.events(run.session_id)
    check_stream(events)
    assert received_seqs(events) == sorted(receipts), "a message was not processed once"
    outcomes = [e.delivery_id for e in events if e.kind in OUTCOMES]
    assert len(outcomes) == len(set(outcomes)), f"a result was applied twice: {outcomes}"
    for child in await children_of(run):
        child_events = await run.clients.events(child)
        check_stream(child_events)
        assert {e.deployment_id for e in child_events} == {deployment}, "a child moved"
        work = [e.delivery_id for e in child_events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED]
        assert len(work) == len(set(work)), f"work given twice: {work}"
        mine = [d for d in outcomes if d.startswith(f"task:{child}:")]
        assert len(mine) == len(work), f"{child}: {len(work)} pieces of work, results {mine}"
    return events


async def stop(run: Run) -> None:
    await run.clients.close()
    run.stack.stop()


async def wait_dead(run: Run, *instances: str, timeout: float = 30) -> None:
    async def dead() -> bool:
        return all(run.dead(i) for i in instances)

    await eventually(dead, f"{instances} killed at their failpoints", timeout)


# -- kills while the child works, and while its result is delivered -------------------------

# case -> (a1's failpoints, a2's failpoints, who the test kills mid-task, restart a3)
CASES = {
    "child's owner, mid-task": ("", "", ("a2",), False),
    "parent's owner, mid-task": ("", "", ("a1",), False),
    "both, mid-task": ("", "", ("a1", "a2"), True),
    "child's owner, before its report is delivered": (
        "",
        "children.before_report=kill",
        (),
        False,
    ),
    "child's owner, after its report is delivered": ("", "children.after_report=kill", (), False),
    "parent's owner, while it applies the result": (
        "children.apply_result=kill",
        "",
        (),
        False,
    ),
    "both, while the result is delivered and applied": (
        "children.apply_result=kill",
        "children.after_report=kill",
        (),
        True,
    ),
}


IDS = [
    "child-owner-mid-task",
    "parent-owner-mid-task",
    "both-mid-task",
    "child-owner-before-report",
    "child-owner-after-report",
    "parent-owner-applying",
    "both-delivering",
]


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
async def test_a_child_survives_kills(case: str, etcd_endpoint: str, tmp_path: Path) -> None:
    a1_points, a2_points, kill, restart = CASES[case]
    run = await start(
        etcd_endpoint, tmp_path, {"a1": ("dep-a", a1_points), "a2": ("dep-a", a2_points)}
    )
    try:
        # A workflow tool of three 1 s steps: the parent's turn waits for it.
        receipts = [await run.send("workflow 1000 data")]
        child = await eventually(lambda: _first_child(run), "the child started", 20)
        assert await run.clients.owner_of(child) == "a2", "the child runs on the other instance"
        assert await run.clients.owner_of(run.session_id) == "a1"
        if kill:
            # Its first step is committed; the second runs: kill now.
            await run.clients.wait_events(
                child, lambda ev: _steps(ev) >= 1, "the child's first step", 20
            )
            for instance_id in kill:
                run.stack.kill(instance_id)
        else:
            await wait_dead(run, *[i for i, p in (("a1", a1_points), ("a2", a2_points)) if p])
        if restart:
            await wait_dead(run, "a1", "a2")
            run.stack.start_owner("a3", deployment_id="dep-a")
        await run.clients.wait_events(run.session_id, settled(1), "the turn settled", 60)
        receipts.append(await run.send("hello"))
        events = await run.clients.wait_events(run.session_id, settled(2), "hello answered", 30)
        answers = [e.text for e in events if e.kind == ANSWERED]
        assert answers == ["pipeline says: stored transformed fetched data", "echo: hello"]
        events = await check(run, receipts)
        child_events = await run.clients.events(child)
        assert [
            e.tool_call.name for e in child_events if e.kind == K.EVENT_KIND_TOOL_CALL_REQUESTED
        ] == [
            "fetch",
            "transform",
            "store",
        ], "a committed workflow step ran again"
        if "a2" in kill or a2_points:
            # The child was taken over; its successor delivers its committed
            # reports again (deduplicated), and nothing changes.
            successor = "a3" if restart else "a1"

            async def redelivered() -> bool:
                log = run.stack.workdir / f"{successor}.log"
                return any(
                    "reports delivered" in line and child in line
                    for line in log.read_text(errors="replace").splitlines()
                )

            await eventually(redelivered, "the successor delivered the child's reports", 30)
            assert await run.clients.owner_of(child) == successor
            await check(run, receipts)
    finally:
        await stop(run)


async def _first_child(run: Run) -> str:
    found = await children_of(run)
    return found[0] if found else ""


def _steps(events: list[s.Event]) -> int:
    return sum(e.kind == K.EVENT_KIND_STEP_COMPLETED for e in events)


# -- a lost AcceptHandoff answer while a child's report is in flight --------------------------


async def test_a_lost_accept_answer_while_a_report_is_in_flight(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    """The parent idles on A with two parked subagents (on a2). A send
    through B continues one of them: A hands the parent off, B transfers and
    then stalls before starting it, A's AcceptHandoff answer is lost (A
    settles: FENCED, it moved); meanwhile the other subagent is reset by the
    channel and its finalization report lands in the parent's inbox. B's
    successor processes the trigger and then the report, each once."""
    run = await start(
        etcd_endpoint,
        tmp_path,
        {
            "a1": ("dep-a", "handoff.accept_response=once:error"),
            "a2": ("dep-a", ""),
            "b1": ("dep-b", "handoff.after_transfer=sleep(1500)"),
        },
        {"ingress-b": ("dep-b", "b1")},
    )
    b_channel = public_channel(run.stack.addr("ingress-b"))
    b = ingress_pb2_grpc.IngressServiceStub(b_channel)
    try:
        receipts = [await run.send("ask helper what is 2+3")]
        await run.clients.wait_events(run.session_id, settled(1), "first answer", 30)
        receipts.append(await run.send("ask helper what is 3+4"))
        await run.clients.wait_events(run.session_id, settled(2), "second answer", 30)
        first, second = await children_of(run)
        receipts.append(await run.send(f"continue {first} what is 4*4", via=b))
        await _wait_log(run, ("b1",), "session transferred here")
        await run.clients.ingress.SendControl(
            ingress_pb.SendControlRequest(session_id=second, kind=ingress_pb.CONTROL_KIND_RESET),
            metadata=SLACK,
            timeout=10,
        )

        def done(events: list[s.Event]) -> bool:
            answers = [e.text for e in events if e.kind == ANSWERED]
            return "helper says: The result is 16." in answers and events[-1].kind == WAITING

        await run.clients.wait_events(run.session_id, done, "continued from B", 60)

        async def settled_handle() -> bool:
            snapshot = await run.clients.anchor.snapshot(run.session_id)
            states = {h.child_session_id: h.state for h in snapshot.handles}
            return states.get(second) == s.HANDLE_STATE_SETTLED

        await eventually(settled_handle, "the reset child's handle settled", 30)
        assert run.log_has("a1", "handoff settled: the session moved")
        events = await check(run, receipts)
        trigger = [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED][-1]
        assert trigger.inbox_seq == receipts[-1] and trigger.deployment_id == "dep-b"
        assert sum(e.kind == K.EVENT_KIND_SESSION_HANDED_OFF for e in events) == 1
        assert not [e for e in events if e.kind == K.EVENT_KIND_COMMAND_REJECTED]
        snapshot = await run.clients.anchor.snapshot(run.session_id)
        assert snapshot.deployment_id == "dep-b"
        reports = [e for e in events if e.delivery_id == f"final:{second}"]
        assert reports == [], "a finalization changes handles only"
    finally:
        await b_channel.close()
        await stop(run)


async def _wait_log(run: Run, instances: tuple[str, ...], text: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(run.log_has(i, text) for i in instances):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {instances} log says {text!r} within {timeout}s")


# -- retiring a deployment: a drain waits for running children, then moves all ----------


async def test_a_drain_moves_a_parent_after_its_running_task_and_the_child_too(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    """A drain of dep-a to dep-b while a parent's background task runs: the
    parent is not idle (a child works for it), so it moves once the result
    was applied; the child moves once its turn settled (a drain, unlike an
    upgrade trigger, moves children: retiring a deployment strands none).
    The moved parent continues the moved child on dep-b."""
    run = await start(
        etcd_endpoint,
        tmp_path,
        {"a1": ("dep-a", ""), "b1": ("dep-b", "")},
        {"ingress-b": ("dep-b", "b1")},
    )
    b_channel = public_channel(run.stack.addr("ingress-b"))
    b = ingress_pb2_grpc.IngressServiceStub(b_channel)
    try:
        receipts = [await run.send("task 2500 one")]
        await run.clients.wait_events(run.session_id, settled(1), "the task started", 30)
        [child] = await children_of(run)
        lines: list[str] = []
        drained = asyncio.create_task(
            deployments.drain(
                run.stack.addr("hooks"),
                "dep-a",
                "dep-b",
                run.stack.probe,
                wait_s=60,
                poll_s=0.2,
                write=lines.append,
            )
        )
        # While the task runs, the drain reports the parent as blocked by it.
        owner = OwnerClient(run.stack.addr("a1"), timeout=5, security=run.stack.probe)
        try:

            async def blocked() -> bool:
                report = await owner.drain_sessions("dep-b")
                return any(
                    b.session_id == run.session_id and "a child session works" in b.detail
                    for b in report.blockers
                )

            await eventually(blocked, "the parent reported as blocked by its child", 20)
        finally:
            await owner.close()
        assert await drained == deployments.EXIT_DRAINED, "\n".join(lines)
        # The drain counts the parent as moved once the transfer is done; the
        # successor's first commit (session.handed_off) may land just after.
        events = await run.clients.wait_events(
            run.session_id,
            lambda ev: any(e.kind == K.EVENT_KIND_SESSION_HANDED_OFF for e in ev),
            "the successor's first commit",
            30,
        )
        done = [e for e in events if e.kind == K.EVENT_KIND_TASK_COMPLETED]
        handed = [e for e in events if e.kind == K.EVENT_KIND_SESSION_HANDED_OFF]
        assert len(done) == 1 and done[0].deployment_id == "dep-a"
        assert len(handed) == 1 and handed[0].seq > done[0].seq, "moved before its result"
        child_events = await run.clients.events(child)
        assert [e.text for e in child_events if e.kind == K.EVENT_KIND_SESSION_HANDED_OFF] == [
            "dep-a"
        ]
        receipts.append(await run.send(f"continue {child} two", via=b))
        events = await run.clients.wait_events(run.session_id, settled(3), "continued on B", 30)
        assert [e.text for e in events if e.kind == ANSWERED][-1] == "slow_task says: done: two"
        check_stream(events)
        assert [e.deployment_id for e in events if e.kind == ANSWERED][-1] == "dep-b"
        child_events = await run.clients.events(child)
        check_stream(child_events)
        last_turn = [e for e in child_events if e.kind == K.EVENT_KIND_TURN_COMPLETED][-1]
        assert last_turn.deployment_id == "dep-b"
    finally:
        await b_channel.close()
        await stop(run)
