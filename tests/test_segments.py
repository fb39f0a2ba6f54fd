"""Sealed segments (issue 34; docs/storage.md): a session's stream and model
history past their open tails live in an object store, etcd keeps the tails
and a small index, and every reader sees the same stream and context as
before. Real etcd, real gRPC, a real file:// store (and a real S3-protocol
server in test_segments_s3.py); in-process services here, real processes
with kill -9 in test_segments_faults.py."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import aetcd
import grpc
import pytest

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.anchor.v1 import segments_pb2 as spb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.config import AnchorConfig
from baton_runtime.anchor.journal import Journal
from baton_runtime.anchor.segments import index as ix
from baton_runtime.anchor.segments.format import (
    Corrupt,
    ObjectNames,
    decode_object,
    encode_object,
    segment_object,
)
from baton_runtime.anchor.segments.objects import check_url
from baton_runtime.anchor.segments.schedule import SealSchedule
from baton_runtime.anchor.segments.seal import SEAL_RECORDS
from baton_runtime.cli.__main__ import build_parser
from baton_runtime.cli.system.launch_settings import LaunchSettings
from baton_runtime.cli.system.local_system import LocalSystem
from baton_runtime.cli.system.port_plan import Ports
from baton_runtime.common import ids
from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import DataLoss, Reason
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.observability import metrics
from baton_runtime.common.rpc.status_map import error_reason
from baton_runtime.common.security.identity import Role
from baton_runtime.owner.rules.held import RunIdentity, make_event
from baton_runtime.owner.run.snapshots import initial_snapshot
from tests.procs import eventually
from tests.scrape import in_process
from tests.stack import (
    SLACK,
    Stack,
    add_deployment,
    object_store_url,
    start_stack,
    stop_deployment,
    stop_stack,
)
from tests.test_turns import RESET, control, follow_until, read_to_close, waits

EV = spb.SEGMENT_LOG_EVENTS
H = spb.SEGMENT_LOG_HISTORY


# -- the rules (pure) ----------------------------------------------------------------


def ref_of(first: int, end: int, dated_ms: int = 0) -> spb.SegmentRef:
    return spb.SegmentRef(first=first, end=end, nonce=first + 1, dated_ms=dated_ms)


def test_an_object_is_read_back_only_as_it_was_recorded() -> None:
    records = [f"event {i}".encode() for i in range(5)]
    raw, digest = encode_object(segment_object(EV, "ses_a", 10, records))
    ref = spb.SegmentRef(first=10, end=15, nonce=7, size=len(raw), sha256=digest)
    assert list(decode_object(raw, ref, EV, "ses_a", directory=False).records) == records
    assert digest == hashlib.sha256(raw[40:]).digest()
    flipped = bytearray(raw)
    flipped[-3] ^= 0x01
    cases = {
        "checksum mismatch": bytes(flipped),
        "recorded": raw[:-1],
        "bad magic": b"X" + raw[1:],
    }
    for why, bad in cases.items():
        with pytest.raises(Corrupt, match=why):
            decode_object(bad, ref, EV, "ses_a", directory=False)
    # Another session's, another log's or another range's object is refused.
    for log, sid in ((H, "ses_a"), (EV, "ses_b")):
        with pytest.raises(Corrupt, match="another"):
            decode_object(raw, ref, log, sid, directory=False)
    other = spb.SegmentRef(first=10, end=16, nonce=7, size=len(raw), sha256=digest)
    with pytest.raises(Corrupt, match="records"):
        decode_object(raw, other, EV, "ses_a", directory=False)


def test_the_index_stays_bounded_and_drops_from_the_bottom() -> None:
    index = spb.SegmentIndex()
    directory: list[spb.SegmentRef] = []
    for n in range(40):
        ref = ref_of(n * 10, n * 10 + 10, dated_ms=n)
        roll = ix.rolls_over(index)
        listed = ix.rolled(index, directory) if roll else []
        dir_ref = ref_of(listed[0].first, listed[-1].end, n) if listed else None
        index = ix.sealed(index, ref, roll=roll, directory=dir_ref)
        if roll:
            directory = listed
        assert len(index.recent) <= ix.MAX_RECENT
    assert index.sealed_below == 400
    assert [r.first for r in directory] == list(range(0, 320, 10))
    assert index.directory.end == 320 and len(index.recent) == 8
    assert ix.covering(list(index.recent), 335).first == 330
    assert ix.covering(list(index.recent), 400) is None
    assert ix.needs_directory(index, 100) and not ix.needs_directory(index, 330)
    # Dropping below 125: the directory's first 12 segments go (the one holding
    # 125 stays whole), the recent ones stay, nothing is listed twice.
    dropped = ix.dropping(index, 125, directory)
    assert [r.first for r in dropped.segments] == list(range(0, 120, 10))
    assert dropped.directory is None and dropped.index.dropped_below == 125
    assert [r.end for r in ix.live(directory, 125)][0] == 130
    # Dropping past the directory's end drops it too.
    later = ix.dropping(dropped.index, 335, directory)
    assert later.directory is not None and later.directory.end == 320
    assert [r.first for r in later.segments] == list(range(120, 320, 10)) + [320]
    assert not later.index.HasField("directory")
    assert [r.first for r in later.index.recent] == list(range(330, 400, 10))
    # The age rule's dates: the directory's refs when given, else as a whole.
    assert ix.dates(index, [])[0] == (320, 32)
    assert ix.dates(index, directory)[:2] == [(10, 0), (20, 1)]


def test_the_object_store_url_is_checked() -> None:
    assert check_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert check_url("file:///var/lib/baton/objects")
    for bad, why in (
        ("ftp://x/y", "scheme"),
        ("s3://key:secret@bucket/p", "no credentials"),
        ("file://relative/path", "absolute"),
    ):
        with pytest.raises(ConfigError, match=why):
            check_url(bad)


def test_object_names_keep_stacks_and_sessions_apart() -> None:
    names = ObjectNames.of("/baton/")
    ref = spb.SegmentRef(first=64, end=128, nonce=0xABC)
    path = names.segment("ses_x", EV, ref)
    assert path == "baton/s/ses_x/ev/00000000000000000064-0000000000000abc"
    assert names.directory("ses_x", H, ref) == "baton/s/ses_x/h/dir-0000000000000abc"
    assert names.session_of(path) == "ses_x"
    assert names.session_of("other/s/ses_x/ev/1") is None


# -- over a real stack ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def sealing(
    etcd_endpoint: str, *, park_after: float | None = None, **anchor: object
) -> AsyncIterator[Stack]:
    """A stack whose anchor seals a session's tails once it is quiet for
    0.3 s, sweeping every 0.2 s; hooks forget delivery ids after 1 s."""
    options: dict[str, object] = {"seal_idle_seconds": 0.3, "retention_sweep_seconds": 0.2}
    stack = await start_stack(
        etcd_endpoint,
        anchor_options=options | anchor,
        hooks_options={"dedupe_window_seconds": 1.0},
        park_after=park_after,
    )
    try:
        yield stack
    finally:
        await stop_stack(stack)


def journal(stack: Stack) -> Journal:
    app = stack.anchor.app
    assert isinstance(app, Journal)
    return app


def sealer(stack: Stack) -> SealSchedule:
    found = journal(stack).sealer
    assert found is not None
    return found


async def index_of(raw: aetcd.Client, keys: Keys, sid: str, log: str) -> spb.SegmentIndex:
    kv = await raw.get(keys.segment_index(sid, log))
    return ix.parse_index(kv.value if kv is not None else None)


async def etcd_usage(raw: aetcd.Client, keys: Keys, sid: str) -> tuple[int, int]:
    """Keys and bytes (keys and values) under the session's prefix."""
    found = await raw.get_prefix(keys.session_prefix(sid))
    return len(found), sum(len(kv.key) + len(kv.value) for kv in found)


