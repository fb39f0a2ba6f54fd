"""Which etcd releases Baton runs on: one table of known-bad releases, the
verdict on a version, and the corruption-check flags a release takes.

Pure (no I/O): `baton up`, the test stack, hooks and anchor (for the members
of an external cluster) and `baton etcd check` all judge a version here, so
there is one answer to "is this etcd safe?" and one place to add a row when
etcd announces a new defect. docs/etcd.md shows the same table to operators.

A row is a range of releases with a defect that loses or diverges committed
data (or, for #14110, crashes on a call Baton makes), the release that fixed
it and a link. The guidance of etcd and Kubernetes follows from the rows:
3.4.22 or later on the 3.4 line, 3.5.6 or later on the 3.5 line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ISSUE = "https://github.com/etcd-io/etcd/issues/13766"
"""The defect that made this table necessary (3.5.0-3.5.2 lose committed
transactions when a member is killed under load)."""

INSTALL_HINT = (
    "install a safe etcd (Debian/Ubuntu: apt-get install -y etcd-server, 3.4.23 today; or "
    "an official 3.5.6+ / 3.6 release) and put it on PATH or pass --etcd-binary "
    "(BATON_ETCD_BINARY)"
)
RISK_HINT = "to run it anyway, pass --accept-etcd-risk (BATON_ACCEPT_ETCD_RISK=1)"


@dataclass(frozen=True, order=True)
class EtcdVersion:
    major: int
    minor: int
    patch: int
    # "rc.1", "alpha.0", ...; "" for a release. Ordered after the numbers only
    # for sorting; the table judges a pre-release as the release it precedes.
    pre: str = ""

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}" + (f"-{self.pre}" if self.pre else "")


_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z.]+))?")


def parse_version(text: str) -> EtcdVersion | None:
    """The first `X.Y.Z[-pre]` in `text` (`3.5.1`, `v3.6.0-rc.1`), None if none."""
    match = _VERSION.search(text)
    if match is None:
        return None
    major, minor, patch, pre = match.groups()
    return EtcdVersion(int(major), int(minor), int(patch), pre or "")


_BINARY_VERSION = re.compile(r"etcd Version:\s*(\S+)")


def parse_binary_version(output: str) -> EtcdVersion | None:
    """The version in `etcd --version`'s output ("etcd Version: 3.4.23")."""
    match = _BINARY_VERSION.search(output)
    return parse_version(match.group(1)) if match else None


@dataclass(frozen=True)
class KnownDefect:
    """Releases `first` to `last` (inclusive) have this defect."""

    first: EtcdVersion
    last: EtcdVersion
    fixed_in: str
    reason: str
    link: str

    def covers(self, version: EtcdVersion) -> bool:
        plain = EtcdVersion(version.major, version.minor, version.patch)
        return self.first <= plain <= self.last

    @property
    def releases(self) -> str:
        return f"{self.first}" if self.first == self.last else f"{self.first} - {self.last}"


def _v(text: str) -> EtcdVersion:
    version = parse_version(text)
    assert version is not None
    return version


KNOWN_BAD: tuple[KnownDefect, ...] = (
    KnownDefect(
        _v("3.0.0"),
        _v("3.4.20"),
        "3.4.21",
        "a single-member cluster can lose a write it acknowledged when it crashes right "
        "after answering (`baton up` runs one member by default)",
        "https://github.com/etcd-io/etcd/issues/14370",
    ),
    KnownDefect(
        _v("3.4.20"),
        _v("3.4.21"),
        "3.4.22",
        "with auth on (as Baton runs etcd), a newly added member can fail to apply entries "
        "and diverge from the others",
        "https://github.com/etcd-io/etcd/issues/14571",
    ),
    KnownDefect(
        _v("3.5.0"),
        _v("3.5.2"),
        "3.5.3",
        "a member killed under load can lose committed transactions (revisions diverge)",
        ISSUE,
    ),
    KnownDefect(
        _v("3.5.0"),
        _v("3.5.4"),
        "3.5.5",
        "a single-member cluster can lose a write it acknowledged when it crashes right "
        "after answering",
        "https://github.com/etcd-io/etcd/issues/14370",
    ),
    KnownDefect(
        _v("3.5.0"),
        _v("3.5.4"),
        "3.5.5",
        "a read-only txn whose request context ends early (a client cancel or deadline) "
        "panics the member",
        "https://github.com/etcd-io/etcd/issues/14110",
    ),
    KnownDefect(
        _v("3.5.0"),
        _v("3.5.5"),
        "3.5.6",
        "a member that crashes during defragmentation re-applies entries on restart "
        "(revision inconsistency)",
        "https://github.com/etcd-io/etcd/pull/14685",
    ),
    KnownDefect(
        _v("3.5.5"),
        _v("3.5.5"),
        "3.5.6",
        "with auth on, a newly added member can fail to apply entries and diverge",
        "https://github.com/etcd-io/etcd/issues/14571",
    ),
)


@dataclass(frozen=True)
class Verdict:
    """What the table says about one etcd: `ok`, or the defects that make it
    unsafe (or that its version could not be read)."""

    version: EtcdVersion | None
    defects: tuple[KnownDefect, ...] = ()

    @property
    def ok(self) -> bool:
        return self.version is not None and not self.defects

    def explain(self, what: str = "etcd") -> str:
        """One paragraph for an operator: which release, why it is refused,
        what to install, how to run it anyway."""
        if self.ok:
            return f"{what} {self.version} has no known data-loss defect"
        if self.version is None:
            why = f"{what}: its version could not be read, so Baton cannot tell if it is safe"
        else:
            reasons = "; ".join(
                f"{d.reason} (fixed in {d.fixed_in}: {d.link})" for d in self.defects
            )
            why = f"{what} {self.version} is a known-bad release: {reasons}"
        return f"{why}. See docs/etcd.md (known-bad releases); {INSTALL_HINT}; {RISK_HINT}."


def judge(version: EtcdVersion | None) -> Verdict:
    if version is None:
        return Verdict(None)
    return Verdict(version, tuple(d for d in KNOWN_BAD if d.covers(version)))


def corruption_check_flags(
    version: EtcdVersion, *, periodic: str = "5m", compact_hash: str = "1m"
) -> list[str]:
    """etcd's corruption checks, as this release spells them: the initial
    check before serving, the leader's periodic hash check of every member,
    and (3.5.5+) the check of the hashes kept at each compaction. 3.6 moved
    the experimental flags to feature gates and plain names (the old ones
    are deprecated there and go in 3.7)."""
    if (version.major, version.minor) >= (3, 6):
        return [
            "--feature-gates=InitialCorruptCheck=true,CompactHashCheck=true",
            f"--corrupt-check-time={periodic}",
            f"--compact-hash-check-time={compact_hash}",
        ]
    flags = [
        "--experimental-initial-corrupt-check=true",
        f"--experimental-corrupt-check-time={periodic}",
    ]
    if (version.major, version.minor, version.patch) >= (3, 5, 5):
        flags += [
            "--experimental-compact-hash-check-enabled=true",
            f"--experimental-compact-hash-check-time={compact_hash}",
        ]
    return flags
