"""Property-based fuzzing of every public and internal RPC (hypothesis).

Requests are generated from the proto descriptors: every field may be unset,
a boundary number, arbitrary text, an oversize value, or one of the live
stack's real identifiers (a session, its fence, its tokens, the deployment),
so that validation past the first check gets exercised too; one request in
five is raw random bytes instead of a message. Each goes to the RPC's server
with a certificate of a role the access table allows (the role matrix of
tests/test_access.py covers the wrong ones). Properties:

- every answer is OK or a canonical code with a google.rpc.ErrorInfo reason,
  never UNKNOWN, INTERNAL, UNIMPLEMENTED or DATA_LOSS, and never a hang;
- a refused call writes nothing (etcd's revision does not move; a write by
  background work a previous accepted call started is told apart by
  settling and asking again);
- every server still answers SERVING afterwards.

Pages at the message limit (issue 32): backlogs of commands and events of
drawn sizes, the largest hooks and anchor accept among them (and, always,
the backlog of the issue), read from 0 by every streaming method of hooks
and anchor: each reader gets all of it, in order, in messages within the
page bound.

The CI run is bounded (`EXAMPLES`); `-m slow` runs a longer one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc
import pytest
from google.protobuf import descriptor as d
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2
from baton_runtime._proto.baton.owner.v1 import owner_pb2
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids, limits
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.channels import open_channel
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.etcd.keys import Keys, OwnerRecord, parse_fence
from baton_runtime.common.security import access
from baton_runtime.common.security.identity import Role
from baton_runtime.common.streams import feeds
from baton_runtime.owner.run.snapshots import initial_snapshot
from tests.stack import SLACK, SLACK_KEY, Stack, public_channel, start_stack, stop_stack

EXAMPLES = 250
SLOW_EXAMPLES = 3000
FORBIDDEN = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DATA_LOSS,
}
SERVICES = {
    "baton.hooks.v1.HookRegistryService": hooks_pb2,
    "baton.anchor.v1.AnchorService": anchor_pb2,
    "baton.owner.v1.OwnerService": owner_pb2,
    "baton.ingress.v1.IngressService": ingress_pb2,
}
MAX_DEPTH = 3
# RPCs that never write: no need to wait for the stack to settle after them.
# Refusals that say "try again": the same request may then succeed.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
READ_ONLY = {
    "GetOwner",
    "GetSnapshot",
    "LoadSession",
    "ReadEvents",
    "FollowEvents",
    "LookupHook",
    "ListInstances",
    "ListInstanceSessions",
    "GetTransfer",
    "WatchInstances",
    "WatchBells",
    "StreamInbox",
    "FollowInboxes",
    "StreamEvents",
    "KeepAliveInstance",
    "DescribeSession",
    "ListChannelSessions",
    "GetSession",
    "ListSessions",
    "ListDeployments",
    "DescribeDeployment",
    # Live items are kept in memory only (docs/design.md "Live items").
    "PublishLive",
}


@dataclass(frozen=True)
class Rpc:
    path: str
    service: str
    method: d.MethodDescriptor

    @property
    def request_class(self) -> type[pb_message.Message]:
        return message_factory.GetMessageClass(self.method.input_type)

    @property
    def response_class(self) -> type[pb_message.Message]:
        return message_factory.GetMessageClass(self.method.output_type)


def all_rpcs() -> list[Rpc]:
    out = []
    for full_name, module in SERVICES.items():
        service = module.DESCRIPTOR.services_by_name[full_name.rpartition(".")[2]]
        out += [Rpc(f"/{full_name}/{m.name}", full_name, m) for m in service.methods]
    return out


RPCS = all_rpcs()


def test_every_rpc_is_fuzzed_including_introspection() -> None:
    paths = {rpc.path for rpc in RPCS}
    assert paths == {p for p in access.RPC_ROLES if p.startswith("/baton.")}
    for method in (
        "/baton.ingress.v1.IngressService/GetSession",
        "/baton.ingress.v1.IngressService/ListSessions",
        "/baton.hooks.v1.HookRegistryService/DescribeSession",
        "/baton.hooks.v1.HookRegistryService/ListChannelSessions",
        "/baton.hooks.v1.HookRegistryService/ListDeployments",
        "/baton.hooks.v1.HookRegistryService/DescribeDeployment",
        "/baton.owner.v1.OwnerService/ResumeSession",
    ):
        assert method in paths


# -- strategies from descriptors ------------------------------------------------------

_INT_RANGES = {
    d.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# A delayed write (a session timing out a second after a fuzzed create) would
# look like a refused call writing; a timeout the fuzzer may set is either
# refused, 0 or far away.
_NO_DELAYED_WRITES = {"timeout_seconds", "duration_seconds"}


def int_strategy(field: d.FieldDescriptor, hints: list[int]) -> st.SearchStrategy[int]:
    low, high = _INT_RANGES[field.type]
    edges = [
        v for v in (0, 1, 2, 255, 2**31 - 1, 2**53, 2**63 - 1, high, low, -1) if low <= v <= high
    ]
    values = st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(0, 50))
    if hints:  # two in three: a value that gets past the first checks
        good = st.sampled_from([v for v in hints if low <= v <= high] or [0])
        values = st.one_of(good, good, good, good, values, values)
    if field.name in _NO_DELAYED_WRITES:
        values = values.filter(lambda v: v == 0 or v >= 24 * 3600)
    return values


def string_strategy(known: list[str], hints: list[str]) -> st.SearchStrategy[str]:
    generic = st.one_of(
        st.sampled_from(known),
        st.text(max_size=40),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_:-./", max_size=60),
        st.just("x" * 20_000),
    )
    if not hints:
        return generic
    good = st.sampled_from(hints)
    return st.one_of(good, good, good, good, generic, generic)


class Fuzz:
    """Strategies for one stack's messages: a field named like one the stack
    has a real value for (session_id, epoch, token, ...) mostly gets that
    value, so that calls get past the first checks; every field may also be
    anything else."""

    def __init__(self, known: list[str], hints: dict[str, list[Any]]) -> None:
        self.known = known
        self.hints = hints
        self._cache: dict[str, st.SearchStrategy[pb_message.Message]] = {}

    def scalar(self, field: d.FieldDescriptor) -> st.SearchStrategy[Any]:
        t = field.type
        hints = self.hints.get(field.name, [])
        if t in _INT_RANGES:
            return int_strategy(field, [h for h in hints if isinstance(h, int)])
        if t == d.FieldDescriptor.TYPE_BOOL:
            return st.booleans()
        if t == d.FieldDescriptor.TYPE_STRING:
            return string_strategy(self.known, [h for h in hints if isinstance(h, str)])
        if t == d.FieldDescriptor.TYPE_BYTES:
            return st.one_of(st.binary(max_size=64), st.just(b"\x0a\x03ses"))
        if t in (d.FieldDescriptor.TYPE_DOUBLE, d.FieldDescriptor.TYPE_FLOAT):
            return st.floats(allow_nan=True, allow_infinity=True, width=32)
        if t == d.FieldDescriptor.TYPE_ENUM:
            numbers = [v.number for v in field.enum_type.values]
            return st.one_of(st.sampled_from(numbers), st.integers(-(2**31), 2**31 - 1))
        raise AssertionError(f"unhandled field type {t} of {field.full_name}")

    def message(self, descriptor: d.Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
        key = f"{descriptor.full_name}@{depth}"
        if key not in self._cache:
            self._cache[key] = st.deferred(lambda: self._build(descriptor, depth))
        return self._cache[key]

    def _build(self, descriptor: d.Descriptor, depth: int) -> st.SearchStrategy[Any]:
        cls = message_factory.GetMessageClass(descriptor)
        fields = [
            f
            for f in descriptor.fields
            if f.type != d.FieldDescriptor.TYPE_MESSAGE or depth < MAX_DEPTH
        ]

        @st.composite
        def build(draw: Callable[[st.SearchStrategy[Any]], Any]) -> pb_message.Message:
            msg = cls()
            for field in fields:
                if draw(st.integers(0, 3)) == 0:  # one field in four left unset
                    continue
                self._fill(msg, field, depth, draw)
            return msg

        return build()

    def _value(self, field: d.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        if field.type == d.FieldDescriptor.TYPE_MESSAGE:
            return self.message(field.message_type, depth + 1)
        return self.scalar(field)

    def _fill(
        self,
        msg: pb_message.Message,
        field: d.FieldDescriptor,
        depth: int,
        draw: Callable[[st.SearchStrategy[Any]], Any],
    ) -> None:
        target = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field = field.message_type.fields_by_name["key"]
            value_field = field.message_type.fields_by_name["value"]
            for _ in range(draw(st.integers(0, 3))):
                k = draw(self.scalar(key_field))
                v = draw(self._value(value_field, depth))
                if value_field.type == d.FieldDescriptor.TYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
            return
        if field.is_repeated:
            for _ in range(draw(st.integers(0, 3))):
                value = draw(self._value(field, depth))
                if field.type == d.FieldDescriptor.TYPE_MESSAGE:
                    target.add().CopyFrom(value)
                else:
                    target.append(value)
            return
        value = draw(self._value(field, depth))
        if field.type == d.FieldDescriptor.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(msg, field.name, value)


# -- the stack under fuzz -------------------------------------------------------------


@dataclass
class Target:
    stack: Stack
    etcd: aetcd.Client
    channels: dict[str, grpc.aio.Channel]
    known: list[str]
    hints: dict[str, list[Any]]


async def make_target(stack: Stack, etcd: aetcd.Client) -> Target:
    session_id = await stack.create(aliases=["victim"])
    await stack.send(session_id, "hello")
    await stack.events(session_id, until=1)
    k = Keys(stack.etcd.prefix)
    fence_kv = await etcd.get(k.fence(session_id))
    owner_kv = await etcd.get(k.owner(session_id))
    head_kv = await etcd.get(k.inbox_head(session_id))
    snapshot_kv = await etcd.get(k.snapshot(session_id))
    assert fence_kv and owner_kv and head_kv and snapshot_kv
    epoch, run = parse_fence(fence_kv.value)
    owner = OwnerRecord.decode(owner_kv.value)
    head = int(head_kv.value)
    dep = stack.deployment_id
    hints: dict[str, list[Any]] = {
        "session_id": [session_id],
        "owner_run_id": [run],
        "epoch": [epoch, epoch + 1],
        "deployment_id": [dep, "dep-b"],
        "instance_id": [owner.instance_id],
        "expected_instance_id": [owner.instance_id],
        "token": [ids.inbox_token(session_id), "slack:victim"],
        "tokens": ["slack:victim", "slack:other"],
        "channel": ["slack"],
        "after_channel": ["slack", "web"],
        "alias": ["victim", "slack:victim"],
        "aliases": ["victim", "another"],
        "text": ["hello", "calc 6*7"],
        "delivery_id": ["d-1", "d-2"],
        "traceparent": ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"],
        "last_trace_id": ["4bf92f3577b34da6a3ce929d0e0e4736"],
        "request_id": ["r-1", "r-2"],
        "handoff_id": ["ho_fuzz"],
        "address": ["127.0.0.1:1"],
        "ttl_seconds": [5],
        "from_seq": [0, head],
        "inbox_next_seq": [head],
        "trigger_seq": [head - 1],
        "start_seq": [0, 3],
        "snapshot_revision": [snapshot_kv.mod_revision],
        "expected_snapshot_revision": [snapshot_kv.mod_revision],
        "consumed_inbox_from": [0, head],
        "seq": [0, 1, 2],
        "next_event_seq": [1, 2, 3],
        "kind": [1, 2, 3],
        "format_version": [1],
        "timeout_seconds": [0, 86_400],
        "token_budget": [0, 1_000],
        "lease_id": [1],
        "below_index": [0, 2, 4],
        "from_index": [0],
        "parked": [True],
        "to_deployment_id": ["dep-b"],
        # introspection
        "consumed_seq": [0, head],
        "after_session_id": [session_id],
        "limit": [1, 10],
        "page_size": [0, 1, 50],
        "filter": [
            "status = idle",
            'deployment = "dep-a"',
            'create_time > "2026-01-01T00:00:00Z"',
            "inbox_depth > 0",
            'inbox_depth >= 1 AND oldest_unconsumed_age > "30s"',
            'oldest_unconsumed_age <= "1.5h"',
            'oldest_unconsumed_age = "30s"',
            "inbox_depth > -1",
        ],
        "order_by": [
            "",
            "inbox_depth desc",
            "oldest_unconsumed_age",
            "oldest_unconsumed_age asc",
            "status desc",
            "inbox_depth up",
        ],
        "page_token": [""],
        # live items (PublishLive, ReadEvents/StreamEvents `live`)
        "base_seq": [0, 3],
        "attempt": [1, 2],
        "offset": [0, 1],
        "dropped": [0, 1],
        "tool_call_index": [0],
        "turn_id": ["turn_1"],
        "live": [True],
    }
    known = [
        "",
        session_id,
        run,
        str(epoch),
        stack.deployment_id,
        owner.instance_id,
        ids.inbox_token(session_id),
        "slack:victim",
        "victim",
        "slack",
        "web",
        "latest",
        "dep-b",
        ids.new_session_id(),
        "ho_" + "a" * 26,
        "session:" + ids.new_session_id(),
        "ses_../../t/x",
        "\x00",
    ]
    channels = {
        "baton.hooks.v1.HookRegistryService": open_channel(
            stack.addr(stack.hooks), stack.security(Role.OWNER, dep)
        ),
        "baton.anchor.v1.AnchorService": open_channel(
            stack.addr(stack.anchor), stack.security(Role.OWNER, dep)
        ),
        "baton.owner.v1.OwnerService": open_channel(
            stack.addr(stack.owner), stack.security(Role.INGRESS, dep)
        ),
        "owner-as-owner": open_channel(
            stack.addr(stack.owner), stack.security(Role.OWNER, "dep-b")
        ),
        "owner-as-operator": open_channel(stack.addr(stack.owner), stack.security(Role.OPERATOR)),
        "hooks-as-ingress": open_channel(
            stack.addr(stack.hooks), stack.security(Role.INGRESS, dep)
        ),
        "hooks-as-operator": open_channel(stack.addr(stack.hooks), stack.security(Role.OPERATOR)),
        "baton.ingress.v1.IngressService": public_channel(stack.addr(stack.ingress), stack.pki),
    }
    return Target(stack, etcd, channels, known, hints)


def channel_for(target: Target, rpc: Rpc) -> grpc.aio.Channel:
    """A channel with a certificate of a role the table allows for `rpc`."""
    allowed = access.allowed_roles(rpc.path)
    assert allowed is not None
    if rpc.service == "baton.owner.v1.OwnerService" and Role.INGRESS not in allowed:
        if Role.OWNER in allowed:
            return target.channels["owner-as-owner"]  # AcceptHandoff: another deployment's
        return target.channels["owner-as-operator"]  # DrainSessions
    if rpc.service == "baton.hooks.v1.HookRegistryService" and Role.OWNER not in allowed:
        if Role.INGRESS not in allowed:
            return target.channels["hooks-as-operator"]  # the fleets' operator views
        return target.channels["hooks-as-ingress"]  # introspection reads
    return target.channels[rpc.service]


async def store_revision(target: Target) -> int:
    response = await target.etcd.get_prefix(target.stack.etcd.prefix.encode(), keys_only=True)
    return int(response.header.revision)


async def settle(target: Target, timeout: float = 5.0) -> int:
    """Wait until nothing has been written for a moment (work an accepted
    call started, e.g. a turn, has finished)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last = await store_revision(target)
    while loop.time() < deadline:
        await asyncio.sleep(0.1)
        now = await store_revision(target)
        if now == last:
            return now
        last = now
    return last


