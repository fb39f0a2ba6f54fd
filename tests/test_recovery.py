"""Crash recovery with real processes (docs/design.md §5, §9).

Owner instances register under leases; when one dies (kill -9) or is paused
past its lease (SIGSTOP), another instance of the deployment takes its
sessions over with epoch + 1 and continues from the last committed snapshot
and inbox position. Commands accepted while no owner was live are processed
in order; no committed step runs twice (only the step in flight at the crash
runs again); the paused owner's late writes are fenced and it exits. etcd
restarts under load lose nothing.

Each test checks the whole history with `check_history`: gapless stream,
every receipt processed once in FIFO order, no tool call or step twice, one
owner run per epoch (a run never writes after its successor).
"""

from __future__ import annotations

import asyncio
import functools
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.rpc.status_map import error_reason
from baton_runtime.owner.run.terms import Lease
from baton_runtime.owner.server import EXIT_LEASE_LOST
from tests.certs import etcd_client, start_etcd
from tests.procs import (
    SLACK,
    ProcessStack,
    StackClients,
    answered,
    check_history,
    eventually,
    inbox_entries_left,
    received_seqs,
)
from tests.scrape import scrape

K = s.EventKind
MakeStack = Callable[..., ProcessStack]

# A takeover must land within the lease TTL plus this (generous for loaded CI).
TAKEOVER_SLACK_S = 8.0


@pytest.fixture
def make_stack(etcd_endpoint: str, tmp_path: Path) -> Iterator[MakeStack]:
    stacks: list[ProcessStack] = []

    def make(owners: int = 2, endpoint: str = "", **kwargs: object) -> ProcessStack:
        stack = ProcessStack(
            endpoint or etcd_endpoint,
            tmp_path / f"stack{len(stacks)}",
            **kwargs,  # type: ignore[arg-type]
        )
        stacks.append(stack)
        return stack.start(owners)

    try:
        yield make
    finally:
        for stack in stacks:
            stack.stop()


def step_committed(step: int) -> Callable[[list[s.Event]], bool]:
    return lambda events: any(
        e.kind == K.EVENT_KIND_STEP_COMPLETED and e.step == step for e in events
    )


def runs_in_order(events: list[s.Event]) -> list[str]:
    return list(dict.fromkeys(e.owner_run_id for e in events))


def answers(events: list[s.Event]) -> list[str]:
    return [e.text for e in events if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED]


async def wait_owner(c: StackClients, session_id: str, instance_id: str, timeout: float) -> float:
    """Seconds until the ownership index names `instance_id` for the session."""
    start = time.monotonic()

    async def moved() -> bool:
        return await c.owner_of(session_id) == instance_id

    await eventually(moved, f"{session_id} owned by {instance_id}", timeout)
    return time.monotonic() - start


async def test_kill9_mid_step_is_taken_over_and_continues(make_stack: MakeStack) -> None:
    stack = make_stack(owners=2)
    c = stack.clients()
    try:
        await c.wait_registered("o1", "o2")
        sid = await c.create()  # ingress creates on o1
        receipts = [(await c.send(sid, "sleep 4 700")).receipt.seq]
        await c.wait_events(sid, step_committed(1), "step 1 committed")
        stack.kill("o1")  # step 2 (a 700 ms tool call) is in flight
        # Accepted while no owner is live: queued behind the open turn.
        for i in range(3):
            receipts.append((await c.send(sid, f"while dead {i}")).receipt.seq)
        took = await wait_owner(c, sid, "o2", stack.lease_ttl + TAKEOVER_SLACK_S)
        events = await c.wait_events(sid, lambda ev: answered(ev, 4), "every command answered")
        check_history(events, receipts)
        # The successor read from the snapshot's position and deleted what it consumed.
        assert await inbox_entries_left(stack.etcd_endpoint, stack.prefix, sid) == []
        first_run, second_run = runs_in_order(events)
        assert answers(events) == [
            "The result is slept 3.",
            "echo: while dead 0",
            "echo: while dead 1",
            "echo: while dead 2",
        ]
        # Step 1 was committed by the first run; the step in flight at the crash
        # (2) ran again, under the successor only, which finished the turn.
        turn = next(e.turn_id for e in events if e.kind == K.EVENT_KIND_TURN_STARTED)
        steps = [
            (e.step, e.owner_run_id)
            for e in events
            if e.kind == K.EVENT_KIND_STEP_COMPLETED and e.turn_id == turn
        ]
        assert steps == [(1, first_run), (2, second_run), (3, second_run), (4, second_run)]
        print(f"takeover observed {took:.2f}s after kill -9 (lease TTL {stack.lease_ttl}s)")
    finally:
        await c.close()


