"""FollowEvents (issue 21): event reads multiplexed over one stream to anchor
(services/common/streams/feeds.py). Each follow is read as ReadEvents reads it and
ends as it would end: a read that is not live with OK after its last page,
a missing session with NOT_FOUND; bounds and windows are checked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as a
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import Reason
from baton_runtime.common.limits import MAX_EVENT_BYTES, MAX_PAGE_BYTES
from baton_runtime.common.rpc.status_map import from_rpc_error, from_status_proto
from tests.stack import Stack
from tests.test_fencing import Env, open_env, wait_until
from tests.test_inbox_feed import close_one_before_its_open_is_written, items_until_end

METHOD = "/baton.anchor.v1.AnchorService/FollowEvents"


@pytest.fixture
async def env(stack: Stack) -> AsyncIterator[Env]:
    async with open_env(stack) as opened:
        yield opened


async def test_event_reads_share_one_stream_and_follow_live(env: Env) -> None:
    """Two sessions followed live through one AnchorClient, and a read that
    is not live: one stream carries them all; each read gets exactly what
    ReadEvents gives (the public stream through ingress), a live one also
    the next turn's events; the read that is not live ends by itself."""
    stack = env.stack
    sessions = [await stack.create() for _ in range(2)]
    for sid in sessions:
        await stack.send(sid, "hello")
        await stack.events(sid, until=1)
    whole = [e async for page in env.anchor.read_events(sessions[0]) for e in page]
    public = await stack.events(sessions[0], follow=False)
    assert [e.seq for e in whole] == [e.seq for e in public] and whole
    seen: dict[str, list[s.Event]] = {sid: [] for sid in sessions}

    async def follow(sid: str) -> None:
        async for page in env.anchor.read_events(sid, 0, True):
            seen[sid].extend(page)

    loop = asyncio.get_running_loop()
    readers = [loop.create_task(follow(sid)) for sid in sessions]
    try:
        await wait_until(lambda: all(seen.values()), what="the replayed events")
        assert env.anchor._reads.follows_open() == 2
        await stack.send(sessions[1], "again")
        waits = s.EVENT_KIND_SESSION_WAITING
        await wait_until(
            lambda: sum(e.kind == waits for e in seen[sessions[1]]) == 2, what="the live turn"
        )
        assert [e.seq for e in seen[sessions[1]]] == list(range(len(seen[sessions[1]])))
        assert sum(e.kind == waits for e in seen[sessions[0]]) == 1
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    await wait_until(lambda: env.anchor._reads.follows_open() == 0, what="the stops")