@dataclass(frozen=True)
class Answer:
    code: grpc.StatusCode
    reason: str
    details: str


async def call(
    target: Target, rpc: Rpc, body: bytes, metadata: tuple[tuple[str, str], ...]
) -> Answer:
    """Send raw request bytes; read a stream's first message (a stream that
    stays open without one is a live follow, accepted)."""
    channel = channel_for(target, rpc)
    try:
        if rpc.method.server_streaming:
            stream = channel.unary_stream(rpc.path)(body, metadata=metadata)
            try:
                await asyncio.wait_for(stream.read(), 1.5)
            except TimeoutError:
                pass
            finally:
                stream.cancel()
        else:
            await channel.unary_unary(rpc.path)(body, metadata=metadata, timeout=15)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED:
            return Answer(grpc.StatusCode.OK, "", "")
        return Answer(exc.code(), error_reason(exc), exc.details() or "")
    return Answer(grpc.StatusCode.OK, "", "")


def error_reason(exc: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    if status is None:
        return ""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return ""


def request_bodies(fuzz: Fuzz) -> st.SearchStrategy[tuple[Rpc, bytes, bool]]:
    """(rpc, body bytes, send the API key) - a message or, one time in five,
    random bytes."""

    @st.composite
    def draw_one(draw: Callable[[st.SearchStrategy[Any]], Any]) -> tuple[Rpc, bytes, bool]:
        rpc = draw(st.sampled_from(RPCS))
        if draw(st.integers(0, 4)) == 0:
            body = draw(st.binary(max_size=128))
        else:
            body = draw(fuzz.message(rpc.method.input_type)).SerializeToString()
        return rpc, body, draw(st.integers(0, 9)) > 0

    return draw_one()


async def check_one(target: Target, rpc: Rpc, body: bytes, with_key: bool) -> None:
    metadata = SLACK if with_key else (("authorization", "Bearer not-" + SLACK_KEY),)
    before = await store_revision(target)
    answer = await call(target, rpc, body, metadata)
    assert answer.code not in FORBIDDEN, (rpc.path, answer, body[:200])
    assert answer.code != grpc.StatusCode.DEADLINE_EXCEEDED, ("hang", rpc.path, body[:200])
    if answer.code == grpc.StatusCode.OK:
        if rpc.method.name not in READ_ONLY:
            await settle(target)
        return
    assert answer.reason, ("a refusal without an ErrorInfo reason", rpc.path, answer)
    after = await store_revision(target)
    if after != before:
        # Background work of an earlier accepted call, or this refusal? Let
        # the stack settle and ask again: a refusal must write nothing.
        before = await settle(target)
        again = await call(target, rpc, body, metadata)
        if again.code != grpc.StatusCode.OK:
            after = await store_revision(target)
            assert after == before, ("a refused call wrote to etcd", rpc.path, again, body[:200])
        else:
            # The same request refused and then accepted: only a refusal
            # that says "try again" may do that. Anything else is a refusal
            # that wrote and whose retry found what it wrote (a zombie).
            assert answer.code in RETRYABLE, (
                "refused, with a write, then accepted",
                rpc.path,
                answer,
                body[:200],
            )
            await settle(target)


@pytest.fixture
async def fuzz_target(etcd_endpoint: str) -> AsyncIterator[Target]:
    from tests.certs import etcd_client

    stack = await start_stack(etcd_endpoint, park_after=None)
    etcd = await etcd_client(stack.etcd.endpoint)
    target = await make_target(stack, etcd)
    try:
        yield target
    finally:
        for channel in target.channels.values():
            await channel.close()
        await etcd.close()
        await stop_stack(stack)


async def assert_all_serving(target: Target) -> None:
    stack = target.stack
    for server, channel in (
        (stack.hooks, target.channels["baton.hooks.v1.HookRegistryService"]),
        (stack.anchor, target.channels["baton.anchor.v1.AnchorService"]),
        (stack.owner, target.channels["baton.owner.v1.OwnerService"]),
        (stack.ingress, target.channels["baton.ingress.v1.IngressService"]),
    ):
        for name in ("", *server.service_names):
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=name), timeout=5
            )
            assert response.status == health_pb2.HealthCheckResponse.SERVING, name


