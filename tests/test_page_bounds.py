"""Pages bounded in bytes, and a page's failure kept to its follow (issue 32).

An inbox or event page travels in one gRPC message, and a feed's message
batches the pages of several follows: over gRPC's 4 MiB the whole stream
fails, every follow on it. Pages hold entries up to limits.MAX_PAGE_BYTES
(services/common/streams/pages.py), the largest entry Baton accepts (ingress' largest
message with every field at its largest among them) fits one, a feed's
message stays within its bound, and a page that could still not be sent
ends its own follow, no other. A stream that gRPC itself ended (no Baton
reason) is broken for every follow on it, and never counts against a
session's restart budget."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import status_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as a
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as h
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import bounds, limits
from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import InvalidArgument, Reason
from baton_runtime.common.rpc import server as grpc_server
from baton_runtime.common.rpc.status_map import from_rpc_error, from_status_proto, status_proto
from baton_runtime.common.streams import feeds
from baton_runtime.common.streams.multiplex_client import StreamBroken, stream_failure
from baton_runtime.common.streams.pages import ENTRY_FRAMING, byte_pages
from baton_runtime.hooks.inbox import check_command
from baton_runtime.ingress.config import IngressConfig
from baton_runtime.ingress.edge import MAX_INPUT_RESPONSES, MAX_LABEL_BYTES, MAX_LABELS, Edge
from baton_runtime.owner.host.restarts import transient
from tests.stack import SLACK_KEY

MiB = 1024 * 1024


def cost(size: int) -> int:
    return size + ENTRY_FRAMING


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3 * MiB), max_size=40), st.integers(1, 2 * MiB))
def test_pages_keep_the_order_and_end_only_where_the_next_entry_would_not_fit(
    sizes: list[int], limit: int
) -> None:
    pages = list(byte_pages(((size, n) for n, size in enumerate(sizes)), limit))
    assert [n for page in pages for n in page] == list(range(len(sizes)))
    for page in pages:
        assert page
        assert len(page) == 1 or sum(cost(sizes[n]) for n in page) <= limit
    for page, after in zip(pages, pages[1:], strict=False):
        assert sum(cost(sizes[n]) for n in page) + cost(sizes[after[0]]) > limit


def largest_entry(seq: int) -> s.InboxEntry:
    """An inbox entry of the largest command hooks accepts."""
    command = s.Command(delivery=s.DeliveryMetadata(delivery_id="d" * 128), send=s.SendCommand())
    _fill(command, lambda text: setattr(command.send, "text", text), limits.MAX_COMMAND_BYTES)
    check_command(command)  # accepted
    return s.InboxEntry(
        seq=seq, command=command, accepted_at=Timestamp(seconds=2**40, nanos=999_999_999)
    )


def largest_event(seq: int) -> s.Event:
    """An event of the largest size anchor accepts."""
    event = s.Event(session_id="ses_" + "a" * 26, seq=seq, kind=s.EVENT_KIND_MESSAGE_COMPLETED)
    _fill(event, lambda text: setattr(event, "text", text), limits.MAX_EVENT_BYTES)
    return event


def _fill(message: Any, set_text: Any, size: int) -> None:
    """Set the text `set_text` sets so that `message` is exactly `size` bytes."""
    length = size - message.ByteSize()
    set_text("x" * length)
    set_text("x" * (length - (message.ByteSize() - size)))
    assert message.ByteSize() == size


def test_ingress_takes_no_message_hooks_would_refuse(tmp_path: Path) -> None:
    """--max-message-bytes is at most MAX_MESSAGE_TEXT_BYTES, and a message
    of that much text with every label, input response and id at its
    largest is a command hooks accepts: so every inbox entry is within
    MAX_COMMAND_BYTES, whichever way it came."""
    keys = tmp_path / "api-keys"
    keys.write_text(f"slack={SLACK_KEY}\n")
    environ = {"BATON_API_KEYS_FILE": str(keys), "BATON_PLAINTEXT": "1"}
    environ["BATON_DEPLOYMENT_ID"] = "d" * 63
    limit = limits.MAX_MESSAGE_TEXT_BYTES
    for bad in (limit + 1, limits.MAX_COMMAND_BYTES):
        with pytest.raises(ConfigError):
            IngressConfig.load(argv=[f"--max-message-bytes={bad}"], environ=environ)
    config = IngressConfig.load(argv=[f"--max-message-bytes={limit}"], environ=environ)
    edge = Edge(config.deployment_id, config.api_keys, None, None, None, limit)  # type: ignore[arg-type]
    responses = [
        s.InputResponse(request_id=f"{n:03d}" + "r" * 125, approved=True)
        for n in range(MAX_INPUT_RESPONSES)
    ]
    labels = {f"{n:02d}": "v" * (MAX_LABEL_BYTES - 2) for n in range(MAX_LABELS)}
    text = "x" * limit
    command = edge.build_send("c" * 64, text, responses, 0, "d" * 128, "c" * 128, labels)
    command.delivery.traceparent = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    check_command(command)  # accepted
    assert command.ByteSize() <= limits.MAX_COMMAND_BYTES


def test_the_largest_entries_fit_a_page_and_a_full_page_fits_its_message() -> None:
    """The framing counted is never less than the message's, and the largest
    command (hooks) and event (anchor) each fit a page, several to one."""
    seq = bounds.MAX_SEQ
    inbox = [largest_entry(seq + n) for n in range(9)]
    events = [largest_event(seq + n) for n in range(9)]
    for entries, message in (
        (inbox, lambda page: h.StreamInboxResponse(entries=page)),
        (events, lambda page: a.ReadEventsResponse(events=page)),
    ):
        pages = list(byte_pages((e.ByteSize(), e) for e in entries))
        assert len(pages) > 1 and all(len(page) > 1 for page in pages[:-1])
        for page in pages:
            assert message(page).ByteSize() <= feeds.page_bytes(page) <= limits.MAX_PAGE_BYTES
    assert limits.MAX_PAGE_BYTES + 1024 < feeds.MAX_SENDABLE_PAGE_BYTES


async def test_feed_messages_keep_their_bound_and_an_unsendable_page_ends_one_follow() -> None:
    """Eight follows on one stream, served by `serve_follows` as hooks serves
    FollowInboxes: six whose pages are full (a backlog of the largest
    commands), one whose producer broke the bound (a page over 4 MiB), and
    one of small pages. No message passes the bound (and so gRPC's limit);
    the broken follow ends INTERNAL alone, the others get every entry in
    order and end OK."""
    sessions = {n: f"ses_{n:026d}" for n in range(1, 9)}

    async def open_follow(request: h.StreamInboxRequest) -> AsyncIterator[list[s.InboxEntry]]:
        n = int(request.fence.session_id.removeprefix("ses_"))
        if n == 7:
            yield [largest_entry(seq) for seq in range(17)]  # over 4 MiB in one page
        elif n == 8:
            for seq in range(40):
                yield [s.InboxEntry(seq=seq, command=s.Command(send=s.SendCommand(text="hi")))]
        else:
            backlog = [largest_entry(seq) for seq in range(12)]
            for page in byte_pages((e.ByteSize(), e) for e in backlog):
                yield page

    async def requests() -> AsyncIterator[h.FollowInboxesRequest]:
        yield h.FollowInboxesRequest(
            follows=[
                h.InboxFollow(
                    follow_id=n,
                    request=h.StreamInboxRequest(fence=s.Fence(session_id=sid)),
                    window=64,
                )
                for n, sid in sessions.items()
            ]
        )

    def message(ready: list[feeds.Item]) -> h.FollowInboxesResponse:
        return h.FollowInboxesResponse(
            items=[h.InboxFeedItem(follow_id=i, entries=p or (), end=e) for i, p, e in ready]
        )

    served = feeds.serve_follows(requests(), open_follow, message, method="StreamInbox")
    messages = [m async for m in served]
    sizes = [m.ByteSize() for m in messages]
    assert max(sizes) <= feeds.MAX_MESSAGE_BYTES + 64 < grpc_server.MAX_MESSAGE_BYTES
    seqs: dict[int, list[int]] = {n: [] for n in sessions}
    ends: dict[int, status_pb2.Status] = {}
    for item in (item for m in messages for item in m.items):
        seqs[item.follow_id] += [e.seq for e in item.entries]
        if item.end:
            ends[item.follow_id] = status_pb2.Status.FromString(item.end)
    assert {n: e.code for n, e in ends.items()} == {n: 13 if n == 7 else 0 for n in sessions}
    assert from_status_proto(ends[7]).reason == Reason.INTERNAL
    assert seqs == {n: [] if n == 7 else list(range(40 if n == 8 else 12)) for n in sessions}


def rpc_error(code: grpc.StatusCode, details: str, status: Any = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if status is not None:
        trailing.add("grpc-status-details-bin", status.SerializeToString())
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def test_a_status_grpc_made_breaks_the_stream_and_is_never_the_sessions_failure() -> None:
    """The stream of the issue ended RESOURCE_EXHAUSTED with no Baton reason
    (gRPC's own refusal to send a message): every follow on it is told the
    stream broke (retry), and a run that failed on such a status is restarted
    without counting against its budget. A refusal with a Baton reason stays
    what it was, for the stream and for the budget."""
    made = rpc_error(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "Sent message larger than max (4199342 vs. 4194304)"
    )
    assert isinstance(stream_failure(made, "FollowInboxes"), StreamBroken)
    failure = from_rpc_error(made)
    assert failure.reason == Reason.TRANSPORT_FAILED and not failure.retryable
    assert transient(failure)
    refusal = InvalidArgument(Reason.INVALID_FIELD, "follows: 1 to 256")
    refused = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, refusal.message, status_proto(refusal))
    answer = stream_failure(refused, "FollowInboxes")
    assert isinstance(answer, InvalidArgument) and answer.reason == Reason.INVALID_FIELD
    assert not transient(answer)