async def test_follows_end_as_read_events_would_and_bounds_are_refused(env: Env) -> None:
    """On a raw stream: a read that is not live ends with OK after its page;
    a missing session's read ends NOT_FOUND; a window over 1,024 ends its
    follow INVALID_ARGUMENT; a grant of 0 pages ends the stream."""
    sid = await env.stack.create()
    await env.stack.send(sid, "hello")
    await env.stack.events(sid, until=1)
    call = raw_stream(env)
    try:
        await call.write(
            a.FollowEventsRequest(
                follows=[
                    a.EventFollow(follow_id=1, request=a.ReadEventsRequest(session_id=sid)),
                    a.EventFollow(
                        follow_id=2,
                        request=a.ReadEventsRequest(session_id=ids.new_session_id(), follow=True),
                    ),
                    a.EventFollow(
                        follow_id=3, request=a.ReadEventsRequest(session_id=sid), window=1025
                    ),
                ]
            )
        )
        items: list[a.EventFeedItem] = []
        async with asyncio.timeout(10):
            while sum(1 for i in items if i.end) < 3:
                items.extend((await call.read()).items)
        await call.write(a.FollowEventsRequest(grants=[a.EventFeedGrant(follow_id=1, pages=0)]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
    finally:
        call.cancel()
    ends = {i.follow_id: status_pb2.Status.FromString(i.end) for i in items if i.end}
    assert ends[1].code == 0
    assert from_status_proto(ends[2]).reason == Reason.SESSION_NOT_FOUND
    assert from_status_proto(ends[3]).reason == Reason.INVALID_FIELD
    pages = [i for i in items if not i.end]
    assert {i.follow_id for i in pages} == {1} and pages[0].events[0].seq == 0
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(info.value).reason == Reason.INVALID_FIELD


async def test_a_stop_in_the_message_of_its_open_ends_that_follow(env: Env) -> None:
    """Issue 32: one message opens live reads 1 and 2 of a session and stops
    2. A stop applies after its follow's open: read 2 ends at once and
    nothing is sent for it, read 1 gets the events; once 1 is stopped and
    the client half-closes, the stream ends with OK, as it does only when no
    follow is left open. (Stops applied before opens left read 2 open for
    nobody, holding its watch, for the life of the stream.)"""
    sid = await env.stack.create()
    await env.stack.send(sid, "hello")
    await env.stack.events(sid, until=1)
    call = raw_stream(env)
    live = a.ReadEventsRequest(session_id=sid, follow=True)
    try:
        await call.write(
            a.FollowEventsRequest(
                follows=[
                    a.EventFollow(follow_id=1, request=live),
                    a.EventFollow(follow_id=2, request=live),
                ],
                stop_ids=[2],
            )
        )
        items: list[a.EventFeedItem] = []
        async with asyncio.timeout(10):
            while not items:
                items.extend((await call.read()).items)
        await call.write(a.FollowEventsRequest(stop_ids=[1]))
        await call.done_writing()
        rest, ended = await items_until_end(call)
    finally:
        call.cancel()
    assert {(i.follow_id, i.end) for i in items + rest} == {(1, b"")}
    assert items[0].events[0].seq == 0
    assert ended, "a follow left open after its stop"


async def test_a_read_closed_before_its_open_is_written_is_never_sent(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32, the client half: a read closed while its open still waits
    for the writer is dropped from the queue. No message names it, neither
    an open nor a stop (written together, or the stop first, they left it
    open on anchor for nobody); the read before it is served and stopped as
    usual, and the stream, half-closed, ends: nothing is left open."""
    sid = await env.stack.create()
    await env.stack.send(sid, "hello")
    await env.stack.events(sid, until=1)
    page, written, ended = await close_one_before_its_open_is_written(
        env.anchor._reads, monkeypatch, lambda: env.anchor.read_events(sid, 0, True)
    )
    assert page[0].seq == 0
    assert written == [([1], []), ([], [1])]
    assert ended, "a follow left open on anchor"


def raw_stream(env: Env) -> Any:
    call: Any = env.anchor.channel.stream_stream(
        METHOD,
        request_serializer=a.FollowEventsRequest.SerializeToString,
        response_deserializer=a.FollowEventsResponse.FromString,
    )()
    return call


async def test_event_pages_keep_their_bytes_bound_live_and_replayed(env: Env) -> None:
    """Issue 32: a commit of four events near the largest anchor accepts
    (1.25 MiB in all), read live and replayed, through FollowEvents and
    through ReadEvents: every page within MAX_PAGE_BYTES (a commit's live
    batch split), every event once and in order."""
    from tests import certs
    from tests.test_fencing import OWN_DEPLOYMENT, commit_request, event, own_session

    fence, snapshot = await own_session(env)
    sid = fence.session_id
    single = env.stack.anchor_client(certs.owner(OWN_DEPLOYMENT), event_feed=False)
    clients = {"FollowEvents": env.anchor, "ReadEvents": single}
    live: dict[str, list[list[s.Event]]] = {name: [] for name in clients}

    async def follow(name: str) -> None:
        async for page in clients[name].read_events(sid, 0, True):
            live[name].append(page)

    loop = asyncio.get_running_loop()
    readers = [loop.create_task(follow(name)) for name in clients]
    try:
        await wait_until(lambda: all(live.values()), what="session.started")
        big = []
        for seq in range(1, 5):
            big.append(event(sid, seq, s.EVENT_KIND_MESSAGE_COMPLETED))
            big[-1].text = "e" * (MAX_EVENT_BYTES - big[-1].ByteSize() - 8)
        await env.anchor_stub.CommitStep(commit_request(fence, big, snapshot), timeout=10)
        await wait_until(
            lambda: all(sum(map(len, pages)) == 5 for pages in live.values()), what="the commit"
        )
        replayed = {
            name: [page async for page in client.read_events(sid, 0)]
            for name, client in clients.items()
        }
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await single.close()
    for pages in (*live.values(), *replayed.values()):
        assert [e.seq for page in pages for e in page] == [0, 1, 2, 3, 4]
        assert max(sum(e.ByteSize() for e in page) for page in pages) <= MAX_PAGE_BYTES
        assert [e.text for page in pages for e in page][1:] == [e.text for e in big]
