"""Who may call what: the per-RPC role table, TLS at the transport, owners
held to their own deployment.

Every internal RPC is called with no client certificate, with a certificate
from another CA, in plaintext, and with the certificate of each role the
table does not allow: every call is refused and etcd's revision does not
move. The forged-commit sequence of issue 10 fails at its first step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest
from google.protobuf import message as pb_message
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2
from baton_runtime._proto.baton.owner.v1 import owner_pb2
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.channels import open_channel
from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import BatonError, PermissionDenied, Reason
from baton_runtime.common.etcd.keys import Keys, OwnerRecord, parse_fence
from baton_runtime.common.rpc.server import ServiceBinding, build_server
from baton_runtime.common.rpc.status_map import from_rpc_error, from_status_proto
from baton_runtime.common.security import access
from baton_runtime.common.security.identity import CERTIFICATE_ROLES, Caller, Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security, load_material, server_name
from tests.stack import Stack, start_stack, stop_stack

Code = grpc.StatusCode
MODULES = {
    "baton.hooks.v1.HookRegistryService": hooks_pb2,
    "baton.anchor.v1.AnchorService": anchor_pb2,
    "baton.owner.v1.OwnerService": owner_pb2,
    "baton.ingress.v1.IngressService": ingress_pb2,
}
INTERNAL = (
    "baton.hooks.v1.HookRegistryService",
    "baton.anchor.v1.AnchorService",
    "baton.owner.v1.OwnerService",
)


def every_method() -> list[str]:
    """Every RPC every Baton server serves (its own service, health, reflection)."""
    methods = []
    for full_name, module in MODULES.items():
        service = module.DESCRIPTOR.services_by_name[full_name.rpartition(".")[2]]
        methods += [f"/{full_name}/{m.name}" for m in service.methods]
    for descriptor, name in (
        (health_pb2.DESCRIPTOR, "Health"),
        (reflection_pb2.DESCRIPTOR, "ServerReflection"),
    ):
        service = descriptor.services_by_name[name]
        methods += [f"/{service.full_name}/{m.name}" for m in service.methods]
    return methods


def test_every_rpc_of_every_service_has_an_entry() -> None:
    """A new RPC must be given its roles in services/common/security/access.py (until
    then the interceptor refuses it): this fails for any RPC without one."""
    missing = [m for m in every_method() if access.allowed_roles(m) is None]
    assert missing == [], f"RPCs without an entry in access.RPC_ROLES: {missing}"
    stale = sorted(set(access.RPC_ROLES) - set(every_method()))
    assert stale == [], f"entries for RPCs that do not exist: {stale}"


def test_the_table_opens_internal_rpcs_to_certificate_roles_only() -> None:
    for method, roles in access.RPC_ROLES.items():
        if method.startswith(("/grpc.health.", "/grpc.reflection.")):
            continue
        public = method.startswith("/baton.ingress.")
        assert (Role.PUBLIC in roles) == public, method
        if not public:
            assert roles and roles <= CERTIFICATE_ROLES, method
    assert access.RPC_ROLES["/baton.anchor.v1.AnchorService/CommitStep"] == {Role.OWNER}
    assert access.RPC_ROLES["/baton.hooks.v1.HookRegistryService/Transfer"] == {Role.OWNER}
    assert access.RPC_ROLES["/baton.hooks.v1.HookRegistryService/ResumeHook"] == {
        Role.INGRESS,
        Role.OWNER,
    }
    assert access.RPC_ROLES["/baton.anchor.v1.AnchorService/ReadEvents"] >= {
        Role.INGRESS,
        Role.OWNER,
    }


@pytest.mark.parametrize(
    ("uri", "caller"),
    [
        ("spiffe://baton/owner/dep-1", Caller(Role.OWNER, "dep-1")),
        ("spiffe://baton/ingress/build.7", Caller(Role.INGRESS, "build.7")),
        ("spiffe://baton/hooks", Caller(Role.HOOKS)),
        ("spiffe://baton/operator", Caller(Role.OPERATOR)),
    ],
)
def test_spiffe_ids_name_role_and_deployment(uri: str, caller: Caller) -> None:
    assert Caller.parse(uri) == caller
    assert Caller.from_peer([b"localhost", uri.encode(), b"127.0.0.1"]) == caller


@pytest.mark.parametrize(
    "identities",
    [
        [],
        [b"localhost"],
        [b"spiffe://other/owner/dep-1"],
        [b"spiffe://baton/owner"],  # an owner names its deployment
        [b"spiffe://baton/hooks/dep-1"],  # a shared service names none
        [b"spiffe://baton/public"],
        [b"spiffe://baton/root"],
        [b"spiffe://baton/owner/latest/x"],
        [b"spiffe://baton/owner/dep-1", b"spiffe://baton/operator"],  # two identities
    ],
)
def test_certificates_without_exactly_one_baton_identity_are_refused(
    identities: list[bytes],
) -> None:
    with pytest.raises(Exception) as info:
        Caller.from_peer(identities)
    assert getattr(info.value, "reason", "") == Reason.NO_CLIENT_IDENTITY


# -- a server built with the one bootstrap ------------------------------------------------

PROBE = "baton.test.v1.Probe"


def probe_binding(
    behavior: Callable[..., Any], follow: Callable[..., Any] | None = None
) -> ServiceBinding:
    methods = {
        "Hold": grpc.unary_unary_rpc_method_handler(
            behavior,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
    }
    if follow is not None:
        methods["Follow"] = grpc.unary_stream_rpc_method_handler(
            follow,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
    handler = grpc.method_handlers_generic_handler(PROBE, methods)
    return ServiceBinding(PROBE, lambda server: server.add_generic_rpc_handlers((handler,)))


async def call_probe(channel: grpc.aio.Channel) -> Any:
    return await channel.unary_unary(
        f"/{PROBE}/Hold",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )(health_pb2.HealthCheckRequest(), timeout=10)


async def test_an_rpc_without_an_entry_is_refused_before_it_runs() -> None:
    """Deny by default: a served method the table does not name answers
    PERMISSION_DENIED/RPC_NOT_ALLOWED, whoever calls, and never runs."""
    ran: list[bool] = []

    async def hold(request: Any, context: Any) -> Any:
        ran.append(True)
        return health_pb2.HealthCheckResponse()

    from tests import certs

    server = build_server(
        "127.0.0.1:0",
        [probe_binding(hold)],
        service="probe",
        security=certs.security(Role.HOOKS),
    )
    await server.start()
    try:
        for role in CERTIFICATE_ROLES:
            deployment = "dep-1" if role in (Role.OWNER, Role.INGRESS) else ""
            channel = open_channel(f"127.0.0.1:{server.port}", certs.security(role, deployment))
            try:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call_probe(channel)
            finally:
                await channel.close()
            assert info.value.code() == Code.PERMISSION_DENIED
            assert from_rpc_error(info.value).reason == Reason.RPC_NOT_ALLOWED
        assert ran == []
    finally:
        await server.stop(0.1)


async def test_the_server_caps_concurrent_calls_with_retry_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over the server's capacity a call is refused at once with
    RESOURCE_EXHAUSTED/SERVER_BUSY and RetryInfo; when a slot frees, calls
    are served again (the count never goes wrong, unlike grpc#41531)."""
    from baton_runtime.common.config import Capacity
    from tests import certs

    monkeypatch.setitem(access.RPC_ROLES, f"/{PROBE}/Hold", frozenset({Role.OPERATOR}))
    release = asyncio.Event()
    both_in = asyncio.Event()
    inside = 0

    async def hold(request: Any, context: Any) -> Any:
        nonlocal inside
        inside += 1
        if inside == 2:
            both_in.set()
        try:
            await release.wait()
        finally:
            inside -= 1
        return health_pb2.HealthCheckResponse()

    server = build_server(
        "127.0.0.1:0",
        [probe_binding(hold)],
        service="probe",
        security=certs.security(Role.HOOKS),
        capacity=Capacity(max_unary=2, retry_after=0.25),
    )
    await server.start()
    channel = open_channel(f"127.0.0.1:{server.port}", certs.operator())
    try:
        for _round in range(3):
            held = [asyncio.ensure_future(call_probe(channel)) for _ in range(2)]
            await asyncio.wait_for(both_in.wait(), 10)
            refused = []
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call_probe(channel)
                refused.append(from_rpc_error(info.value))
                assert info.value.code() == Code.RESOURCE_EXHAUSTED
            assert {e.reason for e in refused} == {Reason.SERVER_BUSY}
            assert all(e.retry_after == pytest.approx(0.25) for e in refused)
            assert all(e.retryable for e in refused)
            release.set()
            await asyncio.gather(*held)
            release.clear()
            both_in.clear()
        release.set()
        await call_probe(channel)  # a slot is free: served
    finally:
        await channel.close()
        await server.stop(0.1)


