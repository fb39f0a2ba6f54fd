"""A live session's stream retention horizon (docs/design.md §7; issue 20): anchor
keeps at least the last `--stream-retention-events` events and every event
younger than `--stream-retention`, deletes the rest in the background, and a
read below the horizon (from the start, or a slow reader the horizon passes)
answers OUT_OF_RANGE naming the earliest seq kept; reading from there is
gapless; a takeover after kill -9 and a wake from parking need nothing
below it. Real etcd, real gRPC; in-process services, and real processes for
the takeover."""

from __future__ import annotations

import contextlib
import functools
import io
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aetcd
import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.config import AnchorConfig
from baton_runtime.anchor.horizon import PAGE, StreamHorizon, StreamPolicy, opened_pages
from baton_runtime.anchor.journal import Journal
from baton_runtime.anchor.segments.index import parse_index
from baton_runtime.cli.__main__ import build_parser
from baton_runtime.cli.system.launch_settings import LaunchSettings
from baton_runtime.cli.system.local_system import LocalSystem
from baton_runtime.cli.system.port_plan import Ports
from baton_runtime.common import ids
from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import OutOfRange, Reason
from baton_runtime.common.etcd.keys import Keys, OwnerRecord
from baton_runtime.common.observability import metrics
from baton_runtime.common.security.identity import Role
from baton_runtime.owner.rules.held import RunIdentity, make_event
from baton_runtime.owner.run.snapshots import initial_snapshot
from tests.certs import etcd_client
from tests.procs import ProcessStack, check_history, eventually
from tests.scrape import in_process
from tests.stack import SLACK, Stack, start_stack, stop_stack
from tests.test_turns import RESET, control, follow_until, read_to_close, waits

KEEP = 200
SWEEP = 0.2


@contextlib.asynccontextmanager
async def retaining(
    etcd_endpoint: str, keep_events: int, keep_seconds: float
) -> AsyncIterator[Stack]:
    """A stack whose anchor keeps `keep_events` and `keep_seconds` of each live
    stream, sweeping every 0.2 s."""
    stack = await start_stack(
        etcd_endpoint,
        anchor_options={
            "stream_retention_events": keep_events,
            "stream_retention_seconds": keep_seconds,
            "retention_sweep_seconds": SWEEP,
        },
    )
    try:
        yield stack
    finally:
        await stop_stack(stack)


@pytest.fixture
async def counted(etcd_endpoint: str) -> AsyncIterator[Stack]:
    """Streams keep their last 200 events, whatever their age."""
    async with retaining(etcd_endpoint, KEEP, 0.0) as stack:
        yield stack


def journal(stack: Stack) -> Journal:
    app = stack.anchor.app
    assert isinstance(app, Journal)
    return app


def horizon(stack: Stack) -> StreamHorizon:
    found = journal(stack).horizon
    assert found is not None
    return found


async def turns(stack: Stack, session_id: str, count: int, start: int = 0) -> int:
    """`count` one-step turns, each awaited; returns the stream head."""
    for i in range(count):
        await stack.send(session_id, f"turn {i}")
        events = await follow_until(stack, session_id, waits(1), start_seq=start)
        start = events[-1].seq + 1
    return start


async def live_events(stack: Stack, raw: aetcd.Client, session_id: str) -> list[int]:
    return await kept_seqs(raw, Keys(stack.etcd.prefix), session_id)


async def kept_seqs(raw: aetcd.Client, keys: Keys, session_id: str) -> list[int]:
    """The seqs the stream keeps: its keys in etcd and, from the horizon
    on, the ones its sealed segments hold (services/anchor/segments/)."""
    found = await raw.get_prefix(keys.events_prefix(session_id))
    seqs = {int(kv.key[-20:]) for kv in found}
    index = parse_index((await raw.get(keys.segment_index(session_id, "ev")) or _NONE).value)
    horizon_kv = await raw.get(keys.horizon(session_id))
    horizon = int(horizon_kv.value) if horizon_kv is not None else 0
    seqs.update(range(max(horizon, index.dropped_below), index.sealed_below))
    return sorted(seqs)


class _None:
    value = None


_NONE = _None()


async def stored_horizon(stack: Stack, raw: aetcd.Client, session_id: str) -> int:
    kv = await raw.get(Keys(stack.etcd.prefix).horizon(session_id))
    return int(kv.value) if kv is not None else 0