async def quiet(raw: aetcd.Client, keys: Keys, sid: str) -> tuple[int, int]:
    """Once the session is sealed whole (its stream's last event and no
    history entry left as keys) and its delivery ids expired: its usage."""

    async def settled() -> tuple[int, int] | None:
        found = await raw.get_prefix(keys.session_prefix(sid))
        names = [kv.key[len(keys.session_prefix(sid)) :] for kv in found]
        events = [n for n in names if n.startswith(b"ev/")]
        left = [n for n in names if n.startswith((b"h/", b"dlv/", b"c/in/"))]
        if len(events) == 1 and not left:
            return len(found), sum(len(kv.key) + len(kv.value) for kv in found)
        return None

    return await eventually(settled, "the session sealed and quiet", timeout=30)


def object_dir(stack: Stack, sid: str) -> Path:
    root = Path(urlsplit(object_store_url()).path)
    return root / ObjectNames.of(stack.etcd.prefix).session_prefix(sid)


def object_files(stack: Stack, sid: str) -> list[Path]:
    top = object_dir(stack, sid)
    return sorted(p for p in top.rglob("*") if p.is_file()) if top.exists() else []


class LiveFollower:
    """StreamEvents from 0, following: every event as it arrived (bytes)."""

    def __init__(self, stack: Stack, sid: str) -> None:
        self.events: list[bytes] = []
        self.waits = 0
        self._call = stack.ingress_stub.StreamEvents(
            ingress_pb.StreamEventsRequest(session_id=sid, start_seq=0, follow=True),
            metadata=SLACK,
        )
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for response in self._call:
            for event in response.events:
                self.events.append(event.SerializeToString())
                if event.kind == s.EVENT_KIND_SESSION_WAITING:
                    self.waits += 1

    async def until_waits(self, count: int) -> None:
        async def reached() -> bool:
            if self._task.done():
                self._task.result()
                raise AssertionError("the follower's stream ended")
            return self.waits >= count

        await eventually(reached, f"{count} turns answered", timeout=30)

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self._task


