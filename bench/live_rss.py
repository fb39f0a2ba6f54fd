"""What a live session costs hooks and its owner, and what a live follower
of its events costs anchor: memory and CPU added by N sessions that stay
unparked (each with its run and its inbox stream open), and by one live
event read of each (as an ingress follows them for its clients), with the
streams multiplexed (`feed`, the default: the owner's inbox streams on one
FollowInboxes stream, the reads on one FollowEvents stream) and with one
call each (`per-session`: `--inbox-feed 0`, and ReadEvents calls), in the
same run.

    python -m bench.live_rss [--sessions 3000] [--baseline 10] [--settle 5]
                             [--json PATH] [--smoke]

For each mode in turn, a stack of bench.idle_rss (etcd, hooks, anchor and
one owner as processes, TLS on every hop) whose owner never parks: it
starts `--baseline` sessions, reads the RSS of hooks and the owner, starts
`--sessions` more (64 StartSession calls at a time, as an ingress), waits
`--settle` seconds and reads them again; and the CPU each process spent
while the sessions were started. Then this process, as an ingress, follows
every session's events live and anchor's RSS and CPU are read the same
way. Reports per live session: bytes of RSS and ms of CPU, in hooks and the
owner (the session), and in anchor (its follower), and the ratios feed /
per-session.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from typing import Any

from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.errors import BatonError
from baton_runtime.common.security.identity import Role
from bench.common import write_json
from bench.idle_rss import DEPLOYMENT_ID, INSTANCE_ID, IdleStack, create_sessions, rss_bytes
from bench.measure import cpu_seconds

MODES = {"feed": "1", "per-session": "0"}
PROCESSES = ("hooks", "owner", "anchor")


async def measure_mode(stack: IdleStack, args: argparse.Namespace, feed: bool) -> dict[str, Any]:
    owner = OwnerClient(
        stack.addrs["owner"], timeout=30, security=stack.security(Role.INGRESS, DEPLOYMENT_ID)
    )
    hooks = HooksClient(
        stack.addrs["hooks"], timeout=60, security=stack.security(Role.OWNER, DEPLOYMENT_ID)
    )
    pids = {name: stack.services[name].pid for name in PROCESSES}
    try:
        await create_sessions(owner, hooks, args.baseline, min(64, args.baseline), False)
        await asyncio.sleep(args.settle)
        rss_before = {name: rss_bytes(pid) for name, pid in pids.items() if name != "anchor"}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items() if name != "anchor"}
        start = time.monotonic()
        await create_sessions(owner, hooks, args.sessions, 64, False)
        create_s = time.monotonic() - start
        cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items() if name != "anchor"}
        await asyncio.sleep(args.settle)
        rss_after = {name: rss_bytes(pid) for name, pid in pids.items() if name != "anchor"}
        anchor_pid = pids["anchor"]
        rss_before["anchor"], cpu_before["anchor"] = rss_bytes(anchor_pid), cpu_seconds(anchor_pid)
        readers = await follow_every_session(stack, hooks, args.settle, feed)
        cpu_after["anchor"] = cpu_seconds(anchor_pid)
        rss_after["anchor"] = rss_bytes(anchor_pid)
        await readers.aclose()
    finally:
        await owner.close()
        await hooks.close()
    # per session started (hooks, owner); per session followed (anchor)
    n = {"hooks": args.sessions, "owner": args.sessions, "anchor": len(readers.tasks)}
    return {
        "reads_reopened": len(readers.reopened),
        "create_seconds": create_s,
        "rss_bytes_per_session": {k: (rss_after[k] - rss_before[k]) / n[k] for k in pids},
        "cpu_ms_per_session": {k: (cpu_after[k] - cpu_before[k]) * 1000 / n[k] for k in pids},
    }


class _Readers:
    """Live event reads, one per session, and the client they ride."""

    def __init__(
        self, anchor: AnchorClient, tasks: list[asyncio.Task[None]], reopened: list[str]
    ) -> None:
        self.anchor, self.tasks, self.reopened = anchor, tasks, reopened

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.anchor.close()


async def follow_every_session(
    stack: IdleStack, hooks: HooksClient, settle: float, feed: bool
) -> _Readers:
    """Every session of the owner followed live from anchor (as an ingress
    would), once each read has its first page, and `settle` s later."""
    anchor = AnchorClient(
        stack.addrs["anchor"],
        timeout=30,
        security=stack.security(Role.INGRESS, DEPLOYMENT_ID),
        event_feed=feed,
    )
    owned = await hooks.list_instance_sessions(DEPLOYMENT_ID, INSTANCE_ID)
    sessions = [o.fence.session_id for o in owned]
    started: list[asyncio.Event] = []
    reopened: list[str] = []

    async def read(sid: str, first: asyncio.Event) -> None:
        while True:  # reopened when it ends UNAVAILABLE, as a follower resumes
            try:
                async for _ in anchor.read_events(sid, 0, True):
                    first.set()
            except BatonError as exc:
                if not exc.retryable:
                    raise
                reopened.append(sid)
                await asyncio.sleep(0.1)

    tasks = []
    for sid in sessions:
        started.append(asyncio.Event())
        tasks.append(asyncio.ensure_future(read(sid, started[-1])))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    await asyncio.sleep(settle)
    return _Readers(anchor, tasks, reopened)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"sessions": args.sessions, "modes": {}}
    for mode, switch in MODES.items():
        print(f"... {mode}: {args.sessions} live sessions", file=sys.stderr, flush=True)
        log_dir = tempfile.mkdtemp(prefix="baton-live-rss-")
        stack = IdleStack(log_dir, park_after=86_400, extra_env={"BATON_OWNER_INBOX_FEED": switch})
        try:
            stack.start()
            out["modes"][mode] = asyncio.run(measure_mode(stack, args, switch == "1"))
        finally:
            stack.stop()
            shutil.rmtree(log_dir, ignore_errors=True)
    feed, each = out["modes"]["feed"], out["modes"]["per-session"]
    out["ratios"] = {
        f"{what}_{name}_feed_over_per_session": (
            feed[what][name] / each[what][name] if each[what][name] > 0 else None
        )
        for what in ("rss_bytes_per_session", "cpu_ms_per_session")
        for name in PROCESSES
    }
    return out


def report(out: dict[str, Any]) -> str:
    lines = [
        f"{out['sessions']} live (unparked) sessions on one owner, per session:",
        f"  {'mode':<12} {'hooks RSS':>12} {'owner RSS':>12} {'anchor RSS':>12} "
        f"{'hooks CPU':>12} {'owner CPU':>12} {'anchor CPU':>12} {'started in':>11}",
    ]
    for mode, m in out["modes"].items():
        rss, cpu = m["rss_bytes_per_session"], m["cpu_ms_per_session"]
        lines.append(
            f"  {mode:<12} "
            + " ".join(f"{rss[name] / 1024:>8.1f} KiB" for name in PROCESSES)
            + " "
            + " ".join(f"{cpu[name]:>9.2f} ms" for name in PROCESSES)
            + f" {m['create_seconds']:>9.1f} s"
        )
    lines.append("  (anchor: one live event read of each session, as an ingress follows them)")
    lines.append(
        "  reads that ended UNAVAILABLE and were reopened: "
        + ", ".join(f"{mode} {m['reads_reopened']}" for mode, m in out["modes"].items())
    )
    lines += [
        f"  {name:<48} " + ("n/a" if value is None else f"{value:.3f}x")
        for name, value in out["ratios"].items()
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.live_rss",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=3000, help="live sessions added")
    parser.add_argument("--baseline", type=int, default=10, help="sessions started first")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before each reading")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: checks the bench runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sessions, args.baseline, args.settle = 40, 4, 0.5
    if args.sessions < 1 or args.baseline < 1:
        parser.error("need --sessions >= 1 and --baseline >= 1")
    out = run(args)
    print(report(out), flush=True)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