def kept_exactly(
    stack: Stack, raw: aetcd.Client, session_id: str, count: int
) -> Callable[[], Awaitable[bool]]:
    """A probe: the stream holds exactly `count` events."""

    async def probe() -> bool:
        return len(await live_events(stack, raw, session_id)) == count

    return probe


async def read(stack: Stack, session_id: str, start_seq: int) -> list[int]:
    events = await stack.events(session_id, start_seq=start_seq, follow=False)
    return [e.seq for e in events]


def below_horizon_of(exc: grpc.aio.AioRpcError) -> int:
    """The earliest seq kept, from a public OUT_OF_RANGE/BELOW_HORIZON status."""
    assert exc.code() == grpc.StatusCode.OUT_OF_RANGE, exc
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.reason == Reason.BELOW_HORIZON, info
    return int(info.metadata["earliest_seq"])


def trimmed_total() -> float:
    return in_process(metrics.STREAM_EVENTS_TRIMMED, "baton_stream_events_trimmed_total")


# -- the rule (pure) --------------------------------------------------------------


def test_the_horizon_keeps_the_last_n_and_every_page_younger_than_the_window() -> None:
    now = 1_000_000
    # (seq, ms): every event below seq was committed no later than ms (a page
    # stamp dates the events before its page; a sealed segment, its own).
    pages = [(p * PAGE, ms) for p, ms in ((1, now - 9000), (2, now - 8000), (3, now - 500))]
    pages.append((4 * PAGE, now - 100))
    # By count alone (no window): head - N.
    assert StreamPolicy(100, 0).first_kept(300, pages, now) == 200
    # A window of 5 s: pages 1 and 2 began over 5 s ago, so every event before
    # seq 2*PAGE is older; the younger ones stay although N is small.
    assert StreamPolicy(10, 5).first_kept(300, pages, now) == 2 * PAGE
    # The count keeps more than the window: the count wins.
    assert StreamPolicy(250, 5).first_kept(300, pages, now) == 50
    # No page old enough (or none stamped): nothing is old enough to go.
    assert StreamPolicy(10, 60).first_kept(300, pages, now) == 0
    assert StreamPolicy(10, 5).first_kept(300, [], now) == 0
    assert not StreamPolicy(300, 0).may_trim(300) and StreamPolicy(299, 0).may_trim(300)
    with pytest.raises(ValueError):
        StreamPolicy(0, 0)


def test_a_commit_stamps_the_pages_it_opens() -> None:
    assert opened_pages(0, 5) == []  # page 0 dates nothing
    assert opened_pages(PAGE - 2, 3) == [1]
    assert opened_pages(PAGE, 1) == [1]
    assert opened_pages(PAGE + 1, PAGE - 1) == []
    assert opened_pages(PAGE - 1, 2 * PAGE + 2) == [1, 2, 3]
    assert opened_pages(7, 0) == []


# -- settings ---------------------------------------------------------------------


