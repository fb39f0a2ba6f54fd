"""The chaos run of tests/chaos.py: combined process and network faults on
the production topology, then a history check over every session's whole
stream, the fence of every commit and the etcd members' hashes (issues 16
and 38). A short version runs in the default suite; the long one (22
minutes of faults, over 100,000 commands) is slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from tests.chaos import arguments, replay_command, run_chaos, waits_again


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
    assert report.commits_checked > 0


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