async def test_an_unmetered_method_is_served_past_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A method the capacity does not meter (hooks: an owner's lease
    keep-alive) is served however many calls are in flight, and takes no
    slot from the metered ones; hooks names its membership methods so."""
    from baton_runtime.common.config import Capacity
    from baton_runtime.hooks.server import MEMBERSHIP_METHODS, SERVICE_NAME
    from tests import certs

    service = hooks_pb2.DESCRIPTOR.services_by_name["HookRegistryService"]
    assert MEMBERSHIP_METHODS == {
        f"/{SERVICE_NAME}/{service.methods_by_name[name].name}"
        for name in (
            "RegisterInstance",
            "KeepAliveInstance",
            "SetInstanceDrain",
            "DeregisterInstance",
        )
    }
    monkeypatch.setitem(access.RPC_ROLES, f"/{PROBE}/Hold", frozenset({Role.OPERATOR}))
    release = asyncio.Event()
    inside = 0
    all_in = asyncio.Event()

    async def hold(request: Any, context: Any) -> Any:
        nonlocal inside
        inside += 1
        if inside == 3:
            all_in.set()
        await release.wait()
        return health_pb2.HealthCheckResponse()

    server = build_server(
        "127.0.0.1:0",
        [probe_binding(hold)],
        service="probe",
        security=certs.security(Role.HOOKS),
        capacity=Capacity(max_unary=1, unmetered=frozenset({f"/{PROBE}/Hold"})),
    )
    await server.start()
    channel = open_channel(f"127.0.0.1:{server.port}", certs.operator())
    try:
        held = [asyncio.ensure_future(call_probe(channel)) for _ in range(3)]
        await asyncio.wait_for(all_in.wait(), 10)  # three in at a cap of one
        release.set()
        await asyncio.gather(*held)
    finally:
        await channel.close()
        await server.stop(0.1)


async def test_the_server_caps_concurrent_streams_apart_from_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Streams count against their own limit: over it a stream is refused
    with RESOURCE_EXHAUSTED/SERVER_BUSY while unary calls are still served;
    a stream the client cancels and a stream that ends both free their slot."""
    from baton_runtime.common.config import Capacity
    from tests import certs

    for name in ("Hold", "Follow"):
        monkeypatch.setitem(access.RPC_ROLES, f"/{PROBE}/{name}", frozenset({Role.OPERATOR}))
    release = asyncio.Event()

    async def hold(request: Any, context: Any) -> Any:
        return health_pb2.HealthCheckResponse()

    async def follow(request: Any, context: Any) -> AsyncIterator[Any]:
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        await release.wait()

    server = build_server(
        "127.0.0.1:0",
        [probe_binding(hold, follow)],
        service="probe",
        security=certs.security(Role.HOOKS),
        capacity=Capacity(max_unary=1, max_streams=2, retry_after=0.25),
    )
    await server.start()
    channel = open_channel(f"127.0.0.1:{server.port}", certs.operator())
    open_follow = channel.unary_stream(
        f"/{PROBE}/Follow",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )

    async def first(stream: Any) -> Any:
        return await asyncio.wait_for(stream.read(), 10)

    try:
        for _round in range(2):
            held = [open_follow(health_pb2.HealthCheckRequest()) for _ in range(2)]
            for stream in held:
                assert (await first(stream)).status == health_pb2.HealthCheckResponse.SERVING
            refused = open_follow(health_pb2.HealthCheckRequest())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await first(refused)
            assert info.value.code() == Code.RESOURCE_EXHAUSTED
            assert from_rpc_error(info.value).reason == Reason.SERVER_BUSY
            await call_probe(channel)  # unary calls have their own limit
            held[0].cancel()  # the client leaves: its slot frees
            for _ in range(100):
                again = open_follow(health_pb2.HealthCheckRequest())
                try:
                    await first(again)
                    break
                except grpc.aio.AioRpcError as exc:  # the cancel not yet seen
                    assert exc.code() == Code.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("a cancelled stream never freed its slot")
            release.set()  # both remaining streams end: their slots free
            assert await again.read() == grpc.aio.EOF
            assert await held[1].read() == grpc.aio.EOF
            release.clear()
    finally:
        await channel.close()
        await server.stop(0.1)


