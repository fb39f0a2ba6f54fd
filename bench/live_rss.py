"""What a live session costs hooks and its owner: memory and CPU added by N
sessions that stay unparked (each with its run and its inbox stream open),
with the owner's inbox streams on one FollowInboxes stream (`feed`, the
default) and with one StreamInbox call per session (`per-session`,
`--inbox-feed 0`), in the same run.

    python -m bench.live_rss [--sessions 3000] [--baseline 10] [--settle 5]
                             [--json PATH] [--smoke]

For each mode in turn, a stack of bench.idle_rss (etcd, hooks, anchor and
one owner as processes, TLS on every hop) whose owner never parks: it
starts `--baseline` sessions, reads the RSS of hooks and the owner, starts
`--sessions` more (64 StartSession calls at a time, as an ingress), waits
`--settle` seconds and reads them again; and the CPU each process spent
while the sessions were started. Reports per live session: bytes of RSS and
ms of CPU, in hooks and in the owner, and the ratios feed / per-session.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from typing import Any

from baton_runtime.common.hooks_client import HooksClient
from baton_runtime.common.identity import Role
from baton_runtime.common.owner_client import OwnerClient
from bench.common import write_json
from bench.idle_rss import DEPLOYMENT_ID, IdleStack, create_sessions, rss_bytes
from bench.turn_latency import cpu_seconds

MODES = {"feed": "1", "per-session": "0"}
PROCESSES = ("hooks", "owner")


async def measure_mode(stack: IdleStack, args: argparse.Namespace) -> dict[str, Any]:
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
        rss_before = {name: rss_bytes(pid) for name, pid in pids.items()}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.monotonic()
        await create_sessions(owner, hooks, args.sessions, 64, False)
        create_s = time.monotonic() - start
        cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        await asyncio.sleep(args.settle)
        rss_after = {name: rss_bytes(pid) for name, pid in pids.items()}
    finally:
        await owner.close()
        await hooks.close()
    n = args.sessions
    return {
        "create_seconds": create_s,
        "rss_bytes_per_session": {k: (rss_after[k] - rss_before[k]) / n for k in pids},
        "cpu_ms_per_session": {k: (cpu_after[k] - cpu_before[k]) * 1000 / n for k in pids},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"sessions": args.sessions, "modes": {}}
    for mode, switch in MODES.items():
        print(f"... {mode}: {args.sessions} live sessions", file=sys.stderr, flush=True)
        log_dir = tempfile.mkdtemp(prefix="baton-live-rss-")
        stack = IdleStack(log_dir, park_after=86_400, extra_env={"BATON_OWNER_INBOX_FEED": switch})
        try:
            stack.start()
            out["modes"][mode] = asyncio.run(measure_mode(stack, args))
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
        f"  {'mode':<12} {'hooks RSS':>12} {'owner RSS':>12} {'hooks CPU':>12} "
        f"{'owner CPU':>12} {'started in':>11}",
    ]
    for mode, m in out["modes"].items():
        rss, cpu = m["rss_bytes_per_session"], m["cpu_ms_per_session"]
        lines.append(
            f"  {mode:<12} {rss['hooks'] / 1024:>8.1f} KiB {rss['owner'] / 1024:>8.1f} KiB "
            f"{cpu['hooks']:>9.2f} ms {cpu['owner']:>9.2f} ms {m['create_seconds']:>9.1f} s"
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
