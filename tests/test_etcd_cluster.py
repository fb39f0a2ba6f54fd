"""The etcd client over a real three-member cluster: it takes every member's
endpoint, balances over them, and fails over when one dies.

A writer keeps putting keys while the leader is killed (-9), restarted, and
then another member is killed: every write lands exactly once (a write whose
outcome was lost with its member is retried behind an absence compare), and
a follower watching the prefix sees every key once, in order, across both
failures (its watch resumes on a live member from the last revision it
delivered).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from baton_runtime.cli.system.etcd_process import EtcdCluster
from baton_runtime.common.errors import Unavailable
from baton_runtime.common.etcd.client import etcd_target, make_client
from baton_runtime.common.etcd.keys import prefix_end
from baton_runtime.common.etcd.ops import cmp_absent, op_get, op_put
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.watch import follow_range
from tests import certs
from tests.procs import eventually


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    running = certs.start_etcd_cluster(3)
    try:
        yield running
    finally:
        running.stop()


def test_several_endpoints_make_one_balanced_target() -> None:
    assert etcd_target("127.0.0.1:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert etcd_target("http://localhost:1, http://127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert etcd_target("localhost:2379") == "127.0.0.1:2379"
    assert etcd_target("dns:///etcd.baton.svc:2379") == "dns:///etcd.baton.svc:2379"
    with pytest.raises(ValueError, match="dns:///"):
        etcd_target("etcd-0:2379,etcd-1:2379")


async def put_once(store: Store, key: bytes, value: bytes) -> int:
    """Put `key` if absent, retrying while etcd is unavailable; the absence
    compare makes a retry of a write that did land a no-op. Returns the
    number of failed attempts."""
    failures = 0
    while True:
        try:
            await store.txn([cmp_absent(key)], [op_put(key, value)], [op_get(key)])
            return failures
        except Unavailable:
            failures += 1
            await asyncio.sleep(0.05)


async def test_the_client_fails_over_when_members_die(cluster: EtcdCluster) -> None:
    # TLS to every member, as the hooks etcd user (auth is on).
    store = Store(make_client(cluster.endpoint, 2, certs.etcd_security()), 2)
    await store.connect()
    prefix = f"{certs.TEST_PREFIX}cluster/{uuid.uuid4().hex}/".encode()
    seen: list[bytes] = []

    async def follow() -> None:
        # The writer may already have written when this reads: what the read
        # returns counts as seen, the watch follows from its revision.
        read = await store.txn([], [op_get(prefix, prefix_end(prefix), keys_only=True)])
        seen.extend(kv.key for kv in read.responses[0].response_range.kvs)
        async for event in follow_range(store.client, prefix, read.header.revision + 1):
            seen.append(event.kv.key)

    follower = asyncio.create_task(follow())
    written: list[bytes] = []
    failures = 0

    async def write(count: int) -> None:
        nonlocal failures
        for _ in range(count):
            key = prefix + f"{len(written):06d}".encode()
            failures += await put_once(store, key, b"v")
            written.append(key)

    try:
        await write(100)
        leader = cluster.leader()
        cluster.members[leader].kill()
        await write(150)
        cluster.restart(leader)
        await write(100)
        # Now lose a member other than the one that came back.
        other = next(i for i in range(3) if i != leader)
        cluster.members[other].kill()
        await write(150)

        async def caught_up() -> bool:
            return len(seen) >= len(written)

        await eventually(caught_up, "the follower to see every write", timeout=30)
        assert seen == written, "the follower missed, repeated or reordered a key"
        # The restarted member serves reads of everything written meanwhile.
        alone = Store(make_client(cluster.members[leader].endpoint, 2, certs.etcd_security()), 2)
        await alone.connect()
        try:
            response = await alone.txn([], [op_get(prefix, prefix_end(prefix), keys_only=True)])
            assert [kv.key for kv in response.responses[0].response_range.kvs] == written
        finally:
            await alone.close()
        print(f"{len(written)} writes, {failures} failed attempts retried across two failures")
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await store.close()