async def test_plaintext_is_refused_for_a_non_loopback_bind() -> None:
    for listen in ("0.0.0.0:0", "[::]:0", "10.1.2.3:0", "example.com:0", ":0"):
        with pytest.raises(ConfigError, match="refusing to serve plaintext"):
            build_server(listen, [], service="probe", security=Security.plaintext())
    for listen in ("127.0.0.1:0", "localhost:0", "[::1]:0"):
        server = build_server(listen, [], service="probe", security=Security.plaintext())
        assert server.port > 0


def test_tls_or_plaintext_must_be_chosen_explicitly() -> None:
    from baton_runtime.hooks.config import HooksConfig

    with pytest.raises(ConfigError, match="--plaintext"):
        HooksConfig.load([], {})
    with pytest.raises(ConfigError, match="exclude each other"):
        HooksConfig.load(["--plaintext", "--tls-cert", "x"], {})
    plain = HooksConfig.load(["--plaintext"], {})
    assert not plain.tls.is_tls and not plain.etcd.security.is_tls
    tls = HooksConfig.load([], {"BATON_TLS_CERT": "c", "BATON_TLS_KEY": "k", "BATON_TLS_CA": "a"})
    assert tls.tls.is_tls and tls.etcd.security.files == tls.tls.files  # etcd too, by default


# -- the role matrix over a live stack ----------------------------------------------------


@dataclass
class Target:
    """A live session and everything a forger would need to address it."""

    session_id: str
    fence: s.Fence
    owner: OwnerRecord
    hooks: list[str]
    head: int
    snapshot_revision: int


async def target_of(stack: Stack, etcd: aetcd.Client) -> Target:
    sid = await stack.create(aliases=["victim"])
    await stack.send(sid, "secret plans")
    await stack.events(sid, until=1)
    k = Keys(stack.etcd.prefix)
    fence_kv, owner_kv, hooks_kv, head_kv, snap_kv = [
        await etcd.get(key)
        for key in (k.fence(sid), k.owner(sid), k.hooks(sid), k.inbox_head(sid), k.snapshot(sid))
    ]
    assert fence_kv and owner_kv and hooks_kv and head_kv and snap_kv
    epoch, run = parse_fence(fence_kv.value)
    import json

    return Target(
        session_id=sid,
        fence=s.Fence(session_id=sid, owner_run_id=run, epoch=epoch),
        owner=OwnerRecord.decode(owner_kv.value),
        hooks=json.loads(hooks_kv.value),
        head=int(head_kv.value),
        snapshot_revision=snap_kv.mod_revision,
    )