async def read_bytes(stack: Stack, sid: str, start_seq: int = 0) -> list[bytes]:
    events = await stack.events(sid, start_seq=start_seq, follow=False, timeout=120)
    return [e.SerializeToString() for e in events]


@pytest.mark.parametrize("turns", [pytest.param(3000, marks=pytest.mark.slow), 300])
async def test_a_long_session_keeps_etcd_flat_and_reads_back_what_its_follower_saw(
    etcd_endpoint: str, raw: aetcd.Client, turns: int
) -> None:
    """At the default retention, `turns` one-step turns: quiet after the last
    turn, the session holds in etcd what it held quiet after a tenth of them
    (within a small constant: the seqs gain digits), under 8 KB; busy, its
    tails stay within a segment's worth. A read from 0 returns every event
    once, in order, byte for byte what a live follower received."""
    early = turns // 10
    async with sealing(etcd_endpoint) as stack:
        keys = Keys(stack.etcd.prefix)
        sid = await stack.create()
        follower = LiveFollower(stack, sid)
        try:
            busiest = longest_tail = 0
            for turn in range(1, turns + 1):
                await stack.send(sid, f"turn {turn}")
                await follower.until_waits(turn)
                if turn % 10 == 0:
                    tail = await raw.get_prefix(keys.events_prefix(sid))
                    longest_tail = max(longest_tail, len(tail))
                if turn % 50 == 0:
                    busiest = max(busiest, (await etcd_usage(raw, keys, sid))[1])
                if turn == early:
                    at_early = await quiet(raw, keys, sid)
            at_end = await quiet(raw, keys, sid)
            live = list(follower.events)
        finally:
            await follower.close()
        print(
            f"{turns} turns: quiet etcd {at_early} at turn {early}, {at_end} at turn {turns} "
            f"(keys, bytes); busiest {busiest} bytes, longest stream tail {longest_tail} events; "
            f"{len(live)} events, "
            f"{len(object_files(stack, sid))} objects"
        )
        assert at_end[0] - at_early[0] <= 1, (at_early, at_end)
        assert at_end[1] - at_early[1] <= 1536, (at_early, at_end)
        assert at_end[1] <= 8 * 1024, at_end
        assert busiest <= 64 * 1024, busiest
        # Sealed as it grows: a segment's worth, a turn's events and the last.
        assert longest_tail <= SEAL_RECORDS + 16, longest_tail
        stream = await index_of(raw, keys, sid, "ev")
        assert stream.sealed_below == len(live) - 1 and stream.dropped_below == 0
        assert await read_bytes(stack, sid) == live
        # And from any cursor: inside a segment, at a boundary, in the tail.
        first = stream.recent[0].first
        for start in (1, first, first + 1, len(live) - 1):
            assert await read_bytes(stack, sid, start) == live[start:]


