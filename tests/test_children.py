"""Child sessions end to end through ingress (docs/design.md §11), on one
deployment: background tasks, subagents and workflow tools run as sessions
of their own; their results come back through the parent's inbox; cancel and
reset cascade; budgets roll up; bad input changes nothing. Every outcome is
read off the public streams (the parent's and the child's own). Upgrades are
in test_children_upgrade.py; crashes with real processes in
test_children_faults.py."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import BatonError, Reason
from baton_runtime.common.rpc.status_map import error_reason
from baton_runtime.owner.host.host import OwnerHost
from tests.stack import WEB, Stack, start_stack, stop_stack
from tests.test_turns import (
    CANCEL,
    RESET,
    Events,
    barrier,
    control,
    follow_until,
    kinds,
    names,
    of,
    one,
    read_all,
    read_to_close,
    respond,
    seen,
    texts,
    waits,
)

K = s.EventKind
STARTED = K.EVENT_KIND_SESSION_STARTED
WAITING = K.EVENT_KIND_SESSION_WAITING
COMPLETED = K.EVENT_KIND_SESSION_COMPLETED
TURN_STARTED = K.EVENT_KIND_TURN_STARTED
TURN_COMPLETED = K.EVENT_KIND_TURN_COMPLETED
TURN_CANCELLED = K.EVENT_KIND_TURN_CANCELLED
STEP_STARTED = K.EVENT_KIND_STEP_STARTED
STEP_COMPLETED = K.EVENT_KIND_STEP_COMPLETED
RECEIVED = K.EVENT_KIND_MESSAGE_RECEIVED
ANSWERED = K.EVENT_KIND_MESSAGE_COMPLETED
TOOL_CALL = K.EVENT_KIND_TOOL_CALL_REQUESTED
TOOL_RESULT = K.EVENT_KIND_TOOL_CALL_RESULT
INPUT_REQUESTED = K.EVENT_KIND_INPUT_REQUESTED
REJECTED = K.EVENT_KIND_COMMAND_REJECTED
TASK_STARTED = K.EVENT_KIND_TASK_STARTED
TASK_COMPLETED = K.EVENT_KIND_TASK_COMPLETED
TASK_FAILED = K.EVENT_KIND_TASK_FAILED


def child_of(events: Events) -> str:
    started = of(events, TASK_STARTED)
    assert started, f"no task.started in {kinds(events)}"
    return started[-1].child_session_id


def handle(snapshot: s.SessionSnapshot, child: str) -> s.ChildHandle:
    found = [h for h in snapshot.handles if h.child_session_id == child]
    assert len(found) == 1, snapshot.handles
    return found[0]


async def snapshot_of(stack: Stack, session_id: str) -> s.SessionSnapshot:
    anchor = stack.anchor_client(timeout=5)
    try:
        return await anchor.snapshot(session_id)
    finally:
        await anchor.close()


async def inject(stack: Stack, session_id: str, report: s.TaskResultCommand) -> int:
    """Append a task_result to a session's inbox as an internal caller would."""
    hooks = stack.hooks_client(timeout=5)
    try:
        command = s.Command(
            delivery=s.DeliveryMetadata(delivery_id=report.task_delivery_id), task_result=report
        )
        receipt = await hooks.append(ids.inbox_token(session_id), command)
        return receipt.seq
    finally:
        await hooks.close()


# -- same deployment ------------------------------------------------------------------


