"""The sync SDK client through grpcio-testing: the test plays IngressService
and answers each call as the servers would (statuses built by the servers'
own `status_map.to_status`), so these check the client's side alone: every
error reason surfaces as its typed exception, retries repeat only what is
safe with the same idempotency key, and a follower resumes at its cursor
without gap or duplicate. Real servers: tests/test_sdk.py."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import baton_client
import grpc
import grpc_testing
import pytest
from baton_client import errors as sdk_errors
from baton_client._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_client._proto.baton.session.v1 import session_pb2 as s
from baton_client.retry import RetryPolicy

from baton_runtime.common import errors as server_errors
from baton_runtime.common.rpc.status_map import to_status

SERVICE = pb.DESCRIPTOR.services_by_name["IngressService"]
METHOD = SERVICE.methods_by_name
_T = TypeVar("_T")

# Every error class the servers raise (Fenced, a FailedPrecondition of its
# own, stays inside Baton), with metadata: the SDK must raise the class of
# the same status, keep the reason and metadata, and agree on whether a
# retry may succeed.
SERVER_CLASSES = sorted(
    (
        cls
        for cls in vars(server_errors).values()
        if isinstance(cls, type)
        and issubclass(cls, server_errors.BatonError)
        and cls not in (server_errors.BatonError, server_errors.Fenced)
    ),
    key=lambda cls: cls.__name__,
)
SERVER_FAMILIES: list[Callable[[str], server_errors.BatonError]] = [
    *(
        lambda reason, cls=cls: cls(reason, f"{cls.__name__} refusal", field="x", seq="7")
        for cls in SERVER_CLASSES
    ),
    lambda reason: server_errors.ResourceExhausted(reason, "slow down", retry_after=1.5),
]
SERVER_REASONS = sorted(
    value for name, value in vars(server_errors.Reason).items() if name.isupper()
)


def settings(**overrides: Any) -> baton_client.Settings:
    return baton_client.Settings(target="ingress.test:443", api_key="test-key", **overrides)


class Harness:
    """A sync client on a grpc_testing channel; its calls run in a thread
    while the test takes them and answers."""

    def __init__(self, **overrides: Any) -> None:
        self.channel = grpc_testing.channel([SERVICE], grpc_testing.strict_real_time())
        self.waits: list[float] = []
        ids = iter(f"id{i}" for i in range(1_000_000))
        self.client = baton_client.Client(
            settings(**overrides),
            channel=self.channel,
            new_id=lambda: next(ids),
            sleep=self.waits.append,
        )
        self.pool = ThreadPoolExecutor(1)

    def run(self, call: Callable[[], _T]) -> Future[_T]:
        return self.pool.submit(call)

    def take(self, method: str) -> tuple[Any, Any, Any]:
        return self.channel.take_unary_unary(METHOD[method])

    def take_stream(self, method: str = "StreamEvents") -> tuple[Any, Any, Any]:
        return self.channel.take_unary_stream(METHOD[method])

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def harness() -> Iterator[Harness]:
    made = Harness(retry=RetryPolicy(max_attempts=1))
    try:
        yield made
    finally:
        made.close()


def fail(rpc: Any, err: server_errors.BatonError, *, stream: bool = False) -> None:
    """End a taken call with the status the servers send for `err`."""
    status = to_status(err)
    ending = (status.trailing_metadata, status.code, status.details)
    if stream:
        rpc.terminate(*ending)
    else:
        rpc.terminate(None, *ending)


def test_every_reason_of_every_family_surfaces_as_its_typed_exception(harness: Harness) -> None:
    assert len(SERVER_CLASSES) >= 12, SERVER_CLASSES
    for make in SERVER_FAMILIES:
        for reason in SERVER_REASONS:
            sent = make(reason)
            future = harness.run(lambda: harness.client.get_session("ses_x"))
            metadata, request, rpc = harness.take("GetSession")
            assert dict(metadata)["authorization"] == "Bearer test-key"
            fail(rpc, sent)
            with pytest.raises(baton_client.BatonError) as raised:
                future.result(timeout=10)
            got = raised.value
            assert type(got).code.name == sent.kind.value, (sent, got)
            assert (got.reason, got.message, got.metadata) == (
                sent.reason,
                sent.message,
                sent.metadata,
            )
            assert got.retryable == sent.retryable, (sent, got)
            assert got.retry_after == sent.retry_after


def test_the_sdks_reasons_are_the_servers() -> None:
    """The SDK's `Reason` names only reasons the servers give (plus its own)."""
    own = {"UNKNOWN", "STREAM_GAP"}
    for name, value in vars(sdk_errors.Reason).items():
        if name.isupper() and name not in own:
            assert getattr(server_errors.Reason, name) == value


