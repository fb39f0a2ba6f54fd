"""`baton deployments drain OLD --to NEW`: retire a deployment without
stranding a session (docs/design.md §13, docs/deploy.md); `baton
deployments undrain DEP`: stop it.

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

from baton_runtime.common import ids
from baton_runtime.common.clients.answers import (
    DrainReport,
    OwnedSession,
    OwnerInstance,
    Undrained,
)
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.errors import BatonError, NotFound, Reason
from baton_runtime.common.security.tls import Security

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
    old = ids.validate_deployment_id(old)
    new = ids.validate_deployment_id(new)
    if old == new:
        raise DrainError(f"deployment {old} cannot be drained to itself")
    hooks = HooksClient(hooks_address, security=security)  # as an operator
    progress = _Progress(old, new, write, output)
    owners = _Owners(security)
    try:
        if not await hooks.list_instances(new):
            raise DrainError(f"deployment {new} has no live owner instance to take sessions")
        deadline = time.monotonic() + wait_s
        while True:
            instances = await hooks.list_instances(old)
            if not instances:
                left_on_gone = await hooks.list_instance_sessions(old, "")
                code = _no_fleet_left(left_on_gone, old, new, progress.say)
                return progress.outcome(code, [], [o.fence.session_id for o in left_on_gone])
            reports = await owners.drain(instances, new, progress.say)
            left = progress.report(reports)
            if left == 0:
                progress.say(f"drained: nothing left on {old}; its fleet can be scaled to zero")
                return progress.outcome(EXIT_DRAINED, reports, [])
            if time.monotonic() >= deadline:
                progress.blocked(reports, left, wait_s)
                return progress.outcome(EXIT_LEFT, reports, [])
            await asyncio.sleep(poll_s)
    except BatonError as exc:
        raise DrainError(f"{exc.reason}: {exc.message}") from exc
    finally:
        await hooks.close()
        await owners.close()


class _Owners:
    """A client per owner instance of the drained deployment, kept across
    polls, asked to drain its sessions."""

    def __init__(self, security: Security) -> None:
        self._security = security
        self._clients: dict[str, OwnerClient] = {}

    async def drain(
        self, instances: list[OwnerInstance], new: str, say: Callable[[str], None]
    ) -> list[DrainReport]:
        """Each instance's report on draining to `new` (one gone meanwhile
        is said and skipped: its sessions are taken over)."""
        reports: list[DrainReport] = []
        for instance in instances:
            client = self._clients.get(instance.address)
            if client is None:
                client = OwnerClient(instance.address, security=self._security)
                self._clients[instance.address] = client
            try:
                reports.append(await client.drain_sessions(new))
            except BatonError as exc:
                say(f"  {instance.instance_id}: {exc.reason}: {exc.message}")
        return reports

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


class _Progress:
    """What a drain prints: progress lines for people (`text`), a line per
    change of progress (`jsonl`), and one object at the end (`json`, `jsonl`)."""

    def __init__(self, old: str, new: str, write: Callable[[str], None], output: str) -> None:
        self.old = old
        self.new = new
        self.write = write
        self.output = output
        self.machine = output != "text"
        self._last = ""

    def say(self, line: str) -> None:
        if not self.machine:
            self.write(line)

    def report(self, reports: list[DrainReport]) -> int:
        """Say the progress if it changed; returns how many are left."""
        moved = sum(r.moved for r in reports)
        left = sum(r.remaining for r in reports)
        per_instance = ", ".join(f"{r.instance_id}: {r.remaining}" for r in reports)
        line = f"  {moved} moved to {self.new}, {left} left on {self.old} ({per_instance})"
        if line != self._last:
            self.say(line)
            if self.output == "jsonl":
                self.write(json.dumps({"moved": moved, "left": left}, sort_keys=True))
            self._last = line
        return left

    def blocked(self, reports: list[DrainReport], left: int, wait_s: float) -> None:
        """What is left after the wait, and why."""
        self.say(f"{left} session(s) left on {self.old} after {wait_s:.0f}s:")
        for report in reports:
            for blocker in report.blockers:
                self.say(f"  {blocker.session_id}  {blocker.reason}  {blocker.detail}")
        self.say("run the same command again to keep draining")

    def outcome(self, code: int, reports: list[DrainReport], left_on_gone: list[str]) -> int:
        """The closing object (machine output only); returns `code`."""
        if self.machine:
            data = {
                "from": self.old,
                "to": self.new,
                "drained": code == EXIT_DRAINED,
                "moved": sum(r.moved for r in reports),
                "left": sum(r.remaining for r in reports) + len(left_on_gone),
                "instances": [asdict(r) for r in reports],
                "sessions_left_without_fleet": left_on_gone,
            }
            indent = 2 if self.output == "json" else None
            self.write(json.dumps(data, indent=indent, sort_keys=True))
        return code


async def undrain(
    hooks_address: str,
    deployment_id: str,
    security: Security,
    *,
    write: Callable[[str], None] = print,
    output: str = "text",
) -> int:
    """Ask every live owner instance of `deployment_id` to stop draining: it
    keeps the sessions still on it and takes handoffs again. NOT_FOUND when
    no instance of it is live (nothing drains it then). Exit codes are the
    other commands' (0 done)."""
    deployment_id = ids.validate_deployment_id(deployment_id)
    hooks = HooksClient(hooks_address, security=security)  # as an operator
    clients: list[OwnerClient] = []
    try:
        instances = await hooks.list_instances(deployment_id)
        if not instances:
            raise NotFound(
                Reason.DEPLOYMENT_NOT_FOUND,
                f"deployment {deployment_id} has no live owner instance (nothing drains it)",
            )
        answers: list[Undrained] = []
        for instance in instances:
            client = OwnerClient(instance.address, security=security)
            clients.append(client)
            answers.append(await client.undrain_sessions())
    finally:
        await hooks.close()
        for client in clients:
            await client.close()
    if output == "json":
        write(json.dumps([asdict(a) for a in answers], indent=2, sort_keys=True))
        return EXIT_DRAINED
    if output == "jsonl":
        for a in answers:
            write(json.dumps(asdict(a), sort_keys=True))
        return EXIT_DRAINED
    for a in answers:
        if a.was_to_deployment_id:
            write(
                f"undrained: {a.instance_id} ({a.deployment_id}) no longer drains to "
                f"{a.was_to_deployment_id} ({a.moved} moved there stay there; {a.held} held "
                "here stay here)"
            )
        else:
            write(f"{a.instance_id} ({a.deployment_id}) was not draining ({a.held} held here)")
    write(f"deployment {deployment_id} takes handoffs again")
    return EXIT_DRAINED


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
