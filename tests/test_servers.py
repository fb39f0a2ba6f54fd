"""Every server speaks grpc.health.v1 per service and server reflection, and a
stopped server stops reporting SERVING."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2
from baton_runtime._proto.baton.owner.v1 import owner_pb2
from baton_runtime.anchor.server import create_server as create_anchor
from baton_runtime.cli.system.processes import sync_channel
from baton_runtime.common.clients.channels import open_channel
from baton_runtime.common.rpc.server import GrpcServer, build_server
from baton_runtime.common.security.tls import Security
from baton_runtime.hooks.server import create_server as create_hooks
from tests import certs
from tests.stack import Stack, anchor_config, hooks_config, public_channel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"

SERVICES = {
    "hooks": ("baton.hooks.v1.HookRegistryService", hooks_pb2),
    "anchor": ("baton.anchor.v1.AnchorService", anchor_pb2),
    "owner": ("baton.owner.v1.OwnerService", owner_pb2),
    "ingress": ("baton.ingress.v1.IngressService", ingress_pb2),
}


def server_of(stack: Stack, name: str) -> GrpcServer:
    server: GrpcServer = getattr(stack, name)
    return server


def channel_to(stack: Stack, name: str) -> grpc.aio.Channel:
    """An operator's channel to an internal server; a gateway's to ingress."""
    address = stack.addr(server_of(stack, name))
    if name == "ingress":
        return public_channel(address)
    return open_channel(address, certs.operator())


@pytest.fixture
async def channels(stack: Stack) -> AsyncIterator[dict[str, grpc.aio.Channel]]:
    opened = {name: channel_to(stack, name) for name in SERVICES}
    try:
        yield opened
    finally:
        for channel in opened.values():
            await channel.close()


async def list_services(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    async for response in call:
        assert not response.HasField("error_response"), response.error_response
        return [svc.name for svc in response.list_services_response.service]
    raise AssertionError("no reflection response")


async def file_containing(
    channel: grpc.aio.Channel, symbol: str
) -> list[descriptor_pb2.FileDescriptorProto]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)]), timeout=10
    )
    async for response in call:
        assert not response.HasField("error_response"), response.error_response
        protos = response.file_descriptor_response.file_descriptor_proto
        return [descriptor_pb2.FileDescriptorProto.FromString(raw) for raw in protos]
    raise AssertionError("no reflection response")


@pytest.mark.parametrize("name", list(SERVICES))
async def test_health_reports_serving_overall_and_per_service(
    stack: Stack, channels: dict[str, grpc.aio.Channel], name: str
) -> None:
    full_name, _ = SERVICES[name]
    assert full_name in server_of(stack, name).service_names
    stub = health_pb2_grpc.HealthStub(channels[name])
    for service in ("", full_name):
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == SERVING, (name, service)
    # A service the server does not host is unknown, not SERVING.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Check(health_pb2.HealthCheckRequest(service="baton.nope.v1.Nope"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("name", list(SERVICES))
async def test_reflection_lists_and_describes_the_service(
    stack: Stack, channels: dict[str, grpc.aio.Channel], name: str
) -> None:
    full_name, module = SERVICES[name]
    listed = await list_services(channels[name])
    assert full_name in listed
    assert HEALTH in listed and REFLECTION in listed
    # The served descriptor is the generated one: same methods, same types.
    files = await file_containing(channels[name], full_name)
    package, _, short = full_name.rpartition(".")
    served = next(
        svc for f in files if f.package == package for svc in f.service if svc.name == short
    )
    generated = module.DESCRIPTOR.services_by_name[short]
    assert [m.name for m in served.method] == [m.name for m in generated.methods]
    assert [m.input_type.lstrip(".") for m in served.method] == [
        m.input_type.full_name for m in generated.methods
    ]


async def test_reflection_descriptor_database_resolves_every_method(stack: Stack) -> None:
    """What grpcurl does: resolve a service and its message types through
    reflection alone (a sync client, run off the event loop)."""

    def resolve(address: str, full_name: str) -> list[str]:
        with sync_channel(address, certs.operator()) as channel:
            pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
            service = pool.FindServiceByName(full_name)
            return [f"{m.name}({m.input_type.full_name})" for m in service.methods]

    for name, (full_name, module) in SERVICES.items():
        address = stack.addr(server_of(stack, name))
        methods = await asyncio.to_thread(resolve, address, full_name)
        generated = module.DESCRIPTOR.services_by_name[full_name.rpartition(".")[2]]
        assert methods == [f"{m.name}({m.input_type.full_name})" for m in generated.methods]


Factory = Callable[[Stack], Awaitable[GrpcServer]]


async def _extra_hooks(stack: Stack) -> GrpcServer:
    return await create_hooks(hooks_config(stack.etcd))


async def _extra_anchor(stack: Stack) -> GrpcServer:
    return await create_anchor(anchor_config(stack.etcd))


@pytest.mark.parametrize(
    ("factory", "full_name"),
    [
        (_extra_hooks, "baton.hooks.v1.HookRegistryService"),
        (_extra_anchor, "baton.anchor.v1.AnchorService"),
    ],
    ids=["hooks", "anchor"],
)
async def test_stopped_server_is_no_longer_serving(
    stack: Stack, factory: Factory, full_name: str
) -> None:
    server = await factory(stack)
    await server.start()
    stopped = False
    channel = open_channel(f"127.0.0.1:{server.port}", certs.operator())
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", full_name):
            response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == SERVING

        # A watcher sees SERVING, then NOT_SERVING as soon as shutdown begins.
        watch = health.Watch(health_pb2.HealthCheckRequest(service=full_name))
        first = await asyncio.wait_for(watch.read(), 5)
        assert first.status == SERVING
        stopping = asyncio.get_running_loop().create_task(server.stop(grace=2.0))
        statuses = []
        try:
            async with asyncio.timeout(10):
                while True:
                    response = await watch.read()
                    if response is grpc.aio.EOF:
                        break
                    statuses.append(response.status)
                    if response.status == NOT_SERVING:
                        break
        except grpc.aio.AioRpcError:
            pass  # the server went away: also not serving
        finally:
            watch.cancel()
        await asyncio.wait_for(stopping, 10)
        stopped = True
        assert statuses == [NOT_SERVING], statuses

        # After stop() the server is gone: health cannot answer SERVING.
        for service in ("", full_name):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            assert info.value.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
    finally:
        await channel.close()
        if not stopped:
            await server.stop(grace=0.1)


async def test_a_stop_step_that_never_ends_is_logged_and_left_behind(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A stop always ends: a callback that ignores cancellation (here, one
    that never returns) costs its step's bound, is named in an error line,
    and the steps after it still run; a callback's error is raised as before."""
    server = build_server("127.0.0.1:0", [], service="bounded", security=Security.plaintext())
    await server.start()
    ran: list[str] = []
    release = asyncio.Event()

    async def stuck() -> None:
        while not release.is_set():  # deaf to cancellation until released
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    async def last() -> None:
        ran.append("last")

    server.on_stop += [last, stuck]  # run in reverse: stuck, then last
    async with asyncio.timeout(10):
        await server.stop(grace=0, step_seconds=0.3)
    assert ran == ["last"]
    out = capsys.readouterr().out
    assert "a stop step overran" in out and "stuck" in out, out
    release.set()  # (so the test's own loop can close)

    async def failing() -> None:
        raise RuntimeError("closing failed")

    again = build_server("127.0.0.1:0", [], service="bounded", security=Security.plaintext())
    await again.start()
    again.on_stop.append(failing)
    with pytest.raises(RuntimeError, match="closing failed"):
        await again.stop(grace=0, step_seconds=0.3)
