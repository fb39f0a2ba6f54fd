"""Turn rules end to end through ingress (docs/design.md §3-§4, §9; the module
docstring of services/owner/run/session.py): steering, queueing, merging, cancel,
human input, sign-in, limits, clear/compact/reset, the session timeout and
runtime aliases. Every outcome is read off the public event stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.rpc.status_map import error_reason
from tests.stack import SLACK, TERMINAL, Stack

K = s.EventKind
Events = list[s.Event]
Predicate = Callable[[Events], bool]

STARTED = K.EVENT_KIND_SESSION_STARTED
WAITING = K.EVENT_KIND_SESSION_WAITING
COMPLETED = K.EVENT_KIND_SESSION_COMPLETED
TURN_STARTED = K.EVENT_KIND_TURN_STARTED
TURN_COMPLETED = K.EVENT_KIND_TURN_COMPLETED
TURN_CANCELLED = K.EVENT_KIND_TURN_CANCELLED
TURN_FAILED = K.EVENT_KIND_TURN_FAILED
STEP_STARTED = K.EVENT_KIND_STEP_STARTED
STEP_COMPLETED = K.EVENT_KIND_STEP_COMPLETED
RECEIVED = K.EVENT_KIND_MESSAGE_RECEIVED
ANSWERED = K.EVENT_KIND_MESSAGE_COMPLETED
TOOL_CALL = K.EVENT_KIND_TOOL_CALL_REQUESTED
TOOL_RESULT = K.EVENT_KIND_TOOL_CALL_RESULT
INPUT_REQUESTED = K.EVENT_KIND_INPUT_REQUESTED
AUTH_REQUIRED = K.EVENT_KIND_AUTHORIZATION_REQUIRED
AUTH_COMPLETED = K.EVENT_KIND_AUTHORIZATION_COMPLETED
CLEARED = K.EVENT_KIND_CONTEXT_CLEARED
COMPACTED = K.EVENT_KIND_CONTEXT_COMPACTED
REJECTED = K.EVENT_KIND_COMMAND_REJECTED

CANCEL = ingress_pb.CONTROL_KIND_CANCEL
RESET = ingress_pb.CONTROL_KIND_RESET
CLEAR = ingress_pb.CONTROL_KIND_CLEAR
COMPACT = ingress_pb.CONTROL_KIND_COMPACT
CALLBACK = ingress_pb.CONTROL_KIND_AUTHORIZATION_CALLBACK


# -- stream helpers -----------------------------------------------------------


def kinds(events: Events) -> list[str]:
    return [K.Name(e.kind).removeprefix("EVENT_KIND_") for e in events]


def names(*values: int) -> list[str]:
    return [K.Name(v).removeprefix("EVENT_KIND_") for v in values]  # type: ignore[arg-type]


def of(events: Events, kind: int, turn_id: str | None = None) -> Events:
    return [e for e in events if e.kind == kind and (turn_id is None or e.turn_id == turn_id)]


def one(events: Events, kind: int) -> s.Event:
    found = of(events, kind)
    assert len(found) == 1, f"expected one {names(kind)[0]}, got {kinds(events)}"
    return found[0]


def texts(events: Events, kind: int) -> list[str]:
    return [e.text for e in of(events, kind)]


def waits(n: int) -> Predicate:
    """Holds once `n` session.waiting events were read."""
    return lambda events: len(of(events, WAITING)) >= n


def seen(kind: int, n: int = 1) -> Predicate:
    return lambda events: len(of(events, kind)) >= n


def usage_sum(events: Events) -> s.Usage:
    total = s.Usage()
    for e in of(events, STEP_COMPLETED):
        total.input_tokens += e.usage.input_tokens
        total.output_tokens += e.usage.output_tokens
        total.model_calls += e.usage.model_calls
        total.cost_micros += e.usage.cost_micros
    return total


async def follow_until(
    stack: Stack,
    session_id: str,
    predicate: Predicate,
    *,
    start_seq: int = 0,
    timeout: float = 15.0,
) -> Events:
    """Follow the stream from `start_seq` until `predicate(events so far)` holds."""
    out: Events = []
    call = stack.ingress_stub.StreamEvents(
        ingress_pb.StreamEventsRequest(session_id=session_id, start_seq=start_seq, follow=True),
        metadata=SLACK,
    )
    try:
        async with asyncio.timeout(timeout):
            async for response in call:
                for event in response.events:
                    out.append(event)
                    if predicate(out):
                        return out
    except TimeoutError:
        raise AssertionError(
            f"condition not met within {timeout}s; stream from {start_seq}: {kinds(out)}"
        ) from None
    finally:
        call.cancel()
    raise AssertionError(f"stream ended before the condition held: {kinds(out)}")


async def read_to_close(
    stack: Stack, session_id: str, *, start_seq: int = 0, timeout: float = 15.0
) -> Events:
    """Follow the stream until the server ends it (the session's stream closed)."""
    out: Events = []
    call = stack.ingress_stub.StreamEvents(
        ingress_pb.StreamEventsRequest(session_id=session_id, start_seq=start_seq, follow=True),
        metadata=SLACK,
    )
    try:
        async with asyncio.timeout(timeout):
            async for response in call:
                out.extend(response.events)
    except TimeoutError:
        raise AssertionError(
            f"follow stream from {start_seq} did not close within {timeout}s: {kinds(out)}"
        ) from None
    finally:
        call.cancel()
    return out


async def read_all(stack: Stack, session_id: str, start_seq: int = 0) -> Events:
    return await stack.events(session_id, start_seq=start_seq, follow=False)


async def control(
    stack: Stack, session_id: str, kind: int, **kwargs: object
) -> ingress_pb.SendControlResponse:
    return await stack.ingress_stub.SendControl(
        ingress_pb.SendControlRequest(session_id=session_id, kind=kind, **kwargs),  # type: ignore[arg-type]
        metadata=SLACK,
        timeout=10,
    )


async def respond(
    stack: Stack, session_id: str, *responses: s.InputResponse
) -> ingress_pb.SendMessageResponse:
    return await stack.send(session_id, "", input_responses=list(responses))


async def barrier(stack: Stack, session_id: str, start_seq: int) -> Events:
    """Everything accepted before this call has been processed once the events
    from `start_seq` are returned: the inbox is FIFO, and an input response
    while no input is pending is always answered with a rejection."""
    receipt = await respond(stack, session_id, s.InputResponse(request_id="input_barrier"))
    seq = receipt.receipt.seq

    def answered(events: Events) -> bool:
        return any(e.kind == REJECTED and e.inbox_seq == seq for e in events)

    return await follow_until(stack, session_id, answered, start_seq=start_seq)


def assert_gapless(events: Events) -> None:
    assert [e.seq for e in events] == list(range(len(events))), "stream has a gap or duplicate"


# -- steer, queue, merge ------------------------------------------------------


async def test_steer_joins_the_open_turn_and_a_later_message_starts_the_next(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    # Three steps: two sleeping tool steps, then the answer. Once step 1 is on
    # the stream, step 2 (a 1.5 s tool call, long enough for a loaded machine)
    # is running: a message sent now must join this turn at the next
    # model-call boundary.
    slow = await stack.send(session_id, "sleep 3 1500", caller="alice")
    await follow_until(stack, session_id, lambda ev: STEP_COMPLETED in [e.kind for e in ev])
    # A different principal, so it can never be merged at turn start.
    steer = await stack.send(session_id, "hello", caller="bob")
    assert (slow.receipt.seq, steer.receipt.seq) == (0, 1)

    events = await follow_until(stack, session_id, waits(1))
    tool_step = [STEP_STARTED, TOOL_CALL, TOOL_RESULT, STEP_COMPLETED]
    assert kinds(events) == names(
        STARTED,
        TURN_STARTED,
        RECEIVED,
        *tool_step,
        *tool_step,
        RECEIVED,
        STEP_STARTED,
        ANSWERED,
        STEP_COMPLETED,
        TURN_COMPLETED,
        WAITING,
    )
    turn_id = one(events, TURN_STARTED).turn_id
    assert turn_id
    assert {e.turn_id for e in events[1:-1]} == {turn_id}, "steered message left the turn"
    received = of(events, RECEIVED)
    assert [e.inbox_seq for e in received] == [0, 1]
    assert [e.text for e in received] == ["sleep 3 1500", "hello"]
    assert [e.delivery_id for e in received] == [slow.delivery_id, steer.delivery_id]
    assert texts(events, ANSWERED) == ["echo: hello"]
    assert [e.step for e in of(events, STEP_STARTED)] == [1, 2, 3]
    done = one(events, TURN_COMPLETED)
    assert done.usage.model_calls == 3, "turn usage must accumulate over every model call"
    assert done.usage == usage_sum(events)
    assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0

    # After session.waiting the turn is over: a new message starts the next one.
    later = await stack.send(session_id, "again", caller="bob")
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert kinds(rest) == names(
        TURN_STARTED, RECEIVED, STEP_STARTED, ANSWERED, STEP_COMPLETED, TURN_COMPLETED, WAITING
    )
    next_turn = one(rest, TURN_STARTED).turn_id
    assert next_turn and next_turn != turn_id
    assert one(rest, RECEIVED).inbox_seq == later.receipt.seq == 2
    assert texts(rest, ANSWERED) == ["echo: again"]
    assert one(rest, TURN_COMPLETED).usage.model_calls == 1
    assert_gapless(events + rest)


async def test_queue_policy_waits_for_the_turn_to_settle(stack: Stack) -> None:
    session_id = await stack.create()
    await stack.send(session_id, "wait 1500")
    queued = await stack.send(session_id, "queued", turn_policy=s.TURN_POLICY_QUEUE)

    events = await follow_until(stack, session_id, waits(2))
    first_done = events.index(of(events, TURN_COMPLETED)[0])
    first, second = events[: first_done + 2], events[first_done + 2 :]
    assert kinds(first) == names(
        STARTED,
        TURN_STARTED,
        RECEIVED,
        STEP_STARTED,
        ANSWERED,
        STEP_COMPLETED,
        TURN_COMPLETED,
        WAITING,
    )
    assert texts(first, RECEIVED) == ["wait 1500"]
    assert one(first, TURN_COMPLETED).usage.model_calls == 1
    assert kinds(second) == names(
        TURN_STARTED, RECEIVED, STEP_STARTED, ANSWERED, STEP_COMPLETED, TURN_COMPLETED, WAITING
    )
    message = one(second, RECEIVED)
    assert (message.text, message.inbox_seq) == ("queued", queued.receipt.seq)
    assert message.turn_id and message.turn_id != first[1].turn_id
    assert texts(second, ANSWERED) == ["echo: queued"]


async def test_pending_messages_from_one_principal_start_one_turn_together(
    stack: Stack,
) -> None:
    """session.py merges, at turn start, the steer messages that follow the
    starting message from the same (channel, caller). A queued message holds
    bob's messages back until alice's slow turn settles; then bob's three
    start one turn together: all admitted before its single model call."""
    session_id = await stack.create()
    await stack.send(session_id, "wait 1500", caller="alice")
    await stack.send(session_id, "first", caller="bob", turn_policy=s.TURN_POLICY_QUEUE)
    await stack.send(session_id, "second", caller="bob")
    await stack.send(session_id, "third", caller="bob")

    events = await follow_until(stack, session_id, waits(2))
    turn_ids = [e.turn_id for e in of(events, TURN_STARTED)]
    assert len(turn_ids) == 2, kinds(events)
    first_turn = [e for e in events if e.turn_id == turn_ids[0]]
    assert texts(first_turn, RECEIVED) == ["wait 1500"]
    assert one(first_turn, TURN_COMPLETED).usage.model_calls == 1

    merged = events[events.index(of(events, TURN_STARTED)[1]) :]
    assert kinds(merged) == names(
        TURN_STARTED,
        RECEIVED,
        RECEIVED,
        RECEIVED,
        STEP_STARTED,
        ANSWERED,
        STEP_COMPLETED,
        TURN_COMPLETED,
        WAITING,
    )
    assert {e.turn_id for e in merged[:-1]} == {turn_ids[1]}
    received = of(merged, RECEIVED)
    assert [e.text for e in received] == ["first", "second", "third"]
    assert [e.inbox_seq for e in received] == [1, 2, 3]
    assert texts(merged, ANSWERED) == ["echo: third"]
    assert one(merged, TURN_COMPLETED).usage.model_calls == 1


# -- cancel -------------------------------------------------------------------


async def test_cancel_aborts_the_running_step_and_keeps_what_came_before(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    # Two 1.5 s sleeping tool steps, then an answer. Once step 1 is on the
    # stream, step 2 is running: its model call is done, its tool call sleeps.
    await stack.send(session_id, "sleep 3 1500")
    before = await follow_until(
        stack, session_id, lambda ev: STEP_COMPLETED in [e.kind for e in ev]
    )
    cancel = await control(stack, session_id, CANCEL, reason="changed mind")

    events = await follow_until(stack, session_id, waits(1))
    assert [e.SerializeToString() for e in events[: len(before)]] == [
        e.SerializeToString() for e in before
    ]
    tool_step = [STEP_STARTED, TOOL_CALL, TOOL_RESULT, STEP_COMPLETED]
    assert kinds(events) == names(
        STARTED, TURN_STARTED, RECEIVED, *tool_step, *tool_step, TURN_CANCELLED, WAITING
    )
    turn_id = one(events, TURN_STARTED).turn_id
    cancelled = one(events, TURN_CANCELLED)
    assert cancelled.turn_id == turn_id
    assert cancelled.inbox_seq == cancel.receipt.seq == 1
    assert cancelled.delivery_id == cancel.delivery_id
    # The aborted step keeps its completed model call; its tool call did not finish.
    results = of(events, TOOL_RESULT)
    assert not results[0].tool_result.is_error
    assert results[1].tool_result.is_error and results[1].tool_result.output == "cancelled"
    assert cancelled.usage.model_calls == 2
    assert cancelled.usage == usage_sum(events)

    after = await stack.send(session_id, "after cancel")
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert kinds(rest) == names(
        TURN_STARTED, RECEIVED, STEP_STARTED, ANSWERED, STEP_COMPLETED, TURN_COMPLETED, WAITING
    )
    assert one(rest, TURN_STARTED).turn_id not in ("", turn_id)
    assert one(rest, RECEIVED).inbox_seq == after.receipt.seq
    assert texts(rest, ANSWERED) == ["echo: after cancel"]

    # The aborted turn never produced an answer, ever.
    everything = await read_all(stack, session_id)
    assert_gapless(everything)
    assert [t for t in texts(everything, ANSWERED) if "sleep" in t or "result" in t] == []
    assert [e.SerializeToString() for e in everything[: len(events)]] == [
        e.SerializeToString() for e in events
    ]


async def test_cancel_while_idle_is_rejected_and_the_session_keeps_working(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    await stack.send(session_id, "hello")
    events = await follow_until(stack, session_id, waits(1))

    cancel = await control(stack, session_id, CANCEL)
    rejected = await follow_until(stack, session_id, seen(REJECTED), start_seq=len(events))
    assert kinds(rejected) == names(REJECTED)
    assert rejected[0].error.reason == "NOTHING_TO_CANCEL"
    assert rejected[0].inbox_seq == cancel.receipt.seq == 1
    assert rejected[0].delivery_id == cancel.delivery_id

    await stack.send(session_id, "still here")
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events) + len(rejected))
    assert texts(rest, ANSWERED) == ["echo: still here"]
    assert of(rest, TURN_CANCELLED) == [] and of(rest, TURN_COMPLETED)


# -- human input --------------------------------------------------------------


async def _request_approval(stack: Stack, session_id: str, amount: str) -> Events:
    await stack.send(session_id, f"transfer {amount}")
    events = await follow_until(stack, session_id, waits(1))
    assert kinds(events) == names(
        STARTED,
        TURN_STARTED,
        RECEIVED,
        STEP_STARTED,
        TOOL_CALL,
        INPUT_REQUESTED,
        STEP_COMPLETED,
        WAITING,
    )
    request = one(events, INPUT_REQUESTED).input_request
    assert request.kind == s.INPUT_KIND_APPROVAL
    assert request.request_id
    assert request.tool_call.name == "transfer"
    assert request.tool_call.id == one(events, TOOL_CALL).tool_call.id
    assert of(events, TOOL_RESULT) == [] and of(events, TURN_COMPLETED) == []
    return events


async def test_approval_resumes_the_same_turn(stack: Stack) -> None:
    session_id = await stack.create()
    events = await _request_approval(stack, session_id, "100")
    turn_id = one(events, TURN_STARTED).turn_id
    request = one(events, INPUT_REQUESTED).input_request

    await respond(stack, session_id, s.InputResponse(request_id=request.request_id, approved=True))
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert kinds(rest) == names(
        TOOL_RESULT, STEP_STARTED, ANSWERED, STEP_COMPLETED, TURN_COMPLETED, WAITING
    )
    assert {e.turn_id for e in rest[:-1]} == {turn_id}, "the answer opened another turn"
    result = one(rest, TOOL_RESULT).tool_result
    assert (result.output, result.is_error) == ("transferred 100", False)
    assert result.tool_call_id == request.tool_call.id
    assert texts(rest, ANSWERED) == ["The result is transferred 100."]
    assert one(rest, TURN_COMPLETED).usage.model_calls == 2
    assert of(events + rest, TURN_STARTED) == of(events, TURN_STARTED)


async def test_denied_approval_gives_the_model_an_error_and_the_turn_completes(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    events = await _request_approval(stack, session_id, "5")
    turn_id = one(events, TURN_STARTED).turn_id
    request = one(events, INPUT_REQUESTED).input_request

    await respond(stack, session_id, s.InputResponse(request_id=request.request_id, approved=False))
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert kinds(rest) == names(
        TOOL_RESULT, STEP_STARTED, ANSWERED, STEP_COMPLETED, TURN_COMPLETED, WAITING
    )
    result = one(rest, TOOL_RESULT).tool_result
    assert result.is_error
    assert "transferred" not in result.output
    assert one(rest, TURN_COMPLETED).turn_id == turn_id
    assert texts(rest, ANSWERED) == [f"The result is {result.output}."]


async def test_a_plain_message_while_approval_waits_abandons_it_in_the_same_turn(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    events = await _request_approval(stack, session_id, "7")
    turn_id = one(events, TURN_STARTED).turn_id

    await stack.send(session_id, "never mind")
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert kinds(rest) == names(
        TOOL_RESULT, RECEIVED, STEP_STARTED, ANSWERED, STEP_COMPLETED, TURN_COMPLETED, WAITING
    )
    assert {e.turn_id for e in rest[:-1]} == {turn_id}
    result = one(rest, TOOL_RESULT).tool_result
    assert result.is_error and "transferred" not in result.output
    assert texts(rest, ANSWERED) == ["echo: never mind"]


async def test_question_is_answered_with_text(stack: Stack) -> None:
    session_id = await stack.create()
    await stack.send(session_id, "ask my name")
    events = await follow_until(stack, session_id, waits(1))
    assert kinds(events) == names(
        STARTED,
        TURN_STARTED,
        RECEIVED,
        STEP_STARTED,
        ANSWERED,
        INPUT_REQUESTED,
        STEP_COMPLETED,
        WAITING,
    )
    turn_id = one(events, TURN_STARTED).turn_id
    request = one(events, INPUT_REQUESTED).input_request
    assert request.kind == s.INPUT_KIND_QUESTION
    assert request.request_id and request.prompt == "What is your name?"
    assert texts(events, ANSWERED) == ["What is your name?"]

    await respond(stack, session_id, s.InputResponse(request_id=request.request_id, text="Ada"))
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert kinds(rest) == names(STEP_STARTED, ANSWERED, STEP_COMPLETED, TURN_COMPLETED, WAITING)
    assert {e.turn_id for e in rest[:-1]} == {turn_id}
    assert texts(rest, ANSWERED) == ["Nice to meet you, Ada."]
    assert one(rest, TURN_COMPLETED).usage.model_calls == 2


async def test_input_responses_to_unknown_or_absent_requests_are_rejected(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    # Nothing pending at all.
    early = await respond(stack, session_id, s.InputResponse(request_id="input_1", text="x"))
    events = await follow_until(stack, session_id, seen(REJECTED))
    assert kinds(events) == names(STARTED, REJECTED)
    assert events[-1].error.reason == "INPUT_NOT_PENDING"
    assert events[-1].inbox_seq == early.receipt.seq

    await stack.send(session_id, "ask my name")
    asked = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    events += asked
    request = one(asked, INPUT_REQUESTED).input_request
    turn_id = one(asked, TURN_STARTED).turn_id

    # A response naming an unknown request: rejected, the turn keeps waiting.
    unknown = await respond(stack, session_id, s.InputResponse(request_id="input_999", text="x"))
    rejected = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    events += rejected
    assert kinds(rejected) == names(REJECTED, WAITING)
    assert rejected[0].error.reason == "UNKNOWN_INPUT_REQUEST"
    assert rejected[0].inbox_seq == unknown.receipt.seq
    assert rejected[0].turn_id == turn_id

    # The real request is still pending and can be answered.
    await respond(stack, session_id, s.InputResponse(request_id=request.request_id, text="Ada"))
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    events += rest
    assert texts(rest, ANSWERED) == ["Nice to meet you, Ada."]
    assert one(rest, TURN_COMPLETED).turn_id == turn_id

    # Answering the same request again: nothing is pending any more.
    again = await respond(stack, session_id, s.InputResponse(request_id=request.request_id))
    late = await follow_until(stack, session_id, seen(REJECTED), start_seq=len(events))
    assert kinds(late) == names(REJECTED)
    assert late[0].error.reason == "INPUT_NOT_PENDING"
    assert late[0].inbox_seq == again.receipt.seq


# -- sign-in ------------------------------------------------------------------


async def test_authorization_resumes_after_every_attempt_and_drops_stale_ones(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    await stack.send(session_id, "read calendar")
    events = await follow_until(stack, session_id, waits(1))
    assert kinds(events) == names(
        STARTED,
        TURN_STARTED,
        RECEIVED,
        STEP_STARTED,
        TOOL_CALL,
        AUTH_REQUIRED,
        AUTH_REQUIRED,
        STEP_COMPLETED,
        WAITING,
    )
    turn_id = one(events, TURN_STARTED).turn_id
    required = of(events, AUTH_REQUIRED)
    first, second = (e.attempt_id for e in required)
    assert first and second and first != second
    call = one(events, TOOL_CALL).tool_call
    assert call.name == "calendar"
    assert all(e.tool_call.id == call.id for e in required)

    # An unknown attempt, one real attempt, and that attempt again: only the
    # real one counts, so the tool must not run yet.
    await control(stack, session_id, CALLBACK, attempt_id="attempt_999", granted=True)
    await control(stack, session_id, CALLBACK, attempt_id=first, granted=True)
    await control(stack, session_id, CALLBACK, attempt_id=first, granted=True)
    settled = await barrier(stack, session_id, len(events))
    assert kinds(settled) == names(REJECTED), "a stale or repeated attempt had an effect"
    events += settled

    last = await control(stack, session_id, CALLBACK, attempt_id=second, granted=True)
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert kinds(rest) == names(
        AUTH_COMPLETED,
        TOOL_RESULT,
        STEP_STARTED,
        ANSWERED,
        STEP_COMPLETED,
        TURN_COMPLETED,
        WAITING,
    )
    assert {e.turn_id for e in rest[:-1]} == {turn_id}
    completed = one(rest, AUTH_COMPLETED)
    assert completed.attempt_id == second
    assert completed.inbox_seq == last.receipt.seq
    assert completed.error.reason == ""
    result = one(rest, TOOL_RESULT).tool_result
    assert (result.output, result.is_error, result.tool_call_id) == (
        "3 meetings today",
        False,
        call.id,
    )
    assert texts(rest, ANSWERED) == ["The result is 3 meetings today."]
    events += rest

    # A repeat after the turn completed is dropped too.
    await control(stack, session_id, CALLBACK, attempt_id=second, granted=True)
    after = await barrier(stack, session_id, len(events))
    assert kinds(after) == names(REJECTED)


# -- queue and steer while the turn waits (issue 32) --------------------------
#
# A queued message waits for the turn to end (design §4) also while the turn
# waits for the user: the run takes what answers or ends the wait past it,
# and the message starts its own turn once the turn has ended. A steer keeps
# its meaning: it abandons the waits and joins the turn.

QUEUE = s.TURN_POLICY_QUEUE
ECHO_TURN = (STEP_STARTED, ANSWERED, STEP_COMPLETED, TURN_COMPLETED, WAITING)


def split_turns(events: Events) -> list[Events]:
    """`events` cut before each turn.started."""
    turns: list[Events] = [[]]
    for event in events:
        if event.kind == TURN_STARTED:
            turns.append([])
        turns[-1].append(event)
    return turns


def assert_own_turn(events: Events, text: str, seq: int, after_turn: str) -> None:
    """`events` are one turn, started by the message `text` (inbox `seq`)."""
    assert kinds(events) == names(TURN_STARTED, RECEIVED, *ECHO_TURN)
    message = one(events, RECEIVED)
    assert (message.text, message.inbox_seq) == (text, seq)
    assert message.turn_id and message.turn_id != after_turn
    assert texts(events, ANSWERED) == [f"echo: {text}"]


async def still_waits(stack: Stack, session_id: str, start_seq: int) -> Events:
    """Everything sent before has been taken or set aside, and the turn still
    waits for its input: an answer naming no pending request, taken past
    whatever waits, is rejected, and nothing else happened."""
    stray = await respond(stack, session_id, s.InputResponse(request_id="input_stray"))
    settled = await follow_until(stack, session_id, waits(1), start_seq=start_seq)
    assert kinds(settled) == names(REJECTED, WAITING), "a message acted on the waiting turn"
    assert settled[0].error.reason == "UNKNOWN_INPUT_REQUEST"
    assert settled[0].inbox_seq == stray.receipt.seq
    return settled


async def test_a_queued_message_waits_for_the_approval_then_starts_its_own_turn(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    events = await _request_approval(stack, session_id, "100")
    turn_id = one(events, TURN_STARTED).turn_id
    request = one(events, INPUT_REQUESTED).input_request

    queued = await stack.send(session_id, "later", turn_policy=QUEUE)
    events += await still_waits(stack, session_id, len(events))

    await respond(stack, session_id, s.InputResponse(request_id=request.request_id, approved=True))
    rest = await follow_until(stack, session_id, waits(2), start_seq=len(events))
    answered, own = split_turns(rest)
    assert kinds(answered) == names(TOOL_RESULT, *ECHO_TURN)
    assert {e.turn_id for e in answered[:-1]} == {turn_id}
    result = one(answered, TOOL_RESULT).tool_result
    assert (result.output, result.is_error) == ("transferred 100", False)
    assert_own_turn(own, "later", queued.receipt.seq, turn_id)
    assert_gapless(events + rest)


async def test_a_queued_message_waits_for_a_cancelled_approval_then_starts_its_turn(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    events = await _request_approval(stack, session_id, "9")
    turn_id = one(events, TURN_STARTED).turn_id

    queued = await stack.send(session_id, "later", turn_policy=QUEUE)
    cancel = await control(stack, session_id, CANCEL)
    rest = await follow_until(stack, session_id, waits(2), start_seq=len(events))
    cancelled, own = split_turns(rest)
    assert kinds(cancelled) == names(TURN_CANCELLED, WAITING)
    assert cancelled[0].turn_id == turn_id and cancelled[0].inbox_seq == cancel.receipt.seq
    assert_own_turn(own, "later", queued.receipt.seq, turn_id)
    assert not of(rest, TOOL_RESULT), "the approval was answered for the user"


async def test_messages_behind_a_queued_one_wait_with_it_in_order(stack: Stack) -> None:
    """While the turn waits, a queued message holds back the messages behind
    it, as it does while a turn runs: a steer behind it does not abandon the
    wait, and joins the queued message's turn (the same principal's)."""
    session_id = await stack.create()
    events = await _request_approval(stack, session_id, "3")
    turn_id = one(events, TURN_STARTED).turn_id
    request = one(events, INPUT_REQUESTED).input_request

    queued = await stack.send(session_id, "later", turn_policy=QUEUE)
    steer = await stack.send(session_id, "and then")
    events += await still_waits(stack, session_id, len(events))

    await respond(stack, session_id, s.InputResponse(request_id=request.request_id, approved=True))
    rest = await follow_until(stack, session_id, waits(2), start_seq=len(events))
    answered, own = split_turns(rest)
    assert one(answered, TOOL_RESULT).tool_result.output == "transferred 3"
    assert one(answered, TURN_COMPLETED).turn_id == turn_id
    assert kinds(own) == names(TURN_STARTED, RECEIVED, RECEIVED, *ECHO_TURN)
    assert [(e.text, e.inbox_seq) for e in of(own, RECEIVED)] == [
        ("later", queued.receipt.seq),
        ("and then", steer.receipt.seq),
    ]
    assert_gapless(events + rest)


async def test_a_queued_message_waits_for_the_sign_in_then_starts_its_own_turn(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    await stack.send(session_id, "read calendar")
    events = await follow_until(stack, session_id, waits(1))
    turn_id = one(events, TURN_STARTED).turn_id
    first, second = (e.attempt_id for e in of(events, AUTH_REQUIRED))

    queued = await stack.send(session_id, "later", turn_policy=QUEUE)
    await control(stack, session_id, CALLBACK, attempt_id=first, granted=True)
    settled = await barrier(stack, session_id, len(events))
    assert kinds(settled) == names(REJECTED), "the queued message acted on the sign-in"
    events += settled

    await control(stack, session_id, CALLBACK, attempt_id=second, granted=True)
    rest = await follow_until(stack, session_id, waits(2), start_seq=len(events))
    signed_in, own = split_turns(rest)
    assert kinds(signed_in) == names(AUTH_COMPLETED, TOOL_RESULT, *ECHO_TURN)
    assert {e.turn_id for e in signed_in[:-1]} == {turn_id}
    result = one(signed_in, TOOL_RESULT).tool_result
    assert (result.output, result.is_error) == ("3 meetings today", False)
    assert_own_turn(own, "later", queued.receipt.seq, turn_id)
    assert_gapless(events + rest)


async def test_a_steer_while_the_sign_in_waits_abandons_it_in_the_same_turn(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    await stack.send(session_id, "read calendar")
    events = await follow_until(stack, session_id, waits(1))
    turn_id = one(events, TURN_STARTED).turn_id

    await stack.send(session_id, "never mind")
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert kinds(rest) == names(TOOL_RESULT, RECEIVED, *ECHO_TURN)
    assert {e.turn_id for e in rest[:-1]} == {turn_id}
    result = one(rest, TOOL_RESULT).tool_result
    assert result.is_error and result.output.startswith("sign-in abandoned")
    assert texts(rest, ANSWERED) == ["echo: never mind"]


# -- limits -------------------------------------------------------------------


async def test_max_steps_per_turn_fails_the_turn(stack: Stack) -> None:
    session_id = await stack.create()
    await stack.send(session_id, "steps 20")
    events = await follow_until(stack, session_id, waits(1))
    assert of(events, TURN_COMPLETED) == []
    failed = one(events, TURN_FAILED)
    assert failed.error.reason == "MAX_STEPS"
    assert [e.step for e in of(events, STEP_STARTED)] == list(range(1, 9))
    assert failed.usage.model_calls == 8
    assert failed.usage == usage_sum(events)
    assert kinds(events)[-2:] == names(TURN_FAILED, WAITING)

    await stack.send(session_id, "steps 3")
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert one(rest, TURN_COMPLETED).usage.model_calls == 3
    assert of(rest, TURN_FAILED) == []


async def test_token_budget_asks_before_the_model_call(stack: Stack) -> None:
    session_id = await stack.create(token_budget=5)
    await stack.send(session_id, "hello")
    events = await follow_until(stack, session_id, waits(1))
    assert texts(events, ANSWERED) == ["echo: hello"]
    spent = one(events, TURN_COMPLETED).usage
    assert spent.input_tokens + spent.output_tokens >= 5

    # The budget is spent: the next turn asks before any model call.
    await stack.send(session_id, "again")
    asked = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    events += asked
    assert kinds(asked) == names(TURN_STARTED, RECEIVED, INPUT_REQUESTED, WAITING)
    turn_id = one(asked, TURN_STARTED).turn_id
    request = one(asked, INPUT_REQUESTED).input_request
    assert request.kind == s.INPUT_KIND_SESSION_LIMIT and request.request_id

    await respond(stack, session_id, s.InputResponse(request_id=request.request_id, approved=True))
    extended = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    events += extended
    assert kinds(extended) == names(STEP_STARTED, ANSWERED, STEP_COMPLETED, TURN_COMPLETED, WAITING)
    assert {e.turn_id for e in extended[:-1]} == {turn_id}
    assert texts(extended, ANSWERED) == ["echo: again"]

    # Spent again; this time the user keeps the limit.
    await stack.send(session_id, "once more")
    asked = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    events += asked
    assert kinds(asked) == names(TURN_STARTED, RECEIVED, INPUT_REQUESTED, WAITING)
    request = one(asked, INPUT_REQUESTED).input_request
    assert request.kind == s.INPUT_KIND_SESSION_LIMIT

    await respond(stack, session_id, s.InputResponse(request_id=request.request_id, approved=False))
    denied = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert kinds(denied) == names(TURN_FAILED, WAITING)
    assert denied[0].error.reason == "LIMIT_EXCEEDED"
    assert denied[0].turn_id == one(asked, TURN_STARTED).turn_id
    assert denied[0].usage.model_calls == 0


async def test_a_failing_model_fails_the_turn_only(stack: Stack) -> None:
    session_id = await stack.create()
    await stack.send(session_id, "fail model")
    events = await follow_until(stack, session_id, waits(1))
    assert kinds(events) == names(STARTED, TURN_STARTED, RECEIVED, TURN_FAILED, WAITING)
    assert events[3].error.reason == "MODEL_ERROR"

    await stack.send(session_id, "hello")
    rest = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    assert texts(rest, ANSWERED) == ["echo: hello"]


# -- clear, compact, reset ----------------------------------------------------


async def test_clear_and_compact(stack: Stack) -> None:
    session_id = await stack.create()
    await stack.send(session_id, "first topic")
    events = await follow_until(stack, session_id, waits(1))

    clear = await control(stack, session_id, CLEAR)
    cleared = await follow_until(stack, session_id, seen(CLEARED), start_seq=len(events))
    events += cleared
    assert kinds(cleared) == names(CLEARED)
    assert cleared[0].inbox_seq == clear.receipt.seq

    await stack.send(session_id, "second topic")
    events += await follow_until(stack, session_id, waits(1), start_seq=len(events))

    compact = await control(stack, session_id, COMPACT)
    compacted = await follow_until(stack, session_id, seen(COMPACTED), start_seq=len(events))
    events += compacted
    assert kinds(compacted) == names(COMPACTED)
    event = compacted[0]
    assert event.inbox_seq == compact.receipt.seq
    # The clear dropped "first topic": two messages remain, the second turn's.
    assert event.text == "2 messages about: second topic"
    assert event.usage.model_calls == 1
    assert event.usage.output_tokens == len(event.text.split())
    assert event.usage.input_tokens > 0

    # The summary replaced the history: one system message plus the next turn.
    await stack.send(session_id, "third topic")
    turn = await follow_until(stack, session_id, waits(1), start_seq=len(events))
    events += turn
    assert texts(turn, ANSWERED) == ["echo: third topic"]
    await control(stack, session_id, COMPACT)
    again = await follow_until(stack, session_id, seen(COMPACTED), start_seq=len(events))
    assert again[0].text == "3 messages about: third topic"
    assert_gapless(events + again)


async def test_reset_finalizes_closes_the_stream_once_and_releases_tokens(
    stack: Stack,
) -> None:
    session_id = await stack.create(aliases=["reset-me"])
    await stack.send(session_id, "hello")
    events = await follow_until(stack, session_id, waits(1))

    follower = asyncio.ensure_future(read_to_close(stack, session_id))
    reset = await control(stack, session_id, RESET, reason="done")
    closed = await follower
    assert closed[: len(events)] == events
    assert kinds(closed[len(events) :]) == names(COMPLETED)
    terminal = closed[-1]
    assert terminal.inbox_seq == reset.receipt.seq
    assert terminal.error.reason == ""

    # Reading again from 0 ends at the same terminal event, and only once.
    again = await read_to_close(stack, session_id)
    assert [e.SerializeToString() for e in again] == [e.SerializeToString() for e in closed]
    assert len([e for e in again if e.kind in TERMINAL]) == 1

    # The session id is finalized; nothing can be sent to it any more.
    with pytest.raises(grpc.aio.AioRpcError) as by_id:
        await stack.send(session_id, "anyone there?")
    assert by_id.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
    if by_id.value.code() == grpc.StatusCode.FAILED_PRECONDITION:
        assert error_reason(by_id.value) == "SESSION_FINALIZED"

    # The alias is released (right after the close commit): never accepted,
    # and NOT_FOUND once the dispose that follows the close has landed.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while True:
        with pytest.raises(grpc.aio.AioRpcError) as by_alias:
            await stack.send(alias="reset-me", text="anyone there?")
        code = by_alias.value.code()
        if code == grpc.StatusCode.NOT_FOUND or loop.time() > deadline:
            break
        assert code == grpc.StatusCode.FAILED_PRECONDITION, code
        assert error_reason(by_alias.value) == "SESSION_FINALIZED"
        await asyncio.sleep(0.05)
    assert code == grpc.StatusCode.NOT_FOUND
    assert error_reason(by_alias.value) == "TOKEN_NOT_FOUND"

    # Nothing after the terminal event.
    final = await read_all(stack, session_id)
    assert [e.SerializeToString() for e in final] == [e.SerializeToString() for e in closed]


async def test_a_follower_resuming_after_the_terminal_event_ends(stack: Stack) -> None:
    """The stream is closed for good: a follower whose cursor is already past
    the terminal event (it saw it, then reconnected) ends with nothing."""
    session_id = await stack.create()
    await control(stack, session_id, RESET)
    closed = await read_to_close(stack, session_id)
    assert kinds(closed) == names(STARTED, COMPLETED)
    after = await read_to_close(stack, session_id, start_seq=len(closed), timeout=5)
    assert after == []


# -- the session timeout ------------------------------------------------------


async def test_session_timeout_finalizes_once(stack: Stack) -> None:
    session_id = await stack.create(timeout_seconds=2)
    await stack.send(session_id, "hello")
    events = await read_to_close(stack, session_id, timeout=15)
    assert_gapless(events)
    assert texts(events, ANSWERED) == ["echo: hello"]
    assert of(events, TURN_COMPLETED)
    terminal = [e for e in events if e.kind in TERMINAL]
    assert len(terminal) == 1 and terminal[0] is events[-1]
    assert terminal[0].kind == COMPLETED
    assert terminal[0].error.reason == "TIMEOUT"

    again = await read_to_close(stack, session_id)
    assert [e.SerializeToString() for e in again] == [e.SerializeToString() for e in events]
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await stack.send(session_id, "too late")
    assert late.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


# -- runtime aliases ----------------------------------------------------------


async def test_an_alias_claimed_at_runtime_reaches_the_session(stack: Stack) -> None:
    session_id = await stack.create(aliases=["front-desk"])
    await stack.send(session_id, "alias helpdesk")
    events = await follow_until(stack, session_id, waits(1))
    result = one(events, TOOL_RESULT).tool_result
    assert (result.output, result.is_error) == ("alias slack:helpdesk added", False)
    assert texts(events, ANSWERED) == ["The result is alias slack:helpdesk added."]

    sent = {
        "via helpdesk": await stack.send(alias="helpdesk", text="via helpdesk"),
        "via slack:helpdesk": await stack.send(alias="slack:helpdesk", text="via slack:helpdesk"),
        "via front-desk": await stack.send(alias="front-desk", text="via front-desk"),
    }
    assert {r.receipt.session_id for r in sent.values()} == {session_id}

    def all_answered(ev: Events) -> bool:
        return set(texts(ev, RECEIVED)) >= set(sent) and ev[-1].kind == WAITING

    rest = await follow_until(stack, session_id, all_answered, start_seq=len(events))
    by_text = {e.text: e.inbox_seq for e in of(rest, RECEIVED)}
    assert by_text == {text: r.receipt.seq for text, r in sent.items()}

    # The runtime alias also addresses the stream.
    call = stack.ingress_stub.StreamEvents(
        ingress_pb.StreamEventsRequest(alias="helpdesk", start_seq=0, follow=False),
        metadata=SLACK,
    )
    by_alias = [event async for response in call for event in response.events]
    assert {e.session_id for e in by_alias} == {session_id}
    assert len(by_alias) >= len(events) + len(rest)
