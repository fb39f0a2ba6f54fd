"""The client SDK (sdk/, `baton_client`) against real stacks: a conversation
through the asyncio and the sync client, real refusals as typed errors,
retried sends never doubled, and a follower that reads on, gapless, across
a handoff. Ingress kill -9 and restart: tests/test_sdk_restart.py; the
client side alone through grpcio-testing: tests/test_sdk_errors.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import baton_client
import pytest
from baton_client import AsyncClient, Client, Settings
from baton_client._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_client.types import Event

from baton_runtime.common.rpc.server import GrpcServer
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from tests.stack import SLACK_KEY, WEB_KEY, Stack, start_stack, stop_stack
from tests.test_handoff import Env, env  # noqa: F401  (the fixture)

K = baton_client.EventKind
QUEUE = baton_client.TurnPolicy.Value("TURN_POLICY_QUEUE")
TERMINAL = baton_client.types.TERMINAL_KINDS


def settings_for(addr: str, pki: LocalPki, api_key: str = SLACK_KEY, **extra: object) -> Settings:
    """What a gateway configures: the ingress, the CA its certificate chains
    to, and the channel's API key."""
    ca = pki.files(Role.OPERATOR).ca
    return Settings(target=addr, api_key=api_key, ca_cert=ca, **extra)  # type: ignore[arg-type]


def sdk(stack: Stack, server: GrpcServer | None = None, **extra: object) -> AsyncClient:
    return AsyncClient(settings_for(stack.addr(server or stack.ingress), stack.pki, **extra))


async def collect(
    follower: baton_client.AsyncFollower, done: Callable[[list[Event]], bool]
) -> list[Event]:
    out: list[Event] = []
    try:
        async with asyncio.timeout(30):
            async for event in follower:
                out.append(event)
                if done(out):
                    break
    except TimeoutError:
        kinds = [K.Name(e.kind) for e in out]
        raise AssertionError(f"the stream did not get there: {kinds}") from None
    return out


def waits(n: int) -> Callable[[list[Event]], bool]:
    return lambda events: sum(e.kind == K.EVENT_KIND_SESSION_WAITING for e in events) >= n


async def test_a_conversation_through_the_async_client(stack: Stack) -> None:
    async with sdk(stack) as client:
        created = await client.create_session(aliases=["thread-9"], token_budget=50_000)
        assert created.created and created.deployment_id == stack.deployment_id
        again = await client.create_session(request_id=created.request_id)
        assert (again.session_id, again.created) == (created.session_id, False)
        sid = created.session_id

        receipt = await client.send(alias="thread-9", text="what is 6*7")
        assert receipt.session_id == sid and receipt.delivery_id.startswith("sdk-dlv-")
        assert receipt.accepted_deployment_id == stack.deployment_id
        by_alias = client.follow(alias="thread-9")
        events = await collect(by_alias, waits(1))
        assert by_alias.session_id == sid
        assert [e.seq for e in events] == list(range(len(events)))
        answers = [e.text for e in events if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED]
        assert answers == ["The result is 42."]

        view = await client.get_session(alias="thread-9")
        assert view.session_id == sid and view.stream_head == len(events)
        assert baton_client.status_name(view.status) == "idle"
        assert "slack:thread-9" in view.aliases
        listed = [v.session_id async for v in client.iter_sessions(filter="status = idle")]
        assert sid in listed
        page = await client.list_sessions(page_size=1)
        assert len(page.sessions) == 1

        # Reset is terminal: a follower from the cursor ends after it.
        reset = await client.control(sid, baton_client.ControlKind.CONTROL_KIND_RESET)
        assert reset.delivery_id.startswith("sdk-dlv-")
        tail = [e async for e in client.follow(sid, start_seq=len(events))]
        assert [e.seq for e in tail] == list(range(len(events), len(events) + len(tail)))
        assert tail[-1].kind in TERMINAL
        # And a read past the end is over at once.
        assert [e async for e in client.follow(sid, start_seq=tail[-1].seq + 1)] == []


async def test_the_sync_client_sends_once_with_its_delivery_id(stack: Stack) -> None:
    """The sync client (in a thread: the stack runs on this event loop)."""
    settings = settings_for(stack.addr(stack.ingress), stack.pki)

    def converse() -> tuple[list[baton_client.Receipt], list[Event]]:
        with Client(settings) as client:
            sid = client.create_session().session_id
            first = client.send(sid, "hello", delivery_id="gw-42")
            again = client.send(sid, "hello", delivery_id="gw-42")
            other = client.send(
                sid, "hello again", turn_policy=baton_client.TurnPolicy.Value("TURN_POLICY_QUEUE")
            )
            events: list[Event] = []
            for event in client.follow(sid):
                events.append(event)
                if waits(2)(events):
                    break
            replay = list(client.follow(sid, follow=False))
            assert [e.seq for e in replay[: len(events)]] == [e.seq for e in events]
            return [first, again, other], events

    (first, again, other), events = await asyncio.to_thread(converse)
    assert (again.seq, again.duplicate, first.duplicate) == (first.seq, True, False)
    assert other.seq == first.seq + 1
    received = [e.delivery_id for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED]
    assert received == ["gw-42", other.delivery_id]


