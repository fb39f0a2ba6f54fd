"""Session introspection through the public API (docs/design.md §14), on real
etcd and real gRPC: GetSession reports each status as the session goes
through it, with what hooks and anchor store; ListSessions pages through a
channel's sessions exactly once each, filters them, and shows another
channel none of them; the channel index goes with the session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.rpc.status_map import from_rpc_error
from baton_runtime.ingress import listing
from tests.procs import eventually
from tests.stack import (
    SLACK,
    WEB,
    Stack,
    add_deployment,
    start_stack,
    stop_deployment,
    stop_stack,
)

K = s.EventKind
Code = grpc.StatusCode
Metadata = tuple[tuple[str, str], ...]
ST = pb.SessionStatus


async def get(
    stack: Stack, session_id: str = "", alias: str = "", md: Metadata = SLACK
) -> pb.Session:
    target = {"alias": alias} if alias else {"session_id": session_id}
    response = await stack.ingress_stub.GetSession(
        pb.GetSessionRequest(**target),  # type: ignore[arg-type]
        metadata=md,
        timeout=10,
    )
    return response.session


async def status_becomes(
    stack: Stack, session_id: str, status: int, timeout: float = 20
) -> pb.Session:
    async def probe() -> pb.Session | None:
        view = await get(stack, session_id)
        return view if view.status == status else None

    return await eventually(probe, f"{pb.SessionStatus.Name(status)}", timeout)


async def list_page(
    stack: Stack, page_size: int = 0, token: str = "", filter: str = "", md: Metadata = SLACK
) -> pb.ListSessionsResponse:
    return await stack.ingress_stub.ListSessions(
        pb.ListSessionsRequest(page_size=page_size, page_token=token, filter=filter),
        metadata=md,
        timeout=30,
    )


async def list_all(stack: Stack, page_size: int = 0, filter: str = "") -> list[pb.Session]:
    out: list[pb.Session] = []
    token = ""
    while True:
        page = await list_page(stack, page_size, token, filter)
        out.extend(page.sessions)
        if not page.next_page_token:
            return out
        token = page.next_page_token


async def refused(call: object, code: grpc.StatusCode, reason: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    assert from_rpc_error(info.value).reason == reason, info.value.details()
    return info.value.details() or ""


async def test_an_idle_session_reports_what_is_stored(stack: Stack) -> None:
    sid = await stack.create(aliases=["intro-1"], token_budget=10_000, timeout_seconds=86_400)
    receipt = (await stack.send(sid, "calc 6*7")).receipt
    events = await stack.events(sid, until=1)
    view = await status_becomes(stack, sid, ST.SESSION_STATUS_IDLE)
    assert view.session_id == sid and view.channel == "slack"
    assert view.deployment_id == stack.deployment_id
    assert (view.owner_run_id, view.epoch) == (receipt.owner_run_id, 1)
    assert view.instance_id == f"{stack.deployment_id}-i1"
    assert view.stream_head == len(events) == events[-1].seq + 1
    assert view.turn_count == 1
    assert view.inbox_depth == 0 and not view.HasField("oldest_unconsumed_age")
    steps = [e for e in events if e.kind == K.EVENT_KIND_STEP_COMPLETED]
    used = sum(e.usage.input_tokens + e.usage.output_tokens for e in steps)
    assert used > 0
    assert view.usage.input_tokens + view.usage.output_tokens == used
    assert view.limits.token_budget == 10_000
    assert view.remaining.HasField("tokens") and view.remaining.tokens == 10_000 - used
    assert not view.remaining.HasField("cost_micros")  # unlimited
    assert list(view.aliases) == [ids.inbox_token(sid), "slack:intro-1"]
    assert not view.pending_inputs and not view.children and not view.HasField("parent")
    assert not view.HasField("last_failure")
    assert view.update_time == events[-1].time
    assert 0 < view.create_time.ToMilliseconds() <= view.update_time.ToMilliseconds()
    started = events[0].time.ToMilliseconds()
    assert abs(view.create_time.ToMilliseconds() - started) < 10_000
    assert view.timeout_deadline.seconds >= events[0].time.seconds + 86_400 - 60
    # By alias, the same view.
    assert (await get(stack, alias="intro-1")).session_id == sid
    assert (await get(stack, alias="slack:intro-1")).stream_head == view.stream_head


async def test_running_with_a_queued_command_then_idle(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "sleep 3 1500")
    running = await status_becomes(stack, sid, ST.SESSION_STATUS_RUNNING)
    assert running.inbox_depth <= 1
    await stack.send(sid, "queued", turn_policy=s.TURN_POLICY_QUEUE)

    async def backlog() -> pb.Session | None:
        view = await get(stack, sid)
        return view if view.inbox_depth >= 1 and view.HasField("oldest_unconsumed_age") else None

    waiting = await eventually(backlog, "an unconsumed command with its age", 10)
    assert waiting.status == ST.SESSION_STATUS_RUNNING
    assert waiting.oldest_unconsumed_age.ToMilliseconds() >= 0
    events = await stack.events(sid, until=2, timeout=30)
    done = await status_becomes(stack, sid, ST.SESSION_STATUS_IDLE)
    assert done.turn_count == 2 and done.inbox_depth == 0
    assert done.stream_head == len(events)


async def test_waiting_for_input_then_answered(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "ask my name")
    view = await status_becomes(stack, sid, ST.SESSION_STATUS_WAITING_FOR_INPUT)
    assert [r.prompt for r in view.pending_inputs] == ["What is your name?"]
    assert view.pending_inputs[0].kind == s.INPUT_KIND_QUESTION
    request_id = view.pending_inputs[0].request_id
    await stack.send(sid, "", input_responses=[s.InputResponse(request_id=request_id, text="Ada")])
    answered = await status_becomes(stack, sid, ST.SESSION_STATUS_IDLE)
    assert not answered.pending_inputs and answered.turn_count == 1


async def test_waiting_for_authorization(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "read calendar")
    view = await status_becomes(stack, sid, ST.SESSION_STATUS_WAITING_FOR_AUTHORIZATION)
    assert len(view.pending_authorizations) == 1
    assert len(view.pending_authorizations[0].expected_attempt_ids) == 2


async def test_reset_finalizes_and_the_view_stays_readable(stack: Stack) -> None:
    sid = await stack.create(aliases=["gone-soon"])
    await stack.send(sid, "hello")
    await stack.events(sid, until=1)
    await stack.ingress_stub.SendControl(
        pb.SendControlRequest(session_id=sid, kind=pb.CONTROL_KIND_RESET, reason="done"),
        metadata=SLACK,
        timeout=10,
    )
    closed = await stack.events(sid)
    assert closed[-1].kind == K.EVENT_KIND_SESSION_COMPLETED
    view = await status_becomes(stack, sid, ST.SESSION_STATUS_FINALIZED)
    assert view.stream_head == len(closed)
    # The aliases were released; the inbox token stays.
    assert list(view.aliases) == [ids.inbox_token(sid)]
    assert view.update_time == closed[-1].time


async def test_another_channels_session_is_not_found_like_a_missing_one(stack: Stack) -> None:
    sid = await stack.create()
    missing = ids.new_session_id()
    theirs = await refused(get(stack, sid, md=WEB), Code.NOT_FOUND, "SESSION_NOT_FOUND")
    unknown = await refused(get(stack, missing, md=WEB), Code.NOT_FOUND, "SESSION_NOT_FOUND")
    assert theirs.replace(sid, missing) == unknown
    assert not (await list_page(stack, md=WEB)).sessions
    assert [v.session_id for v in (await list_page(stack)).sessions] == [sid]


@pytest.fixture
async def parking(etcd_endpoint: str) -> AsyncIterator[Stack]:
    stack = await start_stack(etcd_endpoint, park_after=0.2)
    try:
        yield stack
    finally:
        await stop_stack(stack)


async def test_a_parked_session_reports_parked_and_wakes(parking: Stack) -> None:
    sid = await parking.create()
    await parking.send(sid, "hello")
    await parking.events(sid, until=1)
    view = await status_becomes(parking, sid, ST.SESSION_STATUS_PARKED)
    assert view.inbox_depth == 0 and view.turn_count == 1
    await parking.send(sid, "again")
    await parking.events(sid, until=2)
    woken = await get(parking, sid)
    assert woken.turn_count == 2
    assert woken.status in (ST.SESSION_STATUS_IDLE, ST.SESSION_STATUS_PARKED)


@pytest.fixture
async def crashing(etcd_endpoint: str) -> AsyncIterator[Stack]:
    stack = await start_stack(
        etcd_endpoint,
        agent="baton_runtime.owner.agents.fixture:build_crash_on_load_agent",
        restart_budget=1,
    )
    try:
        yield stack
    finally:
        await stop_stack(stack)


async def test_a_stalled_session_says_why(crashing: Stack) -> None:
    sid = await crashing.create()
    await crashing.send(sid, "hello")
    view = await status_becomes(crashing, sid, ST.SESSION_STATUS_STALLED, timeout=30)
    assert view.status_reason.reason == "RESTART_BUDGET_SPENT"
    assert "runs in a row failed" in view.status_reason.message
    assert view.last_failure.reason == "RESTART_BUDGET_SPENT"
    assert view.last_failure.seq == view.stream_head - 1
    assert view.inbox_depth == 1  # accepted, kept, not consumed


async def test_a_page_is_cut_short_by_its_size_and_the_token_goes_on(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page stops before its sessions pass MAX_PAGE_BYTES (a page must fit
    in one message: 200 sessions with 256 aliases each would not), with a
    token that goes on from the first session it left out."""
    from baton_runtime.ingress import introspection

    made = sorted([await stack.create(request_id=f"size-{i}") for i in range(6)])
    one = (await get(stack, made[0])).ByteSize()
    monkeypatch.setattr(introspection, "MAX_PAGE_BYTES", 2 * one + one // 2)
    seen: list[str] = []
    token = ""
    while True:
        page = await list_page(stack, 50, token)
        assert 1 <= len(page.sessions) <= 2, "a page passed its byte budget"
        seen += [v.session_id for v in page.sessions]
        if not page.next_page_token:
            break
        token = page.next_page_token
    mine = [sid for sid in seen if sid in made]
    assert mine == made, "a session was skipped or listed twice across size-cut pages"
    monkeypatch.setattr(introspection, "MAX_PAGE_BYTES", 1)  # at least one a page
    assert len((await list_page(stack, 50)).sessions) == 1


async def test_list_pages_through_1000_sessions_exactly_once(stack: Stack) -> None:
    """1,000 sessions (created 50 at a time, concurrently), paged through
    while more are created: each listed exactly once, in order."""

    async def create_many(n: int, prefix: str) -> list[str]:
        out: list[str] = []
        for start in range(0, n, 50):
            out += await asyncio.gather(
                *(
                    stack.create(request_id=f"{prefix}-{i}")
                    for i in range(start, min(n, start + 50))
                )
            )
        return out

    before = set(await create_many(1000, "bulk"))
    seen: list[str] = []
    token = ""
    pages = 0
    added: list[str] = []
    while True:
        page = await list_page(stack, 173, token)
        assert len(page.sessions) <= 173
        seen += [v.session_id for v in page.sessions]
        pages += 1
        if pages <= 3:  # sessions created while paging
            added += await create_many(5, f"during-{pages}")
        if not page.next_page_token:
            break
        token = page.next_page_token
    assert len(seen) == len(set(seen)), "a session was listed twice"
    assert before <= set(seen), "a session was skipped"
    assert set(seen) <= before | set(added)
    assert seen == sorted(seen)
    assert pages >= 1000 // 173
    # Default page size; the maximum caps a larger one.
    assert len((await list_page(stack)).sessions) == listing.DEFAULT_PAGE_SIZE
    assert len((await list_page(stack, 10_000)).sessions) == listing.MAX_PAGE_SIZE
    # A listed view is the GetSession view.
    first = (await list_page(stack, 1)).sessions[0]
    single = await get(stack, first.session_id)
    assert single.session_id == first.session_id
    assert (single.status, single.stream_head, single.create_time) == (
        first.status,
        first.stream_head,
        first.create_time,
    )
    assert not (await list_page(stack, 200, md=WEB)).sessions


async def test_list_filters_by_status_deployment_and_time(stack: Stack) -> None:
    plain = [await stack.create() for _ in range(4)]
    for sid in plain:
        await stack.send(sid, "hello")
    reset = plain[:2]
    for sid in reset:
        await stack.ingress_stub.SendControl(
            pb.SendControlRequest(session_id=sid, kind=pb.CONTROL_KIND_RESET),
            metadata=SLACK,
            timeout=10,
        )
    for sid in plain:
        await stack.events(sid, until=1)
    for sid in reset:
        await status_becomes(stack, sid, ST.SESSION_STATUS_FINALIZED)
    asking = await stack.create()
    await stack.send(asking, "ask my name")
    await status_becomes(stack, asking, ST.SESSION_STATUS_WAITING_FOR_INPUT)
    marker = (await get(stack, asking)).create_time
    other = await add_deployment(stack, "dep-b")
    try:
        moved = [await other.create() for _ in range(3)]

        def ids_of(views: list[pb.Session]) -> set[str]:
            return {v.session_id for v in views}

        assert ids_of(await list_all(stack, 2, "status = finalized")) == set(reset)
        assert ids_of(await list_all(stack, 2, 'status = "waiting_for_input"')) == {asking}
        assert ids_of(await list_all(stack, 2, "status != finalized AND deployment = dep-a")) == (
            set(plain[2:]) | {asking}
        )
        assert ids_of(await list_all(stack, 2, 'deployment = "dep-b"')) == set(moved)
        assert ids_of(await list_all(stack, 0, "deployment != dep-a")) == set(moved)
        later = Timestamp()
        later.FromMilliseconds(marker.ToMilliseconds() + 1)
        after = f'create_time >= "{later.ToJsonString()}"'
        assert ids_of(await list_all(stack, 0, after)) == set(moved)
        assert ids_of(await list_all(stack, 0, f'create_time < "{later.ToJsonString()}"')) == (
            set(plain) | {asking}
        )
        assert ids_of(await list_all(stack, 0, 'update_time > "2000-01-01T00:00:00Z"')) == (
            set(plain) | {asking} | set(moved)
        )
        assert not await list_all(stack, 0, 'update_time < "2000-01-01T00:00:00Z"')
    finally:
        await stop_deployment(other)


async def test_bad_list_arguments_are_invalid(stack: Stack) -> None:
    for _ in range(3):
        await stack.create()
    page = await list_page(stack, 1, filter="status != finalized")
    assert page.next_page_token
    await refused(
        list_page(stack, 1, page.next_page_token, "status = idle"),
        Code.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )
    await refused(
        list_page(stack, 1, page.next_page_token, "status != finalized", md=WEB),
        Code.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )
    # Another page size with the same filter is fine (AIP-158).
    assert (await list_page(stack, 5, page.next_page_token, "status != finalized")).sessions
    for token in ("garbage", "x" * 2000, page.next_page_token[:-3]):
        await refused(
            list_page(stack, 1, token, "status != finalized"),
            Code.INVALID_ARGUMENT,
            "INVALID_PAGE_TOKEN",
        )
    for bad in (
        "status = sleeping",
        "colour = red",
        "status > idle",
        "create_time = 2026-01-01T00:00:00Z",
        'create_time > "yesterday"',
        'create_time > "2026-01-01T00:00:00"',
        "status = idle AND status = running",
        "status = idle OR status = running",
        "deployment = latest",
        "x" * 2000,
    ):
        await refused(
            list_page(stack, filter=bad),
            Code.INVALID_ARGUMENT,
            "INVALID_DEPLOYMENT_ID" if "latest" in bad else "INVALID_FILTER",
        )
    await refused(list_page(stack, -1), Code.INVALID_ARGUMENT, "INVALID_FIELD")


@pytest.fixture
async def retaining(etcd_endpoint: str) -> AsyncIterator[Stack]:
    stack = await start_stack(
        etcd_endpoint,
        anchor_options={"retention_seconds": 0.5, "retention_sweep_seconds": 0.2},
    )
    try:
        yield stack
    finally:
        await stop_stack(stack)


async def test_the_channel_index_entry_goes_with_the_session(
    retaining: Stack, raw: aetcd.Client
) -> None:
    stack, etcd = retaining, raw
    keep = await stack.create()
    sid = await stack.create()
    keys = Keys(stack.etcd.prefix)
    assert await etcd.get(keys.channel_entry("slack", sid)) is not None
    await stack.ingress_stub.SendControl(
        pb.SendControlRequest(session_id=sid, kind=pb.CONTROL_KIND_RESET),
        metadata=SLACK,
        timeout=10,
    )

    async def gone() -> bool:
        return await etcd.get(keys.channel_entry("slack", sid)) is None

    await eventually(gone, "the channel index entry deleted with the session", 15)
    assert [v.session_id for v in await list_all(stack)] == [keep]
    await refused(get(stack, sid), Code.NOT_FOUND, "SESSION_NOT_FOUND")


async def test_children_with_their_states_and_the_parent_link(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "bg helper hello there")

    async def settled() -> pb.Session | None:
        view = await get(stack, sid)
        parked = [h for h in view.children if h.state == s.HANDLE_STATE_PARKED]
        return view if view.status == ST.SESSION_STATUS_IDLE and parked else None

    view = await eventually(settled, "the parent idle with its subagent parked", 30)
    [handle] = view.children
    assert (handle.kind, handle.name) == (s.TASK_KIND_SUBAGENT, "helper")
    assert handle.deployment_id == stack.deployment_id
    child = await get(stack, handle.child_session_id)
    assert child.parent.parent_session_id == sid
    assert (child.parent.kind, child.parent.name, child.parent.depth) == (
        s.TASK_KIND_SUBAGENT,
        "helper",
        1,
    )
    assert not child.parent.outbox
    assert child.channel == "slack" and child.status == ST.SESSION_STATUS_IDLE
    listed = {v.session_id for v in await list_all(stack)}
    assert listed == {sid, handle.child_session_id}
    await refused(get(stack, handle.child_session_id, md=WEB), Code.NOT_FOUND, "SESSION_NOT_FOUND")


async def test_after_an_upgrade_the_view_names_the_new_owner(stack: Stack) -> None:
    sid = await stack.create()
    await stack.send(sid, "hello")
    await stack.events(sid, until=1)
    before = await status_becomes(stack, sid, ST.SESSION_STATUS_IDLE)
    other = await add_deployment(stack, "dep-b")
    hooks = stack.hooks_client(timeout=5)
    try:
        await eventually(lambda: hooks.list_instances("dep-b"), "dep-b registered", 15)
        await other.send(sid, "whoami")
        events = await stack.events(sid, until=2)
        assert [e for e in events if e.kind == K.EVENT_KIND_SESSION_HANDED_OFF]
        after = await status_becomes(stack, sid, ST.SESSION_STATUS_IDLE)
        assert (after.deployment_id, after.epoch) == ("dep-b", before.epoch + 1)
        assert after.owner_run_id != before.owner_run_id
        assert after.turn_count == 2 and after.stream_head == len(events)
        assert after.create_time == before.create_time
        assert after.update_time.ToMilliseconds() > before.update_time.ToMilliseconds()
        # Either ingress answers the same (the view is the session's, not the edge's).
        assert await get(other, sid) == after
        dep_b = await list_all(stack, filter='deployment = "dep-b"')
        assert [v.session_id for v in dep_b] == [sid]
    finally:
        await hooks.close()
        await stop_deployment(other)


async def test_a_session_between_transfer_and_its_successors_commit_is_handing_off(
    stack: Stack,
) -> None:
    """The failpoint `handoff.after_transfer` holds the successor after the
    transfer committed and before it runs: GetSession says handing_off (the
    owner record names dep-b, the last snapshot dep-a), then idle on dep-b."""
    from baton_runtime.common import failpoints

    sid = await stack.create()
    await stack.send(sid, "hello")
    await stack.events(sid, until=1)
    await status_becomes(stack, sid, ST.SESSION_STATUS_IDLE)
    other = await add_deployment(stack, "dep-b")
    hooks = stack.hooks_client(timeout=5)
    failpoints.configure("handoff.after_transfer=once:sleep(4000)")
    try:
        await eventually(lambda: hooks.list_instances("dep-b"), "dep-b registered", 15)
        await other.send(sid, "whoami")
        moving = await status_becomes(stack, sid, ST.SESSION_STATUS_HANDING_OFF)
        assert moving.deployment_id == "dep-b" and moving.inbox_depth == 1
        after = await status_becomes(stack, sid, ST.SESSION_STATUS_IDLE)
        assert after.deployment_id == "dep-b" and after.epoch == moving.epoch
    finally:
        failpoints.configure("")
        await hooks.close()
        await stop_deployment(other)


async def test_accepted_commands_nobody_consumed_yet_count_as_running(
    etcd_endpoint: str,
) -> None:
    """With its owner gone, a session's accepted commands wait in its inbox:
    the view counts them, dates the oldest, and says running (they will be
    processed when an owner takes the session over)."""
    stack = await start_stack(etcd_endpoint)
    owner_stopped = False
    try:
        sid = await stack.create()
        await stack.send(sid, "hello")
        await stack.events(sid, until=1)
        assert (await status_becomes(stack, sid, ST.SESSION_STATUS_IDLE)).inbox_depth == 0
        await stack.owner.stop(grace=0.5)
        owner_stopped = True
        first = (await stack.send(sid, "one")).receipt
        await stack.send(sid, "two")
        view = await get(stack, sid)
        assert view.status == ST.SESSION_STATUS_RUNNING
        assert view.inbox_depth == 2 and first.seq == 1
        assert view.HasField("oldest_unconsumed_age")
        later = await get(stack, sid)
        assert (
            later.oldest_unconsumed_age.ToNanoseconds()
            >= view.oldest_unconsumed_age.ToNanoseconds()
        )
    finally:
        if owner_stopped:
            await stack.channel.close()
            for server in (stack.ingress, stack.anchor, stack.hooks):
                await server.stop(grace=0.5)
        else:
            await stop_stack(stack)