def fuzz_test(examples: int) -> Callable[..., Any]:
    def decorate(test: Callable[..., Any]) -> Callable[..., Any]:
        strategy = st.data()
        return settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=examples == EXAMPLES,  # CI: the same examples every run
            suppress_health_check=list(HealthCheck),
        )(given(data=strategy)(test))

    return decorate


async def run_fuzz(target: Target, data: st.DataObject) -> None:
    fuzz = Fuzz(target.known, target.hints)
    rpc, body, with_key = data.draw(request_bodies(fuzz), label="request")
    await check_one(target, rpc, body, with_key)
    await assert_all_serving(target)


@fuzz_test(EXAMPLES)
async def test_fuzzed_requests_get_canonical_answers_and_refusals_write_nothing(
    fuzz_target: Target, data: st.DataObject
) -> None:
    await run_fuzz(fuzz_target, data)


def base_message(descriptor: d.Descriptor, hints: dict[str, list[Any]], depth: int = 0) -> Any:
    """A message with every field the stack has a real value for set to it
    (nested messages too): a request that gets past the first checks."""
    msg = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if field.type == d.FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated or depth >= 2 or field.message_type.GetOptions().map_entry:
                continue
            getattr(msg, field.name).CopyFrom(base_message(field.message_type, hints, depth + 1))
            continue
        good = hints.get(field.name)
        if not good:
            continue
        if field.is_repeated:
            getattr(msg, field.name).extend(good[:1])
        else:
            try:
                setattr(msg, field.name, good[0])
            except (TypeError, ValueError):
                pass
    return msg