async def test_real_refusals_surface_as_typed_errors(stack: Stack) -> None:
    async with (
        sdk(stack) as slack,
        sdk(stack, api_key=WEB_KEY) as web,
        sdk(stack, api_key="no-such-key-000000") as stranger,
    ):
        sid = (await slack.create_session(aliases=["mine"])).session_id
        cases: list[tuple[object, type[baton_client.BatonError], str]] = [
            (stranger.get_session(sid), baton_client.Unauthenticated, "INVALID_API_KEY"),
            (web.get_session(sid), baton_client.NotFound, "SESSION_NOT_FOUND"),
            (slack.get_session(alias="nobody"), baton_client.NotFound, "TOKEN_NOT_FOUND"),
            (slack.send(sid, "   "), baton_client.InvalidArgument, "EMPTY_MESSAGE"),
            (
                slack.send(alias="web:theirs", text="hi"),
                baton_client.PermissionDenied,
                "CROSS_TENANT",
            ),
            (
                slack.list_sessions(filter="colour = red"),
                baton_client.InvalidArgument,
                "INVALID_FILTER",
            ),
            (
                slack.send(sid, "x", delivery_id="bad id!"),
                baton_client.InvalidArgument,
                "INVALID_FIELD",
            ),
        ]
        for call, cls, reason in cases:
            with pytest.raises(cls) as raised:
                await call  # type: ignore[misc]
            assert raised.value.reason == reason and not raised.value.retryable
        await slack.control(sid, pb.CONTROL_KIND_RESET)
        await collect(
            slack.follow(sid), lambda es: es[-1].kind in baton_client.types.TERMINAL_KINDS
        )
        with pytest.raises(baton_client.FailedPrecondition) as finalized:
            await slack.send(sid, "too late")
        assert finalized.value.reason == "SESSION_FINALIZED"


async def test_a_follower_reads_on_across_a_handoff(env: Env) -> None:  # noqa: F811
    """A reader on A's ingress since seq 0 while the session moves to B (a
    send accepted by B's ingress): one gapless stream, one handoff event."""
    a, b = env.a, env.b
    async with sdk(a) as via_a, sdk(b) as via_b:
        sid = (await via_a.create_session()).session_id
        await via_a.send(sid, "what is 6*7")
        follower = via_a.follow(sid)
        reading = asyncio.create_task(collect(follower, waits(2)))
        first = await collect(via_a.follow(sid), waits(1))
        receipt = await via_b.send(sid, "whoami")
        assert receipt.accepted_deployment_id == "dep-b"
        followed = await reading
    assert [e.seq for e in followed] == list(range(len(followed)))
    assert followed[: len(first)] == first
    handed = [e for e in followed if e.kind == K.EVENT_KIND_SESSION_HANDED_OFF]
    assert len(handed) == 1 and handed[0].deployment_id == "dep-b"
    assert followed[-1].deployment_id == "dep-b"
    answers = [e.text for e in followed if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED]
    assert answers == ["The result is 42.", "The result is dep-b."]


async def test_a_cursor_below_the_stream_horizon_is_out_of_range(etcd_endpoint: str) -> None:
    """A read from a cursor the server no longer has is an explicit
    OutOfRange naming the earliest seq kept; reading from there is gapless."""
    stack = await start_stack(
        etcd_endpoint,
        anchor_options={
            "stream_retention_events": 20,
            "stream_retention_seconds": 0.0,
            "retention_sweep_seconds": 0.2,
        },
    )
    try:
        async with sdk(stack) as client:
            sid = (await client.create_session()).session_id
            head = 0
            for i in range(6):
                await client.send(sid, f"turn {i}")
                head += len(await collect(client.follow(sid, start_seq=head), waits(1)))
            deadline = time.monotonic() + 30
            while True:  # the horizon moves in the background
                try:
                    [e async for e in client.follow(sid, follow=False)]
                except baton_client.OutOfRange as exc:
                    below = exc
                    break
                assert time.monotonic() < deadline, "the stream was never trimmed"
                await asyncio.sleep(0.1)
            assert below.reason == "BELOW_HORIZON" and not below.retryable
            earliest = below.earliest_seq
            assert earliest is not None and 0 < earliest <= head - 20
            kept = [e.seq async for e in client.follow(sid, start_seq=earliest, follow=False)]
            assert kept == list(range(earliest, head))
    finally:
        await stop_stack(stack)


async def test_a_follow_beyond_the_head_is_out_of_range(stack: Stack) -> None:
    """A follow from a seq no event will have next is refused at once
    (OutOfRange/BEYOND_HEAD with the head), not left waiting for nothing."""
    async with sdk(stack) as client:
        sid = (await client.create_session()).session_id
        await client.send(sid, "hello")
        head = len(await collect(client.follow(sid), waits(1)))
        with pytest.raises(baton_client.OutOfRange) as beyond:
            async with asyncio.timeout(10):
                [e async for e in client.follow(sid, start_seq=head + 3)]
        assert beyond.value.reason == baton_client.Reason.BEYOND_HEAD
        assert beyond.value.metadata["next_seq"] == str(head) and not beyond.value.retryable


async def test_a_client_certificate_is_offered_and_closing_ends_followers(stack: Stack) -> None:
    """TLS with a client certificate (for a proxy in front of ingress that
    asks for one; ingress itself authenticates gateways by API key), and a
    follower on a live session ends, without an error, when its client closes."""
    files = stack.pki.files(Role.OPERATOR)
    client = sdk(stack, client_cert=files.cert, client_key=files.key)
    sid = (await client.create_session()).session_id
    await client.send(sid, "hello")
    seen: list[Event] = []
    first_turn = asyncio.Event()

    async def read() -> None:
        async for event in client.follow(sid):
            seen.append(event)
            if waits(1)(seen):
                first_turn.set()

    reader = asyncio.create_task(read())
    async with asyncio.timeout(30):
        await first_turn.wait()
    await client.close()
    async with asyncio.timeout(10):
        await reader
    assert [e.seq for e in seen] == list(range(len(seen)))