def forged_requests(t: Target, deployment_id: str) -> dict[str, pb_message.Message]:
    """A well-formed, harmful request for every internal RPC (by method)."""
    sid, fence = t.session_id, t.fence
    me = s.OwnerIdentity(
        owner_run_id=t.owner.owner_run_id,
        deployment_id=t.owner.deployment_id,
        instance_id=t.owner.instance_id,
    )
    thief = s.OwnerIdentity(
        owner_run_id=ids.new_run_id(), deployment_id=deployment_id, instance_id="thief-1"
    )
    forged = s.Event(session_id=sid, seq=1_000, kind=s.EVENT_KIND_MESSAGE_COMPLETED, text="forged")
    h, a, o = hooks_pb2, anchor_pb2, owner_pb2
    command = s.Command(send=s.SendCommand(text="forged command"))
    return {
        "CreateSession": h.CreateSessionRequest(
            session_id=ids.new_session_id(), owner=thief, channel="slack"
        ),
        "ClaimHooks": h.ClaimHooksRequest(fence=fence, tokens=["slack:stolen"]),
        "ResumeHook": h.ResumeHookRequest(token=ids.inbox_token(sid), command=command),
        "ResumeHooks": h.ResumeHooksRequest(
            calls=[
                h.ResumeHookCall(
                    call_id=1,
                    request=h.ResumeHookRequest(token=ids.inbox_token(sid), command=command),
                )
            ]
        ),
        "LookupHook": h.LookupHookRequest(token=ids.inbox_token(sid)),
        "DisposeHooks": h.DisposeHooksRequest(fence=fence),
        "StreamInbox": h.StreamInboxRequest(fence=fence, from_seq=0),
        "FollowInboxes": h.FollowInboxesRequest(
            follows=[
                h.InboxFollow(follow_id=1, request=h.StreamInboxRequest(fence=fence, from_seq=0))
            ]
        ),
        "RegisterInstance": h.RegisterInstanceRequest(
            deployment_id=deployment_id, instance_id="thief-1", ttl_seconds=5, address="x:1"
        ),
        "KeepAliveInstance": h.KeepAliveInstanceRequest(lease_id=1),
        "DeregisterInstance": h.DeregisterInstanceRequest(lease_id=1),
        "SetInstanceDrain": h.SetInstanceDrainRequest(
            deployment_id=deployment_id,
            instance_id=t.owner.instance_id,
            lease_id=1,
            to_deployment_id="dep-thief",
        ),
        "ListInstances": h.ListInstancesRequest(deployment_id=deployment_id),
        "WatchInstances": h.WatchInstancesRequest(deployment_id=deployment_id),
        "ListInstanceSessions": h.ListInstanceSessionsRequest(
            deployment_id=deployment_id, instance_id=t.owner.instance_id
        ),
        "TakeOverSession": h.TakeOverSessionRequest(
            expected=fence, expected_instance_id=t.owner.instance_id, successor=thief
        ),
        "SetParked": h.SetParkedRequest(fence=fence, parked=True, inbox_next_seq=t.head),
        "WatchBells": h.WatchBellsRequest(instance_id=t.owner.instance_id),
        "Transfer": h.TransferRequest(
            handoff_id="ho_steal",
            expected=fence,
            expected_owner=me,
            successor=thief,
            hooks=t.hooks,
            trigger_seq=t.head - 1,
            snapshot_revision=t.snapshot_revision,
        ),
        "GetTransfer": h.GetTransferRequest(session_id=sid, handoff_id="ho_steal"),
        "GetOwner": h.GetOwnerRequest(session_id=sid),
        "DescribeSession": h.DescribeSessionRequest(session_id=sid),
        "ListChannelSessions": h.ListChannelSessionsRequest(channel="slack", limit=10),
        "ListDeployments": h.ListDeploymentsRequest(),
        "DescribeDeployment": h.DescribeDeploymentRequest(deployment_id=deployment_id),
        "DrainSessions": o.DrainSessionsRequest(to_deployment_id="dep-b"),
        "UndrainSessions": o.UndrainSessionsRequest(),
        "ResumeSession": o.ResumeSessionRequest(session_id=sid),
        "AdoptSession": o.AdoptSessionRequest(session_id=sid),
        "CommitStep": a.CommitStepRequest(
            fence=fence,
            events=[forged],
            snapshot=s.SessionSnapshot(session_id=sid, next_event_seq=1_001),
        ),
        "CommitSteps": a.CommitStepsRequest(
            calls=[
                a.CommitStepCall(
                    call_id=1,
                    request=a.CommitStepRequest(
                        fence=fence,
                        events=[forged],
                        snapshot=s.SessionSnapshot(session_id=sid, next_event_seq=1_001),
                    ),
                )
            ]
        ),
        "GetSnapshot": a.GetSnapshotRequest(session_id=sid),
        "LoadSession": a.LoadSessionRequest(session_id=sid),
        "RetireHistory": a.RetireHistoryRequest(fence=fence, below_index=10**6),
        "ReadEvents": a.ReadEventsRequest(session_id=sid),
        "FollowEvents": a.FollowEventsRequest(
            follows=[a.EventFollow(follow_id=1, request=a.ReadEventsRequest(session_id=sid))]
        ),
        "PublishLive": a.PublishLiveRequest(
            batches=[
                s.LiveBatch(
                    step=s.LiveStep(
                        session_id=sid,
                        base_seq=1,
                        step=1,
                        owner_run_id=fence.owner_run_id or "run_x",
                        epoch=fence.epoch or 1,
                        attempt=1,
                    ),
                    items=[s.LiveItem(kind=s.LIVE_KIND_TEXT, text="forged")],
                )
            ]
        ),
        "StartSession": o.StartSessionRequest(
            session_id=ids.new_session_id(), deployment_id=deployment_id, channel="slack"
        ),
        "AcceptHandoff": o.AcceptHandoffRequest(
            handoff_id="ho_steal", fence=fence, deployment_id=deployment_id, from_owner=me
        ),
    }


