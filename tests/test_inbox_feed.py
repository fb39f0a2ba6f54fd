"""FollowInboxes (issue 21): an owner instance's inbox streams multiplexed over
one stream to hooks (services/common/streams/feeds.py, feed_client.py). Each follow is
served as StreamInbox serves it, ends as it would end, and alone; a stop ends
one follow and no other; a message that breaks the bounds is refused. Pages
are bounded in bytes, and one too large to send ends its own follow only
(issue 32)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as h
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import Fenced, Internal, Reason
from baton_runtime.common.limits import MAX_PAGE_BYTES
from baton_runtime.common.rpc.status_map import from_rpc_error, from_status_proto
from baton_runtime.common.streams.feed_client import FollowedStreams
from tests.stack import Stack
from tests.test_fencing import Env, open_env, own_session, take_over, wait_until

METHOD = "/baton.hooks.v1.HookRegistryService/FollowInboxes"
Code = grpc.StatusCode


@pytest.fixture
async def env(stack: Stack) -> AsyncIterator[Env]:
    async with open_env(stack) as opened:
        yield opened


def clear(delivery_id: str) -> s.Command:
    return s.Command(delivery=s.DeliveryMetadata(delivery_id=delivery_id), clear=s.ClearCommand())


async def test_follows_of_many_sessions_share_one_stream_and_end_alone(env: Env) -> None:
    """Three sessions followed through one HooksClient: one stream carries
    them all; the fence of one moves and its follow alone ends FENCED, the
    others keep receiving, gapless and in order."""
    fences = [(await own_session(env))[0] for _ in range(3)]
    seen: dict[str, list[int]] = {f.session_id: [] for f in fences}
    arrived = asyncio.Event()

    async def follow(fence: s.Fence) -> None:
        async for page in env.hooks.stream_inbox(fence, 0):
            seen[fence.session_id].extend(e.seq for e in page)
            arrived.set()

    loop = asyncio.get_running_loop()
    readers = {f.session_id: loop.create_task(follow(f)) for f in fences}
    try:
        for n in range(2):
            for fence in fences:
                await env.hooks.append(ids.inbox_token(fence.session_id), clear(f"a-{n}"))
        await wait_for(lambda: all(len(v) == 2 for v in seen.values()), "the first entries")
        assert env.hooks._inboxes.follows_open() == 3  # one stream, three follows
        moved = fences[0].session_id
        await take_over(env, moved)
        with pytest.raises(Fenced):
            await asyncio.wait_for(readers[moved], 10)
        for fence in fences[1:]:
            await env.hooks.append(ids.inbox_token(fence.session_id), clear("b"))
        await wait_for(lambda: all(len(seen[f.session_id]) == 3 for f in fences[1:]), "more")
        assert seen == {moved: [0, 1], **{f.session_id: [0, 1, 2] for f in fences[1:]}}
        assert env.hooks._inboxes.follows_open() == 2
    finally:
        for reader in readers.values():
            reader.cancel()
        await asyncio.gather(*readers.values(), return_exceptions=True)
    await wait_for(lambda: env.hooks._inboxes.follows_open() == 0, "the stops")


async def test_a_stopped_follow_gets_nothing_more_and_the_stream_serves_on(env: Env) -> None:
    """On a raw stream: follow 1 gets its backlog; once stopped, an append to
    its session reaches nobody, while follow 2, opened after, gets its own
    (so anything for follow 1 would have come first)."""
    first, _ = await own_session(env)
    second, _ = await own_session(env)
    await env.hooks.append(ids.inbox_token(first.session_id), clear("one"))
    call = raw_stream(env)
    try:
        await call.write(open_follows((1, first)))
        (item,) = (await call.read()).items
        assert (item.follow_id, [e.seq for e in item.entries], item.end) == (1, [0], b"")
        await call.write(h.FollowInboxesRequest(stop_ids=[1, 99]))  # 99: not open, ignored
        await env.hooks.append(ids.inbox_token(first.session_id), clear("two"))
        await asyncio.sleep(0.3)
        await call.write(open_follows((2, second)))
        await env.hooks.append(ids.inbox_token(second.session_id), clear("three"))
        pages = await read_items(call, until=lambda got: bool(got))
        assert [(i.follow_id, [e.seq for e in i.entries]) for i in pages] == [(2, [0])]
    finally:
        call.cancel()


async def test_a_stop_in_the_message_of_its_open_ends_that_follow(env: Env) -> None:
    """Issue 32: one message opens follows 1 and 2 of a session with a
    backlog and stops 2. A stop applies after its follow's open: follow 2
    ends at once and nothing is sent for it, follow 1 gets its page; once 1
    is stopped and the client half-closes, the stream ends with OK, as it
    does only when no follow is left open. (Stops applied before opens left
    follow 2 open for nobody, holding its watch, for the life of the stream.)"""
    fence, _ = await own_session(env)
    await env.hooks.append(ids.inbox_token(fence.session_id), clear("one"))
    call = raw_stream(env)
    try:
        opening = open_follows((1, fence), (2, fence))
        opening.stop_ids.append(2)
        await call.write(opening)
        items = await read_items(call, until=lambda got: bool(got))
        await call.write(h.FollowInboxesRequest(stop_ids=[1]))
        await call.done_writing()
        rest, ended = await items_until_end(call)
    finally:
        call.cancel()
    assert [(i.follow_id, [e.seq for e in i.entries], i.end) for i in items + rest] == [
        (1, [0], b"")
    ]
    assert ended, "a follow left open after its stop"


async def test_a_follow_closed_before_its_open_is_written_is_never_sent(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32, the client half: a follow closed while its open still waits
    for the writer is dropped from the queue. No message names it, neither
    an open nor a stop (written together, or the stop first, they left it
    open on hooks for nobody); the follow before it is served and stopped as
    usual, and the stream, half-closed, ends: nothing is left open."""
    fence, _ = await own_session(env)
    await env.hooks.append(ids.inbox_token(fence.session_id), clear("one"))
    page, written, ended = await close_one_before_its_open_is_written(
        env.hooks._inboxes, monkeypatch, lambda: env.hooks.stream_inbox(fence, 0)
    )
    assert [e.seq for e in page] == [0]
    assert written == [([1], []), ([], [1])]
    assert ended, "a follow left open on hooks"


