"""Per-channel limits at the edge: sends per second, sessions per minute and
open follow streams. Over a limit a call gets RESOURCE_EXHAUSTED with a
reason and RetryInfo, nothing is accepted, and a retry after the delay goes
through; every accepted command is processed once, in order. Limits are per
channel: one tenant at its limit does not slow another."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import BatonError, Reason, ResourceExhausted
from baton_runtime.common.etcd.keys import Keys, prefix_end
from baton_runtime.common.rpc.status_map import from_rpc_error
from baton_runtime.ingress.rates import ChannelBudget, ChannelLimits, TokenBucket
from tests.procs import check_history
from tests.stack import SLACK, WEB, Stack, start_stack, stop_stack

Code = grpc.StatusCode


def test_token_bucket_bursts_then_paces() -> None:
    bucket = TokenBucket(rate=2.0, burst=2.0)
    assert bucket.take(0.0) == 0.0
    assert bucket.take(0.0) == 0.0
    assert bucket.take(0.0) == pytest.approx(0.5)  # the next token in half a second
    assert bucket.take(0.25) == pytest.approx(0.25)
    assert bucket.take(0.5) == 0.0
    assert bucket.take(10.0) == 0.0 and bucket.tokens == pytest.approx(1.0)  # capped at burst


def test_budget_is_per_channel_and_streams_are_released() -> None:
    now = [0.0]
    budget = ChannelBudget(
        ChannelLimits(follow_streams=1, sends_per_second=1, sessions_per_minute=1),
        clock=lambda: now[0],
    )
    budget.admit_send("a")
    with pytest.raises(ResourceExhausted) as info:
        budget.admit_send("a")
    assert info.value.reason == Reason.RATE_LIMITED and info.value.retry_after == 1.0
    budget.admit_send("b")  # another tenant's budget
    now[0] = 1.0
    budget.admit_send("a")
    budget.admit_create("a")
    with pytest.raises(ResourceExhausted) as info:
        budget.admit_create("a")
    assert info.value.retry_after == pytest.approx(60.0)
    with budget.follow_stream("a"):
        with pytest.raises(ResourceExhausted) as info, budget.follow_stream("a"):
            pass
        assert info.value.reason == Reason.TOO_MANY_STREAMS
        with budget.follow_stream("b"):
            pass
    with budget.follow_stream("a"):  # released
        assert budget.open_streams("a") == 1
    assert budget.open_streams("a") == 0


@pytest.fixture
async def limited(etcd_endpoint: str) -> AsyncIterator[Stack]:
    stack = await start_stack(
        etcd_endpoint,
        limits=ChannelLimits(follow_streams=2, sends_per_second=4, sessions_per_minute=3),
    )
    try:
        yield stack
    finally:
        await stop_stack(stack)


def exhausted(exc: grpc.aio.AioRpcError, reason: str) -> BatonError:
    assert exc.code() == Code.RESOURCE_EXHAUSTED, exc.details()
    err = from_rpc_error(exc)
    assert err.reason == reason
    assert err.retry_after is not None and err.retry_after > 0
    assert err.retryable
    return err


async def test_sends_over_the_rate_are_refused_and_nothing_accepted_is_lost(
    limited: Stack,
) -> None:
    stack = limited
    session_id = await stack.create()
    other = await stack.create(WEB)
    accepted: list[int] = []
    texts: list[str] = []
    refusals = 0
    for i in range(24):
        text = f"m{i}"
        while True:  # a gateway retrying after the delay it was told
            try:
                sent = await stack.send(session_id, text, turn_policy=s.TURN_POLICY_QUEUE)
            except grpc.aio.AioRpcError as exc:
                err = exhausted(exc, Reason.RATE_LIMITED)
                refusals += 1
                if refusals == 1:
                    # Another channel is not slowed by this one's limit.
                    await stack.send(other, "unaffected", metadata=WEB)
                await asyncio.sleep(err.retry_after or 0.1)
                continue
            accepted.append(sent.receipt.seq)
            texts.append(text)
            break
    assert refusals > 0, "24 sends at once never hit a limit of 4/s"
    events = await stack.events(session_id, until=len(accepted), timeout=60)
    check_history(events, accepted)
    assert [e.text for e in events if e.kind == s.EVENT_KIND_MESSAGE_RECEIVED] == texts


async def test_sessions_over_the_rate_are_refused_and_write_nothing(
    limited: Stack, etcd: aetcd.Client
) -> None:
    stack = limited
    for i in range(3):
        await stack.create(request_id=f"burst-{i}")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stack.create(request_id="one-too-many")
    err = exhausted(info.value, Reason.RATE_LIMITED)
    assert err.retry_after == pytest.approx(20.0, abs=1.0)  # 3/min: one every 20 s
    refused = ids.session_id_for_request("slack", "one-too-many")
    prefix = Keys(stack.etcd.prefix).session_prefix(refused)
    assert list(await etcd.get_range(prefix, prefix_end(prefix))) == []
    # The web channel has its own budget.
    await stack.create(WEB, request_id="web-1")


async def test_follow_streams_over_the_limit_are_refused_until_one_closes(
    limited: Stack,
) -> None:
    stack = limited
    session_id = await stack.create()
    await stack.send(session_id, "hello")

    def follow() -> grpc.aio.UnaryStreamCall:
        return stack.ingress_stub.StreamEvents(
            ingress_pb.StreamEventsRequest(session_id=session_id, follow=True), metadata=SLACK
        )

    open_calls = [follow(), follow()]
    for call in open_calls:
        assert (await call.read()).events  # admitted, reading
    third = follow()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await third.read()
    exhausted(info.value, Reason.TOO_MANY_STREAMS)
    # A read that does not follow is not a held stream.
    assert await stack.events(session_id, follow=False)
    open_calls[0].cancel()

    async def admitted() -> bool:
        call = follow()
        try:
            return bool((await call.read()).events)
        except grpc.aio.AioRpcError as exc:
            exhausted(exc, Reason.TOO_MANY_STREAMS)
            return False
        finally:
            call.cancel()

    deadline = asyncio.get_running_loop().time() + 10
    while not await admitted():
        assert asyncio.get_running_loop().time() < deadline, "a closed stream's slot never freed"
        await asyncio.sleep(0.05)
    open_calls[1].cancel()