def internal_rpcs(stack: Stack) -> list[tuple[str, str, Any, Any, bool]]:
    """(full method, address, request class, response class, server streaming)."""
    servers = {
        "baton.hooks.v1.HookRegistryService": stack.hooks,
        "baton.anchor.v1.AnchorService": stack.anchor,
        "baton.owner.v1.OwnerService": stack.owner,
    }
    out = []
    for full_name in INTERNAL:
        module = MODULES[full_name]
        service = module.DESCRIPTOR.services_by_name[full_name.rpartition(".")[2]]
        for m in service.methods:
            out.append(
                (
                    f"/{full_name}/{m.name}",
                    stack.addr(servers[full_name]),
                    getattr(module, m.input_type.name),
                    getattr(module, m.output_type.name),
                    m.server_streaming,
                )
            )
    return out


async def invoke(
    channel: grpc.aio.Channel, method: str, request: Any, response: Any, streaming: bool
) -> None:
    """Call once; for a stream, read its first message. Raises AioRpcError."""
    if streaming:
        call = channel.unary_stream(
            method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response.FromString,
        )(request, timeout=5)
        try:
            async for _ in call:
                return
        finally:
            call.cancel()
        return
    await channel.unary_unary(
        method,
        request_serializer=type(request).SerializeToString,
        response_deserializer=response.FromString,
    )(request, timeout=5)


@pytest.fixture
async def quiet_stack(etcd_endpoint: str) -> AsyncIterator[Stack]:
    """A stack whose owner never parks (no background writes to etcd)."""
    stack = await start_stack(etcd_endpoint, park_after=None)
    try:
        yield stack
    finally:
        await stop_stack(stack)


async def revision(etcd: aetcd.Client) -> int:
    status = await etcd.status()
    return int(status.raft_index)


async def store_revision(etcd: aetcd.Client, stack: Stack) -> int:
    response = await etcd.get_prefix(stack.etcd.prefix.encode(), keys_only=True)
    return int(response.header.revision)


def other_ca_credentials(stack: Stack, tmp: Path) -> grpc.ChannelCredentials:
    """Trusts the stack's CA, but presents an owner certificate of another CA."""
    other = LocalPki(tmp / "other-ca")
    stranger = load_material(other.files(Role.OWNER, stack.deployment_id))
    ours = load_material(stack.pki.files(Role.OPERATOR))
    return grpc.ssl_channel_credentials(
        root_certificates=ours.ca, private_key=stranger.key, certificate_chain=stranger.cert
    )


async def test_every_internal_rpc_refuses_every_wrong_caller_and_writes_nothing(
    quiet_stack: Stack, etcd: aetcd.Client, tmp_path: Path
) -> None:
    stack = quiet_stack
    target = await target_of(stack, etcd)
    requests = forged_requests(target, stack.deployment_id)
    ca = load_material(stack.pki.files(Role.OPERATOR)).ca
    transports: dict[str, Callable[[str], grpc.aio.Channel]] = {
        "no client certificate": lambda addr: grpc.aio.secure_channel(
            addr, grpc.ssl_channel_credentials(root_certificates=ca)
        ),
        "another CA's certificate": lambda addr: grpc.aio.secure_channel(
            addr, other_ca_credentials(stack, tmp_path)
        ),
        "plaintext": lambda addr: grpc.aio.insecure_channel(addr),
    }
    roles = {
        role: stack.security(
            role, stack.deployment_id if role in (Role.OWNER, Role.INGRESS) else ""
        )
        for role in CERTIFICATE_ROLES
    }
    before = await store_revision(etcd, stack)
    checked = 0
    for method, address, _, response, streaming in internal_rpcs(stack):
        request = requests[method.rpartition("/")[2]]
        for what, open_transport in transports.items():
            channel = open_transport(address)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await invoke(channel, method, request, response, streaming)
            finally:
                await channel.close()
            assert info.value.code() == Code.UNAVAILABLE, (method, what, info.value.details())
            checked += 1
        allowed = access.allowed_roles(method)
        assert allowed is not None
        for role, security in roles.items():
            if role in allowed:
                continue
            channel = open_channel(address, security)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await invoke(channel, method, request, response, streaming)
            finally:
                await channel.close()
            assert info.value.code() == Code.PERMISSION_DENIED, (method, role)
            assert from_rpc_error(info.value).reason == Reason.ROLE_NOT_ALLOWED, (method, role)
            checked += 1
    assert checked > 100
    assert await store_revision(etcd, stack) == before, "a refused call wrote to etcd"
    # The session is untouched and still answers its own channel.
    await stack.send(target.session_id, "still mine")
    events = await stack.events(target.session_id, until=2)
    assert [e.text for e in events if e.kind == s.EVENT_KIND_MESSAGE_COMPLETED] == [
        "echo: secret plans",
        "echo: still mine",
    ]


