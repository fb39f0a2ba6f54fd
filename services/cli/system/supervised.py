"""What `baton up` supervises: the children it started (`Child`, whatever
kind: etcd or a service) and the stop signals it polls for (`StopSignals`).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType


class StopSignals:
    """SIGINT/SIGTERM set a flag that the supervisor polls; nothing is raised
    from the handler, so no child can be spawned without being recorded."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)


@dataclass
class Child:
    """One started process, whatever kind."""

    name: str
    address: str
    log_path: str
    proc: subprocess.Popen[bytes]
    stop: Callable[[float], None]
    # The deployment an owner or ingress serves; "" for shared processes.
    deployment_id: str = ""
    # "owner" for every owner replica ("owner", "owner-2", ...); "" = `name`.
    service: str = ""
    # Where its Prometheus metrics are served ("" for etcd).
    metrics_url: str = ""

    @property
    def kind(self) -> str:
        return self.service or self.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def label(self) -> str:
        """ "hooks", or "owner of dep-2" for a per-deployment process."""
        return f"{self.name} of {self.deployment_id}" if self.deployment_id else self.name

    def exit_code(self) -> int | None:
        return self.proc.poll()


def log_tail(path: str, lines: int = 20) -> str:
    """The last `lines` lines of a child's log ("" if it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
