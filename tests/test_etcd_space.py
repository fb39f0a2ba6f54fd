"""etcd's space under a busy session (docs/design.md §4; docs/storage.md "etcd space").

- Many senders to one session: etcd (auto-compacting, as every etcd Baton
  starts) keeps its database within a small multiple of the live data,
  because commits append and never rewrite the history.
- A NOSPACE alarm (a small quota, filled on purpose): hooks and anchor say
  NOT_SERVING with a reason, sends fail fast with RESOURCE_EXHAUSTED /
  STORE_FULL instead of being retried forever, and after the documented
  operator steps (free space, compact, defragment, disarm) service resumes by
  itself and every accepted command is processed exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aetcd
import grpc
import pytest
from aetcd import rpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.common.clients.channels import open_channel
from baton_runtime.common.rpc.status_map import error_reason
from baton_runtime.ingress.rates import ChannelLimits
from tests import certs
from tests.certs import etcd_root_client, start_etcd
from tests.procs import check_history, eventually
from tests.stack import Stack, start_stack, stop_stack

K = s.EventKind


@pytest.fixture
def compacting_etcd(request: pytest.FixtureRequest) -> Iterator[EtcdProcess]:
    """An etcd that compacts every 2 s; with the `small_quota` marker, a
    48 MiB quota (etcd's default, 2 GiB, otherwise)."""
    quota = 48 * 1024 * 1024 if request.node.get_closest_marker("small_quota") else 0
    server = start_etcd(compaction_retention="2s", quota_bytes=quota)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def raw(compacting_etcd: EtcdProcess) -> AsyncIterator[aetcd.Client]:
    client = await etcd_root_client(
        compacting_etcd.endpoint, timeout=30, max_receive_bytes=512 * 1024 * 1024
    )
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def busy(compacting_etcd: EtcdProcess) -> AsyncIterator[Stack]:
    # A load test: no per-channel send limit.
    stack = await start_stack(compacting_etcd.endpoint, limits=ChannelLimits(sends_per_second=0))
    try:
        yield stack
    finally:
        await stop_stack(stack)


async def db_sizes(raw: aetcd.Client) -> tuple[int, int]:
    status = await raw.maintenancestub.Status(rpc.StatusRequest(), timeout=10)
    return status.dbSize, status.dbSizeInUse


async def live_bytes(raw: aetcd.Client) -> int:
    kvs = await raw.get_prefix(b"/")
    return sum(len(kv.key) + len(kv.value) for kv in kvs)


async def all_events(stack: Stack, session_id: str) -> list[s.Event]:
    return await stack.events(session_id, follow=False, timeout=300)


async def drive(stack: Stack, session_id: str, senders: int, each: int) -> list[int]:
    """`senders` concurrent senders, `each` messages each; the receipts' seqs."""
    receipts: list[int] = []

    async def sender(n: int) -> None:
        for i in range(each):
            response = await stack.send(session_id, f"s{n} m{i} " + "p" * 200)
            receipts.append(response.receipt.seq)

    await asyncio.gather(*(sender(n) for n in range(senders)))
    return receipts


async def processed(stack: Stack, session_id: str, count: int) -> list[s.Event]:
    """Every one of the first `count` inbox entries consumed and the session
    waiting; then its whole stream."""
    anchor = stack.anchor_client(timeout=10)

    async def done() -> bool:
        snapshot = await anchor.snapshot(session_id)
        return snapshot.inbox_next_seq >= count and not snapshot.HasField("open_turn")

    try:
        await eventually(done, f"{count} messages processed", 900)
    finally:
        await anchor.close()
    return await all_events(stack, session_id)


async def one_busy_session(
    stack: Stack, raw: aetcd.Client, senders: int, each: int, more: int
) -> None:
    sid = await stack.create()
    receipts = await drive(stack, sid, senders, each)
    await processed(stack, sid, len(receipts))
    receipts += await drive(stack, sid, 1, more)
    events = await processed(stack, sid, len(receipts))
    check_history(events, receipts)
    await asyncio.sleep(2.5)  # one more compaction period
    total, in_use = await db_sizes(raw)
    live = await live_bytes(raw)
    print(
        f"{len(receipts)} messages, {len(events)} events: etcd db {total / 1e6:.1f} MB "
        f"({in_use / 1e6:.1f} MB in use) for {live / 1e6:.1f} MB of live keys"
    )
    assert in_use <= 4 * live + 8 * 1024 * 1024, "etcd keeps far more than the live data"


async def test_one_busy_session_keeps_etcd_near_its_live_data(
    busy: Stack, raw: aetcd.Client
) -> None:
    await one_busy_session(busy, raw, senders=16, each=60, more=1000)


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_one_busy_session_keeps_etcd_near_its_live_data_slow(
    busy: Stack, raw: aetcd.Client
) -> None:
    await one_busy_session(busy, raw, senders=16, each=1000, more=20000)


async def health(address: str, service: str = "") -> int:
    async with open_channel(address, certs.operator()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return response.status


@pytest.mark.small_quota
async def test_a_nospace_alarm_is_reported_fails_fast_and_is_survived(
    busy: Stack, raw: aetcd.Client
) -> None:
    sid = await busy.create()
    receipts = [(await busy.send(sid, f"before {i}")).receipt.seq for i in range(3)]
    await processed(busy, sid, 3)
    # Fill etcd to its quota with someone else's data.
    filler = b"x" * (512 * 1024)
    written = 0
    with pytest.raises(aetcd.ClientError):
        while True:
            await raw.put(f"/filler/{written:06d}".encode(), filler)
            written += 1
    alarms = [alarm async for alarm in raw.list_alarms()]
    assert any(a.alarm_type == rpc.NOSPACE for a in alarms), alarms
    addresses = [busy.addr(busy.hooks), busy.addr(busy.anchor)]
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def both_down() -> bool:
        return all([await health(a) == not_serving for a in addresses])

    await eventually(both_down, "hooks and anchor NOT_SERVING", 15)
    # A send fails fast with a clear status: nothing is accepted, nothing lost.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await busy.send(sid, "while full")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_reason(refused.value) == "STORE_FULL"
    # The operator: free space, compact, defragment, disarm (docs/storage.md).
    await raw.delete_prefix(b"/filler/")
    status = await raw.maintenancestub.Status(rpc.StatusRequest(), timeout=10)
    revision = status.header.revision
    await raw.compact(revision, physical=True)
    await raw.defragment()
    for alarm in alarms:  # as `etcdctl alarm disarm` does: each member's alarm
        await raw.disarm_alarm(alarm.member_id)
    serving = health_pb2.HealthCheckResponse.SERVING

    async def both_up() -> bool:
        return all([await health(a) == serving for a in addresses])

    await eventually(both_up, "hooks and anchor SERVING again", 15)
    receipts += [(await busy.send(sid, f"after {i}")).receipt.seq for i in range(3)]
    events = await processed(busy, sid, len(receipts))
    check_history(events, receipts)
    answers = [e.text for e in events if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED]
    assert answers[-1] == "echo: after 2"


async def test_health_follows_the_store_through_an_etcd_restart(tmp_path: Path) -> None:
    """hooks and anchor say NOT_SERVING once etcd has been unreachable for a
    while, and SERVING again when it is back (docs/design.md §8, issue 9)."""
    data_dir = tmp_path / "etcd"
    data_dir.mkdir()
    etcd = start_etcd(data_dir=str(data_dir))
    stack = await start_stack(etcd.endpoint)
    try:
        addresses = [stack.addr(stack.hooks), stack.addr(stack.anchor)]
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert [await health(a) for a in addresses] == [serving, serving]
        etcd.stop()

        async def both(status: int) -> bool:
            return all([await health(a) == status for a in addresses])

        await eventually(lambda: both(not_serving), "NOT_SERVING while etcd is down", 20)
        etcd = start_etcd(
            client_port=etcd.client_port, peer_port=etcd.peer_port, data_dir=str(data_dir)
        )
        await eventually(lambda: both(serving), "SERVING once etcd is back", 20)
        sid = await stack.create()
        assert (await stack.send(sid, "hello")).receipt.seq == 0
    finally:
        await stop_stack(stack)
        etcd.stop()