def test_a_status_without_error_info_still_has_its_family(harness: Harness) -> None:
    for code, cls, retryable in [
        (grpc.StatusCode.UNAVAILABLE, baton_client.Unavailable, True),
        (grpc.StatusCode.CANCELLED, baton_client.Unavailable, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, baton_client.DeadlineExceeded, True),
        (grpc.StatusCode.UNIMPLEMENTED, baton_client.Internal, False),
        (grpc.StatusCode.UNKNOWN, baton_client.Internal, False),
    ]:
        future = harness.run(lambda: harness.client.get_session("ses_x"))
        _, _, rpc = harness.take("GetSession")
        rpc.terminate(None, (), code, "plain")
        with pytest.raises(cls) as raised:
            future.result(timeout=10)
        assert raised.value.retryable is retryable


def out_of_range(earliest: int) -> tuple[Any, grpc.StatusCode, str]:
    """What a read below the stream's retention horizon answers."""
    from google.protobuf import any_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.ErrorInfo(
            reason="BELOW_HORIZON",
            domain=server_errors.DOMAIN,
            metadata={"earliest_seq": str(earliest)},
        )
    )
    status = rpc_status.to_status(
        status_pb2.Status(code=code_pb2.OUT_OF_RANGE, message="below", details=[detail])
    )
    return status.trailing_metadata, status.code, status.details


def events(*seqs: int, last: bool = False) -> pb.StreamEventsResponse:
    out = [s.Event(session_id="ses_x", seq=q, kind=s.EVENT_KIND_STEP_COMPLETED) for q in seqs]
    if last:
        out[-1].kind = s.EVENT_KIND_SESSION_COMPLETED
    return pb.StreamEventsResponse(events=out)


# -- retries ------------------------------------------------------------------------


def test_a_retried_send_carries_one_generated_delivery_id() -> None:
    harness = Harness()
    try:
        future = harness.run(lambda: harness.client.send("ses_x", "hi"))
        first = [harness.take("SendMessage") for _ in range(1)][0]
        fail(first[2], server_errors.Unavailable("UPSTREAM_UNAVAILABLE", "ingress restarting"))
        _, second, rpc = harness.take("SendMessage")
        fail(rpc, server_errors.DeadlineExceeded("TIMEOUT", "slow"))
        _, third, rpc = harness.take("SendMessage")
        assert first[1].delivery_id == second.delivery_id == third.delivery_id == "sdk-dlv-id0"
        receipt = s.Receipt(session_id="ses_x", seq=7, duplicate=True)
        rpc.terminate(
            pb.SendMessageResponse(receipt=receipt, delivery_id=third.delivery_id),
            (),
            grpc.StatusCode.OK,
            "",
        )
        got = future.result(timeout=10)
        assert (got.seq, got.delivery_id, got.duplicate) == (7, "sdk-dlv-id0", True)
        assert len(harness.waits) == 2 and all(w >= 0 for w in harness.waits)
    finally:
        harness.close()


def test_a_create_is_retried_with_one_request_id_and_a_refusal_is_not_retried() -> None:
    harness = Harness()
    try:
        future = harness.run(lambda: harness.client.create_session(aliases=["t1"]))
        _, first, rpc = harness.take("CreateSession")
        fail(rpc, server_errors.Aborted("CONFLICT", "again"))
        _, second, rpc = harness.take("CreateSession")
        assert first.request_id == second.request_id == "sdk-req-id0"
        rpc.terminate(
            pb.CreateSessionResponse(session_id="ses_n", created=True, deployment_id="dep-1"),
            (),
            grpc.StatusCode.OK,
            "",
        )
        assert future.result(timeout=10).request_id == "sdk-req-id0"
        future = harness.run(lambda: harness.client.send("ses_x", ""))
        _, _, rpc = harness.take("SendMessage")
        fail(rpc, server_errors.InvalidArgument("EMPTY_MESSAGE", "empty"))
        with pytest.raises(baton_client.InvalidArgument):
            future.result(timeout=10)
        # A rate limit without retry info is final; with it, retried after it.
        future = harness.run(lambda: harness.client.control("ses_x", pb.CONTROL_KIND_CANCEL))
        _, first, rpc = harness.take("SendControl")
        fail(rpc, server_errors.ResourceExhausted("RATE_LIMITED", "slow", retry_after=0.25))
        _, second, rpc = harness.take("SendControl")
        assert first.delivery_id == second.delivery_id
        fail(rpc, server_errors.ResourceExhausted("MESSAGE_TOO_LARGE", "big"))
        with pytest.raises(baton_client.ResourceExhausted):
            future.result(timeout=10)
        assert harness.waits[-1] >= 0.25
    finally:
        harness.close()