async def test_feed_bounds_are_refused_and_a_bad_follow_ends_alone(env: Env) -> None:
    """A message with nothing, with more than 256 follows and stops, or with
    a malformed traceparent, and an undecodable one end the stream with
    INVALID_ARGUMENT and a reason; a follow id of 0 or one open, and a follow
    without a fence, end that follow alone, as StreamInbox would have ended;
    the stream serves the good follow beside them."""
    fence, _ = await own_session(env)
    request = h.StreamInboxRequest(fence=fence, from_seq=0)
    ending = {
        "nothing": h.FollowInboxesRequest().SerializeToString(),
        "too many": h.FollowInboxesRequest(
            follows=[h.InboxFollow(follow_id=i + 1, request=request) for i in range(200)],
            stop_ids=list(range(1000, 1057)),
        ).SerializeToString(),
        "traceparent": h.FollowInboxesRequest(
            follows=[h.InboxFollow(follow_id=1, request=request, traceparent="00-xyz")]
        ).SerializeToString(),
        "undecodable": b"\xff\xff\xff\xff\x0f",
    }
    reasons = {}
    for what, body in ending.items():
        call: Any = env.hooks.channel.stream_stream(METHOD)()
        await call.write(body)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == Code.INVALID_ARGUMENT, (what, info.value.details())
        reasons[what] = from_rpc_error(info.value).reason
    assert reasons == {
        "nothing": Reason.INVALID_FIELD,
        "too many": Reason.INVALID_FIELD,
        "traceparent": Reason.MALFORMED_TRACEPARENT,
        "undecodable": Reason.MALFORMED_REQUEST,
    }
    await env.hooks.append(ids.inbox_token(fence.session_id), clear("x"))
    call = raw_stream(env)
    try:
        await call.write(
            h.FollowInboxesRequest(
                follows=[
                    h.InboxFollow(follow_id=0, request=request),
                    h.InboxFollow(follow_id=7, request=request),
                    h.InboxFollow(follow_id=7, request=request),
                    h.InboxFollow(follow_id=8, request=h.StreamInboxRequest(from_seq=0)),
                ]
            )
        )
        items = await read_items(call, until=lambda got: len(got) >= 4)
    finally:
        call.cancel()
    ends = {
        (i.follow_id, from_status_proto(status_pb2.Status.FromString(i.end)).reason)
        for i in items
        if i.end
    }
    assert ends == {
        (0, Reason.INVALID_FIELD),
        (7, Reason.INVALID_FIELD),
        (8, Reason.MISSING_FIELD),
    }
    (page,) = [i for i in items if not i.end]
    assert (page.follow_id, [e.seq for e in page.entries]) == (7, [0])


