"""Child sessions through upgrades (docs/design.md §6 and §11), two deployments in
this process: a running child keeps its parent where it is (the delivery
from the other deployment is processed here and forgotten); parked and
available handles cross a handoff while the child stays on its deployment;
the moved parent continues them by their stable address and their results
reach it there. Crashes with real processes: test_children_faults.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aetcd
import pytest

from baton_runtime._proto.baton.owner.v1 import owner_pb2
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import BatonError
from baton_runtime.common.security.identity import Role
from baton_runtime.owner.rules.held import RunIdentity, make_event
from baton_runtime.owner.run.commit import commit_step
from baton_runtime.owner.run.snapshots import initial_snapshot
from tests import certs
from tests.stack import Stack, add_deployment, stop_deployment
from tests.test_children import (
    ANSWERED,
    INPUT_REQUESTED,
    RECEIVED,
    TASK_COMPLETED,
    TASK_STARTED,
    WAITING,
    child_of,
    handle,
)
from tests.test_handoff import HANDED_OFF, RESULT, Env, turn
from tests.test_turns import Predicate, follow_until, of, read_all, respond, seen, texts, waits


@pytest.fixture
async def env(stack: Stack, etcd: aetcd.Client) -> AsyncIterator[Env]:
    """Deployment A (the stack) and B, as in test_handoff.py."""
    b = await add_deployment(stack, "dep-b")
    running = Env(stack, b, etcd)
    try:
        await running.wait_ready(stack, b)
        yield running
    finally:
        await running.close()
        await stop_deployment(b)


def settled_after(kind: int) -> Predicate:
    """Holds once an event of `kind` was read and the session waits again."""
    return lambda ev: bool(of(ev, kind)) and ev[-1].kind == WAITING


async def child_stays_on_a(env: Env, child: str) -> None:
    events = await read_all(env.a, child)
    assert {e.deployment_id for e in events} == {"dep-a"}
    assert not of(events, HANDED_OFF)
    epoch, record = await env.owner(child)
    assert (epoch, record.deployment_id) == (1, "dep-a")


async def test_a_running_task_keeps_the_parent_and_its_later_result_follows_it(
    env: Env,
) -> None:
    a, b = env.a, env.b
    sid = await a.create()
    first = await turn(a, sid, "task 2500 one", 1)
    child = child_of(first)
    # The task runs: a delivery accepted by B is processed on A and forgotten.
    sent = await b.send(sid, "hello from b")
    rest = await follow_until(
        a, sid, settled_after(TASK_COMPLETED), start_seq=first[-1].seq + 1, timeout=20
    )
    assert [e.inbox_seq for e in of(rest, RECEIVED)] == [sent.receipt.seq]
    assert {e.deployment_id for e in rest} == {"dep-a"}
    assert texts(rest, ANSWERED)[-1] == "slow_task finished: done: one"
    await env.no_upgrade_state(sid, b)

    # Applied and idle: a fresh delivery through B moves the parent; the
    # available handle crosses with it.
    moved = await turn(b, sid, "whoami", rest[-1].seq + 1)
    assert moved[0].kind == HANDED_OFF and moved[0].text == "dep-a"
    assert of(moved, RESULT)[-1].tool_result.output == "dep-b"
    crossed = handle(await env.snapshot(sid), child)
    assert crossed.state == s.HANDLE_STATE_AVAILABLE and crossed.deployment_id == "dep-a"

    # More work for the child, from B: it runs on A; its result reaches the
    # parent on B.
    later = await turn(b, sid, f"continue {child} two", moved[-1].seq + 1)
    assert texts(later, ANSWERED) == ["slow_task says: done: two"]
    assert {e.deployment_id for e in later} == {"dep-b"}
    assert one_of(later, TASK_COMPLETED).child_session_id == child
    await child_stays_on_a(env, child)
    assert len(of(await read_all(a, child), K_TURN_COMPLETED)) == 2


async def test_a_parked_subagent_crosses_and_is_continued_from_b(env: Env) -> None:
    a, b = env.a, env.b
    sid = await a.create()
    asked = await turn(a, sid, "ask helper what is 2+3", 1)
    child = child_of(asked)
    assert texts(asked, ANSWERED) == ["helper says: The result is 5."]
    moved = await turn(b, sid, "whoami", asked[-1].seq + 1)
    assert moved[0].kind == HANDED_OFF
    assert handle(await env.snapshot(sid), child).state == s.HANDLE_STATE_PARKED

    continued = await turn(b, sid, "continue what is 4*4", moved[-1].seq + 1)
    assert texts(continued, ANSWERED) == ["helper says: The result is 16."]
    started = one_of(continued, TASK_STARTED)
    assert started.child_session_id == child and started.deployment_id == "dep-b"
    await child_stays_on_a(env, child)
    child_events = await read_all(a, child)
    assert texts(child_events, RECEIVED) == ["what is 2+3", "what is 4*4"]


async def test_a_child_waiting_on_a_human_keeps_the_parent_on_its_deployment(env: Env) -> None:
    a, b = env.a, env.b
    sid = await a.create()
    await a.send(sid, "ask helper ask my name")
    events = await follow_until(a, sid, seen(INPUT_REQUESTED))
    asked = one_of(events, INPUT_REQUESTED)
    child = asked.child_session_id
    # The wait was surfaced by the child: a delivery through B is processed
    # on A (it joins the waiting turn) and forgotten.
    sent = await b.send(sid, "are you there")
    events += await follow_until(a, sid, seen(RECEIVED), start_seq=events[-1].seq + 1)
    assert of(events, RECEIVED)[-1].inbox_seq == sent.receipt.seq
    await env.no_upgrade_state(sid, b)

    await respond(a, child, s.InputResponse(request_id=asked.input_request.request_id, text="Ada"))
    events += await follow_until(a, sid, waits(1), start_seq=events[-1].seq + 1)
    assert {e.deployment_id for e in events} == {"dep-a"}
    assert texts(events, ANSWERED) == ["helper says: Nice to meet you, Ada."]
    await env.no_upgrade_state(sid, b)
    # Settled and idle now: the next delivery through B moves it.
    moved = await turn(b, sid, "whoami", events[-1].seq + 1)
    assert moved[0].kind == HANDED_OFF
    await child_stays_on_a(env, child)


async def busy_on_x(env: Env) -> tuple[str, s.OwnerIdentity, s.Fence, int]:
    """A session of deployment dep-x (no process: the test plays its owner)
    whose last commit holds a running child handle."""
    sid = ids.new_session_id()
    x = s.OwnerIdentity(owner_run_id="run_x1", deployment_id="dep-x", instance_id="x1")
    as_x = certs.owner("dep-x")  # owners act only for their own deployment
    hooks_x, anchor_x = env.a.hooks_client(as_x), env.a.anchor_client(as_x)
    try:
        created = await hooks_x.create_session(sid, x, "slack", [])
        snapshot = initial_snapshot(sid, "slack", "dep-x", list(created.hooks))
        snapshot.handles.add(
            child_session_id=ids.child_session_id(sid, "call_1"),
            kind=s.TASK_KIND_BACKGROUND,
            name="slow_task",
            state=s.HANDLE_STATE_RUNNING,
            work=1,
        )
        identity = RunIdentity(created.fence, "dep-x", "x1")
        started = make_event(identity, s.EVENT_KIND_SESSION_STARTED)
        revision = await commit_step(anchor_x, identity, snapshot, [started], False, 0)
    finally:
        await hooks_x.close()
        await anchor_x.close()
    assert revision is not None
    return sid, x, created.fence, revision


async def test_b_refuses_a_checkpoint_with_a_running_child(env: Env) -> None:
    """B's own checks (A never asks while a child runs), for a trigger and for
    a drain; and no adoption of an orphan whose child was at work."""
    b = env.b
    sid, x, fence, revision = await busy_on_x(env)
    command = s.Command(
        delivery=s.DeliveryMetadata(delivery_id="d-1", accepted_deployment_id="dep-b"),
        send=s.SendCommand(text="whoami"),
    )
    # The trigger arrives as dep-b's ingress delivers it, in the tenant's channel.
    gateway = env.b.hooks_client(env.b.security(Role.INGRESS, "dep-b"))
    try:
        receipt = await gateway.append(ids.inbox_token(sid), command, "slack")
    finally:
        await gateway.close()
    request = owner_pb2.AcceptHandoffRequest(
        handoff_id="h-1",
        fence=fence,
        deployment_id="dep-b",
        from_owner=x,
        snapshot_revision=revision,
        trigger=s.InboxEntry(seq=receipt.seq, command=command),
    )
    drain = owner_pb2.AcceptHandoffRequest(
        handoff_id="h-2",
        fence=fence,
        deployment_id="dep-b",
        from_owner=x,
        snapshot_revision=revision,
        reason=s.TRANSFER_REASON_DRAIN,
    )
    # As dep-x's owner (a handoff comes from the session's owner), then as
    # dep-b's ingress (which asks its owner to adopt).
    client = b.owner_client(security=b.security(Role.OWNER, "dep-x"), timeout=5)
    adopter = b.owner_client(timeout=5)
    try:
        for attempt in (request, drain):
            with pytest.raises(BatonError) as refused:
                await client.accept_handoff(attempt)
            assert refused.value.reason == "SESSION_NOT_IDLE"
        # dep-x has no live owner: an orphan, but not a settled one.
        with pytest.raises(BatonError) as refused:
            await adopter.adopt_session(sid)
        assert refused.value.reason == "SESSION_NOT_SETTLED"
    finally:
        await client.close()
        await adopter.close()
    assert await env.transfers(sid) == []


K_TURN_COMPLETED = s.EVENT_KIND_TURN_COMPLETED


def one_of(events: list[s.Event], kind: int) -> s.Event:
    found = of(events, kind)
    assert len(found) == 1, [s.EventKind.Name(e.kind) for e in events]
    return found[0]