async def test_all_instances_dead_then_a_new_one_takes_over(make_stack: MakeStack) -> None:
    """The only instance dies between turns; commands keep being accepted; a
    new instance finds the orphaned sessions at start and runs them in order."""
    stack = make_stack(owners=1)
    c = stack.clients()
    try:
        await c.wait_registered("o1")
        sids = [await c.create() for _ in range(3)]
        receipts: dict[str, list[int]] = {sid: [] for sid in sids}
        for sid in sids:
            receipts[sid].append((await c.send(sid, "steps 3")).receipt.seq)
        for sid in sids:
            await c.wait_events(sid, lambda ev: answered(ev, 1), "first turn answered")
        stack.kill("o1")
        for sid in sids:
            for i in range(3):
                receipt = (await c.send(sid, f"orphan {i}")).receipt
                receipts[sid].append(receipt.seq)
        stack.start_owner("o2")
        for sid in sids:
            events = await c.wait_events(
                sid, lambda ev: answered(ev, 4), "orphaned commands answered", timeout=40
            )
            check_history(events, receipts[sid])
            assert answers(events)[1:] == [f"echo: orphan {i}" for i in range(3)]
            assert len(runs_in_order(events)) == 2
            assert await c.owner_of(sid) == "o2"
    finally:
        await c.close()


async def test_session_without_a_first_commit_is_started_by_its_successor(
    make_stack: MakeStack,
) -> None:
    """The creator died between CreateSession and committing session.started:
    the successor commits it, then serves the inbox."""
    stack = make_stack(owners=1)
    c = stack.clients()
    try:
        await c.wait_registered("o1")
        sid = ids.new_session_id()
        ghost = s.OwnerIdentity(
            owner_run_id=ids.new_run_id(), deployment_id=stack.deployment_id, instance_id="ghost"
        )
        await c.hooks.create_session(sid, ghost, "slack", [])
        receipt = (await c.send(sid, "hello")).receipt
        stack.start_owner("o2")  # finds "ghost" indexed but not live
        events = await c.wait_events(sid, lambda ev: answered(ev, 1), "answered by the successor")
        check_history(events, [receipt.seq])
        assert events[0].kind == K.EVENT_KIND_SESSION_STARTED
        assert events[0].owner_run_id != ghost.owner_run_id
        assert answers(events) == ["echo: hello"]
    finally:
        await c.close()


async def test_paused_owner_is_fenced_and_exits(make_stack: MakeStack) -> None:
    """SIGSTOP an owner mid-step past its lease: another instance takes over.
    After SIGCONT its late commit is fenced, its runs end, and it exits."""
    stack = make_stack(owners=2)
    c = stack.clients()
    try:
        await c.wait_registered("o1", "o2")
        sid = await c.create()
        receipts = [(await c.send(sid, "sleep 4 700")).receipt.seq]
        await c.wait_events(sid, step_committed(1), "step 1 committed")
        stack.pause("o1")  # step 2 in flight, frozen
        await wait_owner(c, sid, "o2", stack.lease_ttl + TAKEOVER_SLACK_S)
        for i in range(2):
            receipts.append((await c.send(sid, f"while paused {i}")).receipt.seq)
        events = await c.wait_events(sid, lambda ev: answered(ev, 3), "answered by o2")
        stack.resume("o1")
        proc = stack.owners["o1"].proc
        assert proc is not None

        async def exited() -> bool:
            return proc.poll() is not None

        await eventually(exited, "the paused owner to exit after SIGCONT", timeout=20)
        assert proc.returncode == EXIT_LEASE_LOST
        after = await c.events(sid)
        assert after == events, "the fenced owner wrote after its successor took over"
        check_history(after, receipts)
        first_run, second_run = runs_in_order(after)
        takeover = next(i for i, e in enumerate(after) if e.owner_run_id == second_run)
        assert all(e.owner_run_id == second_run for e in after[takeover:])
        log = (stack.workdir / "o1.log").read_text()
        assert "lease expired" in log
    finally:
        await c.close()


