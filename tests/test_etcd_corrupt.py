"""etcd's CORRUPT alarm is handled as NOSPACE is (tests/test_etcd_space.py):
raised on purpose (as etcd's corruption checks raise it when members' data
differ), hooks and anchor say NOT_SERVING with the reason STORE_CORRUPT, a
send fails fast with UNAVAILABLE / STORE_CORRUPT instead of hanging or
being retried forever (nothing is accepted), and once the operator has
disarmed the alarm service resumes by itself and every accepted message is
processed exactly once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import aetcd
import grpc
import pytest
import structlog
from aetcd import rpc
from grpc_health.v1 import health_pb2

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.common.errors import Reason, Unavailable
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.ops import op_put
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.rpc.status_map import error_reason
from baton_runtime.ingress.rates import ChannelLimits
from tests import certs
from tests.certs import etcd_root_client, start_etcd
from tests.procs import check_history, eventually
from tests.stack import Stack, start_stack, stop_stack
from tests.test_etcd_space import health, processed

K = s.EventKind


@pytest.fixture
def etcd() -> Iterator[EtcdProcess]:
    server = start_etcd()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def raw(etcd: EtcdProcess) -> AsyncIterator[aetcd.Client]:
    client = await etcd_root_client(etcd.endpoint, timeout=10)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def stack(etcd: EtcdProcess) -> AsyncIterator[Stack]:
    running = await start_stack(etcd.endpoint, limits=ChannelLimits(sends_per_second=0))
    try:
        yield running
    finally:
        await stop_stack(running)


async def corrupt_alarm(raw: aetcd.Client, action: int) -> list[rpc.AlarmMember]:
    """ACTIVATE or DEACTIVATE the CORRUPT alarm of the member `raw` talks to
    (as root: alarms are an operator's call)."""
    status = await raw.maintenancestub.Status(rpc.StatusRequest(), timeout=10)
    request = rpc.AlarmRequest(action=action, memberID=status.header.member_id, alarm=rpc.CORRUPT)
    response = await raw.maintenancestub.Alarm(request, timeout=10)
    return list(response.alarms)


async def test_a_corrupt_alarm_is_reported_fails_fast_and_is_survived(
    stack: Stack, raw: aetcd.Client
) -> None:
    sid = await stack.create()
    receipts = [(await stack.send(sid, f"before {i}")).receipt.seq for i in range(3)]
    await processed(stack, sid, 3)
    with structlog.testing.capture_logs() as logs:
        raised = await corrupt_alarm(raw, rpc.AlarmRequest.ACTIVATE)
        assert [a.alarm for a in raised] == [rpc.CORRUPT]
        addresses = [stack.addr(stack.hooks), stack.addr(stack.anchor)]
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

        async def both_down() -> bool:
            return all([await health(a) == not_serving for a in addresses])

        await eventually(both_down, "hooks and anchor NOT_SERVING", 15)
        # A send fails fast with a clear status: nothing is accepted, nothing lost.
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.send(sid, "while corrupt")
        assert time.monotonic() - started < 5, "the refusal was not fast"
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_reason(refused.value) == Reason.STORE_CORRUPT
        assert "CORRUPT alarm" in (refused.value.details() or "")
        # The operator: replace the bad member (docs/etcd.md), then disarm.
        await corrupt_alarm(raw, rpc.AlarmRequest.DEACTIVATE)
        serving = health_pb2.HealthCheckResponse.SERVING

        async def both_up() -> bool:
            return all([await health(a) == serving for a in addresses])

        await eventually(both_up, "hooks and anchor SERVING again", 15)
    # Logged once at the start and once at the end, by each of the two.
    down = [e for e in logs if e["event"].startswith("store unusable")]
    up = [e for e in logs if e["event"].startswith("store usable again")]
    assert all(e["reason"] == Reason.STORE_CORRUPT for e in down), down
    assert all(e["previous_reason"] == Reason.STORE_CORRUPT for e in up), up
    assert len(down) == 2 and len(up) == 2, logs
    receipts += [(await stack.send(sid, f"after {i}")).receipt.seq for i in range(3)]
    events = await processed(stack, sid, len(receipts))
    check_history(events, receipts)
    answers = [e.text for e in events if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED]
    assert answers[-1] == "echo: after 2"


async def test_etcds_corrupt_cluster_error_maps_to_store_corrupt(
    etcd: EtcdProcess, raw: aetcd.Client
) -> None:
    """The store's own mapping, under the servers: a write while the alarm
    is raised raises Unavailable / STORE_CORRUPT at once."""
    store = Store(make_client(etcd.endpoint, 5, certs.etcd_security()), 5)
    await store.connect()
    key = f"{certs.TEST_PREFIX}corrupt/key".encode()
    try:
        await corrupt_alarm(raw, rpc.AlarmRequest.ACTIVATE)
        with pytest.raises(Unavailable) as refused:
            await asyncio.wait_for(store.txn([], [op_put(key, b"v")]), 5)
        assert refused.value.reason == Reason.STORE_CORRUPT
        assert await store.alarms() == ["CORRUPT"]
        await corrupt_alarm(raw, rpc.AlarmRequest.DEACTIVATE)
        await store.txn([], [op_put(key, b"v")])
    finally:
        await store.close()
