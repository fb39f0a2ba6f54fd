"""Clients over several replicas: address settings, round-robin, replicas
shutting down, and retries of idempotent calls only (baton_runtime.common.clients.channels).

Real hooks servers on loopback over the test etcd; one of them may be given
an etcd that is not there, so that it answers UNAVAILABLE to everything.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.processes import free_port
from baton_runtime.common import ids
from baton_runtime.common.clients.channels import service_config
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.hooks_methods import HOOKS_IDEMPOTENT
from baton_runtime.common.config import ConfigError, EtcdConfig, grpc_target
from baton_runtime.common.errors import NotFound, Unavailable
from baton_runtime.common.rpc.server import GrpcServer
from baton_runtime.hooks.rooms import HookRooms
from baton_runtime.hooks.server import create_server as create_hooks
from baton_runtime.ingress.config import IngressConfig
from tests.stack import SLACK_KEY, Stack, hooks_config


def test_address_settings() -> None:
    assert grpc_target("127.0.0.1:50052") == "127.0.0.1:50052"
    assert grpc_target("hooks:50052") == "hooks:50052"
    assert grpc_target("dns:///hooks.baton.svc:50052") == "dns:///hooks.baton.svc:50052"
    assert grpc_target("127.0.0.1:1, 127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert grpc_target("localhost:1,10.0.0.2:2") == "ipv4:127.0.0.1:1,10.0.0.2:2"
    assert grpc_target("[::1]:1,[fe80::1]:2") == "ipv6:[::1]:1,[fe80::1]:2"
    for bad in ("", "hooks", "hooks:x", "a:1,b:2", "127.0.0.1:1,[::1]:2", "1.2.3.4:70000"):
        with pytest.raises(ValueError):
            grpc_target(bad)


def test_a_bad_address_setting_fails_at_startup(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(f"slack={SLACK_KEY}\n")
    env = {
        "BATON_DEPLOYMENT_ID": "dep-a",
        "BATON_API_KEYS_FILE": str(keys),
        "BATON_PLAINTEXT": "1",
    }
    config = IngressConfig.load(["--hooks", "127.0.0.1:1,127.0.0.1:2"], env)
    assert config.hooks == "127.0.0.1:1,127.0.0.1:2"
    with pytest.raises(ConfigError, match="dns:///"):
        IngressConfig.load(["--hooks", "hooks-0:1,hooks-1:1"], env)


def test_only_idempotent_methods_are_retried() -> None:
    config = json.loads(service_config("baton.hooks.v1.HookRegistryService", HOOKS_IDEMPOTENT))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert "healthCheckConfig" not in config
    (method_config,) = config["methodConfig"]
    retried = {name["method"] for name in method_config["name"]}
    assert retried == set(HOOKS_IDEMPOTENT)
    assert "RegisterInstance" not in retried
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


def count_calls(server: GrpcServer, room: str, method: str, counts: Counter[int]) -> None:
    """Count calls of `method` of the hooks `room` on `server` under its port."""
    rooms = server.app
    assert isinstance(rooms, HookRooms)
    domain = getattr(rooms, room)
    original: Callable[..., Awaitable[Any]] = getattr(domain, method)

    async def counted(*args: Any, **kwargs: Any) -> Any:
        counts[server.port] += 1
        return await original(*args, **kwargs)

    setattr(domain, method, counted)


@pytest.fixture
async def replicas(stack: Stack) -> AsyncIterator[list[GrpcServer]]:
    """The stack's hooks and a second replica over the same etcd."""
    second = await create_hooks(hooks_config(stack.etcd, stack.pki))
    await second.start()
    stack.extra.append(second)
    yield [stack.hooks, second]


async def test_calls_are_spread_over_replicas_and_leave_one_shutting_down(
    stack: Stack, replicas: list[GrpcServer]
) -> None:
    counts: Counter[int] = Counter()
    for server in replicas:
        count_calls(server, "tokens", "lookup", counts)
    session_id = await stack.create()
    client = HooksClient(",".join(stack.addr(r) for r in replicas), security=stack.owner_security())
    try:
        for _ in range(20):
            await client.lookup(ids.inbox_token(session_id))
        # Round-robin once both are connected (the first calls may all go to
        # the replica that connected first).
        assert counts[replicas[0].port] >= 5 and counts[replicas[1].port] >= 5, counts
        # A replica shutting down (SIGTERM: a grace period of draining) takes
        # no new call; they all go to the other one, and none fails.
        stopping = asyncio.create_task(replicas[1].stop(grace=2))
        await asyncio.sleep(0.2)
        counts.clear()
        for _ in range(20):
            await client.lookup(ids.inbox_token(session_id))
        assert counts == {replicas[0].port: 20}
        await stopping
        stack.extra.remove(replicas[1])
    finally:
        await client.close()


async def test_no_healthy_backend_never_hides_the_store_s_own_answer(
    stack: Stack, replicas: list[GrpcServer]
) -> None:
    """Replicas whose health says NOT_SERVING (their etcd is full or gone,
    as StoreHealth reports) still get the call, so the caller learns why."""
    for server in replicas:
        await server.set_serving(False)
    client = HooksClient(",".join(stack.addr(r) for r in replicas), security=stack.owner_security())
    try:
        with pytest.raises(NotFound):
            await client.lookup(ids.inbox_token(ids.new_session_id()))
    finally:
        await client.close()


async def test_idempotent_calls_are_retried_on_another_replica(stack: Stack) -> None:
    """A replica without etcd answers UNAVAILABLE to everything: reads and
    delivery-id appends are retried on the good one and all succeed; a lease
    grant (not idempotent) is not retried, so some fail."""
    nowhere = EtcdConfig(
        endpoint=f"127.0.0.1:{free_port()}",
        prefix=stack.etcd.prefix,
        timeout=1,
        security=stack.etcd.security,
    )
    broken = await create_hooks(hooks_config(nowhere, stack.pki))
    await broken.start()
    stack.extra.append(broken)
    counts: Counter[int] = Counter()
    count_calls(broken, "inbox", "append", counts)
    count_calls(broken, "tokens", "parent_of", counts)  # an owner's delivery is checked first
    session_id = await stack.create()
    token = ids.inbox_token(session_id)
    client = HooksClient(
        f"{stack.addr(stack.hooks)},{stack.addr(broken)}", security=stack.owner_security()
    )
    try:
        seqs = []
        for i in range(12):
            command = s.Command(send=s.SendCommand(text=f"m{i}", turn_policy=s.TURN_POLICY_QUEUE))
            receipt = await client.append(token, command)
            assert not receipt.duplicate
            seqs.append(receipt.seq)
            await client.lookup(token)
        assert seqs == list(range(12))
        assert counts[broken.port] > 0, "the broken replica was never tried"
        outcomes = Counter()
        for i in range(12):
            try:
                await client.register_instance(stack.deployment_id, f"probe-{i}", 5, "x:1")
                outcomes["ok"] += 1
            except Unavailable:
                outcomes["unavailable"] += 1
        assert outcomes["ok"] > 0 and outcomes["unavailable"] > 0, outcomes
        # Refusals are answers, not failures: never retried.
        with pytest.raises(NotFound):
            await client.lookup(ids.inbox_token(ids.new_session_id()))
    finally:
        await client.close()
