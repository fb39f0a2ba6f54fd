"""An in-process Baton stack for tests: the four services on loopback ports
(real gRPC with TLS on every hop, each server and client with its role's
certificate from the test PKI), over the test module's TLS etcd with auth,
under a unique key prefix, with anchor's object store a file:// directory
of this test process (the stacks' objects apart by their key prefix)."""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.config import AnchorConfig
from baton_runtime.anchor.server import create_server as create_anchor
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.config import EtcdConfig
from baton_runtime.common.rpc.server import GrpcServer
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security, load_material
from baton_runtime.hooks.config import HooksConfig
from baton_runtime.hooks.server import create_server as create_hooks
from baton_runtime.ingress.api_keys import ApiKeys
from baton_runtime.ingress.config import IngressConfig
from baton_runtime.ingress.rates import ChannelLimits
from baton_runtime.ingress.server import create_server as create_ingress
from baton_runtime.owner.config import OwnerConfig
from baton_runtime.owner.server import create_server as create_owner
from tests import certs
from tests.certs import TEST_PREFIX

SLACK_KEY = "slack-test-key-0001-Xq7w"
WEB_KEY = "web-test-key-00001-Pz4k"
API_KEYS = {SLACK_KEY: "slack", WEB_KEY: "web"}
SLACK = (("authorization", f"Bearer {SLACK_KEY}"),)
WEB = (("authorization", f"Bearer {WEB_KEY}"),)