async def converse(
    stack: Stack, sid: str, count: int, start: int = 0, prefix: str = "hello"
) -> int:
    """`count` one-step turns with messages of one shape; the next seq."""
    for i in range(count):
        await stack.send(sid, f"{prefix} {i}")
        events = await follow_until(stack, sid, waits(1), start_seq=start)
        start = events[-1].seq + 1
    return start


async def input_tokens(stack: Stack, sid: str, text: str, start: int) -> tuple[int, int]:
    """Run one turn; the model call's prompt tokens (the fixture counts one
    per earlier message of the context it was given) and the next seq."""
    await stack.send(sid, text)
    events = await follow_until(stack, sid, waits(1), start_seq=start)
    steps = [e for e in events if e.kind == s.EVENT_KIND_STEP_COMPLETED]
    return steps[-1].usage.input_tokens, events[-1].seq + 1


async def sealed_whole(raw: aetcd.Client, keys: Keys, sid: str) -> spb.SegmentIndex:
    """Once the history's tail is sealed (no entry left as a key)."""

    async def probe() -> spb.SegmentIndex | None:
        left = await raw.get_prefix(keys.history_prefix(sid))
        index = await index_of(raw, keys, sid, "h")
        return index if not left and index.recent else None

    return await eventually(probe, "the history sealed whole", timeout=20)