def bad_values(field: d.FieldDescriptor) -> list[Any]:
    if field.type in _INT_RANGES:
        low, high = _INT_RANGES[field.type]
        return sorted({low, high, 2**53 + 1 if high > 2**53 else high, -1 if low < 0 else 0})
    if field.type == d.FieldDescriptor.TYPE_STRING:
        return ["x" * 20_000, "\x00", "latest", "", "../../t/x", "ses_" + "A" * 26]
    if field.type == d.FieldDescriptor.TYPE_ENUM:
        return [-1, 99, 2**31 - 1]
    return []


def sweep_bodies(rpc: Rpc, hints: dict[str, list[Any]]) -> list[bytes]:
    """Deterministic cases for every RPC: empty, undecodable, and a good base
    request with one field at a time (also inside its sub-messages) set to a
    bad value: oversize, NUL, `latest`, empty, a path, every integer extreme."""
    bodies = [b"", b"\xff\xff\xff\xff\x0f", b"\x0a\xff\xff\xff\xff\x0f"]
    base = base_message(rpc.method.input_type, hints)
    bodies.append(base.SerializeToString())

    def vary(msg: Any, descriptor: d.Descriptor, path: list[str]) -> None:
        for field in descriptor.fields:
            if field.is_repeated:
                continue
            if field.type == d.FieldDescriptor.TYPE_MESSAGE:
                if len(path) < 1:
                    vary(msg, field.message_type, [*path, field.name])
                continue
            for value in bad_values(field):
                variant = type(msg)()
                variant.CopyFrom(msg)
                holder = variant
                for name in path:
                    holder = getattr(holder, name)
                setattr(holder, field.name, value)
                bodies.append(variant.SerializeToString())

    vary(base, rpc.method.input_type, [])
    return bodies