async def test_a_subagent_answers_inside_a_turn(stack: Stack) -> None:
    sid = await stack.create()
    sent = await stack.send(sid, "ask helper what is 6*7")
    events = await follow_until(stack, sid, waits(1))
    assert kinds(events) == names(
        STARTED,
        TURN_STARTED,
        RECEIVED,
        STEP_STARTED,
        TOOL_CALL,
        TASK_STARTED,
        STEP_COMPLETED,
        TASK_COMPLETED,
        TOOL_RESULT,
        STEP_STARTED,
        ANSWERED,
        STEP_COMPLETED,
        TURN_COMPLETED,
        WAITING,
    )
    turn_id = one(events, TURN_STARTED).turn_id
    assert {e.turn_id for e in events[1:-1]} == {turn_id}, "the reply came inside the turn"
    child = child_of(events)
    assert child == ids.child_session_id(sid, one(events, TOOL_CALL).tool_call.id)
    started, done = one(events, TASK_STARTED), one(events, TASK_COMPLETED)
    assert started.text == "what is 6*7" and started.task.kind == s.TASK_KIND_SUBAGENT
    assert started.task.name == "helper" and started.task.state == s.HANDLE_STATE_RUNNING
    assert done.child_session_id == child and done.text == "The result is 42."
    assert done.task.state == s.HANDLE_STATE_PARKED
    assert done.delivery_id == f"task:{child}:1"
    assert texts(events, ANSWERED) == ["helper says: The result is 42."]
    # Budget roll-up: the turn's usage includes the child's.
    turn = one(events, TURN_COMPLETED).usage
    steps = sum(e.usage.model_calls for e in of(events, STEP_COMPLETED))
    assert turn.model_calls == steps + done.usage.model_calls == 2 + 2
    assert one(events, RECEIVED).inbox_seq == sent.receipt.seq

    # The child is a session of its own, with its own stream, readable by id
    # by the same channel; not by another.
    child_events = await read_all(stack, child)
    assert kinds(child_events)[:3] == names(STARTED, TURN_STARTED, RECEIVED)
    assert one(child_events, RECEIVED).text == "what is 6*7"
    assert texts(child_events, ANSWERED) == ["The result is 42."]
    assert [e.seq for e in child_events] == list(range(len(child_events)))
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await stack.events(child, metadata=WEB, follow=False)
    # Another channel's session is as unknown as a missing one (AIP-211).
    assert denied.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason(denied.value) == "SESSION_NOT_FOUND"

    parent = await snapshot_of(stack, sid)
    assert handle(parent, child).state == s.HANDLE_STATE_PARKED
    assert handle(parent, child).deployment_id == stack.deployment_id
    link = (await snapshot_of(stack, child)).parent
    assert (link.parent_session_id, link.kind, link.name, link.depth) == (
        sid,
        s.TASK_KIND_SUBAGENT,
        "helper",
        1,
    )
    assert not link.outbox or link.outbox[0].work == 1  # delivered (cleared by its next commit)


async def test_a_background_task_finishing_while_idle_starts_a_turn(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "task 300 build")
    first = await follow_until(stack, sid, waits(1))
    child = child_of(first)
    assert texts(first, ANSWERED) == [f"Started slow_task as {child}."]
    assert one(first, TASK_STARTED).task.kind == s.TASK_KIND_BACKGROUND
    assert not of(first, TASK_COMPLETED)

    later = await follow_until(stack, sid, waits(1), start_seq=len(first))
    assert kinds(later) == names(
        TURN_STARTED,
        TASK_COMPLETED,
        STEP_STARTED,
        ANSWERED,
        STEP_COMPLETED,
        TURN_COMPLETED,
        WAITING,
    )
    done = one(later, TASK_COMPLETED)
    assert done.child_session_id == child and done.text == "done: build"
    assert one(later, TURN_STARTED).inbox_seq == done.inbox_seq
    assert one(later, TURN_STARTED).turn_id != one(first, TURN_STARTED).turn_id
    assert texts(later, ANSWERED) == ["slow_task finished: done: build"]
    assert handle(await snapshot_of(stack, sid), child).state == s.HANDLE_STATE_AVAILABLE
    # The task is a session: its one step ran the tool, committed on its own.
    child_events = await read_all(stack, child)
    assert of(child_events, TOOL_RESULT)[0].tool_result.output == "done: build"
    assert one(child_events, TURN_COMPLETED).usage.model_calls == 0


async def test_a_parked_subagent_is_continued_two_turns_later(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "ask helper what is 2+3")
    events = await follow_until(stack, sid, waits(1))
    child = child_of(events)
    for text in ("hello", "what is 1+1"):
        await stack.send(sid, text)
        events += await follow_until(stack, sid, waits(1), start_seq=len(events))
    await stack.send(sid, "continue what is 10*10")
    rest = await follow_until(stack, sid, waits(1), start_seq=len(events))
    assert texts(rest, ANSWERED) == ["helper says: The result is 100."]
    started = one(rest, TASK_STARTED)
    assert started.child_session_id == child and started.task.work == 2
    call = one(rest, TOOL_CALL).tool_call
    assert call.name == "continue_task" and json.loads(call.arguments_json)["handle"] == child
    assert one(rest, TASK_COMPLETED).delivery_id == f"task:{child}:2"
    # One child session, two turns in it; the conversation went on.
    child_events = await read_all(stack, child)
    assert len(of(child_events, TURN_COMPLETED)) == 2
    assert texts(child_events, RECEIVED) == ["what is 2+3", "what is 10*10"]
    assert handle(await snapshot_of(stack, sid), child).work == 2