async def test_an_owner_acts_only_for_its_own_deployment(
    quiet_stack: Stack, etcd: aetcd.Client
) -> None:
    """An owner certificate of another deployment may not commit, take over,
    transfer away, claim, park, stream the inbox of, list or register for a
    session or instance of this deployment; nothing is written."""
    stack = quiet_stack
    target = await target_of(stack, etcd)
    requests = forged_requests(target, stack.deployment_id)
    evil = stack.security(Role.OWNER, "dep-evil")
    scoped = [
        "RetireHistory",
        "CreateSession",
        "ClaimHooks",
        "DisposeHooks",
        "StreamInbox",
        "RegisterInstance",
        "SetInstanceDrain",
        "WatchInstances",
        "ListInstanceSessions",
        "TakeOverSession",
        "SetParked",
        "Transfer",
        "CommitStep",
        "AcceptHandoff",
    ]
    rpcs = {m.rpartition("/")[2]: (m, a, r, st) for m, a, _, r, st in internal_rpcs(stack)}
    before = await store_revision(etcd, stack)
    for name in scoped:
        method, address, response, streaming = rpcs[name]
        channel = open_channel(address, evil)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await invoke(channel, method, requests[name], response, streaming)
        finally:
            await channel.close()
        assert info.value.code() == Code.PERMISSION_DENIED, (name, info.value.details())
        assert from_rpc_error(info.value).reason == Reason.DEPLOYMENT_NOT_ALLOWED, name
    # The multiplexed commits: the stream opens (the role is right), the
    # commit it carries is refused as CommitStep refuses it.
    method, address, response, _ = rpcs["CommitSteps"]
    channel = open_channel(address, evil)
    try:
        call = channel.unary_stream(
            method,
            request_serializer=anchor_pb2.CommitStepsRequest.SerializeToString,
            response_deserializer=response.FromString,
        )(requests["CommitSteps"], timeout=5)
        (answer,) = [a async for a in call]
    finally:
        await channel.close()
    (refused,) = answer.answers
    error = from_status_proto(status_pb2.Status.FromString(refused.status))
    assert (refused.call_id, error.reason) == (1, Reason.DEPLOYMENT_NOT_ALLOWED)
    # The multiplexed inbox streams: the follow ends as StreamInbox would.
    method, address, response, _ = rpcs["FollowInboxes"]
    channel = open_channel(address, evil)
    try:
        call = channel.unary_stream(
            method,
            request_serializer=hooks_pb2.FollowInboxesRequest.SerializeToString,
            response_deserializer=response.FromString,
        )(requests["FollowInboxes"], timeout=5)
        (answer,) = [a async for a in call]  # half-closed, its one follow ended: the end
    finally:
        await channel.close()
    (ended,) = answer.items
    error = from_status_proto(status_pb2.Status.FromString(ended.end))
    assert (ended.follow_id, list(ended.entries)) == (1, [])
    assert error.reason == Reason.DEPLOYMENT_NOT_ALLOWED
    # An ingress may start sessions, and ask for adoptions, only on its own
    # deployment's owner.
    channel = open_channel(stack.addr(stack.owner), stack.security(Role.INGRESS, "dep-evil"))
    try:
        for name in ("StartSession", "AdoptSession"):
            method, _, response, streaming = rpcs[name]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await invoke(channel, method, requests[name], response, streaming)
            assert from_rpc_error(info.value).reason == Reason.DEPLOYMENT_NOT_ALLOWED, name
    finally:
        await channel.close()
    assert await store_revision(etcd, stack) == before, "a refused call wrote to etcd"


async def test_owners_start_child_sessions_and_ingresses_tenant_sessions(
    quiet_stack: Stack, etcd: aetcd.Client
) -> None:
    """StartSession is open to owners for child sessions (a parent's owner
    places the child on an instance of its own deployment) and to ingresses
    for tenants' sessions; not the other way round, and not across
    deployments. Nothing is written."""
    stack = quiet_stack
    parent = (await target_of(stack, etcd)).session_id  # (and the stack settled)
    link = s.ParentLink(parent_session_id=parent, kind=s.TASK_KIND_SUBAGENT, name="helper")

    def request(parent: bool) -> owner_pb2.StartSessionRequest:
        started = owner_pb2.StartSessionRequest(
            session_id=ids.new_session_id(), deployment_id=stack.deployment_id, channel="slack"
        )
        if parent:
            started.parent.CopyFrom(link)
        return started

    cases = [
        (stack.owner_security(), False, Reason.ROLE_NOT_ALLOWED),
        (stack.security(Role.INGRESS, stack.deployment_id), True, Reason.ROLE_NOT_ALLOWED),
        (stack.security(Role.OWNER, "dep-evil"), True, Reason.DEPLOYMENT_NOT_ALLOWED),
    ]
    before = await store_revision(etcd, stack)
    for security, parent, reason in cases:
        client = stack.owner_client(security=security)
        try:
            with pytest.raises(PermissionDenied) as info:
                await client.start_session(request(parent))
        finally:
            await client.close()
        assert info.value.reason == reason, info.value
    assert await store_revision(etcd, stack) == before, "a refused call wrote to etcd"