async def test_every_rpc_answers_a_sweep_of_bad_requests(fuzz_target: Target) -> None:
    """Every RPC of every server (so none is left to chance), with empty,
    undecodable, oversize, malformed and extreme requests."""
    for rpc in RPCS:
        for body in sweep_bodies(rpc, fuzz_target.hints):
            await check_one(fuzz_target, rpc, body, True)
    await assert_all_serving(fuzz_target)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 3,000 examples: minutes, more on a loaded machine
@fuzz_test(SLOW_EXAMPLES)
async def test_fuzzed_requests_long_run(fuzz_target: Target, data: st.DataObject) -> None:
    await run_fuzz(fuzz_target, data)


# -- pages at the message limit (issue 32) ---------------------------------------------

PAGE_EXAMPLES = 8
SLOW_PAGE_EXAMPLES = 60
# A deployment without a fleet: the test plays its sessions' owner, so an
# inbox backlog stays unconsumed and the stream holds what it commits.
PAGING_DEPLOYMENT = "dep-p"
KiB = 1024
# Sizes of commands and events (serialized): the largest hooks and anchor
# accept and just under, about ingress' default --max-message-bytes, small.
COMMAND_SIZES = st.one_of(
    st.just(limits.MAX_COMMAND_BYTES),
    st.integers(limits.MAX_COMMAND_BYTES - 4 * KiB, limits.MAX_COMMAND_BYTES),
    st.just(32 * KiB + 64),
    st.integers(1, 300),
)
EVENT_SIZES = st.one_of(
    st.just(limits.MAX_EVENT_BYTES),
    st.integers(limits.MAX_EVENT_BYTES - 4 * KiB, limits.MAX_EVENT_BYTES),
    st.integers(1, 300),
)
HOOKS = "baton.hooks.v1.HookRegistryService"
ANCHOR = "baton.anchor.v1.AnchorService"


