"""Group commit on a real etcd (services/common/etcd/group_commit.py, design
§10): writes issued together ride one request as nested transactions, and
each member ends exactly as it would have alone."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from aetcd import rpc

from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.common.errors import Unavailable
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.group_commit import GroupCommit, overlap, spans
from baton_runtime.common.etcd.keys import prefix_end
from baton_runtime.common.etcd.ops import (
    cmp_absent,
    cmp_none,
    cmp_value,
    op_get,
    op_put,
    single_value,
)
from baton_runtime.common.etcd.store import Store
from tests.procs import eventually


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdProcess]:
    server = EtcdProcess().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def store(etcd: EtcdProcess) -> AsyncIterator[Store]:
    opened = Store(make_client(etcd.endpoint, 10), 10)
    await opened.connect()
    try:
        yield opened
    finally:
        await opened.close()


class Recorded:
    """A GroupCommit over the store's raw write, keeping every request sent;
    the first request is held until `release` so the next writes queue."""

    def __init__(self, store: Store, max_bytes: int = 1 << 20, wait_limit: float = 10) -> None:
        self.store = store
        self.sent: list[rpc.TxnRequest] = []
        self.release = asyncio.Event()
        self.group = GroupCommit(self._send, 1, max_bytes=max_bytes, wait_limit=wait_limit)

    async def _send(self, request: rpc.TxnRequest) -> rpc.TxnResponse:
        self.sent.append(request)
        if len(self.sent) == 1:
            await self.release.wait()
        return await self.store.client.kvstub.Txn(request, timeout=10)

    def members(self) -> list[int]:
        """How many transactions each request carried."""
        return [
            len(r.success) if r.success and r.success[0].request_txn.ByteSize() else 1
            for r in self.sent
        ]


def keys() -> bytes:
    return f"/gc/{uuid.uuid4().hex}/".encode()


async def queued(rec: Recorded, count: int) -> None:
    """Until `count` writes wait behind the held request."""

    async def waiting() -> bool:
        return len(rec.group._waiting) >= count  # noqa: SLF001 (the queue is the subject)

    await eventually(waiting, f"{count} writes queued", timeout=10)


async def held_then_batched(rec: Recorded, txns: list[rpc.TxnRequest]) -> list[rpc.TxnResponse]:
    """The first write holds the one request slot; the rest queue behind it
    and go when it returns."""
    tasks = [asyncio.ensure_future(rec.group.txn(t)) for t in txns]
    await queued(rec, len(txns) - 1)
    rec.release.set()
    return list(await asyncio.gather(*tasks))


async def test_writes_issued_together_ride_one_request_and_each_gets_its_own_answer(
    store: Store,
) -> None:
    root = keys()
    txns = [
        rpc.TxnRequest(compare=[cmp_absent(key)], success=[op_put(key, b"v")])
        for key in (root + b"%d" % i for i in range(12))
    ]
    answers = await held_then_batched(Recorded(store), txns)
    assert all(a.succeeded for a in answers)
    rec_members = [len(a.responses) for a in answers]
    assert rec_members == [1] * 12
    # The 11 queued writes went as one request, in one revision.
    revisions = {a.header.revision for a in answers[1:]}
    assert len(revisions) == 1 and answers[0].header.revision < revisions.pop()
    got = await store.txn([], [op_get(root, prefix_end(root))])
    assert len(got.responses[0].response_range.kvs) == 12


async def test_one_members_failed_compare_takes_its_own_branch_and_no_other(store: Store) -> None:
    root = keys()
    rec = Recorded(store)
    await store.txn([], [op_put(root + b"taken", b"someone")])
    first = rpc.TxnRequest(success=[op_put(root + b"first", b"1")])
    refused = rpc.TxnRequest(
        compare=[cmp_absent(root + b"taken")],
        success=[op_put(root + b"taken", b"me")],
        failure=[op_get(root + b"taken")],
    )
    others = [rpc.TxnRequest(success=[op_put(root + b"o%d" % i, b"x")]) for i in range(3)]
    answers = await held_then_batched(rec, [first, refused, *others])
    assert rec.members() == [1, 4]
    assert not answers[1].succeeded
    assert single_value(answers[1].responses[0]) == b"someone"
    assert all(a.succeeded for a in answers[2:])
    for i in range(3):
        got = await store.txn([], [op_get(root + b"o%d" % i)])
        assert single_value(got.responses[0]) == b"x"


async def test_writes_on_the_same_keys_never_share_a_request_and_keep_their_order(
    store: Store,
) -> None:
    """A compare sees only the state before its request: the second write on
    a key must come in a later request, after the first, to see it."""
    root = keys()
    rec = Recorded(store)
    hold = rpc.TxnRequest(success=[op_put(root + b"hold", b"h")])
    one = rpc.TxnRequest(success=[op_put(root + b"k", b"1")])
    two = rpc.TxnRequest(
        compare=[cmp_value(root + b"k", b"1")], success=[op_put(root + b"k", b"2")]
    )
    apart = rpc.TxnRequest(success=[op_put(root + b"apart", b"a")])
    # (`apart` may ride with `one`; `two` waits for a request of its own.)
    answers = await held_then_batched(rec, [hold, one, two, apart])
    assert [a.succeeded for a in answers] == [True, True, True, True]
    assert rec.members() == [1, 2, 1]
    got = await store.txn([], [op_get(root + b"k")])
    assert single_value(got.responses[0]) == b"2"


async def test_a_compare_over_a_range_never_shares_a_request_with_a_write_inside_it(
    store: Store,
) -> None:
    """A write under a prefix, then a write whose compare says the prefix is
    empty: in the order issued the second must fail, so they never share a
    request (where its compare would see the state before the first)."""
    root = keys()
    rec = Recorded(store)
    hold = rpc.TxnRequest(success=[op_put(root + b"hold", b"h")])
    inside = rpc.TxnRequest(success=[op_put(root + b"r/a", b"1")])
    empty = rpc.TxnRequest(
        compare=[cmp_none(root + b"r/", prefix_end(root + b"r/"))],
        success=[op_put(root + b"claimed", b"1")],
    )
    answers = await held_then_batched(rec, [hold, inside, empty])
    assert rec.members() == [1, 1, 1]
    assert [a.succeeded for a in answers] == [True, True, False]


async def test_a_request_refused_for_its_shape_is_split_and_the_members_go_alone(
    store: Store,
) -> None:
    """etcd refuses a request of over 1.5 MiB (--max-request-bytes) as a
    whole and applies nothing: with the group's own byte bound lifted, three
    writes that fit alone but not together are grouped, refused, and each sent
    again alone, and all three land."""
    root = keys()
    rec = Recorded(store, max_bytes=8 << 20)
    hold = rpc.TxnRequest(success=[op_put(root + b"hold", b"h")])
    sizes = (1 << 20, 400 << 10, 400 << 10)
    parts = [
        rpc.TxnRequest(success=[op_put(root + b"p%d" % i, b"x" * n)]) for i, n in enumerate(sizes)
    ]
    answers = await held_then_batched(rec, [hold, *parts])
    assert rec.members() == [1, 3, 1, 1, 1]
    assert all(a.succeeded for a in answers)
    for i, n in enumerate(sizes):
        got = await store.txn([], [op_get(root + b"p%d" % i)])
        assert len(single_value(got.responses[0]) or b"") == n


async def test_a_caller_that_leaves_before_its_request_is_sent_writes_nothing(
    store: Store,
) -> None:
    root = keys()
    rec = Recorded(store)
    hold = asyncio.ensure_future(rec.group.txn(rpc.TxnRequest(success=[op_put(root + b"h", b"h")])))
    await asyncio.sleep(0.05)
    left = asyncio.ensure_future(rec.group.txn(rpc.TxnRequest(success=[op_put(root + b"l", b"l")])))
    await asyncio.sleep(0.05)
    left.cancel()
    rec.release.set()
    await hold
    with pytest.raises(asyncio.CancelledError):
        await left
    await asyncio.sleep(0.1)
    assert len(rec.sent) == 1
    got = await store.txn([], [op_get(root + b"l")])
    assert single_value(got.responses[0]) is None


async def test_a_write_that_waits_unsent_past_its_limit_fails_and_writes_nothing(
    store: Store,
) -> None:
    """Behind a request that does not return, a waiting write fails after the
    store's timeout as its own request would have, and is never sent."""
    root = keys()
    rec = Recorded(store, wait_limit=0.3)
    hold = asyncio.ensure_future(rec.group.txn(rpc.TxnRequest(success=[op_put(root + b"h", b"h")])))
    await asyncio.sleep(0.05)
    with pytest.raises(TimeoutError):
        await rec.group.txn(rpc.TxnRequest(success=[op_put(root + b"late", b"l")]))
    rec.release.set()
    await hold
    await asyncio.sleep(0.1)
    assert len(rec.sent) == 1
    got = await store.txn([], [op_get(root + b"late")])
    assert single_value(got.responses[0]) is None


