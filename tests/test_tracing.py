"""OpenTelemetry traces (docs/metrics.md "Traces"; services/common/observability/tracing.py).

Over real processes, every one exporting OTLP/gRPC to a small collector in
this test process (opentelemetry-proto's TraceService on loopback): one
conversation yields linked spans from ingress, hooks, owner and anchor; the
owner's `process inbox` span links to the gateway's request of every
command, also after a kill -9 of the owner between acceptance and
processing, and after a handoff to another deployment. With tracing off
nothing is exported and no SDK is even imported. In-process: the spans of
unary calls and of a server stream the caller cancels, the producer's
context kept in the inbox and linked by the owner (also for messages
steered into a running turn), and the W3C traceparent check on the inbox.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import InvalidArgument, Reason
from baton_runtime.common.observability import tracing
from baton_runtime.common.security.identity import Role
from tests.procs import SLACK, ProcessStack, eventually
from tests.stack import Stack, public_channel, start_stack, stop_stack

K = s.EventKind
SEND = "baton.ingress.v1.IngressService/SendMessage"


# -- a collector ------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One exported span, flattened: the service that sent it and its ids in hex."""

    service: str
    instance: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent: str
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    attributes: dict[str, Any]
    error: bool


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Collector(otlp_grpc.TraceServiceServicer):
    """Receives OTLP/gRPC trace exports and keeps the spans."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0

    async def Export(  # noqa: N802 - the proto's name
        self, request: otlp.ExportTraceServiceRequest, context: Any
    ) -> otlp.ExportTraceServiceResponse:
        self.requests += 1
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        Span(
                            service=str(resource.get("service.name", "")),
                            instance=str(resource.get("service.instance.id", "")),
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent=span.parent_span_id.hex(),
                            links=tuple(
                                (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                            ),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            error=span.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
                        )
                    )
        return otlp.ExportTraceServiceResponse()

    def in_trace(self, trace_id: str) -> list[Span]:
        return [span for span in self.spans if span.trace_id == trace_id]

    def linking_to(self, trace_id: str) -> list[Span]:
        return [span for span in self.spans if any(t == trace_id for t, _ in span.links)]


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, int]]:
    server = grpc.aio.server()
    received = Collector()
    otlp_grpc.add_TraceServiceServicer_to_server(received, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield received, port
    finally:
        await server.stop(1)


def otel_env(port: int) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


class _Gateway:
    """A channel gateway's client of one ingress, starting a trace of its own
    per call (the test's trace ids: what the links must lead back to)."""

    def __init__(self, address: str, name: str) -> None:
        self.channel = public_channel(address)
        self.stub = ingress_pb2_grpc.IngressServiceStub(self.channel)
        self.name = name.encode().hex()[:8].ljust(8, "0")
        self.count = 0

    def _traced(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        self.count += 1
        trace_id = self.name + f"{self.count:08x}" + "ab" * 8
        traceparent = f"00-{trace_id}-{self.count:016x}-01"
        return trace_id, (*SLACK, ("traceparent", traceparent))

    async def create(self) -> str:
        response = await self.stub.CreateSession(
            ingress_pb.CreateSessionRequest(), metadata=SLACK, timeout=20
        )
        return str(response.session_id)

    async def send(self, session_id: str, text: str) -> str:
        """Send `text`; the trace id the gateway sent it in."""
        trace_id, metadata = self._traced()
        await self.stub.SendMessage(
            ingress_pb.SendMessageRequest(session_id=session_id, text=text),
            metadata=metadata,
            timeout=20,
        )
        return trace_id

    async def get(self, session_id: str) -> ingress_pb.Session:
        response = await self.stub.GetSession(
            ingress_pb.GetSessionRequest(session_id=session_id), metadata=SLACK, timeout=20
        )
        return response.session

    async def refused_send(self, session_id: str, text: str) -> str:
        trace_id, metadata = self._traced()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await self.stub.SendMessage(
                ingress_pb.SendMessageRequest(session_id=session_id, text=text),
                metadata=metadata,
                timeout=20,
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return trace_id


# -- over real processes ------------------------------------------------------------------


async def test_one_conversation_links_across_a_takeover_and_a_handoff(
    etcd_endpoint: str,
    tmp_path: Path,
    stacks: list[ProcessStack],
    collector: tuple[Collector, int],
) -> None:
    """dep-a (owners a1, a2; ingress ing-a) and dep-b (owner b1; ingress
    ing-b). Turn 1 ("calc", a tool then the answer) on a1. a1 is paused, a
    send is accepted, a1 is killed (kill -9) and a2 takes the session over
    and processes it. A send through ing-b moves the session to b1; the next
    one is refused (ing-b's send limit)."""
    received, port = collector
    stack = ProcessStack(etcd_endpoint, tmp_path, deployment_id="dep-a", env=otel_env(port))
    stacks.append(stack)
    stack.start_deployments(
        owners={"a1": ("dep-a", ""), "a2": ("dep-a", "")},
        ingresses={"ing-a": ("dep-a", "a1")},
    )
    stack.start_owner("b1", deployment_id="dep-b")
    stack.start_ingress("ing-b", "dep-b", ["b1"], env={"BATON_MAX_SENDS_PER_SECOND": "0.001"})
    hooks = HooksClient(stack.addr("hooks"), timeout=5, security=stack.probe)
    anchor = AnchorClient(stack.addr("anchor"), timeout=5, security=stack.probe)
    a, b = _Gateway(stack.addr("ing-a"), "a"), _Gateway(stack.addr("ing-b"), "b")
    try:
        for deployment, instances in (("dep-a", {"a1", "a2"}), ("dep-b", {"b1"})):

            async def registered(d: str = deployment, want: set[str] = instances) -> bool:
                return want <= {i.instance_id for i in await hooks.list_instances(d)}

            await eventually(registered, f"{deployment}'s owners registered")

        async def completed_turns(sid: str, count: int) -> None:
            async def done() -> bool:
                events = [e async for page in anchor.read_events(sid) for e in page]
                return sum(e.kind == K.EVENT_KIND_TURN_COMPLETED for e in events) >= count

            await eventually(done, f"{count} turns completed")

        def processed_by(trace_id: str) -> list[Span]:
            return [s for s in received.linking_to(trace_id) if s.name == "process inbox"]

        sid = await a.create()
        first = await a.send(sid, "calc 2+3")
        await completed_turns(sid, 1)
        assert (await hooks.get_owner(sid)).owner.instance_id == "a1"
        # (a1's spans leave before it is killed: a kill -9 loses what it buffered)
        await eventually(_async(lambda: processed_by(first)), "a1's spans exported")

        stack.pause("a1")
        second = await a.send(sid, "hello")  # accepted: durable in the inbox
        stack.kill("a1")

        async def taken_over() -> bool:
            return (await hooks.get_owner(sid)).owner.instance_id == "a2"

        await eventually(taken_over, "a2 took the session over")
        await completed_turns(sid, 2)
        third = await b.send(sid, "whoami")
        await completed_turns(sid, 3)
        assert (await hooks.get_owner(sid)).owner.instance_id == "b1"
        refused = await b.refused_send(sid, "one more")

        def seen(trace_id: str, service: str, name: str) -> bool:
            return any((x.service, x.name) == (service, name) for x in received.in_trace(trace_id))

        async def exported() -> bool:
            """Every process exports on its own schedule: wait for all of it."""
            return (
                all(processed_by(t) for t in (first, second, third))
                and all(seen(t, "baton-ingress", SEND) for t in (first, second, third, refused))
                and seen(first, "baton-hooks", "baton.hooks.v1.HookRegistryService/ResumeHook")
                and bool([s for s in received.spans if s.name == "handoff"])
            )

        await eventually(exported, "the owners' spans exported")

        # Turn 1: the gateway's trace runs through ingress into hooks ...
        gateway = received.in_trace(first)
        send = _one(gateway, service="baton-ingress", name=SEND)
        assert send.kind == trace_pb2.Span.SPAN_KIND_SERVER
        resume = _one(
            gateway, service="baton-hooks", name="baton.hooks.v1.HookRegistryService/ResumeHook"
        )
        assert resume.kind == trace_pb2.Span.SPAN_KIND_SERVER
        assert _ancestors(gateway, resume)[-1] == send  # through ingress's client span
        # ... and a1's consumer span links to the ingress request that delivered it;
        # its model and tool calls, commits and anchor's side of them are its children.
        (process,) = processed_by(first)
        assert (process.service, process.instance) == ("baton-owner", "a1")
        assert process.kind == trace_pb2.Span.SPAN_KIND_CONSUMER
        assert (first, send.span_id) in process.links
        assert process.attributes["messaging.operation.type"] == "process"
        assert process.attributes["baton.session_id"] == sid
        await eventually(
            _async(lambda: _served_by_anchor(received, process.trace_id)), "anchor's spans"
        )
        turn = received.in_trace(process.trace_id)
        names = {(span.service, span.name) for span in turn}
        assert ("baton-owner", "chat") in names
        assert ("baton-owner", "execute_tool calculator") in names
        assert ("baton-owner", "commit") in names
        served = [
            span
            for span in turn
            if (span.service, span.name)
            == ("baton-anchor", "baton.anchor.v1.AnchorService/CommitStep")
        ]
        assert served  # one per step
        for span in served:
            assert _ancestors(turn, span)[-1] == process
        for span in turn:
            assert span.trace_id == process.trace_id and not span.error

        # Turn 2: accepted while a1 was paused, processed by a2 after a1's kill -9.
        (process,) = processed_by(second)
        assert process.instance == "a2"
        send = _one(received.in_trace(second), service="baton-ingress", name=SEND)
        assert (second, send.span_id) in process.links

        # Turn 3: a2's handoff span links to the trigger and holds the transfer;
        # b1 processes the trigger, linked to the same request.
        send = _one(received.in_trace(third), service="baton-ingress", name=SEND)
        handoff = _one(received.linking_to(third), service="baton-owner", name="handoff")
        assert handoff.instance == "a2"
        assert handoff.links == ((third, send.span_id),)
        await eventually(
            _async(lambda: _transferred(received, handoff.trace_id)), "hooks' Transfer span"
        )
        (process,) = processed_by(third)
        assert process.instance == "b1"
        assert (third, send.span_id) in process.links
        # GetSession names the last turn's trace (its settling commit's).
        assert (await b.get(sid)).last_trace_id == process.trace_id

        # A log line written inside a span names it: ing-b's line of the refused send.
        await eventually(
            _async(lambda: _logged(stack.workdir / "ing-b.log", refused)), "the refusal logged"
        )
        refusal = _one(received.in_trace(refused), service="baton-ingress", name=SEND)
        assert (
            refusal.attributes["rpc.grpc.status_code"]
            == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        )
        line = _logged(stack.workdir / "ing-b.log", refused)
        assert line is not None and line["span_id"] == refusal.span_id
    finally:
        await hooks.close()
        await anchor.close()
        await a.channel.close()
        await b.channel.close()


def _one(spans: list[Span], *, service: str, name: str) -> Span:
    found = [span for span in spans if span.service == service and span.name == name]
    assert len(found) == 1, (service, name, [(x.service, x.name) for x in spans])
    return found[0]


def _ancestors(spans: list[Span], span: Span) -> list[Span]:
    """`span`'s parents in `spans`, nearest first, up to the root."""
    by_id = {x.span_id: x for x in spans}
    chain = []
    while span.parent in by_id:
        span = by_id[span.parent]
        chain.append(span)
    return chain


def _served_by_anchor(received: Collector, trace_id: str) -> bool:
    return any(x.service == "baton-anchor" for x in received.in_trace(trace_id))


def _transferred(received: Collector, trace_id: str) -> bool:
    return any(
        x.service == "baton-hooks" and x.name.endswith("/Transfer")
        for x in received.in_trace(trace_id)
    )


def _logged(path: Path, trace_id: str) -> dict[str, Any] | None:
    for raw in path.read_text().splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("trace_id") == trace_id and line.get("code") == "RESOURCE_EXHAUSTED":
            return dict(line)
    return None


def _async(probe: Any) -> Any:
    async def run() -> Any:
        return probe()

    return run


async def test_with_tracing_off_nothing_is_exported(
    etcd_endpoint: str,
    tmp_path: Path,
    stacks: list[ProcessStack],
    collector: tuple[Collector, int],
) -> None:
    """An OTLP endpoint alone does not turn tracing on (Baton's default
    exporter is none): a turn on a stack told where to export sends nothing."""
    received, port = collector
    env = otel_env(port)
    del env["OTEL_TRACES_EXPORTER"]
    stack = ProcessStack(etcd_endpoint, tmp_path, env=env).start(owners=1)
    stacks.append(stack)
    clients = stack.clients()
    try:
        await clients.wait_registered("o1")
        sid = await clients.create()
        await clients.send(sid, "hello")
        await clients.wait_events(
            sid, lambda es: any(e.kind == K.EVENT_KIND_TURN_COMPLETED for e in es), "a turn"
        )
    finally:
        await clients.close()
    stack.stop()
    for proc in (stack.hooks, stack.anchor, stack.ingress, *stack.owners.values()):
        assert proc is not None and proc.proc is not None
        proc.proc.wait(timeout=30)
    assert received.requests == 0
    assert not [
        line for line in (tmp_path / "o1.log").read_text().splitlines() if "trace_id" in line
    ]


def test_off_by_default_imports_no_sdk_and_installs_no_interceptor() -> None:
    """In a fresh interpreter: the services' modules loaded and tracing
    configured from an environment without OTEL_TRACES_EXPORTER."""
    code = """
import sys
from baton_runtime.common import ids
from baton_runtime.common.observability import tracing
import baton_runtime.owner.server
import baton_runtime.hooks.server
import baton_runtime.anchor.server
import baton_runtime.ingress.server
assert tracing.TRACING.configure("owner", "dep", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) is False
assert tracing.TRACING.configure("owner", env={"OTEL_TRACES_EXPORTER": "none"}) is False
assert tracing.TRACING.configure(
    "owner", env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) is False
assert tracing.client_interceptors() is None
assert tracing.current_traceparent() == ""
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
sdk = [m for m in loaded if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
assert not sdk, sdk
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_an_exporter_baton_does_not_ship_is_a_config_error() -> None:
    from baton_runtime.common.config import ConfigError

    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER"):
        tracing.Tracing().configure("hooks", env={"OTEL_TRACES_EXPORTER": "zipkin"})


# -- in process ----------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, into memory (before channels open)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.TRACING.start(provider)
    try:
        yield exporter
    finally:
        tracing.TRACING.shutdown()


@pytest.fixture
async def traced_stack(spans: InMemorySpanExporter, etcd_endpoint: str) -> AsyncIterator[Stack]:
    running = await start_stack(etcd_endpoint)
    try:
        yield running
    finally:
        await stop_stack(running)


def _named(spans: InMemorySpanExporter, suffix: str) -> list[ReadableSpan]:
    return [span for span in spans.get_finished_spans() if span.name.endswith(suffix)]


async def test_unary_and_cancelled_stream_calls_have_ended_client_and_server_spans(
    traced_stack: Stack, spans: InMemorySpanExporter
) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    sid = await traced_stack.create()
    hooks = traced_stack.hooks_client(traced_stack.owner_security())
    anchor = traced_stack.anchor_client(traced_stack.owner_security())
    try:
        with tracing.span("test"):
            await hooks.get_owner(sid)
            with pytest.raises(Exception):  # noqa: B017 - the code is what is checked
                await hooks.get_owner("ses_" + "0" * 26)
            # A stream read to its end; one following live, cancelled by
            # the caller after its first page.
            assert [page async for page in anchor.read_events(sid)]
            async for _page in anchor.read_events(sid, follow=True):
                break

        async def ended() -> bool:
            return len(_named(spans, "/ReadEvents")) >= 4

        await eventually(ended, "both ends of the stream span ended")
    finally:
        await hooks.close()
        await anchor.close()
    (test_span,) = _named(spans, "test")
    trace_id = test_span.context.trace_id
    get_owner = _named(spans, "/GetOwner")
    kinds = sorted((span.kind.name, span.status.status_code.name) for span in get_owner)
    # OK both ends; NOT_FOUND is an error for the client, the caller's doing for the server.
    assert kinds == [
        ("CLIENT", "ERROR"),
        ("CLIENT", "UNSET"),
        ("SERVER", "UNSET"),
        ("SERVER", "UNSET"),
    ]
    for span in get_owner:
        assert span.context.trace_id == trace_id
    read = sorted(_named(spans, "/ReadEvents"), key=lambda x: x.start_time or 0)
    clients = [x for x in read if x.kind is SpanKind.CLIENT]
    servers = [x for x in read if x.kind is SpanKind.SERVER]
    assert len(clients) == len(servers) == 2
    for client, server in zip(clients, servers, strict=True):
        assert server.parent is not None and server.parent.span_id == client.context.span_id
    codes = [(x.attributes or {}).get("rpc.grpc.status_code") for x in clients]
    assert codes == [grpc.StatusCode.OK.value[0], grpc.StatusCode.CANCELLED.value[0]]
    assert [x.status.status_code for x in clients] == [StatusCode.UNSET, StatusCode.ERROR]


async def test_the_inbox_keeps_the_senders_context_and_the_owner_links_to_it(
    traced_stack: Stack, spans: InMemorySpanExporter
) -> None:
    """A command sent inside a span carries its context into the inbox entry;
    the owner's span that processes it links to that span."""
    sid = await traced_stack.create()
    hooks = traced_stack.hooks_client(
        traced_stack.security(Role.INGRESS, traced_stack.deployment_id)
    )
    try:
        with tracing.span("producer") as producer:
            assert producer is not None
            await hooks.append(
                ids.inbox_token(sid), s.Command(send=s.SendCommand(text="hi")), "slack"
            )
    finally:
        await hooks.close()
    context = producer.get_span_context()

    async def linked() -> list[ReadableSpan]:
        return [
            span
            for span in _named(spans, "process inbox")
            if any(link.context.span_id == context.span_id for link in span.links)
        ]

    (process,) = await eventually(linked, "the owner's span linked to the producer")
    (link,) = [x for x in process.links if x.context.span_id == context.span_id]
    assert link.context.trace_id == context.trace_id
    assert process.context.trace_id != context.trace_id  # a trace of its own, linked


async def test_messages_steered_into_a_running_turn_are_linked_by_its_span(
    traced_stack: Stack, spans: InMemorySpanExporter
) -> None:
    """Two messages sent while a turn sleeps through its steps join it at a
    boundary (steer): the one span that processes the turn links all three
    producers, and no other span links any of them."""
    sid = await traced_stack.create()
    hooks = traced_stack.hooks_client(
        traced_stack.security(Role.INGRESS, traced_stack.deployment_id)
    )
    producers = []
    try:
        for text in ("sleep 3 1000", "hello", "echo x"):
            with tracing.span(f"send {text}") as producer:
                assert producer is not None
                await hooks.append(
                    ids.inbox_token(sid), s.Command(send=s.SendCommand(text=text)), "slack"
                )
            producers.append(producer.get_span_context().span_id)
    finally:
        await hooks.close()

    def linking(span_id: int) -> list[ReadableSpan]:
        return [
            span
            for span in _named(spans, "process inbox")
            if any(link.context.span_id == span_id for link in span.links)
        ]

    async def all_linked() -> bool:
        return all(linking(p) for p in producers)

    await eventually(all_linked, "every producer linked")
    (turn,) = linking(producers[0])
    assert all(linking(p) == [turn] for p in producers)
    assert turn.attributes is not None and turn.attributes["messaging.batch.message_count"] == 3


@pytest.mark.parametrize(
    "value",
    [
        "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # all-zero trace id
        "00-" + "1" * 32 + "-" + "0" * 16 + "-01",  # all-zero span id
        "01-" + "1" * 32 + "-" + "1" * 16 + "-01",  # a version this build does not read
        "00-" + "A" * 32 + "-" + "1" * 16 + "-01",  # upper case
        "00-" + "1" * 32 + "-" + "1" * 16 + "-01-extra",
        "x" * 20_000,
        "\x00",
    ],
)
def test_a_malformed_traceparent_is_refused(value: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        tracing.check_traceparent(value)
    assert refused.value.reason == Reason.MALFORMED_TRACEPARENT


def test_a_w3c_traceparent_and_none_are_accepted() -> None:
    tracing.check_traceparent("")
    tracing.check_traceparent("00-" + "4bf92f3577b34da6a3ce929d0e0e4736" + "-00f067aa0ba902b7-01")


@pytest.mark.parametrize("value", ["0" * 32, "A" * 32, "1" * 31, "1" * 33, "x" * 20_000, "\x00"])
def test_a_malformed_trace_id_is_refused(value: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        tracing.check_trace_id(value, "snapshot.last_trace_id")
    assert refused.value.reason == Reason.MALFORMED_TRACE_ID
    tracing.check_trace_id("", "snapshot.last_trace_id")
    tracing.check_trace_id("4bf92f3577b34da6a3ce929d0e0e4736", "snapshot.last_trace_id")


async def test_resume_hook_refuses_a_malformed_traceparent_and_writes_nothing(
    traced_stack: Stack,
) -> None:
    sid = await traced_stack.create()
    hooks = traced_stack.hooks_client(
        traced_stack.security(Role.INGRESS, traced_stack.deployment_id)
    )
    token = ids.inbox_token(sid)
    try:
        before = await hooks.append(token, s.Command(send=s.SendCommand(text="one")), "slack")
        command = s.Command(send=s.SendCommand(text="hi"))
        command.delivery.traceparent = "00-not-a-trace-context"
        with pytest.raises(InvalidArgument) as refused:
            await hooks.append(token, command, "slack")
        assert refused.value.reason == Reason.MALFORMED_TRACEPARENT
        after = await hooks.append(token, s.Command(send=s.SendCommand(text="two")), "slack")
    finally:
        await hooks.close()
    assert after.seq == before.seq + 1  # nothing was appended in between