def test_retries_stop_at_the_attempt_limit() -> None:
    harness = Harness(retry=RetryPolicy(max_attempts=3))
    try:
        future = harness.run(lambda: harness.client.get_session(alias="thread-1"))
        for _ in range(3):
            _, request, rpc = harness.take("GetSession")
            assert request.alias == "thread-1"
            fail(rpc, server_errors.Unavailable("STORE_UNAVAILABLE", "etcd down"))
        with pytest.raises(baton_client.Unavailable) as raised:
            future.result(timeout=10)
        assert raised.value.reason == "STORE_UNAVAILABLE"
    finally:
        harness.close()


# -- following ------------------------------------------------------------------------


class Reader:
    """Reads a follower in the harness's thread, so the test can wait until
    the client took what was sent (grpc_testing ends a call at once, not
    after the responses before the end were read, as a real channel does)."""

    def __init__(self, harness: Harness, follower: baton_client.Follower) -> None:
        self.seqs: list[int] = []
        self._changed = threading.Condition()
        self._follower = follower
        self.future = harness.run(self._read)

    def _read(self) -> list[int]:
        for event in self._follower:
            with self._changed:
                self.seqs.append(event.seq)
                self._changed.notify_all()
        return self.seqs

    def wait_for(self, seq: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: seq in self.seqs, timeout=10), self.seqs


def test_a_follower_resumes_at_its_cursor_without_gap_or_duplicate() -> None:
    harness = Harness()
    try:
        follower = harness.client.follow("ses_x", start_seq=2)
        reader = Reader(harness, follower)
        _, request, rpc = harness.take_stream()
        assert (request.session_id, request.start_seq, request.follow) == ("ses_x", 2, True)
        rpc.send_response(events(2, 3))
        rpc.send_response(events(4))
        reader.wait_for(4)
        rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "connection reset")
        _, request, rpc = harness.take_stream()
        assert request.start_seq == 5
        rpc.send_response(events(3, 4, 5, 6))  # an overlap: dropped
        reader.wait_for(6)
        rpc.terminate((), grpc.StatusCode.CANCELLED, "ingress stopping")
        _, request, rpc = harness.take_stream()
        assert request.start_seq == 7
        rpc.send_response(events(7, 8, last=True))
        assert reader.future.result(timeout=10) == [2, 3, 4, 5, 6, 7, 8]
        assert follower.next_seq == 9
    finally:
        harness.close()


def test_a_follower_refuses_a_gap_and_a_cursor_below_the_horizon() -> None:
    harness = Harness()
    try:
        reader = Reader(harness, harness.client.follow("ses_x"))
        _, _, rpc = harness.take_stream()
        rpc.send_response(events(0, 1))
        reader.wait_for(1)
        rpc.send_response(events(3))
        with pytest.raises(baton_client.StreamGap):
            reader.future.result(timeout=10)
        assert reader.seqs == [0, 1]

        reader = Reader(harness, harness.client.follow("ses_x", start_seq=0))
        _, _, rpc = harness.take_stream()
        rpc.terminate(*out_of_range(120))
        with pytest.raises(baton_client.OutOfRange) as raised:
            reader.future.result(timeout=10)
        assert raised.value.earliest_seq == 120 and not raised.value.retryable
        assert raised.value.reason == "BELOW_HORIZON"
    finally:
        harness.close()


def test_a_follower_gives_up_on_a_refusal_and_can_be_closed() -> None:
    harness = Harness()
    try:
        follower = harness.client.follow("ses_x")
        future = harness.run(lambda: list(follower))
        _, _, rpc = harness.take_stream()
        fail(rpc, server_errors.NotFound("SESSION_NOT_FOUND", "gone"), stream=True)
        with pytest.raises(baton_client.NotFound):
            future.result(timeout=10)

        follower = harness.client.follow("ses_x")
        reader = Reader(harness, follower)
        _, _, rpc = harness.take_stream()
        rpc.send_response(events(0))
        reader.wait_for(0)
        follower.close()
        rpc.cancelled()
        assert reader.future.result(timeout=10) == [0]
    finally:
        harness.close()