async def test_the_forged_commit_sequence_fails_at_its_first_step(
    quiet_stack: Stack, etcd: aetcd.Client
) -> None:
    """Issue 10, replayed: read another session's snapshot, inject into its
    inbox with an empty channel, list the fences, commit a forged event.
    Without credentials the first step fails; with an ingress certificate
    the inject needs a channel and the rest is refused; with another
    deployment's owner certificate the inject, the listing and the commit
    are refused."""
    stack = quiet_stack
    target = await target_of(stack, etcd)
    requests = forged_requests(target, stack.deployment_id)
    rpcs = {m.rpartition("/")[2]: (m, a, r, st) for m, a, _, r, st in internal_rpcs(stack)}
    ca = load_material(stack.pki.files(Role.OPERATOR)).ca
    steps = ["GetSnapshot", "ResumeHook", "ListInstanceSessions", "CommitStep"]
    before = await store_revision(etcd, stack)

    async def attempt(channel: grpc.aio.Channel, step: str) -> grpc.aio.AioRpcError | None:
        method, _, response, streaming = rpcs[step]
        try:
            await invoke(channel, method, requests[step], response, streaming)
        except grpc.aio.AioRpcError as exc:
            return exc
        return None

    # No credentials: step one (and every other) cannot even connect.
    for step in steps:
        address = rpcs[step][1]
        channel = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca))
        try:
            error = await attempt(channel, step)
        finally:
            await channel.close()
        assert error is not None and error.code() == Code.UNAVAILABLE, step
    # An ingress's certificate: it reads for its tenants, but names the tenant.
    results = {}
    for step in steps:
        channel = open_channel(rpcs[step][1], stack.security(Role.INGRESS, stack.deployment_id))
        try:
            results[step] = await attempt(channel, step)
        finally:
            await channel.close()
    assert results["GetSnapshot"] is None  # ingress checks tenancy itself
    assert from_rpc_error(results["ResumeHook"]).reason == Reason.MISSING_FIELD  # type: ignore[arg-type]
    assert from_rpc_error(results["ListInstanceSessions"]).reason == Reason.ROLE_NOT_ALLOWED  # type: ignore[arg-type]
    assert from_rpc_error(results["CommitStep"]).reason == Reason.ROLE_NOT_ALLOWED  # type: ignore[arg-type]
    # Another deployment's owner: no inject (with or without a channel), no
    # listing, no commit.
    expected = {
        "ResumeHook": Reason.DELIVERY_NOT_ALLOWED,
        "ListInstanceSessions": Reason.DEPLOYMENT_NOT_ALLOWED,
        "CommitStep": Reason.DEPLOYMENT_NOT_ALLOWED,
    }
    for step, reason in expected.items():
        channel = open_channel(rpcs[step][1], stack.security(Role.OWNER, "dep-evil"))
        try:
            error = await attempt(channel, step)
            if step == "ResumeHook":
                assert error is not None
                assert from_rpc_error(error).reason == reason, step
                requests[step].channel = "slack"  # naming the tenant changes nothing
                error = await attempt(channel, step)
        finally:
            await channel.close()
        assert error is not None
        assert from_rpc_error(error).reason == reason, step
    assert await store_revision(etcd, stack) == before
    events = await stack.events(target.session_id, follow=False)
    assert "forged" not in [e.text for e in events]


async def test_etcd_refuses_plaintext_strangers_and_keys_outside_the_prefix(
    stack: Stack,
) -> None:
    """The services reach etcd over TLS as users whose role covers the test
    prefix only; etcd refuses plaintext, and certificates of non-users."""
    from baton_runtime.common.errors import BatonError
    from baton_runtime.common.etcd.client import make_client
    from baton_runtime.common.etcd.ops import op_get, op_put
    from baton_runtime.common.etcd.store import Store
    from tests import certs

    plain = Store(make_client(stack.etcd.endpoint, 2), 2)
    try:
        with pytest.raises(BatonError):
            await plain.connect()
            await plain.txn([], [op_get(b"/t/x")])
    finally:
        await plain.close()
    hooks = Store(make_client(stack.etcd.endpoint, 2, certs.security(Role.HOOKS)), 2)
    await hooks.connect()
    try:
        await hooks.txn([], [op_get(stack.etcd.prefix.encode())])
        with pytest.raises(BatonError) as outside:
            await hooks.txn([], [op_put(b"/elsewhere", b"x")])
        assert "permission denied" in outside.value.message
    finally:
        await hooks.close()
    root = await certs.etcd_root_client(stack.etcd.endpoint)
    try:
        from aetcd import rpc

        # User/role auth is on (the permission denied above says so too);
        # AuthStatus is etcd 3.5's, the user list answers on every release.
        listed = await rpc.AuthStub(root.channel).UserList(rpc.AuthUserListRequest(), timeout=5)
        assert {"root", "hooks", "anchor"} <= set(listed.users)
    finally:
        await root.close()
    stranger = Store(make_client(stack.etcd.endpoint, 2, certs.operator()), 2)
    await stranger.connect()
    try:
        with pytest.raises(BatonError):
            await stranger.txn([], [op_get(stack.etcd.prefix.encode())])
    finally:
        await stranger.close()


def test_replicas_on_one_host_are_verified_against_that_host() -> None:
    """gRPC's authority for a multi-address target is no host name; replicas
    listed by one host's IP are verified against it, other lists need a
    dns:/// name their certificates carry."""
    assert server_name("ipv4:127.0.0.1:1,127.0.0.1:2") == "127.0.0.1"
    assert server_name("ipv6:[::1]:1,[::1]:2") == "::1"
    assert server_name("ipv4:10.0.0.1:1,10.0.0.2:1") is None
    assert server_name("127.0.0.1:50052") is None
    assert server_name("dns:///hooks.baton.svc:50052") is None


