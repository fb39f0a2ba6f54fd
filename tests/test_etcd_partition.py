"""The etcd client when one member is partitioned from the other two (the
members dial each other through the fault layer, tests/netfaults.py;
issue 38's chaos run found this).

A member cut off from the quorum still accepts its clients' connections
and keeps their streams open. Without asking for a member that has a
leader, a watch it serves sees nothing more, with no error, for as long as
the partition lasts: every watch of a process rides one stream, so hooks'
inbox watches or anchor's event watches would stall whole until the
partition healed. Asked with etcd's `hasleader` metadata (clientv3's
WithRequireLeader), the member ends such streams once it has had no leader
for a few election timeouts, and refuses calls at once ("no leader"), so
the follower resumes, and the caller retries, on a member of the majority.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from baton_runtime.cli.system.etcd_process import EtcdCluster, EtcdProcess
from baton_runtime.common.errors import Unavailable
from baton_runtime.common.etcd.client import EtcdClient, make_client
from baton_runtime.common.etcd.ops import op_put
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.watch import follow_range
from tests import certs
from tests.netfaults import Network, Route
from tests.procs import eventually


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[Network, EtcdCluster]]:
    network = Network()
    running = await certs.start_etcd_cluster_behind(network, 3)
    try:
        yield network, running
    finally:
        await asyncio.to_thread(running.stop)
        await network.close()


async def a_follower(cluster: EtcdCluster) -> tuple[EtcdProcess, EtcdProcess]:
    """(a follower, the leader)."""
    leader = await asyncio.to_thread(cluster.leader, 30.0)
    return cluster.members[(leader + 1) % len(cluster.members)], cluster.members[leader]


def partition(network: Network, cluster: EtcdCluster, member: EtcdProcess) -> list[Route]:
    """Cut `member` off from every other member, both ways."""
    others = [m.name for m in cluster.members if m is not member]
    routes = [network.route(member.name, o) for o in others]
    routes += [network.route(o, member.name) for o in others]
    for route in routes:
        route.hold()
    return routes


async def test_a_watch_served_by_a_partitioned_member_resumes_on_the_majority(
    cluster: tuple[Network, EtcdCluster],
) -> None:
    network, etcd = cluster
    cut, other = await a_follower(etcd)
    # The client reaches the member to be cut and one of the majority; its
    # link to the latter is held until the watch stream is on the former.
    to_cut = await network.link("client", cut.name, cut.client_port)
    to_other = await network.link("client", other.name, other.client_port)
    network.route("client", other.name).hold()
    client: EtcdClient = make_client(
        f"127.0.0.1:{to_cut},127.0.0.1:{to_other}", 5.0, certs.etcd_security()
    )
    await client.connect()
    writer = Store(make_client(other.endpoint, 5.0, certs.etcd_security()), 5.0)
    await writer.connect()
    prefix = f"{certs.TEST_PREFIX}{uuid.uuid4().hex}/".encode()
    seen: list[bytes] = []
    got = asyncio.Event()

    async def follow() -> None:
        async for event in follow_range(client, prefix, 1):
            seen.append(event.kv.value)
            got.set()

    follower = asyncio.create_task(follow())
    routes: list[Route] = []
    try:
        await writer.txn([], [op_put(prefix + b"a", b"before")])
        await asyncio.wait_for(got.wait(), 30)
        assert seen == [b"before"]
        routes = partition(network, etcd, cut)
        network.route("client", other.name).heal()
        got.clear()
        await writer.txn([], [op_put(prefix + b"b", b"during")])
        # Still partitioned: the event can only come from the majority.
        await asyncio.wait_for(got.wait(), 30)
        assert seen == [b"before", b"during"]
    finally:
        network.heal(routes)
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await client.close()
        await writer.close()


async def test_a_partitioned_member_refuses_a_call_at_once(
    cluster: tuple[Network, EtcdCluster],
) -> None:
    """A call to the member cut off is refused ("no leader"), as soon as the
    member knows it has no leader, instead of waiting out etcd's request
    timeout: the caller retries on another member sooner."""
    network, etcd = cluster
    cut, _ = await a_follower(etcd)
    store = Store(make_client(cut.endpoint, 120.0, certs.etcd_security()), 120.0)
    await store.connect()
    routes = partition(network, etcd, cut)
    key = f"{certs.TEST_PREFIX}{uuid.uuid4().hex}".encode()
    answers: list[str] = []
    try:
        async with asyncio.timeout(60):
            while "etcdserver: no leader" not in answers:
                try:
                    await store.txn([], [op_put(key, b"x")])
                    answers.append("ok")
                except Unavailable as exc:
                    cause = exc.__cause__
                    assert isinstance(cause, grpc.aio.AioRpcError), repr(cause)
                    answers.append(cause.details() or "")
    except TimeoutError:
        pytest.fail(f"the partitioned member never refused for want of a leader: {answers}")
    finally:
        network.heal(routes)
        await store.close()


async def test_a_member_back_from_a_partition_does_not_unseat_the_leader(
    cluster: tuple[Network, EtcdCluster],
) -> None:
    """With pre-vote, a member cut off campaigns for nothing (a pre-vote no
    one answers), so its term stays: back, it follows the leader it left.
    Without, its term grew with every election timeout, and back it made
    the leader step down: an election, and no leader meanwhile, for
    nothing."""
    network, etcd = cluster
    cut, leader = await a_follower(etcd)
    term = (await asyncio.to_thread(leader.status))["raft_term"]

    async def leaderless() -> bool:
        return (await asyncio.to_thread(cut.status))["leader"] == "0"

    routes = partition(network, etcd, cut)
    try:
        await eventually(leaderless, f"{cut.name} to lose its leader", timeout=30)
        # Several election timeouts: each one, without pre-vote, an election.
        await asyncio.sleep(5)
    finally:
        network.heal(routes)

    async def following() -> dict[str, str] | None:
        status = await asyncio.to_thread(cut.status)
        return status if status["leader"] != "0" else None

    back = await eventually(following, f"{cut.name} to follow a leader again", timeout=30)
    now = await asyncio.to_thread(leader.status)
    assert (now["leader"], now["raft_term"]) == (back["leader"], term), (
        f"the leader changed or its term moved: {term} -> {now}"
    )
    assert now["leader"] == now["member_id"]