@dataclass
class Pager:
    """Clients of hooks and anchor as the owner of PAGING_DEPLOYMENT."""

    hooks: HooksClient
    anchor: AnchorClient


@pytest.fixture
async def pager(fuzz_target: Target) -> AsyncIterator[Pager]:
    stack = fuzz_target.stack
    security = stack.security(Role.OWNER, PAGING_DEPLOYMENT)
    opened = Pager(stack.hooks_client(security), stack.anchor_client(security))
    try:
        yield opened
    finally:
        await opened.hooks.close()
        await opened.anchor.close()


def sized_text(message: Any, holder: Any, size: int) -> None:
    """Set `holder.text` so that `message` serializes to `size` bytes (or
    its envelope and one character, when that is more)."""
    length = max(size - message.ByteSize(), 1)
    holder.text = "x" * length
    holder.text = "x" * max(length - (message.ByteSize() - size), 1)


async def paged_session(pager: Pager, commands: list[int], events: list[int]) -> s.Fence:
    """A session whose inbox holds commands of the sizes `commands` and whose
    stream holds session.started, then events of the sizes `events`."""
    sid = ids.new_session_id()
    owner = s.OwnerIdentity(
        owner_run_id=ids.new_run_id(), deployment_id=PAGING_DEPLOYMENT, instance_id="p1"
    )
    created = await pager.hooks.create_session(sid, owner, "slack", [])
    for n, size in enumerate(commands):
        command = s.Command(delivery=s.DeliveryMetadata(delivery_id=f"p{n}"), send=s.SendCommand())
        sized_text(command, command.send, size)
        await pager.hooks.resume(ids.inbox_token(sid), command)
    stream = [s.Event(session_id=sid, seq=0, kind=s.EVENT_KIND_SESSION_STARTED)]
    for size in events:
        stream.append(s.Event(session_id=sid, seq=len(stream), kind=s.EVENT_KIND_MESSAGE_COMPLETED))
        sized_text(stream[-1], stream[-1], size)
    snapshot = initial_snapshot(sid, "slack", PAGING_DEPLOYMENT, list(created.hooks))
    revision = 0
    for commit in commits_of(stream):
        snapshot.next_event_seq = commit[-1].seq + 1
        request = anchor_pb2.CommitStepRequest(
            fence=created.fence,
            events=commit,
            snapshot=snapshot,
            expected_snapshot_revision=revision,
        )
        revision = (await pager.anchor.commit(request)).revision
    return created.fence