def test_servers_dialled_by_ip_are_verified_against_the_configured_name() -> None:
    """Owners dial other deployments' owners at their registered pod IP; with
    --tls-ip-server-name the certificate must carry that name instead."""
    name = "owner.baton.svc.cluster.local"
    assert server_name("10.1.2.3:50054", name) == name
    assert server_name("ipv4:10.1.2.3:1,10.1.2.4:1", name) == name
    assert server_name("[fd00::1]:50054", name) == name
    assert server_name("dns:///hooks.baton.svc:50052", name) is None
    assert server_name("hooks:50052", name) is None
    assert server_name("10.1.2.3:50054") is None


async def test_the_ip_server_name_is_what_the_server_certificate_must_carry() -> None:
    from dataclasses import replace

    from tests import certs

    async def hold(request: Any, context: Any) -> Any:
        return health_pb2.HealthCheckResponse()

    server = build_server(
        "127.0.0.1:0", [probe_binding(hold)], service="probe", security=certs.owner("dep-1")
    )
    await server.start()
    try:
        # The test certificates name localhost (and the loopback IPs).
        for ip_name, works in (("", True), ("localhost", True), ("owner.baton.example", False)):
            security = replace(certs.owner("dep-2"), ip_server_name=ip_name)
            channel = open_channel(f"127.0.0.1:{server.port}", security)
            try:
                request = health_pb2.HealthCheckRequest()
                check = channel.unary_unary(
                    "/grpc.health.v1.Health/Check",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                )
                if works:
                    await check(request, timeout=10)
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await check(request, timeout=10)
                    assert info.value.code() == Code.UNAVAILABLE
            finally:
                await channel.close()
    finally:
        await server.stop(0.1)


async def test_a_plaintext_health_listener_serves_health_and_nothing_else() -> None:
    """--health-listen: Kubernetes' gRPC probes cannot speak TLS. The listener
    answers the same statuses as the server, on any address, and serves no
    other service; the API port still demands TLS."""
    from grpc_health.v1 import health_pb2_grpc

    from tests import certs

    async def hold(request: Any, context: Any) -> Any:
        return health_pb2.HealthCheckResponse()

    server = build_server(
        "127.0.0.1:0",
        [probe_binding(hold)],
        service="probe",
        security=certs.security(Role.HOOKS),
        health_listen="0.0.0.0:0",
    )
    await server.start()
    probe = grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}")
    api = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        health = health_pb2_grpc.HealthStub(probe)
        for service in ("", PROBE):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call_probe(probe)
        assert info.value.code() == Code.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(api).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert info.value.code() == Code.UNAVAILABLE  # no TLS, no answer
        await server.set_serving(False)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=PROBE), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await probe.close()
        await api.close()
        await server.stop(0.1)


async def test_the_demo_verifies_the_ingress_against_a_given_server_name(stack: Stack) -> None:
    """`baton demo --tls-server-name`: through a port-forward the address
    dialled is not a name the ingress certificate carries."""
    import io

    from baton_runtime.cli.commands import demo
    from tests.stack import SLACK_KEY

    address = stack.addr(stack.ingress)
    out = io.StringIO()
    session_id = await demo.run_demo(
        address, SLACK_KEY, ["hi"], ca_cert=stack.pki.ca_path, server_name="localhost", out=out
    )
    assert session_id in out.getvalue()
    with pytest.raises(demo.DemoError, match="CreateSession"):
        await demo.run_demo(
            address,
            SLACK_KEY,
            ["hi"],
            ca_cert=stack.pki.ca_path,
            server_name="ingress.baton.example",
            out=io.StringIO(),
        )


async def test_introspection_reads_name_the_tenant_and_hide_other_channels(
    quiet_stack: Stack, etcd: aetcd.Client
) -> None:
    """An ingress reads hooks' record of a session only naming its caller's
    channel: without one it is MISSING_FIELD, with another channel the
    session is NOT_FOUND like a missing one, and another channel's index
    lists none of it."""
    stack = quiet_stack
    target = await target_of(stack, etcd)
    hooks = stack.hooks_client(security=stack.security(Role.INGRESS, stack.deployment_id))
    try:
        with pytest.raises(BatonError) as info:
            await hooks.describe_session(target.session_id, "")
        assert info.value.reason == Reason.MISSING_FIELD
        with pytest.raises(BatonError) as info:
            await hooks.describe_session(target.session_id, "web")
        assert info.value.reason == Reason.SESSION_NOT_FOUND
        missing = ids.new_session_id()
        with pytest.raises(BatonError) as other:
            await hooks.describe_session(missing, "slack")
        assert (other.value.reason, other.value.message) == (
            Reason.SESSION_NOT_FOUND,
            info.value.message.replace(target.session_id, missing),
        )
        mine = await hooks.describe_session(target.session_id, "slack")
        assert (mine.channel, mine.fence.epoch) == ("slack", target.fence.epoch)
        assert mine.create_time is not None and mine.create_time.seconds > 0
        assert ids.inbox_token(target.session_id) in mine.hooks
        listed = await hooks.list_channel_sessions("slack", "", 10)
        assert [sid for sid, _ in listed.sessions] == [target.session_id]
        assert not (await hooks.list_channel_sessions("web", "", 10)).sessions
        with pytest.raises(BatonError) as info:
            await hooks.list_channel_sessions("", "", 10)
        assert info.value.reason == Reason.MISSING_FIELD
    finally:
        await hooks.close()