async def test_a_client_without_the_feed_streams_each_inbox_on_its_own(env: Env) -> None:
    """`multiplexed=False` (and hooks without FollowInboxes): StreamInbox."""
    from tests import certs
    from tests.test_fencing import OWN_DEPLOYMENT

    fence, _ = await own_session(env)
    await env.hooks.append(ids.inbox_token(fence.session_id), clear("solo"))
    hooks = env.stack.hooks_client(certs.owner(OWN_DEPLOYMENT), multiplexed=False)
    try:
        async for page in hooks.stream_inbox(fence, 0):
            assert [e.seq for e in page] == [0]
            break
        assert hooks._inboxes.follows_open() == 0
    finally:
        await hooks.close()


# -- helpers -------------------------------------------------------------------


def raw_stream(env: Env) -> Any:
    return env.hooks.channel.stream_stream(
        METHOD,
        request_serializer=h.FollowInboxesRequest.SerializeToString,
        response_deserializer=h.FollowInboxesResponse.FromString,
    )()


def open_follows(*follows: tuple[int, s.Fence]) -> h.FollowInboxesRequest:
    return h.FollowInboxesRequest(
        follows=[
            h.InboxFollow(follow_id=i, request=h.StreamInboxRequest(fence=f, from_seq=0))
            for i, f in follows
        ]
    )


async def read_items(call: Any, until: Any, timeout: float = 10.0) -> list[h.InboxFeedItem]:
    got: list[h.InboxFeedItem] = []
    async with asyncio.timeout(timeout):
        while not until(got):
            message = await call.read()
            assert message is not grpc.aio.EOF
            got.extend(message.items)
    return got


async def wait_for(predicate: Any, what: str) -> None:
    await wait_until(predicate, what=what)


async def items_until_end(call: Any, timeout: float = 5.0) -> tuple[list[Any], bool]:
    """The items a raw stream sends until it ends, and whether the server
    ended it with OK within `timeout` (a stream with a follow open does not
    end when the client half-closes)."""
    got: list[Any] = []
    try:
        async with asyncio.timeout(timeout):
            while (message := await call.read()) is not grpc.aio.EOF:
                got.extend(message.items)
    except TimeoutError:
        return got, False
    return got, await call.code() == Code.OK


