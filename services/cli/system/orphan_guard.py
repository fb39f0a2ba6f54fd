"""`python -m baton_runtime.cli.system.orphan_guard PARENT_PID -- COMMAND [ARGS...]`:
become COMMAND (same process id) with Linux's parent-death signal set to
SIGKILL, so it dies when the thread that started it ends.

Every etcd and service that `baton up` and the tests start runs in a
session of its own (a terminal's Ctrl-C reaches only the parent, which stops
them in order); without this, a parent that is itself killed, timed out or
interrupted would leave them running. The signal is set here, after exec,
rather than in a `preexec_fn`: Python code between fork and exec runs the
fork handlers of gRPC's threads, which can abort the child.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit(
            "usage: python -m baton_runtime.cli.system.orphan_guard PARENT_PID -- COMMAND [ARGS...]"
        )
    parent, command = int(argv[0]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit(f"orphan_guard: prctl failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:  # the parent ended before the signal was set
        sys.exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