def failpoint_hits(log: str, name: str) -> int:
    return sum(1 for line in log.splitlines() if "failpoint hit" in line and name in line)


async def test_a_paused_owner_makes_no_model_call_for_a_step_its_successor_ran(
    make_stack: MakeStack,
) -> None:
    """The protocol model's finding (docs/model.md): o1 took m0 and was
    about to run its step when it was paused past its lease; o2 took over
    and ran the step. Resumed, o1 makes no model call for it: by its own
    clock its lease may have expired, so it waits for a keep-alive, which
    says the lease is gone, and exits. (Before, it called the model, and
    only its commit was fenced.)"""
    points = "step.start=once:sleep(4000);step.model_call=sleep(0)"
    stack = make_stack(owners=2, owner_env={"BATON_FAILPOINTS": points})
    c = stack.clients()
    o1_log = stack.workdir / "o1.log"
    try:
        await c.wait_registered("o1", "o2")
        sid = await c.create()  # ingress creates on o1
        receipts = [(await c.send(sid, "hello")).receipt.seq]

        async def about_to_step() -> bool:
            return failpoint_hits(await asyncio.to_thread(o1_log.read_text), "step.start") > 0

        await eventually(about_to_step, "o1 at m0's step", timeout=20)
        stack.pause("o1")
        assert failpoint_hits(o1_log.read_text(), "step.model_call") == 0, "paused too late"
        await wait_owner(c, sid, "o2", stack.lease_ttl + TAKEOVER_SLACK_S)
        events = await c.wait_events(sid, lambda ev: answered(ev, 1), "m0 answered by o2")
        stack.resume("o1")
        proc = stack.owners["o1"].proc
        assert proc is not None

        async def exited() -> bool:
            return proc.poll() is not None

        await eventually(exited, "the paused owner to exit after SIGCONT", timeout=20)
        assert proc.returncode == EXIT_LEASE_LOST
        log = o1_log.read_text()
        assert failpoint_hits(log, "step.model_call") == 0, "o1 ran the step o2 had run"
        assert "the lease may have expired" in log
        check_history(await c.events(sid), receipts)
        assert events[-1].owner_run_id == runs_in_order(events)[-1] != runs_in_order(events)[0]
    finally:
        await c.close()


async def test_one_hung_keep_alive_does_not_cost_the_lease(make_stack: MakeStack) -> None:
    """One keep-alive that hangs past its interval (a lost reply, a slow
    etcd member) costs that beat only: the next one goes out on the beat
    after, inside the TTL. (Sleeping a whole interval after the hung one
    sent the next three intervals after the last renewal, past a TTL of
    4 s at 1.5 s: the owner lost its lease and exited; issue 38.)"""
    stack = make_stack(
        owners=1,
        lease_ttl=4,
        owner_env={
            "BATON_OWNER_KEEPALIVE_INTERVAL": "1.5",
            "BATON_FAILPOINTS": "fleet.keep_alive=once:sleep(5000)",
        },
    )
    c = stack.clients()
    log = stack.workdir / "o1.log"
    try:
        await c.wait_registered("o1")

        async def outcome() -> str:
            text = log.read_text()
            for line in ("keep-alive answered again", "lease expired"):
                if line in text:
                    return line
            return ""

        assert await eventually(outcome, "the keep-alive after the hung one", 30) == (
            "keep-alive answered again"
        )
        proc = stack.owners["o1"].proc
        assert proc is not None and proc.poll() is None
    finally:
        await c.close()