def public_channel(
    target: str, pki: LocalPki | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A gateway's channel to an ingress: TLS, trusting the test CA, with no
    client certificate (gateways authenticate with API keys)."""
    ca = load_material((pki or certs.pki()).files(Role.OPERATOR)).ca
    return grpc.aio.secure_channel(
        target, grpc.ssl_channel_credentials(root_certificates=ca), options=list(options)
    )


def etcd_config(endpoint: str) -> EtcdConfig:
    """A unique root under the test prefix; TLS as the services' etcd users."""
    return EtcdConfig(
        endpoint=endpoint,
        prefix=f"{TEST_PREFIX}{uuid.uuid4().hex}/",
        timeout=5,
        security=certs.security(Role.HOOKS),
    )


TERMINAL = {s.EVENT_KIND_SESSION_COMPLETED, s.EVENT_KIND_SESSION_FAILED}


@dataclass
class Stack:
    etcd: EtcdConfig
    deployment_id: str
    hooks: GrpcServer
    anchor: GrpcServer
    owner: GrpcServer
    ingress: GrpcServer
    channel: grpc.aio.Channel
    ingress_stub: ingress_pb2_grpc.IngressServiceStub
    # The CA and certificates of the services' gRPC hops (etcd's are the
    # test PKI's: the module's etcd trusts only that CA).
    pki: LocalPki
    extra: list[GrpcServer] = field(default_factory=list)

    def addr(self, server: GrpcServer) -> str:
        return f"127.0.0.1:{server.port}"

    def security(self, role: Role, deployment_id: str = "") -> Security:
        return self.pki.security(role, deployment_id)

    def owner_security(self) -> Security:
        return self.security(Role.OWNER, self.deployment_id)

    def hooks_client(self, security: Security | None = None, **kwargs: float) -> HooksClient:
        """A client of hooks, by default as this deployment's owner."""
        return HooksClient(
            self.addr(self.hooks), security=security or self.owner_security(), **kwargs
        )

    def anchor_client(self, security: Security | None = None, **kwargs: float) -> AnchorClient:
        """A client of anchor, by default as this deployment's owner."""
        return AnchorClient(
            self.addr(self.anchor), security=security or self.owner_security(), **kwargs
        )

    def owner_client(
        self, server: GrpcServer | None = None, security: Security | None = None, **kwargs: float
    ) -> OwnerClient:
        """A client of an owner, by default as this deployment's ingress."""
        return OwnerClient(
            self.addr(server or self.owner),
            security=security or self.security(Role.INGRESS, self.deployment_id),
            **kwargs,
        )

    async def create(self, metadata: tuple[tuple[str, str], ...] = SLACK, **kwargs: object) -> str:
        response = await self.ingress_stub.CreateSession(
            ingress_pb.CreateSessionRequest(**kwargs), metadata=metadata, timeout=10
        )
        return response.session_id

    async def send(
        self,
        session_id: str = "",
        text: str = "",
        metadata: tuple[tuple[str, str], ...] = SLACK,
        **kwargs: object,
    ) -> ingress_pb.SendMessageResponse:
        target = {"session_id": session_id} if session_id else {}
        return await self.ingress_stub.SendMessage(
            ingress_pb.SendMessageRequest(text=text, **target, **kwargs),  # type: ignore[arg-type]
            metadata=metadata,
            timeout=10,
        )

    async def events(
        self,
        session_id: str,
        *,
        start_seq: int = 0,
        until: int | None = None,
        metadata: tuple[tuple[str, str], ...] = SLACK,
        timeout: float = 20,
        follow: bool = True,
    ) -> list[s.Event]:
        """Read events from `start_seq`; with `until`, stop after that many
        session.waiting events (or the terminal event)."""
        out: list[s.Event] = []
        call = self.ingress_stub.StreamEvents(
            ingress_pb.StreamEventsRequest(
                session_id=session_id, start_seq=start_seq, follow=follow
            ),
            metadata=metadata,
        )
        waits = 0

        async def collect() -> None:
            nonlocal waits
            async for response in call:
                for event in response.events:
                    out.append(event)
                    if event.kind == s.EVENT_KIND_SESSION_WAITING:
                        waits += 1
                        if until is not None and waits >= until:
                            return
                    if event.kind in TERMINAL:
                        return

        try:
            await asyncio.wait_for(collect(), timeout)
        finally:
            call.cancel()
        return out


def hooks_config(etcd: EtcdConfig, pki: LocalPki | None = None, **options: object) -> HooksConfig:
    return HooksConfig(
        listen="127.0.0.1:0",
        etcd=etcd_as(etcd, Role.HOOKS),
        tls=(pki or certs.pki()).security(Role.HOOKS),
        **options,  # type: ignore[arg-type]
    )


_OBJECTS: list[str] = []


def object_store_url() -> str:
    """The file:// object store of this test process (made at first use,
    removed at its exit)."""
    if not _OBJECTS:
        path = tempfile.mkdtemp(prefix="baton-objects-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _OBJECTS.append(f"file://{path}")
    return _OBJECTS[0]


def anchor_config(etcd: EtcdConfig, pki: LocalPki | None = None, **options: object) -> AnchorConfig:
    options.setdefault("object_store", object_store_url())
    return AnchorConfig(
        listen="127.0.0.1:0",
        etcd=etcd_as(etcd, Role.ANCHOR),
        tls=(pki or certs.pki()).security(Role.ANCHOR),
        **options,  # type: ignore[arg-type]
    )


def etcd_as(etcd: EtcdConfig, role: Role) -> EtcdConfig:
    """The same etcd and prefix, reached as `role`'s etcd user."""
    return EtcdConfig(etcd.endpoint, etcd.prefix, etcd.timeout, certs.security(role))


async def start_stack(
    etcd_endpoint: str,
    deployment_id: str = "dep-a",
    *,
    anchor_options: dict[str, object] | None = None,
    hooks_options: dict[str, object] | None = None,
    limits: ChannelLimits | None = None,
    api_keys: ApiKeys | None = None,
    pki: LocalPki | None = None,
    **owner_options: object,
) -> Stack:
    """The four services; their gRPC certificates from `pki` (default: the
    test PKI)."""
    pki = pki or certs.pki()
    etcd = etcd_config(etcd_endpoint)
    hooks = await create_hooks(hooks_config(etcd, pki, **(hooks_options or {})))
    await hooks.start()
    anchor = await create_anchor(anchor_config(etcd, pki, **(anchor_options or {})))
    await anchor.start()
    return await _start_deployment(
        etcd,
        hooks,
        anchor,
        deployment_id,
        pki,
        limits=limits,
        api_keys=api_keys,
        **owner_options,
    )


async def add_deployment(base: Stack, deployment_id: str, **owner: object) -> Stack:
    """Owner + ingress of another deployment next to `base`, sharing its
    hooks, anchor and etcd (stop it with `stop_deployment`)."""
    return await _start_deployment(
        base.etcd, base.hooks, base.anchor, deployment_id, base.pki, **owner
    )


async def stop_deployment(stack: Stack) -> None:
    await stack.channel.close()
    for server in (stack.ingress, stack.owner):
        await server.stop(grace=0.5)


async def _start_deployment(
    etcd: EtcdConfig,
    hooks: GrpcServer,
    anchor: GrpcServer,
    deployment_id: str,
    pki: LocalPki,
    *,
    limits: ChannelLimits | None = None,
    api_keys: ApiKeys | None = None,
    **owner_options: object,
) -> Stack:
    owner_options.setdefault("instance_id", f"{deployment_id}-i1")
    owner = await create_owner(
        OwnerConfig(
            listen="127.0.0.1:0",
            deployment_id=deployment_id,
            hooks=f"127.0.0.1:{hooks.port}",
            anchor=f"127.0.0.1:{anchor.port}",
            tls=pki.security(Role.OWNER, deployment_id),
            **owner_options,  # type: ignore[arg-type]
        )
    )
    await owner.start()
    ingress = await create_ingress(
        IngressConfig(
            listen="127.0.0.1:0",
            deployment_id=deployment_id,
            api_keys=api_keys or ApiKeys.of(API_KEYS),
            hooks=f"127.0.0.1:{hooks.port}",
            anchor=f"127.0.0.1:{anchor.port}",
            owner=f"127.0.0.1:{owner.port}",
            tls=pki.security(Role.INGRESS, deployment_id),
            limits=limits or ChannelLimits(),
        )
    )
    await ingress.start()
    channel = public_channel(f"127.0.0.1:{ingress.port}", pki)
    return Stack(
        etcd=etcd,
        deployment_id=deployment_id,
        hooks=hooks,
        anchor=anchor,
        owner=owner,
        ingress=ingress,
        channel=channel,
        ingress_stub=ingress_pb2_grpc.IngressServiceStub(channel),
        pki=pki,
    )


async def stop_stack(stack: Stack) -> None:
    await stack.channel.close()
    for server in (*stack.extra, stack.ingress, stack.owner, stack.anchor, stack.hooks):
        await server.stop(grace=0.5)
