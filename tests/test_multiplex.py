"""Calls multiplexed over one bidirectional stream (services/common/streams/multiplex.py),
on real gRPC over loopback: a test server whose calls answer with what the
test says, the client half as the owner's AnchorClient uses it. Covered:
answers matched by id under concurrency and batched, refusals carried as the
unary method's domain error, a server stopped mid-batch (the calls in flight
fail as outcome-unknown, the next call opens a new stream), a call past its
deadline retiring its stream (not when the stream answers the calls beside
it), a slow server holding the client back within
its in-flight bound, and an older server without the method; then an
owner's commits on a real stack, streamed and (switched off) unary."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as pb
from baton_runtime.common import errors
from baton_runtime.common.errors import Reason
from baton_runtime.common.streams import multiplex, multiplex_client
from tests.procs import ProcessStack, answered, check_history
from tests.scrape import scrape

METHOD = "/test.Mux/Calls"


def _batch(calls: list[tuple[int, pb.CommitStepRequest, str]]) -> pb.CommitStepsRequest:
    return pb.CommitStepsRequest(
        calls=[pb.CommitStepCall(call_id=i, request=r, traceparent=t) for i, r, t in calls]
    )


def _answers(ready: list[multiplex.Answer]) -> pb.CommitStepsResponse:
    return pb.CommitStepsResponse(
        answers=[pb.CommitStepAnswer(call_id=i, response=r, status=s) for i, r, s in ready]
    )


def _answers_of(response: pb.CommitStepsResponse) -> list[multiplex.Answer]:
    return [(a.call_id, a.response if not a.status else None, a.status) for a in response.answers]


class MuxServer:
    """A real gRPC server serving METHOD with `serve_calls` and `handle`."""

    def __init__(
        self, handle: Callable[[pb.CommitStepRequest], Awaitable[pb.CommitStepResponse]]
    ) -> None:
        self.handle = handle
        self.max_in_flight = multiplex.MAX_IN_FLIGHT
        self.batches_seen: list[int] = []
        self.streams = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> MuxServer:
        async def calls(
            requests: AsyncIterator[pb.CommitStepsRequest], context: Any
        ) -> AsyncIterator[pb.CommitStepsResponse]:
            self.streams += 1

            async def seen() -> AsyncIterator[pb.CommitStepsRequest]:
                async for batch in requests:
                    self.batches_seen.append(len(batch.calls))
                    yield batch

            async for answer in multiplex.serve_calls(
                seen(),
                lambda batch: batch.calls,
                self.handle,
                _answers,
                method=METHOD,
                max_in_flight=self.max_in_flight,
            ):
                yield answer

        handler = grpc.method_handlers_generic_handler(
            "test.Mux",
            {
                "Calls": grpc.stream_stream_rpc_method_handler(
                    calls,
                    request_deserializer=pb.CommitStepsRequest.FromString,
                    response_serializer=pb.CommitStepsResponse.SerializeToString,
                )
            },
        )
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(None)


def client(
    channel: grpc.aio.Channel, path: str = METHOD
) -> multiplex_client.StreamedCalls[Any, Any]:
    open_stream = channel.stream_stream(
        path,
        request_serializer=pb.CommitStepsRequest.SerializeToString,
        response_deserializer=pb.CommitStepsResponse.FromString,
    )
    return multiplex_client.StreamedCalls(
        open_stream, _batch, _answers_of, target="test", method=path
    )


def request(n: int) -> pb.CommitStepRequest:
    return pb.CommitStepRequest(expected_snapshot_revision=n)


async def echo(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
    await asyncio.sleep(0.01)
    return pb.CommitStepResponse(revision=req.expected_snapshot_revision)


async def test_concurrent_calls_get_their_own_answers_batched_on_one_stream() -> None:
    server = await MuxServer(echo).start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    calls = client(channel)
    try:
        answers = await asyncio.gather(*(calls.call(request(n), 10) for n in range(1, 301)))
        assert [a.revision for a in answers] == list(range(1, 301))
        # All on one stream, several calls per message (they were ready together).
        assert sum(server.batches_seen) == 300
        assert len(server.batches_seen) < 300
        assert max(server.batches_seen) <= multiplex.MAX_BATCH_CALLS
    finally:
        await calls.close()
        await channel.close()
        await server.stop()


async def _batches_of_a_burst(busy_within_s: float, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calls per message of: one call, then two more queued by two tasks
    in the turn of the event loop that wakes the stream's writer for the
    first of them (the second is queued after the writer woke)."""
    monkeypatch.setattr(multiplex, "BUSY_WITHIN_S", busy_within_s, raising=False)
    server = await MuxServer(echo).start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    calls = client(channel)
    try:
        await calls.call(request(1), 10)  # the stream opens; its writer waits
        first = asyncio.ensure_future(calls.call(request(2), 10))
        await asyncio.sleep(0)  # `first` queues its call and wakes the writer
        # ... whose wake-up runs before `second` queues its call.
        second = asyncio.ensure_future(calls.call(request(3), 10))
        answers = await asyncio.gather(first, second)
        assert [a.revision for a in answers] == [2, 3]
        return server.batches_seen
    finally:
        await calls.close()
        await channel.close()
        await server.stop()