async def test_a_gracefully_stopped_owner_hands_over_without_waiting_for_its_lease(
    make_stack: MakeStack,
) -> None:
    stack = make_stack(owners=2, lease_ttl=60)
    c = stack.clients()
    try:
        await c.wait_registered("o1", "o2")
        sid = await c.create()
        receipts = [(await c.send(sid, "hello")).receipt.seq]
        await c.wait_events(sid, lambda ev: answered(ev, 1), "answered on o1")
        stack.owners["o1"].stop()  # SIGTERM: stop runs, revoke the lease
        took = await wait_owner(c, sid, "o2", timeout=20)
        assert took < 20 < stack.lease_ttl
        receipts.append((await c.send(sid, "after the handover")).receipt.seq)
        events = await c.wait_events(sid, lambda ev: answered(ev, 2), "answered on o2")
        check_history(events, receipts)
    finally:
        await c.close()


async def test_parked_sessions_are_taken_over_parked_and_woken_by_input(
    make_stack: MakeStack,
) -> None:
    """A parked session of a dead instance stays parked under its successor
    (nothing loaded) unless input arrived meanwhile; then it runs at once."""
    stack = make_stack(owners=2, park_after=0.3)
    c = stack.clients()
    try:
        await c.wait_registered("o1", "o2")
        quiet, busy = await c.create(), await c.create()
        receipts: dict[str, list[int]] = {quiet: [], busy: []}
        for sid in (quiet, busy):
            receipts[sid].append((await c.send(sid, "hello")).receipt.seq)

        async def parked_on(instance_id: str, sid: str) -> bool:
            owned = await c.hooks.list_instance_sessions(stack.deployment_id, instance_id)
            return any(o.fence.session_id == sid and o.parked for o in owned)

        for sid in (quiet, busy):
            await eventually(functools.partial(parked_on, "o1", sid), "parked on o1")
        stack.kill("o1")
        receipts[busy].append((await c.send(busy, "while dead")).receipt.seq)
        timeout = stack.lease_ttl + TAKEOVER_SLACK_S
        await eventually(
            functools.partial(parked_on, "o2", quiet), "quiet session parked on o2", timeout
        )
        events = await c.wait_events(busy, lambda ev: answered(ev, 2), "busy session answered")
        check_history(events, receipts[busy])
        # The quiet session wakes on its next command, under its new run.
        receipts[quiet].append((await c.send(quiet, "wake up")).receipt.seq)
        events = await c.wait_events(quiet, lambda ev: answered(ev, 2), "woken and answered")
        check_history(events, receipts[quiet])
        assert answers(events) == ["echo: hello", "echo: wake up"]
        assert len(runs_in_order(events)) == 2
    finally:
        await c.close()


