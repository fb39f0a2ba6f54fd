"""The chaos run of tests/chaos.py: combined process and network faults on
the production topology, then a history check over every session's whole
stream, the fence of every commit and the etcd members' hashes (issues 16
and 38). A short version runs in the default suite; the long one (22
minutes of faults, over 100,000 commands) is slow."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.etcd.keys import Keys
from tests.certs import TEST_PREFIX, etcd_root_client
from tests.chaos import (
    FenceLog,
    KeyLog,
    KeyValue,
    arguments,
    replay_command,
    run_chaos,
    waits_again,
)


@pytest.mark.timeout(600)
async def test_combined_faults_leave_nothing_accepted_unprocessed(tmp_path: Path) -> None:
    """Every kind of fault about once (they come in a seeded order, each
    kind once per round), network faults among them."""
    report = await run_chaos(
        tmp_path,
        seconds=40,
        sessions=12,
        senders_per_session=2,
        fault_every=(1.5, 3.0),
    )
    assert report.accepted > 500
    assert sum(report.faults.values()) >= 12
    assert report.network_faults >= 7
    # About a commit per command (a turn's steps add some, queued messages
    # joining one turn take some): the fence check dated them all.
    assert report.commits_checked >= report.accepted / 3
    assert report.commits_unchecked <= report.commits_checked / 100


@pytest.mark.slow
@pytest.mark.timeout(5400)
async def test_twenty_two_minutes_of_combined_faults_slow(tmp_path: Path) -> None:
    report = await run_chaos(
        tmp_path, seconds=1320, sessions=32, senders_per_session=3, fault_every=(3.5, 7.5)
    )
    assert report.accepted >= 100_000
    assert sum(report.faults.values()) >= 150
    assert report.network_faults >= 60


K = s.EventKind
TURN = [
    K.EVENT_KIND_TURN_STARTED,
    K.EVENT_KIND_MESSAGE_RECEIVED,
    K.EVENT_KIND_STEP_STARTED,
    K.EVENT_KIND_MESSAGE_COMPLETED,
    K.EVENT_KIND_STEP_COMPLETED,
    K.EVENT_KIND_TURN_COMPLETED,
    K.EVENT_KIND_SESSION_WAITING,
]


@pytest.mark.parametrize(
    ("tail", "settled"),
    [
        ([], True),
        # Seed 388078060: an idle session adopted (its fleet gone) says
        # session.handed_off with its successor's first commit, and no more.
        ([K.EVENT_KIND_SESSION_HANDED_OFF], True),
        # Automatic compaction commits after the turn settles (design §16).
        ([K.EVENT_KIND_CONTEXT_COMPACTED], True),
        ([K.EVENT_KIND_CONTEXT_COMPACTED, K.EVENT_KIND_SESSION_HANDED_OFF], True),
        # A handoff with a trigger runs the trigger's turn next.
        ([K.EVENT_KIND_SESSION_HANDED_OFF, K.EVENT_KIND_TURN_STARTED], False),
        (TURN[:-1], False),
    ],
    ids=["waiting", "adopted", "compacted", "compacted-adopted", "trigger-turn", "turn-open"],
)
def test_a_session_waits_again_after_what_an_idle_session_commits(
    tail: list[s.EventKind.ValueType], settled: bool
) -> None:
    kinds = [K.EVENT_KIND_SESSION_STARTED, *TURN, *tail]
    events = [s.Event(seq=seq, kind=kind) for seq, kind in enumerate(kinds)]
    assert waits_again(events) is settled


def test_a_session_that_never_waited_does_not_wait_again() -> None:
    kinds = [K.EVENT_KIND_SESSION_STARTED, K.EVENT_KIND_SESSION_HANDED_OFF]
    assert not waits_again([s.Event(seq=seq, kind=kind) for seq, kind in enumerate(kinds)])
    assert not waits_again([])


def test_the_printed_replay_command_runs_the_same_chaos() -> None:
    """The short test's seed replayed with the CLI's defaults (the long
    run's options) is another run: the command names every option."""
    command = replay_command(388078060, 40, 12, 2, (2.0, 4.0))
    args = arguments().parse_args(command.split()[3:])
    assert (args.seed, args.seconds, args.sessions, args.senders) == (388078060, 40, 12, 2)
    assert args.fault_every == [2.0, 4.0]
    assert args.network and args.faults == ""
    command = replay_command(7, 40, 12, 2, (2.0, 4.0), False, ("owner_kill", "link_flap"))
    args = arguments().parse_args(command.split()[3:])
    assert not args.network and args.faults == "owner_kill,link_flap"


def fence_log(fences: list[tuple[int, bytes]], markers: list[tuple[int, bytes]]) -> FenceLog:
    log = FenceLog("", "/t/x/")
    log.fences["s"] = KeyLog([KeyValue(rev, value) for rev, value in fences])
    log.markers["s"] = KeyLog([KeyValue(rev, value) for rev, value in markers])
    return log


def test_the_fence_check_dates_each_event_by_its_commit_and_finds_a_stale_one() -> None:
    """Run a holds the session from revision 10, run b from 20 (a
    takeover): b's commit at 25 passes; a's commit at 25 is one accepted
    from a run that no longer held the session, even with no commit of b's
    before it."""
    log = fence_log([(10, b"1/run_a"), (20, b"2/run_b")], [(10, b"0"), (15, b"2"), (25, b"3")])
    events = [s.Event(seq=seq, owner_run_id="run_a") for seq in range(3)]
    assert log.check("s", [*events, s.Event(seq=3, owner_run_id="run_b")], 1) == (3, 0)
    with pytest.raises(AssertionError, match="no longer held the session"):
        log.check("s", [*events, s.Event(seq=3, owner_run_id="run_a")], 1)


def test_the_fence_check_wants_each_new_fence_a_higher_epoch() -> None:
    log = fence_log([(10, b"2/run_a"), (20, b"2/run_b")], [(10, b"0")])
    with pytest.raises(AssertionError, match="epoch did not grow"):
        log.check("s", [s.Event(seq=0, owner_run_id="run_a")], 1)


def test_the_fence_check_skips_what_a_blind_window_hides() -> None:
    """The marker log resumed past a compaction: the commit it read after
    the gap may be one of several, and is not checked."""
    log = fence_log([(10, b"1/run_a")], [(10, b"0"), (30, b"2")])
    log.markers["s"].blind.append((10, 30))
    log.markers["s"].after_gap.add(1)
    events = [s.Event(seq=seq, owner_run_id="run_a") for seq in range(3)]
    assert log.check("s", events, 1) == (1, 1)


def test_a_log_resumed_past_a_compaction_is_blind_from_what_it_logged_last() -> None:
    """Values between the last one logged (or, none logged, the session's
    creation) and the one read after the gap may be missing."""
    log = KeyLog()
    log.record(10, b"0")
    log.read_after_gap(5, 30, b"2")
    log.read_after_gap(5, 31, b"3")  # written right after the last: nothing between
    assert (log.blind, log.after_gap, log.revisions()) == ([(10, 30)], {1}, [10, 30, 31])
    log = KeyLog()  # the watch compacted before it said anything
    log.read_after_gap(5, 25, b"2/run_b")
    assert (log.blind, log.after_gap) == ([(4, 25)], {0})
    log = KeyLog()
    log.read_after_gap(5, 5, b"1/run_a")  # the creation's own value: nothing missed
    assert (log.blind, log.after_gap) == ([], set())


def test_a_log_resumed_past_a_compaction_misses_nothing_when_the_version_follows() -> None:
    """A watch resumed from the revision of a value minutes old (the fence
    changes seldom) is compacted; the key changed once meanwhile (its
    version the next one): nothing was missed, nothing is blind."""
    log = KeyLog()
    log.record(10, b"1/run_a", version=1)
    log.read_after_gap(5, 900, b"2/run_b", version=2)
    assert (log.blind, log.after_gap, log.revisions()) == ([], set(), [10, 900])
    log.read_after_gap(5, 900, b"2/run_b", version=2)  # read again: logged already
    log.read_after_gap(5, 990, b"4/run_d", version=4)  # 3/run_c missed
    assert (log.blind, log.after_gap) == ([(900, 990)], {2})
    log = KeyLog()  # compacted before it logged anything
    log.read_after_gap(5, 25, b"1/run_a", version=1)
    assert (log.blind, log.after_gap) == ([], set())


async def test_the_fence_log_checks_nothing_it_may_have_missed_behind_a_compaction(
    etcd_endpoint: str,
) -> None:
    """Run a committed event 0, run b took over and committed event 1, and
    etcd compacted it all before the log's watches (from the session's
    creation) began: what the log read after the gap dates both events,
    and neither is checked (nor reported as a commit from a stale run)."""
    prefix = f"{TEST_PREFIX}fencelog-{uuid.uuid4().hex}/"
    keys = Keys(prefix)
    root = await etcd_root_client(etcd_endpoint)
    log = await FenceLog(etcd_endpoint, prefix).start()
    try:
        await root.put(keys.fence("s"), b"1/run_a")
        await root.put(keys.commit_marker("s"), b"0")
        await root.put(keys.fence("s"), b"2/run_b")
        await root.put(keys.commit_marker("s"), b"1")
        await root.compact((await root.get_prefix(keys.commit_marker("s"))).header.revision)
        log.follow("s")
        await log.caught_up("s", timeout=30)
        events = [s.Event(seq=0, owner_run_id="run_a"), s.Event(seq=1, owner_run_id="run_b")]
        assert log.check("s", events, 1) == (0, 1)
        assert log.markers["s"].after_gap == {0}
    finally:
        await log.close()
        await root.close()