async def test_a_workflow_tool_runs_its_steps_as_a_child(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "workflow 30 data")
    events = await follow_until(stack, sid, waits(1))
    child = child_of(events)
    assert one(events, TASK_STARTED).task.kind == s.TASK_KIND_WORKFLOW
    assert texts(events, ANSWERED) == ["pipeline says: stored transformed fetched data"]
    assert {e.turn_id for e in events[1:-1]} == {one(events, TURN_STARTED).turn_id}
    child_events = await read_all(stack, child)
    # Each step is its own committed step of the child.
    assert [e.tool_call.name for e in of(child_events, TOOL_CALL)] == [
        "fetch",
        "transform",
        "store",
    ]
    assert [e.step for e in of(child_events, STEP_COMPLETED)] == [1, 2, 3, 4]
    assert handle(await snapshot_of(stack, sid), child).state == s.HANDLE_STATE_AVAILABLE


async def test_a_failing_task_reaches_the_parent_as_a_failed_result(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "workflow 0 fail")  # every step succeeds: "fail" is only text
    await follow_until(stack, sid, waits(1))
    events = await read_all(stack, sid)
    await stack.send(sid, "task 0 fail")

    def answered_the_failure(more: list[s.Event]) -> bool:
        # (The workflow's own late results may run a turn before this one,
        # or may already be in `events`: wait for the waiting after the failure.)
        kinds = [e.kind for e in more]
        return TASK_FAILED in kinds and WAITING in kinds[kinds.index(TASK_FAILED) :]

    events += await follow_until(stack, sid, answered_the_failure, start_seq=len(events))
    failed = one(events, TASK_FAILED)
    assert failed.error.reason == "TOOL_FAILED"
    assert "the task was asked to fail" in failed.error.message
    assert texts(events, ANSWERED)[-1].startswith("slow_task failed: TOOL_FAILED")


async def test_a_childs_question_surfaces_on_the_parent_and_is_answered_there(
    stack: Stack,
) -> None:
    sid = await stack.create()
    await stack.send(sid, "ask helper ask my name")
    events = await follow_until(stack, sid, seen(INPUT_REQUESTED))
    asked = one(events, INPUT_REQUESTED)
    child = child_of(events)
    assert asked.child_session_id == child, "the wait names the child to answer"
    assert asked.input_request.prompt == "What is your name?"
    assert not of(events, WAITING), "the parent's turn waits for a child, not for the user"

    # A plain message to the child from the channel is refused; an answer is not.
    await stack.send(child, "hello")
    await respond(
        stack, child, s.InputResponse(request_id=asked.input_request.request_id, text="Ada")
    )
    events += await follow_until(stack, sid, waits(1), start_seq=len(events))
    assert texts(events, ANSWERED) == ["helper says: Nice to meet you, Ada."]
    child_events = await read_all(stack, child)
    refused = one(child_events, REJECTED)
    assert refused.error.reason == "CHILD_SESSION"
    assert texts(child_events, ANSWERED)[-1] == "Nice to meet you, Ada."


async def test_a_nested_childs_wait_surfaces_on_the_root(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "ask planner ask helper ask my name")
    events = await follow_until(stack, sid, seen(INPUT_REQUESTED), timeout=20)
    asked = one(events, INPUT_REQUESTED)
    planner = child_of(events)
    assert asked.child_session_id != planner, "the grandchild waits, and is named"
    helper = asked.child_session_id
    assert (await snapshot_of(stack, helper)).parent.parent_session_id == planner
    await respond(
        stack, helper, s.InputResponse(request_id=asked.input_request.request_id, text="Bo")
    )
    events += await follow_until(stack, sid, waits(1), start_seq=len(events), timeout=20)
    assert texts(events, ANSWERED) == ["planner says: helper says: Nice to meet you, Bo."]


# -- queue and steer while the turn waits for a child (issue 32) ---------------------------


async def _waiting_for_a_child(stack: Stack, sid: str) -> tuple[Events, s.InputRequest, str]:
    """A turn that waits for its subagent, which waits for the user."""
    await stack.send(sid, "ask helper ask my name")
    events = await follow_until(stack, sid, seen(INPUT_REQUESTED))
    asked = one(events, INPUT_REQUESTED)
    return events, asked.input_request, asked.child_session_id