async def test_an_owner_restarted_under_its_own_id_takes_each_session_over_once(
    make_stack: MakeStack,
) -> None:
    """kill -9 of the only instance, restarted under the same instance id (as
    a supervisor does): it takes each of its sessions over exactly once —
    busy, parked, and parked with input that arrived while it was dead — and
    runs them all. (Its own index lists what it took over, under the same
    instance: the restarted process used to take those over again, round
    after round, fencing its own runs; a run that parked meanwhile held a
    dead fence, and its session was never woken again — issue 16.)"""
    stack = make_stack(owners=1, park_after=0.3)
    c = stack.clients()
    try:
        await c.wait_registered("o1")
        quiet = [await c.create() for _ in range(3)]
        woken = [await c.create() for _ in range(3)]
        busy = [await c.create() for _ in range(3)]
        every = [*quiet, *woken, *busy]
        receipts: dict[str, list[int]] = {sid: [] for sid in every}
        for sid in (*quiet, *woken):
            receipts[sid].append((await c.send(sid, "hello")).receipt.seq)

        async def parked(sid: str) -> bool:
            return (await c.hooks.get_owner(sid)).parked

        for sid in (*quiet, *woken):
            await eventually(functools.partial(parked, sid), "parked")
        for sid in busy:
            receipts[sid].append((await c.send(sid, "sleep 4 400")).receipt.seq)
        for sid in busy:
            await c.wait_events(sid, step_committed(1), "a step of the long turn committed")
        epochs = {sid: (await c.hooks.get_owner(sid)).fence.epoch for sid in every}
        stack.kill("o1")
        for sid in woken:
            receipts[sid].append((await c.send(sid, "while dead")).receipt.seq)
        stack.start_owner("o1")
        for sid in (*woken, *busy):
            await c.wait_events(
                sid,
                functools.partial(answered, count=len(receipts[sid])),
                "answered after the restart",
                timeout=40,
            )
        # Everything once more (the quiet ones wake for it): nothing was
        # taken over twice, and every session answers.
        for sid in every:
            receipts[sid].append((await c.send(sid, "again")).receipt.seq)
        for sid in every:
            events = await c.wait_events(
                sid,
                functools.partial(answered, count=len(receipts[sid])),
                "answered again",
                timeout=40,
            )
            check_history(events, receipts[sid])
            taken = (await c.hooks.get_owner(sid)).fence.epoch - epochs[sid]
            assert taken == 1, f"{sid} was taken over {taken} times by the restarted instance"
            assert await c.owner_of(sid) == "o1"
    finally:
        await c.close()


