"""`baton deployments drain OLD --to NEW`: retire a deployment without
stranding a session (docs/design.md §13, docs/deploy.md).

Asks every live owner instance of OLD to hand every session it holds to NEW
through the ordinary handoff: idle ones at once, parked ones after waking
them, busy ones the moment they are next idle. Reports progress and, when it
stops waiting, what is left and why. Safe to repeat: each instance only
(re)sets its drain target and answers its progress.

Output (`-o`): `text` progress lines for people; `json` one object at the
end (`from`, `to`, `drained`, `moved`, `left`, the last report of each
instance with its blockers, or with no fleet left the sessions left on it);
`jsonl` a line per change of progress, then that object.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict

from services.common import ids
from services.common.client_answers import DrainReport, OwnedSession
from services.common.errors import BatonError
from services.common.hooks_client import HooksClient
from services.common.owner_client import OwnerClient
from services.common.tls import Security

EXIT_DRAINED = 0
EXIT_USAGE = 2
EXIT_LEFT = 3
_LISTED = 20  # sessions named when a fleet is gone (the rest are counted)


class DrainError(Exception):
    """The drain could not be asked for (the message says why)."""


async def drain(
    hooks_address: str,
    old: str,
    new: str,
    security: Security,
    *,
    wait_s: float = 60.0,
    poll_s: float = 0.5,
    write: Callable[[str], None] = print,
    output: str = "text",
) -> int:
    """Drain `old` to `new`; EXIT_DRAINED once no instance of `old` holds a
    session, EXIT_LEFT when some are still there after `wait_s`."""
    machine = output != "text"
    say = (lambda line: None) if machine else write

    def outcome(code: int, reports: list[DrainReport], left_on_gone: list[str]) -> int:
        if machine:
            data = {
                "from": old,
                "to": new,
                "drained": code == EXIT_DRAINED,
                "moved": sum(r.moved for r in reports),
                "left": sum(r.remaining for r in reports) + len(left_on_gone),
                "instances": [asdict(r) for r in reports],
                "sessions_left_without_fleet": left_on_gone,
            }
            write(json.dumps(data, indent=2 if output == "json" else None, sort_keys=True))
        return code

    old = ids.validate_deployment_id(old)
    new = ids.validate_deployment_id(new)
    if old == new:
        raise DrainError(f"deployment {old} cannot be drained to itself")
    hooks = HooksClient(hooks_address, security=security)  # as an operator
    owners: dict[str, OwnerClient] = {}
    try:
        if not await hooks.list_instances(new):
            raise DrainError(f"deployment {new} has no live owner instance to take sessions")
        deadline = time.monotonic() + wait_s
        last = ""
        while True:
            instances = await hooks.list_instances(old)
            if not instances:
                left_on_gone = await hooks.list_instance_sessions(old, "")
                code = _no_fleet_left(left_on_gone, old, new, say)
                return outcome(code, [], [o.fence.session_id for o in left_on_gone])
            reports: list[DrainReport] = []
            for instance in instances:
                client = owners.get(instance.address)
                if client is None:
                    client = owners[instance.address] = OwnerClient(
                        instance.address, security=security
                    )
                try:
                    reports.append(await client.drain_sessions(new))
                except BatonError as exc:  # gone meanwhile: its sessions are taken over
                    say(f"  {instance.instance_id}: {exc.reason}: {exc.message}")
            moved = sum(r.moved for r in reports)
            left = sum(r.remaining for r in reports)
            per_instance = ", ".join(f"{r.instance_id}: {r.remaining}" for r in reports)
            line = f"  {moved} moved to {new}, {left} left on {old} ({per_instance})"
            if line != last:
                say(line)
                if output == "jsonl":
                    write(json.dumps({"moved": moved, "left": left}, sort_keys=True))
                last = line
            if left == 0:
                say(f"drained: nothing left on {old}; its fleet can be scaled to zero")
                return outcome(EXIT_DRAINED, reports, [])
            if time.monotonic() >= deadline:
                say(f"{left} session(s) left on {old} after {wait_s:.0f}s:")
                for report in reports:
                    for blocker in report.blockers:
                        say(f"  {blocker.session_id}  {blocker.reason}  {blocker.detail}")
                say("run the same command again to keep draining")
                return outcome(EXIT_LEFT, reports, [])
            await asyncio.sleep(poll_s)
    except BatonError as exc:
        raise DrainError(f"{exc.reason}: {exc.message}") from exc
    finally:
        await hooks.close()
        for client in owners.values():
            await client.close()


def _no_fleet_left(
    left: list[OwnedSession], old: str, new: str, write: Callable[[str], None]
) -> int:
    """`old` has no live owner to drain its sessions: say whether any are
    left on it, and what becomes of them (docs/deploy.md, adoption)."""
    if not left:
        write(f"deployment {old} has no live owner instance and holds no session")
        return EXIT_DRAINED
    write(
        f"deployment {old} has no live owner instance, and {len(left)} session(s) are left "
        f"on it: a settled one moves to {new} (adoption) when a message for it arrives "
        f"through {new}'s ingress; one left mid-step waits for an owner of {old}"
    )
    for owned in left[:_LISTED]:
        write(f"  {owned.fence.session_id}  {'parked' if owned.parked else 'held'}")
    if len(left) > _LISTED:
        write(f"  ... and {len(left) - _LISTED} more")
    return EXIT_LEFT
