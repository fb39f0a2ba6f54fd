"""The chaos run of tests/chaos.py: combined faults on the production
topology, then a history check over every session's whole stream and the
etcd members' hashes (issue 16). A short version runs in the default suite;
the long one (12 minutes of faults, tens of thousands of commands) is slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import run_chaos


@pytest.mark.timeout(600)
async def test_combined_faults_leave_nothing_accepted_unprocessed(tmp_path: Path) -> None:
    report = await run_chaos(
        tmp_path,
        seconds=40,
        sessions=12,
        senders_per_session=2,
        fault_every=(2.0, 4.0),
    )
    assert report.accepted > 500
    assert sum(report.faults.values()) >= 8


@pytest.mark.slow
@pytest.mark.timeout(3000)
async def test_twelve_minutes_of_combined_faults_slow(tmp_path: Path) -> None:
    report = await run_chaos(tmp_path, seconds=720, sessions=32, senders_per_session=3)
    assert report.accepted >= 50_000
    assert sum(report.faults.values()) >= 100