def commits_of(events: list[s.Event]) -> list[list[s.Event]]:
    """`events` in as few commits as anchor's bounds allow."""
    commits: list[list[s.Event]] = [[]]
    room = limits.MAX_COMMIT_BYTES - 64 * KiB  # the snapshot's share
    for event in events:
        full = sum(e.ByteSize() for e in commits[-1]) + event.ByteSize() > room
        if commits[-1] and (full or len(commits[-1]) == limits.MAX_EVENTS_PER_COMMIT):
            commits.append([])
        commits[-1].append(event)
    return commits


async def read_raw(call: Any, done: Callable[[list[Any]], bool] | None = None) -> list[Any]:
    """The messages of a raw call: until `done` says that is all, or (None)
    until its end. A stream that fails raises its status here."""
    messages: list[Any] = []
    try:
        async with asyncio.timeout(30):
            while done is None or not done(messages):
                message = await call.read()
                if message is grpc.aio.EOF:
                    assert done is None, "the stream ended early"
                    break
                messages.append(message)
    finally:
        call.cancel()
    return messages


def raw_call(channel: grpc.aio.Channel, rpc: Rpc) -> Any:
    """A raw call of the streaming method `rpc` on `channel`."""
    method = channel.stream_stream if rpc.method.client_streaming else channel.unary_stream
    request, response = rpc.request_class, rpc.response_class
    return method(rpc.path, request.SerializeToString, response.FromString)


def rpc_named(name: str) -> Rpc:
    return next(rpc for rpc in RPCS if rpc.method.name == name)