async def test_a_parked_sessions_context_is_sealed_and_the_model_sees_it_whole_again(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    """A parked session keeps no history entry in etcd: its context is
    sealed. Loaded again (the wake), and handed off to another deployment
    (whose owner loads it), the model is given the same context entries,
    in order: each turn's prompt counts exactly two messages more."""
    async with sealing(etcd_endpoint, park_after=0.5) as stack:
        keys = Keys(stack.etcd.prefix)
        sid = await stack.create()
        start = await converse(stack, sid, 12)
        before, start = await input_tokens(stack, sid, "hello 12", start)
        anchor = stack.anchor_client()
        b = await add_deployment(stack, "dep-b", park_after=0.5)
        try:
            held = await anchor.load_session(sid)
            index = await sealed_whole(raw, keys, sid)
            assert index.sealed_below == held.snapshot.history_log.next_index
            again = await anchor.load_session(sid)
            assert [m.SerializeToString() for m in again.context] == [
                m.SerializeToString() for m in held.context
            ]
            assert len(held.context) == 26  # 13 turns: a message and an answer each
            # Woken from parking: the model sees every entry.
            woken, start = await input_tokens(stack, sid, "hello 13", start)
            assert woken == before + 2
            # Handed off (a send through dep-b's ingress) after sealing again.
            await sealed_whole(raw, keys, sid)
            moved, start = await input_tokens(b, sid, "hello 14", start)
            assert moved == woken + 2
            owner = await raw.get(keys.owner(sid))
            assert owner is not None and b'"deployment_id":"dep-b"' in owner.value
        finally:
            await anchor.close()
            await stop_deployment(b)


def corrupt_bytes(raw: bytes) -> bytes:
    data = bytearray(raw)
    data[len(data) // 2] ^= 0x40
    return bytes(data)


def corrupt(path: Path) -> None:
    path.write_bytes(corrupt_bytes(path.read_bytes()))


def data_loss_reason(exc: grpc.aio.AioRpcError) -> str:
    assert exc.code() == grpc.StatusCode.DATA_LOSS, exc
    return error_reason(exc)


async def test_a_corrupt_or_missing_segment_is_data_loss_never_a_gap(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    """A segment whose bytes changed is refused (DATA_LOSS, OBJECT_CORRUPT),
    logged and counted; so is one that is gone while the index still names
    it. The rest of the stream, other sessions and new turns are served."""
    async with sealing(etcd_endpoint) as stack:
        keys = Keys(stack.etcd.prefix)
        sid = await stack.create()
        other = await stack.create()
        head = await converse(stack, sid, 20)
        await converse(stack, other, 3)
        await quiet(raw, keys, sid)
        segments = sorted((object_dir(stack, sid) / "ev").glob("0*"))
        assert len(segments) >= 2, segments
        counted = in_process(metrics.OBJECTS_CORRUPT, "baton_objects_corrupt_total", log="ev")
        corrupt(segments[0])
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await read_bytes(stack, sid, 0)
        assert data_loss_reason(lost.value) == Reason.OBJECT_CORRUPT
        assert "checksum" in (lost.value.details() or "")
        after = in_process(metrics.OBJECTS_CORRUPT, "baton_objects_corrupt_total", log="ev")
        assert after == counted + 1
        # What follows the bad segment, the other session and a new turn.
        second = await index_of(raw, keys, sid, "ev")
        from_second = second.recent[1].first
        assert [e for e in await stack.events(sid, start_seq=from_second, follow=False)]
        assert len(await stack.events(other, follow=False)) > 0
        head = await converse(stack, sid, 1, head)
        # Gone while the index names it: DATA_LOSS too (after one re-read).
        segments[1].unlink()
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await read_bytes(stack, sid, from_second)
        assert data_loss_reason(gone.value) == Reason.OBJECT_CORRUPT
        assert "missing" in (gone.value.details() or "")
        # A history segment: the load refuses it.
        history = sorted((object_dir(stack, sid) / "h").glob("0*"))
        corrupt(history[0])
        anchor = stack.anchor_client()
        try:
            with pytest.raises(DataLoss) as refused:
                await anchor.load_session(sid)
            assert refused.value.reason == Reason.OBJECT_CORRUPT
        finally:
            await anchor.close()


async def test_retention_deletes_every_object_of_a_finalized_session(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    async with sealing(etcd_endpoint, retention_seconds=0.5) as stack:
        keys = Keys(stack.etcd.prefix)
        sid = await stack.create()
        kept = await stack.create()
        head = await converse(stack, sid, 20)
        await converse(stack, kept, 20)
        await quiet(raw, keys, sid)
        await quiet(raw, keys, kept)
        assert object_files(stack, sid) and object_files(stack, kept)
        await control(stack, sid, RESET, reason="done")
        await read_to_close(stack, sid, start_seq=head)

        async def deleted() -> bool:
            return not await raw.get_prefix(keys.session_prefix(sid)) and not object_files(
                stack, sid
            )

        await eventually(deleted, "the finalized session's keys and objects deleted", 20)
        assert object_files(stack, kept)
        assert len(await stack.events(kept, follow=False)) > 0


async def test_the_sweep_deletes_orphans_after_the_grace_period_only(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    """Objects nothing refers to (a writer that crashed before recording
    its segment; a session that is gone) are deleted once older than the
    grace period; the recorded ones stay."""
    async with sealing(etcd_endpoint, object_grace_seconds=1.0) as stack:
        keys = Keys(stack.etcd.prefix)
        sid = await stack.create()
        await converse(stack, sid, 20)
        await quiet(raw, keys, sid)
        recorded = object_files(stack, sid)
        top = object_dir(stack, sid)
        orphan = top / "ev" / f"{0:020d}-{0xDEAD:016x}"
        orphan.write_bytes(b"BATONSG1 left by a writer that crashed")
        gone = top.parent / "ses_gone0000000000000000000" / "h" / f"{0:020d}-{1:016x}"
        gone.parent.mkdir(parents=True)
        gone.write_bytes(b"BATONSG1 of a session deleted since")
        counted = in_process(metrics.ORPHANS_DELETED, "baton_orphan_objects_deleted_total")

        async def swept() -> bool:
            return not orphan.exists() and not gone.exists()

        await eventually(swept, "the orphans deleted", timeout=20)
        assert object_files(stack, sid) == recorded
        assert in_process(metrics.ORPHANS_DELETED, "baton_orphan_objects_deleted_total") >= (
            counted + 2
        )
        assert len(await stack.events(sid, follow=False)) > 0


async def test_a_retried_commit_whose_first_event_was_sealed_is_a_replay(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    """The retry of an applied commit (its answer lost) whose events were
    sealed since (their keys gone from etcd) reads as replayed."""
    async with sealing(etcd_endpoint) as stack:
        as_w = stack.security(Role.OWNER, "dep-w")  # a deployment without owners
        hooks, anchor = stack.hooks_client(as_w), stack.anchor_client(as_w)
        keys = Keys(stack.etcd.prefix)
        try:
            sid = ids.new_session_id()
            owner = s.OwnerIdentity(owner_run_id="run_w1", deployment_id="dep-w", instance_id="w1")
            created = await hooks.create_session(sid, owner, "slack", [])
            identity = RunIdentity(created.fence, "dep-w", "w1")
            snapshot = initial_snapshot(sid, "slack", "dep-w", list(created.hooks))
            events = [make_event(identity, s.EVENT_KIND_SESSION_STARTED)]
            events += [make_event(identity, s.EVENT_KIND_MESSAGE_COMPLETED) for _ in range(99)]
            for seq, event in enumerate(events):
                event.seq = seq
            snapshot.next_event_seq = len(events)
            request = anchor_pb.CommitStepRequest(
                fence=created.fence, events=events, snapshot=snapshot, expected_snapshot_revision=0
            )
            applied = await anchor.commit(request)
            await sealer(stack).seal(sid, flush=True)
            assert (await index_of(raw, keys, sid, "ev")).sealed_below == 99
            again = await anchor.commit(request)
            assert again.replayed and again.revision == applied.revision
            read = await stack.events(sid, follow=False)
            assert [e.SerializeToString() for e in read] == [e.SerializeToString() for e in events]
        finally:
            await hooks.close()
            await anchor.close()


def test_the_settings_come_from_flags_env_and_baton_up(tmp_path: Path) -> None:
    base = {"BATON_PLAINTEXT": "1"}
    default = AnchorConfig.load([], base)
    assert (default.object_store, default.seal_idle_seconds) == ("", 300.0)
    assert default.object_grace_seconds == 3600.0
    by_env = AnchorConfig.load(
        [],
        base
        | {
            "BATON_OBJECT_STORE": "s3://bucket/baton",
            "BATON_SEAL_IDLE": "5",
            "BATON_OBJECT_ORPHAN_GRACE": "60",
        },
    )
    assert (by_env.object_store, by_env.seal_idle_seconds) == ("s3://bucket/baton", 5.0)
    assert by_env.object_grace_seconds == 60.0
    flags = ["--object-store", "file:///srv/objects", "--seal-idle", "1"]
    assert AnchorConfig.load(flags, base).object_store == "file:///srv/objects"
    for bad in (
        ["--object-store", "s3://id:secret@bucket"],
        ["--object-store", "ftp://host/x"],
        ["--seal-idle", "0"],
        ["--object-orphan-grace", "0.5"],
    ):
        with pytest.raises(ConfigError):
            AnchorConfig.load(bad, base)
    # `baton up` passes its --object-store to anchor; by default anchor gets
    # an embedded file:// store under the run directory.
    args = build_parser().parse_args(["up", "--object-store", "s3://bucket/p"])
    asked = LocalSystem(
        LaunchSettings(object_store=args.object_store), Ports.plan(0, 0), tmp_path, io.StringIO()
    )
    assert AnchorConfig.load([], asked.service_env("anchor", None)).object_store == "s3://bucket/p"
    assert "BATON_OBJECT_STORE" not in asked.service_env("hooks", None)
    embedded = LocalSystem(LaunchSettings(), Ports.plan(0, 0), tmp_path, io.StringIO())
    env = embedded.service_env("anchor", None)
    assert env["BATON_OBJECT_STORE"] == f"file://{(tmp_path / 'objects').resolve()}"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--object-store", "s3://id:secret@bucket"])


async def test_readers_racing_seals_see_every_event_once(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    """Readers from seq 0 and from the middle, over and over, while turns
    run and the session's tails are sealed between them (quiet for 50 ms):
    every read is gapless, in order, and a prefix of the final stream."""
    async with sealing(etcd_endpoint, seal_idle_seconds=0.05) as stack:
        sid = await stack.create()
        follower = LiveFollower(stack, sid)
        reads: list[tuple[int, list[bytes]]] = []
        done = asyncio.Event()

        async def reader(start: int) -> None:
            while not done.is_set():
                got = await stack.events(sid, start_seq=start, follow=False, timeout=60)
                assert [e.seq for e in got] == list(range(start, start + len(got)))
                reads.append((start, [e.SerializeToString() for e in got]))

        try:
            await stack.send(sid, "turn 0")
            await follower.until_waits(1)
            tasks = [asyncio.ensure_future(reader(start)) for start in (0, 0)]
            for turn in range(2, 42):
                await stack.send(sid, f"turn {turn}")
                await follower.until_waits(turn)
                if len(tasks) == 2 and len(follower.events) > 100:
                    # From the middle once the head is past it (a cursor
                    # beyond the head is OUT_OF_RANGE/BEYOND_HEAD).
                    tasks.append(asyncio.ensure_future(reader(100)))
                await asyncio.sleep(0.08)  # quiet: the tails are sealed
                for task in tasks:
                    if task.done():
                        task.result()
            done.set()
            await asyncio.gather(*tasks)
            live = list(follower.events)
        finally:
            done.set()
            await follower.close()
        keys = Keys(stack.etcd.prefix)
        sealed = (await index_of(raw, keys, sid, "ev")).sealed_below
        assert sealed > 100 and len(reads) > 10, (sealed, len(reads))
        for start, got in reads:
            assert got == live[start : start + len(got)]
        assert await read_bytes(stack, sid) == live


async def test_the_horizon_drops_sealed_segments_and_deletes_their_objects(
    etcd_endpoint: str, raw: aetcd.Client
) -> None:
    """A stream keeping its last 200 events: the segments wholly below the
    horizon leave the index and the store; a read below the horizon is
    OUT_OF_RANGE/BELOW_HORIZON, from it gapless across segments and tail."""
    async with sealing(
        etcd_endpoint, stream_retention_events=200, stream_retention_seconds=0.0
    ) as stack:
        keys = Keys(stack.etcd.prefix)
        sid = await stack.create()
        head = await converse(stack, sid, 80)
        await quiet(raw, keys, sid)

        async def trimmed() -> spb.SegmentIndex | None:
            index = await index_of(raw, keys, sid, "ev")
            kv = await raw.get(keys.horizon(sid))
            horizon = int(kv.value) if kv is not None else 0
            return index if horizon == head - 200 and index.dropped_below == horizon else None

        index = await eventually(trimmed, "the horizon at the last 200 events", timeout=20)
        horizon = head - 200
        names = ObjectNames.of(stack.etcd.prefix)
        root = Path(urlsplit(object_store_url()).path)
        listed = {str(p.relative_to(root)) for p in (object_dir(stack, sid) / "ev").glob("0*")}
        kept = {names.segment(sid, EV, ref) for ref in ix.live(list(index.recent), horizon)}
        assert listed == kept, (listed, kept)
        assert min(ref.first for ref in index.recent) <= horizon < index.sealed_below
        with pytest.raises(grpc.aio.AioRpcError) as below:
            await read_bytes(stack, sid, horizon - 1)
        assert below.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert error_reason(below.value) == Reason.BELOW_HORIZON
        events = await stack.events(sid, start_seq=horizon, follow=False)
        assert [e.seq for e in events] == list(range(horizon, head))