def test_the_settings_come_from_flags_env_and_baton_up(tmp_path: Path) -> None:
    base = {"BATON_PLAINTEXT": "1"}
    default = AnchorConfig.load([], base)
    assert default.stream_policy == StreamPolicy(100_000, 7 * 24 * 3600.0)
    by_env = AnchorConfig.load(
        [], base | {"BATON_STREAM_RETENTION_EVENTS": "200", "BATON_STREAM_RETENTION": "1.5"}
    )
    assert by_env.stream_policy == StreamPolicy(200, 1.5)
    flags = ["--stream-retention-events", "7", "--stream-retention", "0"]
    assert AnchorConfig.load(flags, base).stream_policy == StreamPolicy(7, 0.0)
    for bad in (["--stream-retention-events", "0"], ["--stream-retention", "-1"]):
        with pytest.raises(ConfigError):
            AnchorConfig.load(bad, base)
    # `baton up` passes both to anchor (and to nothing else).
    args = build_parser().parse_args(
        ["up", "--stream-retention-events", "200", "--stream-retention", "2.5"]
    )
    settings = LaunchSettings(
        stream_retention_events=args.stream_retention_events, stream_retention=args.stream_retention
    )
    system = LocalSystem(settings, Ports.plan(0, 0), tmp_path, io.StringIO())
    env = system.service_env("anchor", None)
    assert AnchorConfig.load([], env).stream_policy == StreamPolicy(200, 2.5)
    assert "BATON_STREAM_RETENTION" not in system.service_env("hooks", None)
    unset = LocalSystem(LaunchSettings(), Ports.plan(0, 0), tmp_path, io.StringIO())
    assert "BATON_STREAM_RETENTION_EVENTS" not in unset.service_env("anchor", None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--stream-retention-events", "0"])


# -- over a real stack ------------------------------------------------------------


async def test_a_long_session_keeps_its_last_n_events_and_names_the_earliest(
    counted: Stack, raw: aetcd.Client
) -> None:
    sid = await counted.create()
    trimmed_before = trimmed_total()
    head = 0
    for _ in range(6):
        head = await turns(counted, sid, 20, head)

        # Trims follow the commits that open a page: never more than a page
        # (and a turn's events) behind, once the trim a page scheduled (in
        # anchor's background, its write perhaps riding the next grouped
        # request) has landed.
        async def trimmed_to_bound() -> list[int] | None:
            kept = await live_events(counted, raw, sid)
            return kept if len(kept) <= KEEP + PAGE + 8 else None

        kept = await eventually(trimmed_to_bound, f"at most {KEEP + PAGE + 8} kept", timeout=5)
        assert kept == list(range(kept[0], head)), "a gap inside the kept events"
    assert head > 2 * KEEP + PAGE, head
    # Quiet, the sweep brings the stream to exactly its last KEEP events.
    await eventually(kept_exactly(counted, raw, sid, KEEP), f"{KEEP} events kept", timeout=10)
    earliest = await stored_horizon(counted, raw, sid)
    assert earliest == head - KEEP
    assert trimmed_total() - trimmed_before >= head - KEEP
    # Page stamps go with the events they date.
    pages = await raw.get_prefix(Keys(counted.etcd.prefix).stream_pages_prefix(sid))
    assert len(pages) <= KEEP // PAGE + 1
    # A read from 0 (or any seq below the horizon) says where the stream starts.
    for start in (0, earliest - 1):
        with pytest.raises(grpc.aio.AioRpcError) as below:
            await read(counted, sid, start)
        assert below_horizon_of(below.value) == earliest
        assert f"earliest seq kept is {earliest}" in (below.value.details() or "")
    # From there, the stream is gapless to its end, and goes on.
    assert await read(counted, sid, earliest) == list(range(earliest, head))
    head = await turns(counted, sid, 1, head)
    await eventually(kept_exactly(counted, raw, sid, KEEP), "trimmed again", timeout=10)
    assert await read(counted, sid, head - KEEP) == list(range(head - KEEP, head))
    # Introspection reads the latest events as before.
    got = await counted.ingress_stub.GetSession(
        ingress_pb.GetSessionRequest(session_id=sid), metadata=SLACK, timeout=10
    )
    assert got.session.stream_head == head


async def test_a_slow_reader_the_horizon_passes_is_told_and_resumes_from_the_earliest(
    counted: Stack, raw: aetcd.Client
) -> None:
    sid = await counted.create()
    head = await turns(counted, sid, 60)
    await eventually(kept_exactly(counted, raw, sid, KEEP), "trimmed", timeout=10)
    first_kept = head - KEEP
    # A follower from the horizon takes its first page, then stalls.
    reader = journal(counted).events.read(sid, first_kept, follow=True)
    try:
        page = await anext(reader)
        assert [e.seq for e in page] == list(range(first_kept, first_kept + len(page)))
        assert first_kept + len(page) < head, "the first page was the whole stream"
        # Meanwhile the session goes on and the horizon passes the reader.
        head = await turns(counted, sid, 20, head)
        passed_at = first_kept + len(page)

        async def passed_reader() -> bool:
            return await stored_horizon(counted, raw, sid) > passed_at

        await eventually(passed_reader, "the horizon passed the reader", timeout=10)
        # And the trim is over (no turn runs now), so the earliest seq the
        # reader is told stays the earliest until it resumes from there.
        await eventually(kept_exactly(counted, raw, sid, KEEP), "trimmed again", timeout=10)
        with pytest.raises(OutOfRange) as passed:
            await anext(reader)
    finally:
        await reader.aclose()
    assert passed.value.reason == Reason.BELOW_HORIZON
    earliest = int(passed.value.metadata["earliest_seq"])
    assert earliest > first_kept + len(page)
    # Resuming from the earliest seq kept, through the public API, works.
    assert await read(counted, sid, earliest) == list(range(earliest, head))


async def test_a_short_window_with_a_small_count_ages_the_stream_out(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    async with retaining(etcd_endpoint, 100, 1.0) as stack:
        sid = await stack.create()
        head = await turns(stack, sid, 60)
        assert head > 3 * PAGE + 100
        # Once every page is over a second old, the count alone keeps events.
        await eventually(kept_exactly(stack, raw, sid, 100), "aged out", timeout=10)
        assert await read(stack, sid, head - 100) == list(range(head - 100, head))


async def test_a_long_window_keeps_young_events_beyond_the_count(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    async with retaining(etcd_endpoint, 100, 3600.0) as stack:
        sid = await stack.create()
        head = await turns(stack, sid, 60)
        assert head > 3 * PAGE + 100
        # Nothing is an hour old: a trim and a sweep round delete nothing.
        assert await horizon(stack).trim(sid) == 0
        await horizon(stack).sweep()
        assert await live_events(stack, raw, sid) == list(range(head))
        assert await read(stack, sid, 0) == list(range(head))


async def test_a_finalized_stream_is_not_trimmed_and_introspection_reads_past_a_close_horizon(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    # Fewer than GetSession reads back (16), more than one turn's events (7).
    async with retaining(etcd_endpoint, 10, 0.0) as stack:
        sid = await stack.create()
        head = await turns(stack, sid, 30)
        await eventually(kept_exactly(stack, raw, sid, 10), "trimmed", timeout=10)
        # Fewer events kept than GetSession reads back: it reads from the horizon.
        got = await stack.ingress_stub.GetSession(
            ingress_pb.GetSessionRequest(session_id=sid), metadata=SLACK, timeout=10
        )
        assert got.session.stream_head == head
        await control(stack, sid, RESET, reason="done")
        closing = await read_to_close(stack, sid, start_seq=head)
        closed_head = closing[-1].seq + 1
        kept = await live_events(stack, raw, sid)
        # Closed: retention deletes it whole later; the horizon stays put.
        assert await horizon(stack).trim(sid) == 0
        await horizon(stack).sweep()
        assert await live_events(stack, raw, sid) == kept == list(range(kept[0], closed_head))


async def test_a_retried_commit_whose_events_went_below_the_horizon_is_a_replay(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    """With a horizon closer than one commit's events, the retry of an applied
    commit (its answer lost) still reads as replayed, not as a conflict."""
    async with retaining(etcd_endpoint, 1, 0.0) as stack:
        as_w = stack.security(Role.OWNER, "dep-w")  # a deployment without owners
        hooks, anchor = stack.hooks_client(as_w), stack.anchor_client(as_w)
        try:
            sid = ids.new_session_id()
            owner = s.OwnerIdentity(owner_run_id="run_w1", deployment_id="dep-w", instance_id="w1")
            created = await hooks.create_session(sid, owner, "slack", [])
            identity = RunIdentity(created.fence, "dep-w", "w1")
            snapshot = initial_snapshot(sid, "slack", "dep-w", list(created.hooks))
            events = [make_event(identity, s.EVENT_KIND_SESSION_STARTED, now=time.time())]
            events += [
                make_event(identity, s.EVENT_KIND_MESSAGE_COMPLETED, now=time.time())
                for _ in range(PAGE)
            ]
            for seq, event in enumerate(events):
                event.seq = seq
            snapshot.next_event_seq = len(events)
            request = anchor_pb.CommitStepRequest(
                fence=created.fence, events=events, snapshot=snapshot, expected_snapshot_revision=0
            )
            applied = await anchor.commit(request)
            # (Scheduled by the commit, as it opened page 1.)
            await eventually(kept_exactly(stack, raw, sid, 1), "trimmed to one event", timeout=10)
            again = await anchor.commit(request)
            assert again.replayed and again.revision == applied.revision
            # The stream goes on from its last event.
            more = make_event(identity, s.EVENT_KIND_MESSAGE_COMPLETED, now=time.time())
            more.seq = len(events)
            snapshot.next_event_seq = len(events) + 1
            await anchor.commit(
                anchor_pb.CommitStepRequest(
                    fence=created.fence,
                    events=[more],
                    snapshot=snapshot,
                    expected_snapshot_revision=applied.revision,
                )
            )
            # The horizon keeps one event, so the sweep may trim PAGE at any
            # moment after this commit: read from PAGE, or from the horizon it
            # names, which is then PAGE + 1.
            try:
                read = await stack.events(sid, start_seq=PAGE, follow=False)
            except grpc.aio.AioRpcError as below:
                assert below_horizon_of(below) == PAGE + 1
                read = await stack.events(sid, start_seq=PAGE + 1, follow=False)
                assert [e.seq for e in read] == [PAGE + 1]
            else:
                assert [e.seq for e in read] == [PAGE, PAGE + 1]
        finally:
            await hooks.close()
            await anchor.close()


# -- over real processes: a takeover and a wake need nothing below the horizon ------


async def test_a_takeover_and_a_wake_from_parking_need_nothing_below_the_horizon(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    """Real processes, an anchor keeping 100 events: the session's owner is
    killed (kill -9) and another takes it over, then it parks and is woken.
    Every event, read as it came (before it went below the horizon), makes
    one gapless history with every command processed once in order; the
    stream keeps its last 100 events, gapless, and says so from 0."""
    stack = ProcessStack(
        etcd_endpoint,
        tmp_path,
        park_after=0.3,
        anchor_env={
            "BATON_STREAM_RETENTION_EVENTS": "100",
            "BATON_STREAM_RETENTION": "0",
            "BATON_RETENTION_SWEEP": str(SWEEP),
        },
    )
    stacks.append(stack)
    stack.start(owners=2)
    clients = stack.clients()
    raw_etcd = await etcd_client(etcd_endpoint)
    keys = Keys(stack.prefix)
    seen: list[s.Event] = []
    receipts: list[int] = []

    async def answered(seq: int) -> list[s.Event] | None:
        """The events after those seen, once they answer inbox seq `seq`."""
        start = seen[-1].seq + 1 if seen else 0
        got = [e async for page in clients.anchor.read_events(sid, start) for e in page]
        done = (
            any(e.kind == s.EVENT_KIND_MESSAGE_RECEIVED and e.inbox_seq == seq for e in got)
            and got[-1].kind == s.EVENT_KIND_SESSION_WAITING
        )
        return got if done else None

    async def turns_of(count: int, timeout: float = 10.0) -> None:
        for _ in range(count):
            seq = (await clients.send(sid, f"turn {len(receipts)}")).receipt.seq
            receipts.append(seq)
            seen.extend(
                await eventually(functools.partial(answered, seq), f"seq {seq} answered", timeout)
            )

    async def parked() -> bool:
        kv = await raw_etcd.get(keys.owner(sid))
        return kv is not None and OwnerRecord.decode(kv.value).parked

    try:
        await clients.wait_registered("o1", "o2")
        sid = await clients.create()
        await turns_of(20)
        first_owner = await clients.owner_of(sid)
        stack.kill(first_owner)
        await turns_of(10, timeout=30)  # the first waits for the takeover
        assert await clients.owner_of(sid) not in ("", first_owner)
        await eventually(parked, "the idle session to park", timeout=10)
        await turns_of(10)
        head = seen[-1].seq + 1
        assert head > 2 * 100
        check_history(seen, receipts)
        assert len({e.owner_run_id for e in seen}) == 2  # one takeover, woken with its fence

        async def kept_last_100() -> bool:
            return await kept_seqs(raw_etcd, keys, sid) == list(range(head - 100, head))

        await eventually(kept_last_100, "the last 100 events kept", timeout=10)
        later = [e.seq async for page in clients.anchor.read_events(sid, head - 100) for e in page]
        assert later == list(range(head - 100, head))
        with pytest.raises(grpc.aio.AioRpcError) as below:
            await clients.ingress.StreamEvents(
                ingress_pb.StreamEventsRequest(session_id=sid, start_seq=0), metadata=SLACK
            ).read()
        assert below_horizon_of(below.value) == head - 100
    finally:
        await clients.close()
        await raw_etcd.close()