async def test_a_busy_stream_gathers_the_calls_ready_in_the_same_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Coalescing: the writer of a stream that sent a message less than
    BUSY_WITHIN_S ago lets the loop run once before it takes its calls, so
    a call queued by a task that was ready beside it rides the same message."""
    assert await _batches_of_a_burst(3600.0, monkeypatch) == [1, 2]


async def test_an_idle_stream_sends_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """After idleness the writer sends what it has without waiting: the
    second call goes in a message of its own."""
    assert await _batches_of_a_burst(0.0, monkeypatch) == [1, 1, 1]


async def test_a_refusal_is_the_domain_error_the_unary_method_would_raise() -> None:
    async def refuse(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
        if req.expected_snapshot_revision == 2:
            raise errors.Fenced("a newer run holds it", epoch="7")
        if req.expected_snapshot_revision == 3:
            raise RuntimeError("a bug")
        return pb.CommitStepResponse(revision=1)

    server = await MuxServer(refuse).start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    calls = client(channel)
    try:
        ok, fenced, internal = await asyncio.gather(
            calls.call(request(1), 10),
            calls.call(request(2), 10),
            calls.call(request(3), 10),
            return_exceptions=True,
        )
        assert ok.revision == 1
        assert isinstance(fenced, errors.Fenced) and fenced.reason == Reason.FENCED
        assert fenced.metadata == {"epoch": "7"}
        assert isinstance(internal, errors.Internal) and internal.reason == Reason.INTERNAL
        # The stream outlived the refusals.
        assert (await calls.call(request(4), 10)).revision == 1
    finally:
        await calls.close()
        await channel.close()
        await server.stop()


async def test_a_server_stopped_mid_batch_fails_calls_in_flight_then_a_new_stream() -> None:
    started = asyncio.Event()

    async def hang(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
        started.set()
        await asyncio.sleep(30)
        return pb.CommitStepResponse()

    first = await MuxServer(hang).start()
    port = first.port
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    calls = client(channel)
    try:
        in_flight = [asyncio.ensure_future(calls.call(request(n), 20)) for n in range(1, 6)]
        await asyncio.wait_for(started.wait(), 5)
        await first.stop()
        # No server for a while: every attempt finds the stream broken.
        for call in in_flight:
            with pytest.raises(errors.Unavailable):
                await asyncio.wait_for(call, 15)
        second = await MuxServer(echo).start(port)
        try:
            assert (await calls.call(request(9), 10)).revision == 9
            assert second.batches_seen == [1]
        finally:
            await second.stop()
    finally:
        await calls.close()
        await channel.close()


async def test_a_call_past_its_deadline_retires_its_stream() -> None:
    answered = 0

    async def first_one_hangs(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
        nonlocal answered
        if req.expected_snapshot_revision == 1:
            await asyncio.sleep(30)
        answered += 1
        return pb.CommitStepResponse(revision=req.expected_snapshot_revision)

    server = await MuxServer(first_one_hangs).start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    calls = client(channel)
    try:
        with pytest.raises(errors.DeadlineExceeded):
            await calls.call(request(1), 0.3)
        assert (await calls.call(request(2), 10)).revision == 2
        # Two streams: the second call did not ride the one the first held.
        assert server.batches_seen == [1, 1]
    finally:
        await calls.close()
        await channel.close()
        await server.stop()


async def test_a_slow_call_on_a_stream_that_answers_others_fails_alone() -> None:
    """One call past its deadline while the stream answers the calls beside
    it: that call fails, they succeed, and every call rode one stream."""

    async def first_one_is_slow(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
        await asyncio.sleep(2 if req.expected_snapshot_revision == 1 else 0.01)
        return pb.CommitStepResponse(revision=req.expected_snapshot_revision)

    server = await MuxServer(first_one_is_slow).start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    calls = client(channel)

    async def others() -> list[int]:
        revisions = []
        for n in range(2, 12):
            revisions.append((await calls.call(request(n), 10)).revision)
            await asyncio.sleep(0.05)
        return revisions

    try:
        slow = asyncio.create_task(calls.call(request(1), 0.3))
        assert await others() == list(range(2, 12))
        with pytest.raises(errors.DeadlineExceeded):
            await slow
        assert (await calls.call(request(12), 10)).revision == 12
        assert server.streams == 1
    finally:
        await calls.close()
        await channel.close()
        await server.stop()


async def test_a_slow_server_holds_the_client_back_within_its_bound() -> None:
    running = 0
    most = 0

    async def slow(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.02)
        running -= 1
        return pb.CommitStepResponse(revision=req.expected_snapshot_revision)

    server = MuxServer(slow)
    server.max_in_flight = 3
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    calls = client(channel)
    try:
        answers = await asyncio.gather(*(calls.call(request(n), 20) for n in range(1, 61)))
        assert sorted(a.revision for a in answers) == list(range(1, 61))
        assert most == 3
    finally:
        await calls.close()
        await channel.close()
        await server.stop()


async def test_a_client_that_goes_away_cancels_its_calls_on_the_server() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def hang(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return pb.CommitStepResponse()

    server = await MuxServer(hang).start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    calls = client(channel)
    try:
        pending = asyncio.ensure_future(calls.call(request(1), 20))
        await asyncio.wait_for(started.wait(), 5)
        await calls.close()
        with pytest.raises(errors.Unavailable):
            await pending
        await asyncio.wait_for(cancelled.wait(), 5)
    finally:
        await channel.close()
        await server.stop()


async def test_lanes_spread_calls_over_replicas_and_pass_over_a_stopped_one() -> None:
    """One lane per replica, each on its own channel: calls alternate between
    them; with one replica stopped, every call is answered by the other (the
    broken lane is passed over), and none fails."""
    seen: list[str] = []

    def answering(name: str) -> Callable[[pb.CommitStepRequest], Awaitable[Any]]:
        async def handle(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
            seen.append(name)
            return pb.CommitStepResponse(revision=req.expected_snapshot_revision)

        return handle

    servers = [await MuxServer(answering(name)).start() for name in ("r0", "r1")]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    lanes = multiplex_client.Lanes([client(channel) for channel in channels])
    try:
        for n in range(1, 11):
            assert (await lanes.call(request(n), 10)).revision == n
        assert seen.count("r0") == seen.count("r1") == 5
        await servers[0].stop()
        seen.clear()
        for n in range(1, 11):
            assert (await lanes.call(request(n), 10)).revision == n
        assert seen == ["r1"] * 10
    finally:
        await lanes.close()
        for channel in channels:
            await channel.close()
        await servers[1].stop()


async def test_lanes_retry_an_unavailable_answer_on_the_next_replica() -> None:
    """A replica that answers UNAVAILABLE (its etcd unreachable) is passed
    over as gRPC's retry policy passes over it for a unary call: every call
    succeeds on the other; a refusal that is an answer is never retried."""
    tried: list[str] = []

    async def unavailable(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
        tried.append("bad")
        raise errors.Unavailable(Reason.STORE_UNAVAILABLE, "etcd unavailable")

    async def good(req: pb.CommitStepRequest) -> pb.CommitStepResponse:
        tried.append("good")
        if req.expected_snapshot_revision == 99:
            raise errors.Fenced("a newer run holds it")
        return pb.CommitStepResponse(revision=req.expected_snapshot_revision)

    servers = [await MuxServer(unavailable).start(), await MuxServer(good).start()]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    lanes = multiplex_client.Lanes([client(channel) for channel in channels])
    try:
        for n in range(1, 7):
            assert (await lanes.call(request(n), 10)).revision == n
        assert "bad" in tried and tried.count("good") == 6
        tried.clear()
        with pytest.raises(errors.Fenced):
            await lanes.call(request(99), 10)
        assert tried.count("good") == 1
    finally:
        await lanes.close()
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop()


async def test_a_server_without_the_method_is_reported_unsupported() -> None:
    server = await MuxServer(echo).start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    calls = client(channel, "/test.Mux/Missing")
    try:
        with pytest.raises(multiplex_client.Unsupported):
            await calls.call(request(1), 10)
        assert not calls.supported
        with pytest.raises(multiplex_client.Unsupported):
            await calls.call(request(2), 10)
    finally:
        await calls.close()
        await channel.close()
        await server.stop()


# -- the owner's commits on a real stack ---------------------------------------------


@pytest.mark.parametrize("streamed", [True, False])
async def test_commits_and_appends_ride_streams_or_unary_calls_when_switched_off(
    etcd_endpoint: str, tmp_path: Path, streamed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default an owner's commits ride CommitSteps and an ingress' appends
    ResumeHooks (stream messages, no unary calls); `--commit-stream 0` and
    `--resume-stream 0` (BATON_OWNER_COMMIT_STREAM, BATON_INGRESS_RESUME_STREAM)
    switch them to unary calls. Either way the conversation is answered in
    order, and anchor and hooks count every call as the unary method."""
    if not streamed:
        # (every process the stack starts inherits them)
        monkeypatch.setenv("BATON_OWNER_COMMIT_STREAM", "0")
        monkeypatch.setenv("BATON_INGRESS_RESUME_STREAM", "0")
    stack = ProcessStack(etcd_endpoint, tmp_path, serve_metrics=True)
    stack.start(owners=1)
    c = stack.clients()
    try:
        await c.wait_registered("o1")
        sid = await c.create()
        receipts = [(await c.send(sid, f"hello {n}")).receipt.seq for n in range(3)]
        events = await c.wait_events(sid, functools.partial(answered, count=3), "answered")
        check_history(events, receipts)
        scraped = {
            name: await scrape(stack.metrics_url(name))
            for name in ("o1", "ingress", "anchor", "hooks")
        }
    finally:
        await c.close()
        stack.stop()
    for caller, server, method, calls in (
        ("o1", "anchor", "/baton.anchor.v1.AnchorService/CommitStep", 4),
        ("ingress", "hooks", "/baton.hooks.v1.HookRegistryService/ResumeHook", 3),
    ):
        sent = scraped[caller].total(
            "baton_rpc_client_stream_messages_sent_total", method=method + "s"
        )
        unary = scraped[caller].total("baton_rpc_client_handled_total", method=method, code="OK")
        served = scraped[server].total("baton_rpc_server_handled_total", method=method, code="OK")
        # (the session's start and a step per answer; the three sends)
        assert served >= calls, (method, served)
        if streamed:
            assert 1 <= sent <= served and unary == 0, (method, sent, unary)
        else:
            assert sent == 0 and unary == served, (method, sent, unary)