async def read_every_way(pager: Pager, fence: s.Fence, commands: int) -> dict[str, list[Any]]:
    """The messages of the session's inbox and stream read from 0 by each
    streaming method of hooks and anchor: the inbox (live) until all its
    entries came, the stream (not live) to its end."""
    inbox = hooks_pb2.StreamInboxRequest(fence=fence, from_seq=0)
    read = anchor_pb2.ReadEventsRequest(session_id=fence.session_id)
    channels = {HOOKS: pager.hooks.channel, ANCHOR: pager.anchor.channel}
    got: dict[str, list[Any]] = {}
    for name, request in (
        ("StreamInbox", inbox),
        (
            "FollowInboxes",
            hooks_pb2.FollowInboxesRequest(
                follows=[hooks_pb2.InboxFollow(follow_id=1, request=inbox, window=64)]
            ),
        ),
        ("ReadEvents", read),
        (
            "FollowEvents",
            anchor_pb2.FollowEventsRequest(
                follows=[anchor_pb2.EventFollow(follow_id=1, request=read, window=64)]
            ),
        ),
    ):
        rpc = rpc_named(name)
        opened = raw_call(channels[rpc.service], rpc)
        if rpc.method.client_streaming:
            call = opened()
            await call.write(request)
            if name == "FollowEvents":
                await call.done_writing()  # the stream ends once its one read has
        else:
            call = opened(request)
        if name in ("StreamInbox", "FollowInboxes"):
            got[name] = await read_raw(call, lambda read: len(seqs_in(read, "entries")) >= commands)
        else:
            got[name] = await read_raw(call)
    return got


def seqs_in(messages: list[Any], field: str) -> list[int]:
    """The seqs of the entries or events (`field`) the messages carry, in
    their pages (a feed's message: in its items)."""
    pages = [getattr(p, field) for m in messages for p in getattr(m, "items", [m])]
    return [entry.seq for page in pages for entry in page]


async def check_pages(pager: Pager, commands: list[int], events: list[int]) -> None:
    """Every streaming read of hooks and anchor gets the whole backlog in
    order, each message within the page bound (a feed's within its
    message bound), however near the limits its entries are."""
    fence = await paged_session(pager, commands, events)
    got = await read_every_way(pager, fence, len(commands))
    for name in ("StreamInbox", "FollowInboxes"):
        assert seqs_in(got[name], "entries") == list(range(len(commands))), name
    for name in ("ReadEvents", "FollowEvents"):
        assert seqs_in(got[name], "events") == list(range(len(events) + 1)), name
    ends = [i.end for m in got["FollowEvents"] for i in m.items if i.end]
    assert [status_pb2.Status.FromString(end).code for end in ends] == [0]
    for name, messages in got.items():
        bound = feeds.MAX_MESSAGE_BYTES + 64 if name.startswith("Follow") else limits.MAX_PAGE_BYTES
        assert all(m.ByteSize() <= bound for m in messages), (
            name,
            [m.ByteSize() for m in messages],
        )


# Always tried first: the backlog (reads of 16, 32 and 64 short
# entries, then one of 128 at 32 KiB: over 4 MiB), and a first read of 16
# of the largest commands, with a stream of the largest events.
PINNED = (
    {"commands": [2] * 112 + [32 * KiB + 64] * 128, "events": []},
    {"commands": [limits.MAX_COMMAND_BYTES] * 17, "events": [limits.MAX_EVENT_BYTES] * 9},
)


def page_test(examples: int) -> Callable[..., Any]:
    def decorate(test: Callable[..., Any]) -> Callable[..., Any]:
        drawn = given(
            commands=st.lists(COMMAND_SIZES, max_size=24),
            events=st.lists(EVENT_SIZES, max_size=12),
        )(test)
        for pinned in PINNED:
            drawn = example(**pinned)(drawn)
        return settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=examples == PAGE_EXAMPLES,
            suppress_health_check=list(HealthCheck),
        )(drawn)

    return decorate


@page_test(PAGE_EXAMPLES)
async def test_pages_at_the_message_limit_reach_every_reader_whole(
    pager: Pager, commands: list[int], events: list[int]
) -> None:
    await check_pages(pager, commands, events)


@pytest.mark.slow
@pytest.mark.timeout(900)
@page_test(SLOW_PAGE_EXAMPLES)
async def test_pages_at_the_message_limit_long_run(
    pager: Pager, commands: list[int], events: list[int]
) -> None:
    await check_pages(pager, commands, events)
