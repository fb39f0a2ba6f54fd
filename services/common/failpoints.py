"""Failpoints: named places in the code where a test makes a process die,
stall or see an error at an exact step (the idea of etcd's gofail).

Off unless configured. A process reads `BATON_FAILPOINTS` at start, e.g.

    BATON_FAILPOINTS="handoff.after_prepare=sleep(1500);handoff.activate=kill"

Actions:
- `kill`       — SIGKILL this process at that point (a crash, like kill -9);
- `sleep(ms)`  — stall there for that many milliseconds;
- `error`      — raise Unavailable there (e.g. a lost response);
- `once:<action>` — do it the first time only.

In-process tests call `configure(spec)` and `configure("")` to clear.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import structlog

from baton_runtime.common.errors import Reason, Unavailable

log = structlog.get_logger("baton.failpoints")

ENV = "BATON_FAILPOINTS"

_active: dict[str, str] = {}


def configure(spec: str) -> None:
    """Replace the active failpoints with `spec` ("name=action;...")."""
    _active.clear()
    for item in spec.split(";"):
        name, _, action = item.strip().partition("=")
        if not name:
            continue
        if not action:
            raise ValueError(f"failpoint {name!r} has no action")
        _active[name.strip()] = action.strip()


def _fire(name: str) -> str | None:
    """The action configured for `name` (a `once:` one consumed), logged as
    hit; None when there is none (a dict lookup)."""
    action = _active.get(name)
    if action is None:
        return None
    if action.startswith("once:"):
        action = action.removeprefix("once:")
        del _active[name]
    log.warning("failpoint hit", failpoint=name, action=action)
    return action


async def hit(name: str) -> None:
    """Run the action configured for `name`, if any (a dict lookup when none)."""
    action = _fire(name)
    if action is None:
        return
    if action == "kill":
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith("sleep(") and action.endswith(")"):
        await asyncio.sleep(int(action[6:-1]) / 1000)
    elif action == "error":
        raise Unavailable(Reason.UPSTREAM_UNAVAILABLE, f"failpoint {name}")
    else:
        raise ValueError(f"failpoint {name!r}: unknown action {action!r}")


def armed(name: str) -> bool:
    """For a synchronous place: whether `name` is configured with `error`
    (or `once:error`, consumed here); the caller then skips its step."""
    action = _fire(name)
    if action is None:
        return False
    if action != "error":
        raise ValueError(f"failpoint {name!r}: only error is allowed here, not {action!r}")
    return True


configure(os.environ.get(ENV, ""))