class HeldWrites:
    """A feed's real stream, watched at the wire: the messages written, in
    order (`sent` of them on their way), the first held until `release` is
    set (as HTTP/2 flow control may hold a write), and `ended` once the
    server ended the stream."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.written: list[Any] = []
        self.sent = 0
        self.release = asyncio.Event()
        self.ended = asyncio.Event()

    async def write(self, message: Any) -> None:
        self.written.append(message)
        await self.release.wait()
        await self.call.write(message)
        self.sent += 1

    async def read(self) -> Any:
        message = await self.call.read()
        if message is grpc.aio.EOF:
            self.ended.set()
        return message

    def cancel(self) -> bool:
        cancelled: bool = self.call.cancel()
        return cancelled


async def close_one_before_its_open_is_written(
    feed: FollowedStreams[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    follow: Callable[[], AsyncIterator[Any]],
) -> tuple[Any, list[tuple[list[int], list[int]]], bool]:
    """On `feed`, whose stream is not open yet: follow 1 opened, its open
    held in the writer; follow 2 opened, and closed by its reader before
    its open is written; then follow 1's first page, follow 1 closed, and
    the stream half-closed. Returns that page, the follow ids opened and
    stopped by each message written, and whether the server then ended the
    stream (it does once no follow is open there)."""
    opened = feed._open
    calls: list[HeldWrites] = []

    def open_held() -> HeldWrites:
        calls.append(HeldWrites(opened()))
        return calls[-1]

    monkeypatch.setattr(feed, "_open", open_held)
    first, second = follow().__aiter__(), follow().__aiter__()
    reading = asyncio.ensure_future(anext(first))
    leaving: asyncio.Future[Any] | None = None
    try:
        await wait_for(lambda: len(calls) == 1 and len(calls[0].written) == 1, "open 1, held")
        leaving = asyncio.ensure_future(anext(second))
        await wait_for(lambda: feed.follows_open() == 2, "open 2, queued")
        leaving.cancel()  # follow 2's reader leaves while its open is queued
        await asyncio.gather(leaving, return_exceptions=True)
        assert feed.follows_open() == 1
        (call,) = calls
        call.release.set()
        page = await asyncio.wait_for(reading, 10)
        reading = asyncio.ensure_future(anext(first))  # waits: no more pages
    finally:
        reading.cancel()  # follow 1's reader leaves: it is stopped
        await asyncio.gather(reading, *([leaving] if leaving else []), return_exceptions=True)
    await wait_for(
        lambda: call.sent == len(call.written) and 1 in call.written[-1].stop_ids,
        "the stop of follow 1, sent",
    )
    await call.call.done_writing()
    try:
        await asyncio.wait_for(call.ended.wait(), 5)
    except TimeoutError:
        pass
    written = [([f.follow_id for f in m.follows], list(m.stop_ids)) for m in call.written]
    return page, written, call.ended.is_set()


async def test_a_follow_gets_no_more_than_its_window_until_granted(env: Env) -> None:
    """Flow control: a follow opened with a window of 2 gets two pages of
    four live appends, then nothing until it grants more; a grant of 2 lets
    the other two through. Nothing is lost or reordered."""
    fence, _ = await own_session(env)
    call = raw_stream(env)
    try:
        request = h.StreamInboxRequest(fence=fence, from_seq=0)
        await call.write(
            h.FollowInboxesRequest(follows=[h.InboxFollow(follow_id=3, request=request, window=2)])
        )
        for n in range(4):  # one at a time: one watch event, one page each
            await env.hooks.append(ids.inbox_token(fence.session_id), clear(f"w-{n}"))
        first = await read_items(call, until=lambda got: len(got) >= 2)
        # (a read is not cancelled: that would end the call)
        waiting = asyncio.ensure_future(call.read())
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        assert not done, "a page past the window"
        await call.write(h.FollowInboxesRequest(grants=[h.InboxFeedGrant(follow_id=3, pages=2)]))
        rest = list((await asyncio.wait_for(waiting, 10)).items)
        rest += await read_items(call, until=lambda got: len(rest) + len(got) >= 2)
    finally:
        call.cancel()
    seqs = [e.seq for i in first + rest for e in i.entries]
    assert (len(first), seqs) == (2, [0, 1, 2, 3])


# -- pages bounded in bytes (issue 32) ---------------------------------------------


def send(delivery_id: str, text: str) -> s.Command:
    return s.Command(
        delivery=s.DeliveryMetadata(delivery_id=delivery_id), send=s.SendCommand(text=text)
    )


async def big_backlog(env: Env, fence: s.Fence) -> None:
    """112 short commands, then 128 of 32 KiB (ingress' default
    --max-message-bytes): reads of 16, 32 and 64 short entries, each under
    1 MiB, double the next to 128 entries, over 4 MiB."""
    token = ids.inbox_token(fence.session_id)
    await asyncio.gather(*(env.hooks.append(token, send(f"s{n}", "hi")) for n in range(112)))
    big = "x" * (32 * 1024)
    await asyncio.gather(*(env.hooks.append(token, send(f"b{n}", big)) for n in range(128)))


class Follower:
    """One follow read in a task: its pages, and its end if it ended."""

    def __init__(self, hooks: Any, fence: s.Fence) -> None:
        self.pages: list[list[s.InboxEntry]] = []
        self.task = asyncio.get_running_loop().create_task(self._read(hooks, fence))

    async def _read(self, hooks: Any, fence: s.Fence) -> None:
        async for page in hooks.stream_inbox(fence, 0):
            self.pages.append(page)

    def seqs(self) -> list[int]:
        return [e.seq for page in self.pages for e in page]

    def has(self, count: int) -> bool:
        """`count` entries read, or the follow ended (its end raised here)."""
        if self.task.done():
            self.task.result()
            raise AssertionError(f"the follow ended with OK after {self.seqs()}")
        return len(self.seqs()) >= count

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.mark.parametrize("feed", [True, False], ids=["FollowInboxes", "StreamInbox"])
async def test_a_backlog_over_the_message_limit_arrives_whole_and_spares_the_other_session(
    env: Env, feed: bool
) -> None:
    """Issue 32: two sessions of one owner instance's client, one with the
    backlog above. It reaches its follow complete and in order, in pages of
    at most MAX_PAGE_BYTES; the other session's follow (on the same
    FollowInboxes stream, or a StreamInbox call of its own) is served before,
    during and after it, and neither ends."""
    from tests import certs
    from tests.test_fencing import OWN_DEPLOYMENT

    hooks = env.hooks
    if not feed:
        hooks = env.stack.hooks_client(certs.owner(OWN_DEPLOYMENT), multiplexed=False)
    big, _ = await own_session(env)
    other, _ = await own_session(env)
    await big_backlog(env, big)
    other_token = ids.inbox_token(other.session_id)
    await env.hooks.append(other_token, send("o0", "before"))
    bystander = Follower(hooks, other)
    followers = [bystander]
    try:
        await wait_for(lambda: bystander.has(1), "the bystander's first entry")
        backlog = Follower(hooks, big)
        followers.append(backlog)
        await env.hooks.append(other_token, send("o1", "during"))
        await wait_for(lambda: backlog.has(240) and bystander.has(2), "the backlog")
        await env.hooks.append(other_token, send("o2", "after"))
        await wait_for(lambda: bystander.has(3) and backlog.has(240), "the bystander's third")
        assert backlog.seqs() == list(range(240)) and bystander.seqs() == [0, 1, 2]
        texts = [e.command.send.text for page in backlog.pages for e in page]
        assert texts == ["hi"] * 112 + ["x" * (32 * 1024)] * 128
        assert max(sum(e.ByteSize() for e in page) for page in backlog.pages) <= MAX_PAGE_BYTES
        assert hooks._inboxes.follows_open() == (2 if feed else 0)
    finally:
        for follower in followers:
            await follower.stop()
        if hooks is not env.hooks:
            await hooks.close()


async def test_a_page_too_large_to_send_ends_its_follow_and_no_other(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a producer ever break the page bound (here hooks' inbox is made
    to send each etcd read as one page: the backlog's fourth read, over
    4 MiB), the page ends its own follow (INTERNAL) and no other: the
    bystander on the same FollowInboxes stream keeps being served."""
    from baton_runtime.hooks import inbox

    def one_page_a_read(sized: Any) -> Any:
        entries = [entry for _, entry in sized]
        return iter([entries] if entries else [])

    monkeypatch.setattr(inbox, "byte_pages", one_page_a_read, raising=False)
    big, _ = await own_session(env)
    other, _ = await own_session(env)
    await big_backlog(env, big)
    other_token = ids.inbox_token(other.session_id)
    await env.hooks.append(other_token, send("o0", "before"))
    bystander = Follower(env.hooks, other)
    backlog = Follower(env.hooks, big)
    try:
        with pytest.raises(Internal) as ended:
            await asyncio.wait_for(backlog.task, 20)
        assert ended.value.reason == Reason.INTERNAL and "over" in ended.value.message
        assert backlog.seqs() == list(range(112))  # the three reads before it
        await env.hooks.append(other_token, send("o1", "after"))
        await wait_for(lambda: bystander.has(2), "the bystander's next entry")
        assert bystander.seqs() == [0, 1] and env.hooks._inboxes.follows_open() == 1
    finally:
        await bystander.stop()
        await backlog.stop()
