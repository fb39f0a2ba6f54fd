"""Parking, bells, leases and takeover: hooks primitives and an owner that
parks idle sessions (docs/design.md §5).

The inbox append compares the owner record against a cached copy and rings
the owner instance's bell in the same txn while the record says parked; these
tests drive two hooks servers over the same etcd, so one of them always works
from a stale cache, and check that every arrival after a successful park
rings exactly once-or-more with the right head, and none before or after.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest
import structlog

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.owner.v1 import owner_pb2
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.answers import TakenOver
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import (
    Aborted,
    FailedPrecondition,
    Fenced,
    Internal,
    PermissionDenied,
)
from baton_runtime.common.etcd.keys import Keys, fence_value
from baton_runtime.common.rpc.server import GrpcServer
from baton_runtime.common.security.tls import Security
from baton_runtime.hooks.server import create_server as create_hooks
from baton_runtime.owner.config import OwnerConfig
from baton_runtime.owner.host.parking import ParkedSession, Parking
from baton_runtime.owner.server import create_server as create_owner
from tests import certs
from tests.procs import answered, check_history, eventually, inbox_entries_left
from tests.stack import Stack, hooks_config

K = s.EventKind


@pytest.fixture
async def two_hooks(stack: Stack) -> AsyncIterator[tuple[HooksClient, HooksClient]]:
    """Clients of the stack's hooks and of a second hooks server (own caches)."""
    second = await create_hooks(hooks_config(stack.etcd))
    await second.start()
    # Both act as an owner of dep-p, the deployment of `new_session`'s sessions.
    a = stack.hooks_client(certs.owner("dep-p"), timeout=5)
    b = HooksClient(f"127.0.0.1:{second.port}", timeout=5, security=certs.owner("dep-p"))
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()
        await second.stop(grace=0.2)


def command(text: str) -> s.Command:
    return s.Command(send=s.SendCommand(text=text))


async def new_session(
    hooks: HooksClient, instance_id: str, deployment_id: str = "dep-p"
) -> s.Fence:
    sid = ids.new_session_id()
    owner = s.OwnerIdentity(
        owner_run_id=ids.new_run_id(), deployment_id=deployment_id, instance_id=instance_id
    )
    created = await hooks.create_session(sid, owner, "slack", [])
    return created.fence


def successor(instance_id: str, deployment_id: str = "dep-p") -> s.OwnerIdentity:
    return s.OwnerIdentity(
        owner_run_id=ids.new_run_id(), deployment_id=deployment_id, instance_id=instance_id
    )


async def bell_value(etcd: aetcd.Client, keys: Keys, instance_id: str, sid: str) -> bytes | None:
    got = await etcd.get(keys.bell(instance_id, sid))
    return None if got is None else got.value


async def test_a_bell_rings_exactly_while_parked(
    stack: Stack, two_hooks: tuple[HooksClient, HooksClient], etcd: aetcd.Client
) -> None:
    a, b = two_hooks
    keys = Keys(stack.etcd.prefix)
    fence = await new_session(a, "inst-p")
    sid = fence.session_id
    inbox = ids.inbox_token(sid)
    await a.append(inbox, command("one"))  # a caches the unparked owner record
    with pytest.raises(Aborted) as refused:
        await b.set_parked(fence, True, 0)  # entry 0 is not consumed
    assert refused.value.reason == "INBOX_NOT_DRAINED"
    assert await b.set_parked(fence, True, 1) == 1
    assert await bell_value(etcd, keys, "inst-p", sid) is None  # nothing arrived since

    bells = a.watch_bells("inst-p")
    # a's cache still says unparked: its append must learn better and ring.
    assert (await a.append(inbox, command("two"))).seq == 1
    first = await asyncio.wait_for(anext(bells), 5)
    assert [(x.session_id, x.inbox_head) for x in first] == [(sid, 2)]
    await b.append(inbox, command("three"))
    second = await asyncio.wait_for(anext(bells), 5)
    assert [(x.session_id, x.inbox_head) for x in second] == [(sid, 3)]
    await bells.aclose()  # type: ignore[attr-defined]

    assert await a.set_parked(fence, False) == 3  # unpark deletes the bell
    assert await a.set_parked(fence, False) == 3  # a repeat is fine
    assert await bell_value(etcd, keys, "inst-p", sid) is None
    await b.append(inbox, command("four"))  # b's cache said parked: learns, no bell
    assert await bell_value(etcd, keys, "inst-p", sid) is None

    stale = s.Fence(session_id=sid, owner_run_id="run_other", epoch=fence.epoch)
    with pytest.raises(Fenced):
        await a.set_parked(stale, True, 4)