async def test_etcd_killed_under_a_grouped_request_fails_every_member_unavailable() -> None:
    """An outcome nobody knows: every member fails as its own request would
    have (STORE_UNAVAILABLE), and nothing waits forever."""
    server = EtcdProcess().start()
    grouped = Store(make_client(server.endpoint, 2), 2, group_commit=1)
    try:
        await grouped.connect()
        root = keys()
        await grouped.txn([], [op_put(root + b"warm", b"w")])
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        tasks = [
            asyncio.ensure_future(grouped.txn([], [op_put(root + b"%d" % i, b"v")]))
            for i in range(6)
        ]
        await asyncio.sleep(0.3)
        os.kill(server.proc.pid, signal.SIGKILL)
        os.kill(server.proc.pid, signal.SIGCONT)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        assert all(isinstance(r, Unavailable) for r in results), results
    finally:
        await grouped.close()
        server.stop()


def test_spans_and_overlap() -> None:
    txn = rpc.TxnRequest(
        compare=[cmp_absent(b"/a")],
        success=[
            op_put(b"/b", b""),
            rpc.RequestOp(request_txn=rpc.TxnRequest(success=[op_get(b"/c/", b"/c0")])),
        ],
        failure=[op_get(b"/d")],
    )
    assert spans(txn) == [(b"/a", b""), (b"/b", b""), (b"/c/", b"/c0"), (b"/d", b"")]
    assert overlap((b"/c/x", b""), (b"/c/", b"/c0"))
    assert not overlap((b"/c0", b""), (b"/c/", b"/c0"))
    assert overlap((b"/a", b""), (b"/a", b""))
    assert not overlap((b"/a", b""), (b"/a0", b""))
    assert overlap((b"/zzz", b""), (b"/m", b"\x00"))  # from /m to the end
    assert not overlap((b"/a", b""), (b"/m", b"\x00"))