async def test_a_queued_message_waits_for_the_childs_result_then_starts_its_turn(
    stack: Stack,
) -> None:
    sid = await stack.create()
    events, request, child = await _waiting_for_a_child(stack, sid)
    turn_id = one(events, TURN_STARTED).turn_id

    queued = await stack.send(sid, "later", turn_policy=s.TURN_POLICY_QUEUE)
    # Taken past the queued message (nothing is pending on the parent itself):
    # rejected, and nothing else happened.
    settled = await barrier(stack, sid, len(events))
    assert kinds(settled) == names(REJECTED), "the queued message acted on the waiting turn"
    events += settled

    await respond(stack, child, s.InputResponse(request_id=request.request_id, text="Ada"))
    rest = await follow_until(stack, sid, waits(2), start_seq=len(events))
    turns = [e.turn_id for e in of(rest, TURN_COMPLETED)]
    assert len(turns) == 2 and turns[0] == turn_id != turns[1], kinds(rest)
    assert texts(rest, ANSWERED) == ["helper says: Nice to meet you, Ada.", "echo: later"]
    received = one(rest, RECEIVED)
    assert (received.text, received.inbox_seq, received.turn_id) == (
        "later",
        queued.receipt.seq,
        turns[1],
    )
    assert rest.index(received) > rest.index(of(rest, TURN_COMPLETED)[0])


async def test_a_steer_while_the_turn_waits_for_a_child_joins_the_turn(stack: Stack) -> None:
    """The model sees the message with the child's result, in the same turn."""
    sid = await stack.create()
    events, request, child = await _waiting_for_a_child(stack, sid)
    turn_id = one(events, TURN_STARTED).turn_id

    steer = await stack.send(sid, "by the way")
    events += await follow_until(stack, sid, seen(RECEIVED), start_seq=len(events))
    await respond(stack, child, s.InputResponse(request_id=request.request_id, text="Ada"))
    events += await follow_until(stack, sid, waits(1), start_seq=len(events))
    assert len(of(events, TURN_STARTED)) == 1
    joined = of(events, RECEIVED)[-1]
    assert (joined.text, joined.inbox_seq, joined.turn_id) == (
        "by the way",
        steer.receipt.seq,
        turn_id,
    )
    assert one(events, TURN_COMPLETED).turn_id == turn_id
    assert texts(events, ANSWERED) == ["helper says: Nice to meet you, Ada."]


# -- cancel, reset, budgets ----------------------------------------------------------------


async def test_cancel_of_the_parent_turn_cancels_its_children(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "task 60000 forever")  # a background task of an earlier turn
    events = await follow_until(stack, sid, waits(1))
    background = child_of(events)
    await stack.send(sid, "ask helper sleep 3 1500")
    events += await follow_until(stack, sid, seen(TASK_STARTED), start_seq=len(events))
    child = child_of(events)
    child_started = await follow_until(stack, child, seen(TOOL_RESULT))  # its step 2 runs
    cancel = await control(stack, sid, CANCEL)

    events += await follow_until(stack, sid, waits(1), start_seq=len(events))
    assert one(events, TURN_CANCELLED).inbox_seq == cancel.receipt.seq
    cancelled_call = of(events, TOOL_RESULT)[-1].tool_result
    assert cancelled_call.is_error and json.loads(cancelled_call.output)["status"] == "cancelled"
    # The child's turn is cancelled too, keeping what it had done.
    child_events = await follow_until(stack, child, waits(1), start_seq=len(child_started))
    assert of(child_events, TURN_CANCELLED)
    # Its cancelled result is recorded on the parent and starts no turn.
    events += await follow_until(stack, sid, seen(TASK_FAILED), start_seq=len(events))
    failed = of(events, TASK_FAILED)[-1]
    assert failed.child_session_id == child and failed.error.reason == "CANCELLED"
    assert failed.task.state == s.HANDLE_STATE_PARKED
    parent = await snapshot_of(stack, sid)
    assert handle(parent, child).state == s.HANDLE_STATE_PARKED
    # The earlier turn's background task was not the cancelled turn's: it runs on.
    assert handle(parent, background).state == s.HANDLE_STATE_RUNNING
    assert len(of(await read_all(stack, sid), TURN_STARTED)) == 2