async def test_a_parked_sessions_timeout_survives_its_owners_restart(
    make_stack: MakeStack,
) -> None:
    """A parked session's lifetime deadline survives every takeover that
    keeps it parked (here: kill -9 of its only instance, restarted under the
    same id, as every rolling restart does): `late` times out while its
    owner is dead, `later` after the restart; both time out, and a message
    sent to `late` past its deadline, while no instance holds it, is refused
    as for a finalized session, not accepted to start a turn that the
    timeout then cancels (issue 32)."""
    stack = make_stack(owners=1, park_after=0.3)
    c = stack.clients()
    try:
        await c.wait_registered("o1")
        late, later = await c.create(timeout_seconds=8), await c.create(timeout_seconds=14)
        for sid in (late, later):
            assert (await c.send(sid, "hello")).receipt.seq == 0

        async def parked(sid: str) -> bool:
            return (await c.hooks.get_owner(sid)).parked

        for sid in (late, later):
            await eventually(functools.partial(parked, sid), "parked")
        stack.kill("o1")
        got = await c.ingress.GetSession(
            ingress_pb.GetSessionRequest(session_id=late), metadata=SLACK, timeout=10
        )
        deadline = got.session.timeout_deadline.seconds
        assert deadline
        # A deadline is a time of day: nothing to wait on but the clock.
        await asyncio.sleep(max(0.0, deadline - time.time()) + 0.5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.send(late, "past the deadline")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_reason(refused.value) == "SESSION_FINALIZED"

        stack.start_owner("o1")

        def completed(events: list[s.Event]) -> bool:
            return bool(events) and events[-1].kind == K.EVENT_KIND_SESSION_COMPLETED

        for sid in (late, later):
            events = await c.wait_events(sid, completed, "the session timed out")
            check_history(events, [0])
            assert events[-1].error.reason == "TIMEOUT"
            assert answers(events) == ["echo: hello"]
    finally:
        await c.close()


@pytest.mark.parametrize(
    ("failpoint", "how", "epochs_on"),
    [
        # the host drops the session as it parks: no run holds it anywhere,
        # and the reconciler takes it over from itself (epoch + 1)
        ("host.hold_parked", "taken_over", 1),
        # the session's first bell never reaches it: held parked with input
        # waiting, and the reconciler wakes it (same fence, no takeover)
        ("host.ring", "woken", 0),
    ],
)
async def test_a_session_a_watch_lost_is_set_going_by_the_reconciler(
    make_stack: MakeStack, failpoint: str, how: str, epochs_on: int
) -> None:
    """What no watch will wake (a session its host lost, or one whose bell
    it lost) is found by the instance's reconciliation (two sightings, one
    interval apart, the same fence), set going and answered; the repair is
    counted (baton_reconciled_sessions_total{how})."""
    stack = make_stack(
        owners=1,
        park_after=0.3,
        serve_metrics=True,
        owner_env={
            "BATON_FAILPOINTS": f"{failpoint}=once:error",
            "BATON_OWNER_RECONCILE_INTERVAL": "0.5",
        },
    )
    c = stack.clients()
    try:
        await c.wait_registered("o1")
        sid = await c.create()
        receipts = [(await c.send(sid, "hello")).receipt.seq]

        async def parked() -> bool:
            return (await c.hooks.get_owner(sid)).parked

        await eventually(parked, "parked")
        epoch = (await c.hooks.get_owner(sid)).fence.epoch
        receipts.append((await c.send(sid, "anyone there?")).receipt.seq)
        events = await c.wait_events(
            sid, functools.partial(answered, count=2), "answered after reconciliation"
        )
        check_history(events, receipts)
        assert (await c.hooks.get_owner(sid)).fence.epoch == epoch + epochs_on
        assert len(runs_in_order(events)) == 1 + epochs_on
        assert "failpoint hit" in (stack.workdir / "o1.log").read_text()
        scraped = await scrape(stack.metrics_url("o1"))
        assert scraped.total("baton_reconciled_sessions_total", how=how) == 1
        assert scraped.total("baton_takeovers_total") == epochs_on
    finally:
        await c.close()


# -- etcd restarts -------------------------------------------------------------------


async def send_until_accepted(c: StackClients, sid: str, text: str, delivery_id: str) -> int:
    """Retry a send with the same delivery id until it is accepted (the same
    id makes a retry of an accepted-but-unanswered send a duplicate), as a
    gateway would: also when refused over the channel's send rate
    (RESOURCE_EXHAUSTED: nothing was accepted; retried after a pause)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            response = await c.send(sid, text, delivery_id=delivery_id)
            return response.receipt.seq
        except grpc.aio.AioRpcError as exc:
            if time.monotonic() > deadline or exc.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            ):
                raise
        await asyncio.sleep(0.1)


async def follow(c: StackClients, sid: str, out: list[s.Event]) -> None:
    """A live reader through ingress, reconnecting from its cursor."""
    while True:
        call = c.ingress.StreamEvents(
            ingress_pb.StreamEventsRequest(session_id=sid, start_seq=len(out), follow=True),
            metadata=SLACK,
        )
        try:
            async for response in call:
                out.extend(response.events)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.1)
        finally:
            call.cancel()


async def _stalled(c: StackClients, endpoint: str, sid: str) -> str:
    """Where a session that stopped answering stands: its answers, its last
    events, its consumed inbox position against the inbox head, its owner."""
    events = await c.events(sid)
    keys = Keys(c.stack.prefix)
    client = await etcd_client(endpoint)
    try:
        values: dict[str, str | None] = {}
        for name, key in {
            "inhead": keys.inbox_head(sid),
            "fence": keys.fence(sid),
            "owner": keys.owner(sid),
        }.items():
            got = await client.get(key)
            values[name] = got.value.decode() if got is not None else None
        snap = await client.get(keys.snapshot(sid))
        next_seq = s.SessionSnapshot.FromString(snap.value).inbox_next_seq if snap else None
    finally:
        await client.close()
    kinds = [K.Name(e.kind).removeprefix("EVENT_KIND_") for e in events[-4:]]
    return (
        f"session {sid}: {len(answers(events))} answers, received up to "
        f"{received_seqs(events)[-1:]}, last events {kinds}, snapshot inbox_next_seq "
        f"{next_seq}, etcd {values}"
    )


async def etcd_restart_under_load(
    make_stack: MakeStack, *, sessions: int, messages: int, restarts: int
) -> None:
    data_dir = tempfile.mkdtemp(prefix="baton-etcd-restart-")
    etcd = start_etcd(data_dir=data_dir)
    stack = make_stack(owners=2, endpoint=etcd.endpoint, lease_ttl=5)
    c = stack.clients()
    followers: list[asyncio.Task[None]] = []
    try:
        await c.wait_registered("o1", "o2")
        sids = [await c.create() for _ in range(sessions)]
        seen: dict[str, list[s.Event]] = {sid: [] for sid in sids}
        followers = [asyncio.create_task(follow(c, sid, seen[sid])) for sid in sids]
        receipts: dict[str, list[int]] = {sid: [] for sid in sids}
        sent = asyncio.Event()
        progress = 0

        async def sender(sid: str) -> None:
            nonlocal progress
            for i in range(messages):
                seq = await send_until_accepted(c, sid, f"m{i}", f"{sid}-m{i}")
                receipts[sid].append(seq)
                progress += 1
            sent.set()

        senders = [asyncio.create_task(sender(sid)) for sid in sids]
        total = sessions * messages
        for round_ in range(restarts):
            target = total * (round_ + 1) // (restarts + 1)

            async def reached(target: int = target) -> bool:
                return progress >= target

            await eventually(reached, f"{target} messages accepted", timeout=60)
            etcd.stop()  # SIGTERM; data dir kept
            etcd = start_etcd(
                client_port=etcd.client_port, peer_port=etcd.peer_port, data_dir=data_dir
            )
        await asyncio.gather(*senders)
        for sid in sids:
            try:
                events = await c.wait_events(
                    sid, lambda ev: answered(ev, messages), "every message answered", timeout=60
                )
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{await _stalled(c, etcd.endpoint, sid)}") from None
            check_history(events, sorted(set(receipts[sid])))
            assert sorted(int(t.removeprefix("echo: m")) for t in answers(events)) == list(
                range(messages)
            )

            async def caught_up(sid: str = sid, n: int = len(events)) -> bool:
                return len(seen[sid]) >= n

            await eventually(caught_up, f"the live reader of {sid} to reach {len(events)} events")
            assert [e.SerializeToString() for e in seen[sid][: len(events)]] == [
                e.SerializeToString() for e in events
            ], "the live reader saw a gap or a duplicate across the restart"
        # Every process rode the restart out: nothing crashed, no lease was lost.
        for name, proc in {**stack.owners, "hooks": stack.hooks, "anchor": stack.anchor}.items():
            assert proc is not None and proc.proc is not None
            assert proc.proc.poll() is None, f"{name} exited across the etcd restart"
    finally:
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        await c.close()
        stack.stop()
        etcd.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


async def test_etcd_restart_under_load(make_stack: MakeStack) -> None:
    await etcd_restart_under_load(make_stack, sessions=3, messages=12, restarts=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_etcd_restarts_under_heavy_load_slow(make_stack: MakeStack) -> None:
    await etcd_restart_under_load(make_stack, sessions=8, messages=150, restarts=4)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_repeated_owner_kills_slow(make_stack: MakeStack) -> None:
    """Rounds of traffic, each killing (-9) or pausing an owner mid-work and
    starting a replacement; the whole history stays exact."""
    stack = make_stack(owners=3, park_after=0.5)
    c = stack.clients()
    rng = random.Random(7)
    try:
        await c.wait_registered("o1", "o2", "o3")
        sids = [await c.create() for _ in range(12)]
        receipts: dict[str, list[int]] = {sid: [] for sid in sids}
        spare = 4
        for round_ in range(10):
            for sid in sids:
                text = rng.choice(["sleep 3 300", "steps 3", f"r{round_}"])
                receipts[sid].append((await c.send(sid, text)).receipt.seq)
            # The victim is the owner of a random session (so it holds work).
            live = [i for i, p in stack.owners.items() if p.proc and p.proc.poll() is None]
            victim = await c.owner_of(rng.choice(sids))
            if victim not in live:
                victim = rng.choice(live)
            if round_ % 2:
                stack.kill(victim)
            else:
                stack.pause(victim)
            for sid in sids:
                receipts[sid].append((await c.send(sid, f"after {round_}")).receipt.seq)
            stack.start_owner(f"o{spare}")
            spare += 1
            for sid in sids:
                done = functools.partial(answered, count=len(receipts[sid]))
                await c.wait_events(sid, done, "round answered", timeout=90)
            if not round_ % 2:
                stack.resume(victim)
        for sid in sids:
            events = await c.events(sid)
            check_history(events, receipts[sid])
            assert received_seqs(events) == list(range(len(receipts[sid])))
    finally:
        await c.close()


async def test_a_queued_message_held_behind_an_approval_survives_a_takeover(
    make_stack: MakeStack,
) -> None:
    """Issue 32: while the turn waits for an approval a queued message waits
    too, unconsumed; what the run takes past it is recorded as consumed ahead
    of the inbox position. After kill -9 the successor holds the message
    again, does not take again what was consumed ahead, and once the approval
    is given the message starts its own turn: once, after the first."""
    stack = make_stack(owners=2)
    c = stack.clients()

    async def respond(response: s.InputResponse) -> int:
        sent = await c.ingress.SendMessage(
            ingress_pb.SendMessageRequest(session_id=sid, input_responses=[response]),
            metadata=SLACK,
            timeout=10,
        )
        return sent.receipt.seq

    def rejected(events: list[s.Event]) -> list[int]:
        return [e.inbox_seq for e in events if e.kind == K.EVENT_KIND_COMMAND_REJECTED]

    def asked(events: list[s.Event]) -> bool:
        kinds = [e.kind for e in events]
        return K.EVENT_KIND_INPUT_REQUESTED in kinds and kinds[-1] == K.EVENT_KIND_SESSION_WAITING

    try:
        await c.wait_registered("o1", "o2")
        sid = await c.create()
        receipts = [(await c.send(sid, "transfer 100", queue=False)).receipt.seq]
        events = await c.wait_events(sid, asked, "approval asked")
        request = next(e for e in events if e.kind == K.EVENT_KIND_INPUT_REQUESTED).input_request
        receipts.append((await c.send(sid, "later")).receipt.seq)  # queued
        stray = await respond(s.InputResponse(request_id="input_stray"))
        await c.wait_events(sid, lambda ev: rejected(ev) == [stray], "the stray answer rejected")
        first = await c.owner_of(sid)
        stack.kill(first)
        successor = "o2" if first == "o1" else "o1"
        await wait_owner(c, sid, successor, stack.lease_ttl + TAKEOVER_SLACK_S)
        await respond(s.InputResponse(request_id=request.request_id, approved=True))

        events = await c.wait_events(sid, lambda ev: answered(ev, 2), "the queued one answered")
        check_history(events, receipts)
        assert rejected(events) == [stray], "a command consumed ahead was taken again"
        results = [e.tool_result for e in events if e.kind == K.EVENT_KIND_TOOL_CALL_RESULT]
        assert [(r.output, r.is_error) for r in results] == [("transferred 100", False)]
        assert answers(events) == ["The result is transferred 100.", "echo: later"]
        turns = [e.turn_id for e in events if e.kind == K.EVENT_KIND_TURN_STARTED]
        later = next(
            e for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED and e.text == "later"
        )
        assert len(turns) == 2 and later.turn_id == turns[1]
        assert len(runs_in_order(events)) == 2
        assert await inbox_entries_left(stack.etcd_endpoint, stack.prefix, sid) == []
    finally:
        await c.close()


async def test_a_lease_holds_until_its_last_renewal_plus_the_ttl() -> None:
    """By the instance's own clock, from the send time of the keep-alive."""
    now = [100.0]
    lease = Lease(lambda: now[0])
    assert lease.may_have_expired()  # nothing renewed yet
    lease.renewed(sent_at=100.0, ttl_seconds=2)
    await lease.held()  # at once
    now[0] = 102.0
    assert lease.may_have_expired()
    waiting = asyncio.ensure_future(lease.held())
    await asyncio.sleep(0)
    assert not waiting.done()
    lease.renewed(sent_at=101.5, ttl_seconds=2)  # answered late: dated by its send
    await asyncio.wait_for(waiting, 5)
    assert not lease.may_have_expired()
