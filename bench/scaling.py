"""Scaling curves: turns/s and turn latency at 1, 8, 32, 128 and 512 concurrent sessions.

    python -m bench.scaling [--levels 1,8,32,128,512] [--turns 1000]
                            [--min-turns-per-session 2] [--json PATH] [--smoke]

One stack as `bench.turn_latency` starts it (a real etcd and hooks, anchor,
owner and ingress as separate processes, TLS on every hop, etcd over TLS with
auth; one deployment), the bench process as the one grpc.aio client. For
each level N, in order:

1. etcd alone: append+commit pairs over N sessions back to back on one aetcd
   client, no services (`turn_latency.measure_floor_throughput`, the same
   count of pairs as the level has turns): etcd's ceiling at that concurrency,
   measured in this run;
2. Baton: N new sessions, each with a following StreamEvents reader, one
   warm-up turn each, then max(--turns, N x --min-turns-per-session) one-step
   turns shared out, each session's back to back on its own reader
   (`turn_latency` phase c); every process's CPU is sampled around the
   measured turns;
3. the level's sessions are finalized (RESET, until each stream has ended),
   so no live or parking session of one level runs during the next.

A level that the stack or the client cannot run (over a server or ingress
limit, too few file descriptors, followers that never open, a turn that
times out) is reported with the reason instead of figures, and the run exits
non-zero. bench/README.md "Scaling curves" explains the columns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime.common.config import Capacity
from baton_runtime.ingress.rates import ChannelLimits
from bench.common import apply_smoke, log_dir, write_json
from bench.floor import measure_floor_throughput
from bench.measure import Sample, load_average, per_turn, versions
from bench.stack import METADATA, SERVICES, BenchStack
from bench.turns import Follower, open_followers, run_concurrent_turns

LEVELS = "1,8,32,128,512"
SMOKE = {"levels": "1,4", "turns": 6, "min_turns_per_session": 2}
# Headroom of file descriptors this process keeps over what it holds now.
FD_MARGIN = 256
# The bench client counts as the bottleneck from this many cores on: one
# Python process runs on one core at a time.
CLIENT_BOUND_CORES = 0.85
FINALIZE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class StackLimits:
    """The limits a level of N concurrent sessions meets on this stack and
    client: the ingress's following streams per channel (all the bench's
    sessions are on one channel), every server's concurrent streams and unary
    calls, and this process's file descriptors. Read as the services will
    (their defaults, or the environment passed through to them)."""

    follow_streams: int
    max_streams: int
    max_unary: int
    nofile: int
    open_fds: int

    @classmethod
    def current(cls) -> StackLimits:
        def setting(env: str, default: int) -> int:
            return int(os.environ.get(env, default))

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls(
            follow_streams=setting("BATON_MAX_FOLLOW_STREAMS", ChannelLimits.follow_streams),
            max_streams=setting("BATON_MAX_CONCURRENT_STREAMS", Capacity.max_streams),
            max_unary=setting("BATON_MAX_CONCURRENT_RPCS", Capacity.max_unary),
            nofile=soft,
            open_fds=open_fds(os.getpid()),
        )

    def refusal(self, sessions: int) -> str:
        """Why a level of `sessions` cannot run here; "" when it can.

        Per level: `sessions` following streams on ingress (one channel) and
        as many streams on anchor (ingress follows each) and hooks (the
        owner's inbox stream per live session); up to `sessions` SendMessage
        calls at once on ingress, and ResumeHook on hooks. The client's
        connections do not grow with the level (one channel to ingress, one
        etcd client for the floor)."""
        if self.follow_streams and sessions > self.follow_streams:
            return (
                f"ingress allows {self.follow_streams} following StreamEvents per channel "
                "(BATON_MAX_FOLLOW_STREAMS) and the bench's sessions share one channel"
            )
        if sessions > self.max_streams:
            return (
                f"a server serves at most {self.max_streams} streams (BATON_MAX_CONCURRENT_STREAMS)"
            )
        if sessions > self.max_unary:
            return (
                f"a server serves at most {self.max_unary} unary calls at once "
                "(BATON_MAX_CONCURRENT_RPCS)"
            )
        if self.open_fds + FD_MARGIN > self.nofile:
            return f"{self.open_fds} file descriptors open of a soft limit of {self.nofile}"
        return ""


class ServiceWarnings:
    """The warning and error lines the services log (the stack runs at level
    warning), counted by service and event, since the previous `take`: a
    level that ran while, say, the owner's lease keep-alive timed out says
    so next to its figures."""

    def __init__(self, stack: BenchStack) -> None:
        self.paths = {name: os.path.join(stack.log_dir, f"{name}.log") for name in stack.names}
        self.offsets = {name: _size(path) for name, path in self.paths.items()}

    def take(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for name, path in self.paths.items():
            with contextlib.suppress(OSError), open(path, "rb") as log:
                log.seek(self.offsets[name])
                data = log.read()
                self.offsets[name] += len(data)
            for line in data.decode(errors="replace").splitlines():
                event = _logged_event(line)
                if event:
                    counts = out.setdefault(name, {})
                    counts[event] = counts.get(event, 0) + 1
        return out


def _size(path: str) -> int:
    with contextlib.suppress(OSError):
        return os.path.getsize(path)
    return 0


def _logged_event(line: str) -> str:
    """The event of a warning or error line; "" for other lines."""
    if not line.strip():
        return ""
    try:
        record = json.loads(line)
    except ValueError:
        return "(a line that is not JSON: a traceback?)"
    if not isinstance(record, dict) or record.get("level") not in ("warning", "error", "critical"):
        return ""
    return f"{record['level']}: {record.get('event', '?')}"


def open_fds(pid: int) -> int:
    """File descriptors a process holds (0 when /proc cannot say)."""
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return 0


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"levels must be comma-separated integers: {text!r}"
        ) from None
    if not levels or any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"levels must be positive: {text!r}")
    return levels


async def finalize(stub: ingress_pb2_grpc.IngressServiceStub, followers: Sequence[Follower]) -> int:
    """RESET every session and wait until each stream has ended; how many
    did not within FINALIZE_TIMEOUT_S."""
    await asyncio.gather(
        *(
            stub.SendControl(
                ingress_pb.SendControlRequest(
                    session_id=f.session_id, kind=ingress_pb.CONTROL_KIND_RESET
                ),
                metadata=METADATA,
                timeout=30,
            )
            for f in followers
        )
    )
    _, pending = await asyncio.wait([f.task for f in followers], timeout=FINALIZE_TIMEOUT_S)
    return len(pending)


def level_figures(
    tput: dict[str, Any], floor: dict[str, Any], before: Sample, after: Sample, cpus: int
) -> dict[str, Any]:
    """One level's row: throughput and latency, the same-run ratio to etcd
    alone, CPU per turn by process and cores each kept busy."""
    costs = per_turn(before, after, tput["turns"])
    cpu_ms = costs["cpu_ms"]
    elapsed = tput["elapsed_s"]
    cores = {n: round((after[n][0] - before[n][0]) / elapsed, 3) for n in before}
    client = cores["bench client"]
    return {
        "sessions": tput["sessions"],
        "ran": True,
        "turns": tput["turns"],
        "elapsed_s": round(elapsed, 3),
        "turns_per_s": round(tput["turns_per_s"], 2),
        "turn": tput["turn"].summary(),
        "etcd_alone": {k: round(v, 3) for k, v in floor.items()},
        "over_etcd_alone": round(tput["turns_per_s"] / floor["pairs_per_s"], 4),
        "cpu_ms_per_turn": cpu_ms,
        "services_cpu_ms_per_turn": round(sum(cpu_ms[n] for n in SERVICES), 3),
        "ctx_switches_per_turn": costs["ctx_switches"],
        "cores": cores,
        "machine_busy": round(sum(cores.values()) / cpus, 3),
        "client_bound": client >= CLIENT_BOUND_CORES,
    }


async def etcd_alone(
    stack: BenchStack, sessions: int, pairs: int, snapshot_bytes: int
) -> dict[str, Any]:
    """`pairs` append+commit pairs over `sessions` sessions on one aetcd
    client, no services (at least one pair per session)."""
    assert stack.etcd is not None
    return await measure_floor_throughput(
        stack.etcd.endpoint, sessions, max(pairs, sessions), snapshot_bytes, stack.etcd_security
    )


def both_halves(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """etcd alone over the pairs run before and after a level's turns: the
    machine's drift during the level weighs on both sides of the ratio."""
    pairs = before["pairs"] + after["pairs"]
    elapsed = before["elapsed_s"] + after["elapsed_s"]
    return {
        "sessions": before["sessions"],
        "pairs": pairs,
        "elapsed_s": elapsed,
        "pairs_per_s": pairs / elapsed,
        "before_pairs_per_s": before["pairs_per_s"],
        "after_pairs_per_s": after["pairs_per_s"],
    }


async def run_level(
    stack: BenchStack,
    stub: ingress_pb2_grpc.IngressServiceStub,
    sessions: int,
    turns: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    floor_before = await etcd_alone(stack, sessions, turns // 2, args.snapshot_bytes)
    # Creating a session and opening its reader is a few calls; give large
    # levels time on a loaded machine.
    followers = await open_followers(stub, sessions, ready_timeout=20.0 + 0.1 * sessions)
    marks: list[Sample] = []
    try:
        tput = await run_concurrent_turns(
            stub,
            followers,
            turns,
            lambda: marks.append(stack.sample()),
            lambda: marks.append(stack.sample()),
        )
        fds = {name: open_fds(pid) for name, pid in stack.pids().items()}
        fds["bench client"] = open_fds(os.getpid())
        unfinished = await finalize(stub, followers)
    finally:
        await asyncio.gather(*(f.close() for f in followers))
    floor_after = await etcd_alone(stack, sessions, turns - turns // 2, args.snapshot_bytes)
    floor = both_halves(floor_before, floor_after)
    figures = level_figures(tput, floor, marks[0], marks[1], os.cpu_count() or 1)
    figures["open_fds"] = fds
    figures["not_finalized"] = unfinished
    return figures


async def attempt_level(
    stack: BenchStack,
    stub: ingress_pb2_grpc.IngressServiceStub,
    limits: StackLimits,
    sessions: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The level's figures, or why it cannot run (refused by a limit before
    it starts, or failed while it ran)."""
    turns = max(args.turns, sessions * args.min_turns_per_session)
    reason = limits.refusal(sessions)
    if not reason:
        _progress(f"{sessions} sessions: etcd alone, then {turns} turns")
        try:
            level = await run_level(stack, stub, sessions, turns, args)
            stack.check_alive()
            return level
        except (grpc.aio.AioRpcError, TimeoutError, RuntimeError) as exc:
            reason = _why(exc)
    _progress(f"{sessions} sessions: cannot run: {reason}")
    return {"sessions": sessions, "ran": False, "turns": turns, "reason": reason}


async def run(args: argparse.Namespace, stack: BenchStack) -> dict[str, Any]:
    limits = StackLimits.current()
    results: dict[str, Any] = {
        "versions": versions(),
        "args": vars(args).copy(),
        "load_start": load_average(),
        "limits": vars(limits),
        "levels": [],
    }
    warnings = ServiceWarnings(stack)
    channel = stack.public_channel("ingress")
    stub = ingress_pb2_grpc.IngressServiceStub(channel)
    try:
        for sessions in args.levels:
            level = await attempt_level(stack, stub, limits, sessions, args)
            level["service_warnings"] = warnings.take()
            results["levels"].append(level)
    finally:
        await channel.close()
    results["load_end"] = load_average()
    return results


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "timed out waiting for the sessions' readers or turns (see the service logs)"
    return str(exc)


def _progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


def report(results: dict[str, Any]) -> str:
    v = results["versions"]
    lines = [
        "",
        f"Baton scaling curve: one deployment, TLS on every hop; {v['cpus']} CPUs; "
        f"Python {v['python']}, grpcio {v.get('grpcio', '?')}, etcd {v.get('etcd', '?')}",
        f"load average (1/5/15 min) at start {results['load_start']}, at end "
        f"{results['load_end']}: other work on the machine skews every figure",
        "",
        f"  {'':>33}{'etcd alone':>17}  {'CPU ms per turn':^50}{'client':>8}{'machine':>8}",
        f"  {'sessions':>8}{'turns':>7}{'turns/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'pairs/s':>9}{'ratio':>8}  "
        + "".join(f"{n:>8}" for n in (*SERVICES, "4 svc", "etcd", "client"))
        + f"{'cores':>8}{'busy':>8}",
    ]
    for level in results["levels"]:
        if not level["ran"]:
            lines.append(f"  {level['sessions']:>8}  cannot run: {level['reason']}")
            continue
        cpu, turn = level["cpu_ms_per_turn"], level["turn"]
        columns = [cpu[n] for n in SERVICES]
        columns += [level["services_cpu_ms_per_turn"], cpu["etcd"], cpu["bench client"]]
        lines.append(
            f"  {level['sessions']:>8}{level['turns']:>7}{level['turns_per_s']:>9.1f}"
            f"{turn['p50_ms']:>9.2f}{turn['p99_ms']:>9.2f}"
            f"{level['etcd_alone']['pairs_per_s']:>9.0f}{level['over_etcd_alone']:>8.3f}  "
            + "".join(f"{x:>8.2f}" for x in columns)
            + f"{level['cores']['bench client']:>8.2f}{level['machine_busy']:>8.2f}"
            + ("  client-bound" if level["client_bound"] else "")
        )
    for level in results["levels"]:
        for name, counts in level["service_warnings"].items():
            logged = ", ".join(f"{event} x{n}" for event, n in counts.items())
            lines.append(f"  {level['sessions']} sessions: {name} logged {logged}")
    lines.append("")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--levels", default=LEVELS, help=f"concurrent sessions per level (default {LEVELS})"
    )
    parser.add_argument("--turns", type=int, default=1000, help="measured turns per level")
    parser.add_argument(
        "--min-turns-per-session",
        type=int,
        default=2,
        help="a level runs at least this many measured turns per session",
    )
    parser.add_argument(
        "--snapshot-bytes", type=int, default=400, help="snapshot size of the etcd-alone commit"
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--log-dir", help="keep service and etcd logs here")
    parser.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument(
        "--plaintext", action="store_true", help="no TLS and no etcd auth (default: as shipped)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="levels 1 and 4, a few turns: checks the bench runs"
    )
    args = parser.parse_args(argv)
    apply_smoke(parser, args, SMOKE)
    try:
        args.levels = parse_levels(args.levels)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.turns < 1 or args.min_turns_per_session < 1:
        parser.error("need --turns >= 1 and --min-turns-per-session >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with log_dir(args.log_dir, "baton-scaling-") as logs:
        stack = BenchStack(
            logs, second_deployment=False, log_level=args.log_level, tls=not args.plaintext
        )
        try:
            _progress(f"starting etcd and services (logs in {logs})")
            stack.start()
            results = asyncio.run(run(args, stack))
        finally:
            stack.stop()
    print(report(results), flush=True)
    write_json(args.json, results)
    return 0 if all(level["ran"] for level in results["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