async def test_reset_of_a_parent_finalizes_its_children(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "ask helper hello")
    events = await follow_until(stack, sid, waits(1))
    parked = child_of(events)
    await stack.send(sid, "task 60000 forever")
    events += await follow_until(stack, sid, waits(1), start_seq=len(events))
    running = child_of(events)
    await control(stack, sid, RESET)
    closed = await read_to_close(stack, sid, start_seq=len(events))
    assert kinds(closed)[-1] == "SESSION_COMPLETED"
    for child in (parked, running):
        child_events = await read_to_close(stack, child)
        assert child_events[-1].kind == COMPLETED
        assert child_events[-1].error.reason == ""
    running_events = await read_all(stack, running)
    assert of(running_events, TURN_CANCELLED), "the running task's turn was cancelled first"
    assert all(h.state == s.HANDLE_STATE_SETTLED for h in (await snapshot_of(stack, sid)).handles)


async def test_children_spend_the_parents_budget(stack: Stack) -> None:
    sid = await stack.create(token_budget=30)
    await stack.send(sid, "ask helper what is 6*7")
    events = await follow_until(stack, sid, waits(1))
    child = child_of(events)
    step = one(events, STEP_COMPLETED).usage
    # The child got what the parent had left when it started.
    child_snapshot = await snapshot_of(stack, child)
    assert child_snapshot.limits.token_budget == 30 - step.input_tokens - step.output_tokens
    done = one(events, TASK_COMPLETED)
    assert done.usage.input_tokens > 0
    # With the child's spending the parent's budget is spent: it asks before
    # its next model call.
    asked = one(events, INPUT_REQUESTED).input_request
    assert asked.kind == s.INPUT_KIND_SESSION_LIMIT
    parent = await snapshot_of(stack, sid)
    spent = parent.usage.input_tokens + parent.usage.output_tokens
    assert spent == step.input_tokens + step.output_tokens + (
        done.usage.input_tokens + done.usage.output_tokens
    )
    assert handle(parent, child).usage == done.usage


# -- bad input ---------------------------------------------------------------------------------


async def test_bad_child_input_changes_nothing(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "ask nobody hello")
    events = await follow_until(stack, sid, waits(1))
    result = one(events, TOOL_RESULT).tool_result
    assert result.is_error and result.output.startswith("UNKNOWN_SUBAGENT")
    await stack.send(sid, f"continue ses_{'z' * 26} hello")
    events += await follow_until(stack, sid, waits(1), start_seq=len(events))
    result = of(events, TOOL_RESULT)[-1].tool_result
    assert result.is_error and result.output.startswith("UNKNOWN_TASK")
    assert not (await snapshot_of(stack, sid)).handles

    # Continuing a subagent that is still running.
    await stack.send(sid, "bg helper sleep 2 1500")
    events += await follow_until(stack, sid, waits(1), start_seq=len(events))
    child = child_of(events)
    await stack.send(sid, f"continue {child} hello")
    events += await follow_until(stack, sid, waits(1), start_seq=len(events))
    result = of(events, TOOL_RESULT)[-1].tool_result
    assert result.is_error and result.output.startswith("TASK_RUNNING")
    assert handle(await snapshot_of(stack, sid), child).work == 1

    # Reports of a child that is not this session's: hooks refuses them
    # before anything is written (the run's own UNKNOWN_TASK and NOT_OUR_TASK
    # rejections are tested in test_child_rules).
    stranger = f"ses_{'y' * 26}"
    other_parent = f"ses_{'x' * 26}"
    not_ours = [
        s.TaskResultCommand(
            task_delivery_id="bad-1",
            child_session_id=stranger,
            work=1,
            result="?",
            status=s.TASK_STATUS_COMPLETED,
            parent_session_id=sid,
        ),
        s.TaskResultCommand(
            task_delivery_id="bad-2",
            child_session_id=child,
            work=1,
            result="?",
            status=s.TASK_STATUS_COMPLETED,
            parent_session_id=other_parent,
        ),
    ]
    for report in not_ours:
        with pytest.raises(BatonError) as refused:
            await inject(stack, sid, report)
        assert refused.value.reason == Reason.DELIVERY_NOT_ALLOWED, report
    # Reports the session cannot take: each rejected with a reason.
    bad = {
        "TASK_NOT_RUNNING": s.TaskResultCommand(
            task_delivery_id="bad-3",
            child_session_id=child,
            work=5,
            result="?",
            status=s.TASK_STATUS_COMPLETED,
            parent_session_id=sid,
        ),
    }
    before = await snapshot_of(stack, sid)
    seqs = {reason: await inject(stack, sid, report) for reason, report in bad.items()}
    rejected = await follow_until(stack, sid, seen(REJECTED, len(bad)), start_seq=len(events))
    by_seq = {e.inbox_seq: e.error.reason for e in of(rejected, REJECTED)}
    assert by_seq == {seq: reason for reason, seq in seqs.items()}
    after = await snapshot_of(stack, sid)
    assert list(after.handles) == list(before.handles)
    assert after.turn_count == before.turn_count
    # The real result still arrives and is applied once.
    events += await follow_until(stack, sid, seen(TASK_COMPLETED), start_seq=len(events))
    assert len(of(await read_all(stack, sid), TASK_COMPLETED)) == 1