async def _page(
    hooks: HooksClient, instance_id: str, token: str, size: int
) -> hooks_pb.ListInstanceSessionsResponse:
    request = hooks_pb.ListInstanceSessionsRequest(
        deployment_id="dep-p", instance_id=instance_id, page_token=token, page_size=size
    )
    return await hooks.stub.ListInstanceSessions(request, timeout=5)


async def test_an_instance_listing_pages_through_its_sessions_exactly_once(
    stack: Stack, two_hooks: tuple[HooksClient, HooksClient]
) -> None:
    """25 sessions of one instance (2 of them parked with a bell rung) and 3
    of another, listed 10 index entries a page: every session once, in
    session id order, bells on the right page; a deployment-wide listing
    pages across both instances; the client's listing reads every page;
    bad pages are refused before anything is read."""
    a, b = two_hooks
    mine = [await new_session(a, "paged-1") for _ in range(25)]
    others = [await new_session(a, "paged-2") for _ in range(3)]
    for fence in mine[20:22]:
        await a.set_parked(fence, True, 0)
        await b.append(ids.inbox_token(fence.session_id), command("while parked"))
    pages, token = [], ""
    while True:
        page = await _page(a, "paged-1", token, 10)
        pages.append(page)
        if not page.next_page_token:
            break
        assert page.next_page_token > token
        token = page.next_page_token
    assert [len(p.sessions) for p in pages] == [10, 10, 5]
    listed = [o.fence.session_id for p in pages for o in p.sessions]
    assert listed == sorted(f.session_id for f in mine)
    waiting = {o.fence.session_id for p in pages for o in p.sessions if o.input_waiting}
    assert waiting == {f.session_id for f in mine[20:22]}
    assert {o.fence.session_id for o in await a.list_instance_sessions("dep-p", "paged-1")} == set(
        listed
    )
    every, token = [], ""
    while True:
        page = await _page(a, "", token, 4)
        every += [o.fence.session_id for o in page.sessions]
        if not page.next_page_token:
            break
        token = page.next_page_token
    ours = {f.session_id for f in mine + others}
    assert [sid for sid in every if sid in ours] == sorted(
        ours, key=lambda sid: ("paged-1" if sid in set(listed) else "paged-2", sid)
    )
    unpaged = await _page(a, "paged-1", "", 0)
    assert len(unpaged.sessions) == 25 and unpaged.next_page_token == ""
    for token, size in (
        ("", 1001),
        ("no-slash", 10),
        ("paged-2/" + mine[0].session_id, 10),  # another instance's token
        ("paged-1/not a session", 10),
        ("paged-1/" + "x" * 300, 10),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _page(a, "paged-1", token, size)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (token, size)


async def test_an_index_only_listing_reads_the_index_and_bells_not_the_owners(
    stack: Stack, two_hooks: tuple[HooksClient, HooksClient], etcd: aetcd.Client
) -> None:
    """The reconciliation's cheap listing (index_only): the same sessions in
    the same order and pages as the full listing, each fence as indexed and
    the bell as rung, `parked` unread; an index entry whose owner record
    moved on is listed as the index names it (the full listing drops it)."""
    a, b = two_hooks
    keys = Keys(stack.etcd.prefix)
    mine = [await new_session(a, "idx-1") for _ in range(7)]
    for fence in mine[2:4]:
        await a.set_parked(fence, True, 0)
    await b.append(ids.inbox_token(mine[3].session_id), command("while parked"))
    stale = mine[5]  # an index entry outliving its session's move (epoch 9 here)
    await etcd.put(keys.owned("dep-p", "idx-1", stale.session_id), fence_value(9, "moved-run"))

    def request(token: str, index_only: bool) -> hooks_pb.ListInstanceSessionsRequest:
        return hooks_pb.ListInstanceSessionsRequest(
            deployment_id="dep-p",
            instance_id="idx-1",
            page_token=token,
            page_size=3,
            index_only=index_only,
        )

    async def pages(index_only: bool) -> list[list[hooks_pb.OwnedSession]]:
        listed, token = [], ""
        while True:
            page = await a.stub.ListInstanceSessions(request(token, index_only), timeout=5)
            listed.append(list(page.sessions))
            if not page.next_page_token:
                return listed
            token = page.next_page_token

    full, cheap = await pages(False), await pages(True)
    assert [len(p) for p in cheap] == [3, 3, 1]
    order = sorted(f.session_id for f in mine)
    assert [o.fence.session_id for p in cheap for o in p] == order
    assert [o.fence.session_id for p in full for o in p] == [
        sid for sid in order if sid != stale.session_id
    ]
    by_sid = {o.fence.session_id: o for p in cheap for o in p}
    for fence in mine:
        listed = by_sid[fence.session_id]
        assert listed.owner.instance_id == "idx-1" and listed.owner.deployment_id == "dep-p"
        assert not listed.parked
        assert listed.input_waiting == (fence == mine[3])
        if fence != stale:
            assert listed.fence == fence
    assert by_sid[stale.session_id].fence.epoch == 9
    client = await a.list_instance_sessions("dep-p", "idx-1", index_only=True)
    assert [o.fence for o in client] == [by_sid[sid].fence for sid in order]


async def test_takeover_first_cas_wins_and_keeps_a_quiet_session_parked(
    stack: Stack, two_hooks: tuple[HooksClient, HooksClient], etcd: aetcd.Client
) -> None:
    a, b = two_hooks
    keys = Keys(stack.etcd.prefix)
    quiet = await new_session(a, "dead-1")
    await a.set_parked(quiet, True, 0)
    rung = await new_session(a, "dead-1")
    await a.set_parked(rung, True, 0)
    await b.append(ids.inbox_token(rung.session_id), command("while dead"))
    assert await bell_value(etcd, keys, "dead-1", rung.session_id) == b"1"

    listed = await a.list_instance_sessions("dep-p", "dead-1")
    assert {o.fence.session_id for o in listed} == {quiet.session_id, rung.session_id}
    assert all(o.parked for o in listed)
    # The listing reads the bells: a successor claims `rung` first.
    assert {o.fence.session_id for o in listed if o.input_waiting} == {rung.session_id}
    # Listing every instance of the deployment does not read bells.
    every = await a.list_instance_sessions("dep-p", "")
    assert not any(o.input_waiting for o in every if o.fence.session_id == rung.session_id)

    contenders = [successor("inst-a"), successor("inst-b")]
    results = await asyncio.gather(
        a.take_over_session(quiet, "dead-1", contenders[0]),
        b.take_over_session(quiet, "dead-1", contenders[1]),
        return_exceptions=True,
    )
    won = [r for r in results if isinstance(r, TakenOver)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(lost[0], Fenced)
    # On the wire too: FENCED is FAILED_PRECONDITION everywhere (docs/design.md §2).
    assert isinstance(lost[0].__cause__, grpc.aio.AioRpcError)
    assert lost[0].__cause__.code() == grpc.StatusCode.FAILED_PRECONDITION
    taken = won[0]
    winner = contenders[results.index(taken)]
    assert taken.fence.epoch == quiet.epoch + 1
    assert taken.fence.owner_run_id == winner.owner_run_id
    assert (taken.parked, taken.inbox_head) == (True, 0)
    replay = await b.take_over_session(quiet, "dead-1", winner)
    assert replay.fence == taken.fence
    # The old run is fenced; the index moved with the owner.
    with pytest.raises(Fenced):
        await a.set_parked(quiet, False)
    moved = await a.list_instance_sessions("dep-p", winner.instance_id)
    assert [(o.fence.session_id, o.parked) for o in moved] == [(quiet.session_id, True)]

    # Input arrived while its owner was dead: the successor must run it now.
    taken = await a.take_over_session(rung, "dead-1", successor("inst-a"))
    assert (taken.parked, taken.inbox_head) == (False, 1)
    assert await bell_value(etcd, keys, "dead-1", rung.session_id) is None
    assert await a.list_instance_sessions("dep-p", "dead-1") == []

    other_deployment = s.OwnerIdentity(
        owner_run_id=ids.new_run_id(), deployment_id="dep-q", instance_id="x"
    )
    # An owner of dep-p cannot name a successor of another deployment...
    with pytest.raises(PermissionDenied) as denied:
        await a.take_over_session(taken.fence, "inst-a", other_deployment)
    assert denied.value.reason == "DEPLOYMENT_NOT_ALLOWED"
    # ...and an owner of dep-q cannot take a session of dep-p.
    q = stack.hooks_client(certs.owner("dep-q"), timeout=5)
    try:
        with pytest.raises(FailedPrecondition) as wrong:
            await q.take_over_session(taken.fence, "inst-a", other_deployment)
        assert wrong.value.reason == "WRONG_DEPLOYMENT"
    finally:
        await q.close()


async def test_a_takeover_passes_on_a_parked_sessions_deadline(
    two_hooks: tuple[HooksClient, HooksClient],
) -> None:
    """The owner record keeps the lifetime deadline a park recorded: every
    takeover that keeps the session parked answers it, so its successor
    wakes it then and the timeout fires (an instance restarted under its own
    id takes its own sessions over; issue 32). A bell that rang makes the
    takeover unpark it: the successor loads the snapshot, deadline and all."""
    a, b = two_hooks
    fence = await new_session(a, "dead-t")
    deadline = int(time.time()) + 3600
    assert await a.set_parked(fence, True, 0, deadline) == 0
    first = await a.take_over_session(fence, "dead-t", successor("inst-t"))
    assert (first.parked, first.inbox_head, first.timeout_deadline) == (True, 0, deadline)
    again = await b.take_over_session(first.fence, "inst-t", successor("inst-t"))
    assert (again.parked, again.inbox_head, again.timeout_deadline) == (True, 0, deadline)
    await a.append(ids.inbox_token(fence.session_id), command("rings inst-t"))
    woken = await a.take_over_session(again.fence, "inst-t", successor("inst-u"))
    assert (woken.parked, woken.inbox_head, woken.timeout_deadline) == (False, 1, 0)


async def test_a_replayed_takeover_answers_the_parked_position_it_decided(
    stack: Stack, two_hooks: tuple[HooksClient, HooksClient], etcd: aetcd.Client
) -> None:
    """A replayed takeover (its answer was lost: etcd timed out, or hooks
    died after the txn) answers what the applied one decided, not the inbox
    head of now: the commands that arrived in between rang the successor's
    bell, and held above them the session would ignore it (issue 32)."""
    a, b = two_hooks
    keys = Keys(stack.etcd.prefix)
    fence = await new_session(a, "dead-r")
    sid = fence.session_id
    inbox = ids.inbox_token(sid)
    await a.append(inbox, command("one"))
    assert await a.set_parked(fence, True, 1) == 1
    owner = successor("inst-r")
    first = await a.take_over_session(fence, "dead-r", owner)
    assert (first.parked, first.inbox_head) == (True, 1)
    for text in ("two", "three"):
        await b.append(inbox, command(text))
    assert await bell_value(etcd, keys, "inst-r", sid) == b"3"
    for hooks in (a, b):  # the successor retries, through either replica
        assert await hooks.take_over_session(fence, "dead-r", owner) == first

    # Held where the takeover decided, the bell it heard meanwhile wakes it.
    woken: list[str] = []

    class Activator:
        def start_activation(
            self, fence: s.Fence, *, unpark: bool = False, delay: float = 0.0
        ) -> None:
            woken.append(fence.session_id)

    parking = Parking(Activator(), structlog.get_logger())
    parking.ring(sid, 3, busy=True)  # rung while it was being taken over
    parking.hold(sid, ParkedSession(owner.owner_run_id, first.fence.epoch, first.inbox_head))
    assert woken == [sid] and sid not in parking.parked


async def test_appends_past_a_parked_sessions_deadline_are_refused_as_finalized(
    two_hooks: tuple[HooksClient, HooksClient],
) -> None:
    """Past the lifetime deadline its park recorded, a session is as good as
    finalized: an append is refused as for a finalized session (by a replica
    whose cache knew the deadline, and by one that learns it from the
    append's own compare), except the owner's timeout that finalizes it.
    A replica reads the record again before refusing: a record written
    since (a handoff's, a later park's) may name another deadline."""
    a, b = two_hooks
    fence = await new_session(a, "inst-d")
    inbox = ids.inbox_token(fence.session_id)
    await a.append(inbox, command("one"))  # a caches the record without a deadline
    assert await b.set_parked(fence, True, 1, int(time.time()) - 1) == 1
    for hooks in (b, a):
        with pytest.raises(FailedPrecondition) as refused:
            await hooks.append(inbox, command("too late"))
        assert refused.value.reason == "SESSION_FINALIZED"

    timeout = s.Command(
        delivery=s.DeliveryMetadata(delivery_id=f"timeout-{fence.owner_run_id}"),
        timeout=s.TimeoutCommand(armed_by_owner_run_id=fence.owner_run_id),
    )
    assert (await a.append(inbox, timeout)).seq == 1

    assert await b.set_parked(fence, False) == 2
    assert await b.set_parked(fence, True, 2, int(time.time()) + 3600) == 2
    assert (await a.append(inbox, command("in time"))).seq == 2  # a's cache said past


async def test_leases_register_expire_and_report_the_dead(stack: Stack) -> None:
    hooks = stack.hooks_client(certs.owner("dep-l"), timeout=5)
    try:
        registered = await hooks.register_instance("dep-l", "live-1", 1, "127.0.0.1:1")
        assert registered.ttl_seconds >= 1  # etcd may raise it to its minimum (2 s)
        fence = await new_session(hooks, "live-1", "dep-l")
        with pytest.raises(FailedPrecondition) as live:
            await hooks.take_over_session(
                fence,
                "live-1",
                s.OwnerIdentity(
                    owner_run_id=ids.new_run_id(), deployment_id="dep-l", instance_id="other"
                ),
            )
        assert live.value.reason == "INSTANCE_LIVE"
        assert await hooks.keep_alive_instance(registered.lease_id) >= 1
        instances = hooks.watch_instances("dep-l")
        first = await asyncio.wait_for(anext(instances), 5)
        assert [i.instance_id for i in first.instances] == ["live-1"]
        assert list(first.dead_instance_ids) == []
        # No more keep-alives: the lease expires and the watchers hear of it.
        gone = await asyncio.wait_for(anext(instances), 10)
        assert list(gone.instances) == [] and list(gone.dead_instance_ids) == ["live-1"]
        await instances.aclose()  # type: ignore[attr-defined]
        assert await hooks.keep_alive_instance(registered.lease_id) == 0
        assert await hooks.list_instances("dep-l") == []
        again = hooks.watch_instances("dep-l")
        fresh = await asyncio.wait_for(anext(again), 5)
        assert list(fresh.dead_instance_ids) == ["live-1"]  # indexed, not live
        await again.aclose()  # type: ignore[attr-defined]
    finally:
        await hooks.close()


@pytest.fixture
async def parking_owner(stack: Stack) -> AsyncIterator[GrpcServer]:
    owner = await create_owner(
        OwnerConfig(
            listen="127.0.0.1:0",
            deployment_id="dep-park",
            instance_id="park-1",
            hooks=stack.addr(stack.hooks),
            anchor=stack.addr(stack.anchor),
            park_after=0.2,
            lease_ttl=2,
            tls=certs.owner("dep-park"),
        )
    )
    await owner.start()
    try:
        yield owner
    finally:
        await owner.stop(grace=0.2)


async def test_an_idle_session_parks_and_wakes_on_input(
    stack: Stack, parking_owner: GrpcServer
) -> None:
    owner = OwnerClient(
        f"127.0.0.1:{parking_owner.port}", timeout=10, security=certs.ingress("dep-park")
    )
    hooks = stack.hooks_client(certs.owner("dep-park"), timeout=5)
    anchor = stack.anchor_client(certs.owner("dep-park"), timeout=5)
    rng = random.Random(3)
    try:
        sid = ids.new_session_id()
        await owner.start_session(
            owner_pb2.StartSessionRequest(session_id=sid, deployment_id="dep-park", channel="slack")
        )
        inbox = ids.inbox_token(sid)

        async def is_parked() -> bool:
            owned = await hooks.list_instance_sessions("dep-park", "park-1")
            return any(o.fence.session_id == sid and o.parked for o in owned)

        async def events() -> list[s.Event]:
            return [e async for page in anchor.read_events(sid) for e in page]

        receipts: list[int] = []
        for burst in range(6):
            await eventually(is_parked, "the idle session to park", timeout=10)
            # A burst around the parking moment: some land while the run is
            # still live, some race the park, some ring the bell.
            for i in range(rng.randint(1, 4)):
                receipts.append((await hooks.append(inbox, command(f"b{burst} m{i}"))).seq)
                await asyncio.sleep(rng.choice([0, 0.05, 0.15, 0.25]))

            async def all_answered(n: int = len(receipts)) -> list[s.Event] | None:
                got = await events()
                return got if answered(got, n) else None

            await eventually(all_answered, "every message answered", timeout=10)
        await eventually(is_parked, "parked again at the end", timeout=10)
        history = await events()
        check_history(history, receipts)
        assert len({e.owner_run_id for e in history}) == 1  # woken with the same fence
        # Each wake read from the parked position; every entry it consumed is gone.
        assert await inbox_entries_left(stack.etcd.endpoint, stack.etcd.prefix, sid) == []
    finally:
        await owner.close()
        await hooks.close()
        await anchor.close()


def test_owner_config_reads_lease_and_parking_settings() -> None:
    env = {
        "BATON_DEPLOYMENT_ID": "dep-c",
        "BATON_OWNER_LEASE_TTL": "4",
        "BATON_OWNER_PARK_AFTER": "0.5",
        "BATON_OWNER_ADVERTISE": "owner-1.internal:50054",
        "BATON_PLAINTEXT": "1",
    }
    config = OwnerConfig.load([], env)
    assert (config.lease_ttl, config.keepalive_every, config.park_after) == (4, 4 / 3, 0.5)
    assert config.advertise == "owner-1.internal:50054" and config.exit_on_lease_loss
    never = OwnerConfig.load(["--park-after", "0", "--keepalive-interval", "1"], env)
    assert (never.park_after, never.keepalive_every) == (None, 1.0)
    with pytest.raises(ConfigError):
        OwnerConfig.load(["--lease-ttl", "0"], env)


async def test_host_wakes_a_parked_session_only_for_a_newer_head() -> None:
    """Bells are compared with the parked position: stale and duplicate bells
    are ignored, and a bell that rang while the run was parking is honoured
    when the session lands in `parked`."""
    from baton_runtime.owner.agents.fixture import build_agent
    from baton_runtime.owner.host.host import OwnerHost
    from baton_runtime.owner.host.parking import ParkedSession
    from baton_runtime.owner.host.sessions import HostSettings

    host = OwnerHost(
        HostSettings("dep-u", "unit-1"),
        build_agent("dep-u"),
        HooksClient("127.0.0.1:1", security=Security.plaintext()),
        AnchorClient("127.0.0.1:1", security=Security.plaintext()),
    )
    woken: list[tuple[str, bool]] = []

    def record(fence: s.Fence, *, unpark: bool = False, delay: float = 0.0) -> None:
        host._activating.add(fence.session_id)
        woken.append((fence.session_id, unpark))

    host.start_activation = record  # type: ignore[method-assign]
    try:
        host._hold("ses_a", ParkedSession("run_a", 2, inbox_next_seq=5))
        host.ring("ses_a", 5)  # stale: nothing new
        host.ring("ses_a", 4)
        assert woken == [] and "ses_a" in host.parked
        host.ring("ses_a", 6)
        assert woken == [("ses_a", True)] and "ses_a" not in host.parked
        host.ring("ses_a", 7)  # rung while waking: remembered, no second wake
        assert woken == [("ses_a", True)] and host.parking.bells["ses_a"] == 7

        # A bell rung while the run was still parking (it is in `runs`).
        host.runs["ses_b"] = object()  # type: ignore[assignment]
        host.ring("ses_b", 9)
        del host.runs["ses_b"]
        host._hold("ses_b", ParkedSession("run_b", 1, inbox_next_seq=8))
        assert woken[-1] == ("ses_b", True)
        # Unknown sessions' bells (lost to another instance) are ignored.
        host.ring("ses_c", 3)
        assert "ses_c" not in host.parking.bells
    finally:
        await host.close()
        await host.hooks.close()
        await host.anchor.close()


async def test_the_held_sessions_gauges_read_the_host_when_scraped() -> None:
    """baton_sessions{state}, the oldest unprocessed command's age and
    baton_draining come from the host's one view of its sessions
    (metering.HeldView), read at each scrape."""
    from baton_runtime.owner.agents.fixture import build_agent
    from baton_runtime.owner.host.host import OwnerHost
    from baton_runtime.owner.host.parking import ParkedSession
    from baton_runtime.owner.host.sessions import HostSettings
    from baton_runtime.owner.run.metering import HeldSessions

    host = OwnerHost(
        HostSettings("dep-u", "unit-1"),
        build_agent("dep-u"),
        HooksClient("127.0.0.1:1", security=Security.plaintext()),
        AnchorClient("127.0.0.1:1", security=Security.plaintext()),
    )

    def scrape() -> dict[tuple[str, tuple[str, ...]], float]:
        return {
            (sample.name, tuple(sample.labels.values())): sample.value
            for family in HeldSessions(host, clock=lambda: 100.0).collect()
            for sample in family.samples
        }

    try:
        host._hold("ses_a", ParkedSession("run_a", 2, inbox_next_seq=5))
        host.restarts.stalled["ses_b"] = s.Fence(session_id="ses_b", owner_run_id="run_b")
        got = scrape()
        assert got[("baton_sessions", ("parked",))] == 1
        assert got[("baton_sessions", ("stalled",))] == 1
        assert got[("baton_sessions", ("running",))] == 0
        assert got[("baton_inbox_oldest_unconsumed_seconds", ())] == 0.0
        assert got[("baton_draining", ())] == 0.0
        host.drains.start("dep-v", host.held())
        assert scrape()[("baton_draining", ())] == 1.0
    finally:
        await host.close()
        await host.hooks.close()
        await host.anchor.close()


class _BackwardsPages:
    """A stub whose second page token goes back (hooks never does this)."""

    def __init__(self) -> None:
        self.tokens = iter(["paged-1/ses_b", "paged-1/ses_a"])

    async def ListInstanceSessions(  # noqa: N802 - the stub's method name
        self, request: hooks_pb.ListInstanceSessionsRequest, timeout: float
    ) -> hooks_pb.ListInstanceSessionsResponse:
        return hooks_pb.ListInstanceSessionsResponse(next_page_token=next(self.tokens))


async def test_the_client_refuses_a_listing_whose_page_token_goes_back() -> None:
    """A token that does not advance would loop or silently drop sessions:
    the client says so instead."""
    client = HooksClient("127.0.0.1:1", timeout=1, security=Security.plaintext())
    client.stub = _BackwardsPages()  # type: ignore[assignment]
    try:
        with pytest.raises(Internal, match="page token went back"):
            await client.list_instance_sessions("dep-p", "paged-1")
    finally:
        await client.close()
