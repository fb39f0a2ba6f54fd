"""The storage protocol itself (services/common/etcd/txn.py), on the suite's real
etcd over TLS as the hooks user: named reads on either branch, `read_each`,
named delete counts, the range compare an adoption relies on, and the one
fence check every owner write goes through."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import Fenced, NotFound, PermissionDenied, Reason
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import Keys, OwnerRecord, prefix_end
from baton_runtime.common.etcd.ops import cmp_absent, cmp_none, cmp_value
from baton_runtime.common.etcd.scope import (
    DeploymentScope,
    check_record,
    owner_record_start,
    scope_compares,
)
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Fence, Txn
from baton_runtime.common.security.identity import Caller, Role
from tests import certs


@pytest.fixture
async def store(etcd_endpoint: str) -> AsyncIterator[Store]:
    client = make_client(etcd_endpoint, 5, certs.etcd_security())
    store = Store(client, 5)
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


def root() -> bytes:
    return f"{certs.TEST_PREFIX}txn/{uuid.uuid4().hex}/".encode()


async def test_named_reads_follow_the_branch_that_ran(store: Store) -> None:
    k = root()
    first = await (
        Txn()
        .require(cmp_absent(k + b"a"))
        .put(k + b"a", b"1")
        .put(k + b"b", b"2")
        .read("after", k + b"a")
        .read_on_failure("was", k + b"a")
        .run(store)
    )
    assert first.succeeded and first.value("after") == b"1"
    again = await (
        Txn()
        .require(cmp_absent(k + b"a"))
        .put(k + b"a", b"overwritten")
        .read_on_failure("was", k + b"a")
        .read_on_failure("all", k, prefix_end(k), keys_only=True, limit=1)
        .run(store)
    )
    assert not again.succeeded
    assert again.value("was") == b"1", "the failure branch's read, by its name"
    assert [kv.key for kv in again.kvs("all")] == [k + b"a"] and again.more("all")
    assert again.revision == first.revision, "a refused transaction writes nothing"
    # read_each: several keys under one name, in order, absent ones as None.
    each = await Txn().read_each("values", [k + b"b", k + b"nothing", k + b"a"]).run(store)
    assert each.values("values") == [b"2", None, b"1"]


async def test_a_named_delete_reports_how_many_keys_it_removed(store: Store) -> None:
    k = root()
    for i in range(5):
        await Txn().put(k + f"e/{i:04d}".encode(), b"x").run(store)
    low, high = k + b"e/0001", k + b"e/0004"
    result = await Txn().delete(low, high, name="entries").delete(k + b"e/0000").run(store)
    assert result.deleted("entries") == 3
    left = await Txn().read("left", k, prefix_end(k)).run(store)
    assert [kv.key for kv in left.kvs("left")] == [k + b"e/0004"]


async def test_the_empty_range_compare_holds_only_while_no_key_is_in_the_range(
    store: Store,
) -> None:
    """What an adoption compares: no live instance key under a deployment's
    prefix. A key just outside the range does not count; one inside does."""
    k = root()
    fleet = k + b"d/dep-old/"
    await Txn().put(k + b"d/dep-older", b"elsewhere").run(store)
    empty = await Txn().require(cmp_none(fleet, prefix_end(fleet))).run(store)
    assert empty.succeeded
    await Txn().put(fleet + b"i1", b"live").run(store)
    live = await Txn().require(cmp_none(fleet, prefix_end(fleet))).run(store)
    assert not live.succeeded


async def test_the_fence_compare_and_its_one_check(store: Store) -> None:
    k = root().decode()
    keys = Keys(k)
    sid = "ses_" + "f" * 26
    mine = Fence(sid, "run_a", 3)
    assert Fence.of(mine.proto()) == mine
    with pytest.raises(NotFound) as missing:
        mine.check(None)
    assert missing.value.reason == Reason.SESSION_NOT_FOUND
    await Txn().put(keys.fence(sid), mine.value).run(store)
    held = await Txn().require(mine.compare(keys)).put(keys.snapshot(sid), b"s").run(store)
    assert held.succeeded and mine.holds(mine.value)
    newer = Fence(sid, "run_b", 4)
    await Txn().put(keys.fence(sid), newer.value).run(store)
    stale = (
        await Txn()
        .require(mine.compare(keys))
        .put(keys.snapshot(sid), b"late")
        .read_on_failure("fence", keys.fence(sid))
        .run(store)
    )
    assert not stale.succeeded
    with pytest.raises(Fenced):
        mine.check(stale.value("fence"))
    newer.check(stale.value("fence"))  # the current run passes the same check
    snapshot = await Txn().read("snapshot", keys.snapshot(sid)).run(store)
    assert snapshot.value("snapshot") == b"s", "the stale run's write did not land"
    assert cmp_value(keys.fence(sid), newer.value).value == newer.value
    assert isinstance(mine.proto(), s.Fence)


@pytest.mark.parametrize(
    ("deployment", "epoch", "holds"),
    [
        ("dep-a", 7, True),
        ("dep-b", 7, False),  # another deployment
        ("dep", 7, False),  # a prefix of the record's deployment
        ("dep-a.1", 7, False),  # the record's deployment is a prefix of it
        ("dep-a", 1, False),  # a prefix of the record's epoch
        ("dep-a", 70, False),
        ("dep-a", 8, False),
    ],
)
async def test_the_scope_compares_hold_exactly_for_the_records_deployment_at_its_epoch(
    store: Store, deployment: str, epoch: int, holds: bool
) -> None:
    """Anchor checks an owner's deployment inside its commit's txn
    (services/common/etcd/scope.py): two value compares on the owner record's
    canonical bytes, true exactly when the record names that deployment at
    that epoch; a missing record fails them; a refusal reads the record and
    says PERMISSION_DENIED only for another deployment."""
    keys = Keys(root().decode())
    sid = "ses_scope"
    record = OwnerRecord("run_x", "dep-a", "dep-a-i1", 7, parked=True)
    assert record.encode().startswith(owner_record_start("dep-a", 7))
    await Txn().put(keys.owner(sid), record.encode()).run(store)

    async def compared(session_id: str) -> bool:
        result = (
            await Txn().require(*scope_compares(keys, session_id, epoch, deployment)).run(store)
        )
        return result.succeeded

    assert await compared(sid) is holds
    assert await compared("ses_missing") is False
    if holds:
        check_record(deployment, sid, epoch, record.encode())
    elif epoch == 7:
        with pytest.raises(PermissionDenied) as denied:
            check_record(deployment, sid, epoch, record.encode())
        assert denied.value.reason == Reason.DEPLOYMENT_NOT_ALLOWED


async def test_only_a_fences_first_write_carries_the_scope_compares(store: Store) -> None:
    """`DeploymentScope.in_txn`: an unknown fence asks the write to compare
    the caller's deployment; once a write confirmed it, the next write of
    that fence compares nothing, and another deployment's owner is refused
    from the cache; plaintext and non-owner callers are never scoped."""
    scope = DeploymentScope(store, Keys(root().decode()))
    sid = ids.new_session_id()
    fence = s.Fence(session_id=sid, owner_run_id="run_x", epoch=3)
    owner_a = Caller(role=Role.OWNER, deployment_id="dep-a")
    owner_b = Caller(role=Role.OWNER, deployment_id="dep-b")
    assert scope.in_txn(owner_a, fence) == "dep-a"
    assert scope.in_txn(owner_b, fence) == "dep-b"  # unknown: its own write will fail
    check = scope.pending(owner_a, fence)
    assert check is not None
    check.passed(fence.session_id, fence.epoch, fence.owner_run_id)  # a commit passed the compares
    assert scope.in_txn(owner_a, fence) is None
    with pytest.raises(PermissionDenied) as denied:
        scope.in_txn(owner_b, fence)
    assert denied.value.reason == Reason.DEPLOYMENT_NOT_ALLOWED
    later = s.Fence(session_id=sid, owner_run_id="run_y", epoch=4)
    assert scope.in_txn(owner_a, later) == "dep-a"  # a new fence is checked again
    assert scope.in_txn(Caller.UNVERIFIED, fence) is None
    assert scope.in_txn(Caller(role=Role.OPERATOR), later) is None