async def test_a_child_whose_creator_died_before_its_first_commit_keeps_its_parent(
    stack: Stack,
) -> None:
    """The create (with the first work) landed, the creator died before the
    child's first commit: the owner that runs the child next finds no
    snapshot and commits session.started from the parent link hooks kept,
    with the child's limits, and the work runs."""
    parent = await stack.create()
    host = stack.owner.app
    assert isinstance(host, OwnerHost)
    child = ids.child_session_id(parent, "call_9")
    link = s.ParentLink(
        parent_session_id=parent,
        kind=s.TASK_KIND_SUBAGENT,
        name="helper",
        depth=1,
        limits=s.Limits(token_budget=500),
    )
    work = s.Command(
        delivery=s.DeliveryMetadata(delivery_id=f"work:{parent}:1"),
        send=s.SendCommand(text="what is 5*5", parent_work=1),
    )
    owner = s.OwnerIdentity(
        owner_run_id="run_lost", deployment_id=stack.deployment_id, instance_id=host.instance_id
    )
    hooks = stack.hooks_client(timeout=5)
    try:
        created = await hooks.create_session(child, owner, "slack", [], link, work)
        assert created.first_entry.seq == 0
        found = await hooks.lookup(ids.inbox_token(child))
        assert found.parent.parent_session_id == parent and found.parent.name == "helper"
    finally:
        await hooks.close()
    host.start_activation(created.fence)  # what a takeover or a restart does
    events = await follow_until(stack, child, waits(1))
    assert kinds(events)[:2] == names(STARTED, TURN_STARTED)
    assert texts(events, ANSWERED) == ["The result is 25."]
    snapshot = await snapshot_of(stack, child)
    assert snapshot.parent.parent_session_id == parent and snapshot.parent.depth == 1
    assert snapshot.limits.token_budget == 500
    # Its parent never recorded it (its step died with the creator): the
    # report is rejected there, and changes nothing.
    rejected = await follow_until(stack, parent, seen(REJECTED))
    assert one(rejected, REJECTED).error.reason == "UNKNOWN_TASK"


async def test_a_parked_childs_question_is_not_reported_again_after_the_dedupe_window(
    etcd_endpoint: str,
) -> None:
    """A child delivers its question to the parent and parks. Its delivered
    report must leave its committed outbox before it parks: delivery ids are
    remembered for the window only, so a woken run that sent the report again
    after it would surface the question on the parent a second time."""
    stack = await start_stack(
        etcd_endpoint, hooks_options={"dedupe_window_seconds": 1.0}, park_after=0.3
    )
    try:
        sid = await stack.create()
        await stack.send(sid, "ask helper ask my name")
        events = await follow_until(stack, sid, seen(INPUT_REQUESTED))
        asked = one(events, INPUT_REQUESTED)
        child = child_of(events)
        host = stack.owner.app
        assert isinstance(host, OwnerHost)
        deadline = asyncio.get_running_loop().time() + 15
        while child not in host.parked:
            assert asyncio.get_running_loop().time() < deadline, "the child never parked"
            await asyncio.sleep(0.05)
        assert not (await snapshot_of(stack, child)).parent.outbox, "parked with its report"
        await asyncio.sleep(3.5)  # past the window (1 s, plus its lease buckets)
        await respond(
            stack, child, s.InputResponse(request_id=asked.input_request.request_id, text="Ada")
        )
        events += await follow_until(stack, sid, waits(1), start_seq=len(events))
        assert texts(events, ANSWERED) == ["helper says: Nice to meet you, Ada."]
        assert len(of(events, INPUT_REQUESTED)) == 1, "the question surfaced twice"
        assert not of(events, REJECTED), [e.error.reason for e in of(events, REJECTED)]
    finally:
        await stop_stack(stack)
