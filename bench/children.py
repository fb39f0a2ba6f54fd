"""A turn that asks a subagent, against a plain one-step turn (docs/design.md §11).

    python -m bench.children [--iterations 200] [--warmup 10] [--per-session 40]
                             [--json PATH] [--smoke]

Starts the same real stack as `bench.turn_latency` (etcd and every service as
separate processes; one owner instance, so children start on it) and runs,
interleaved on the same session so both sides see the same etcd, history
size and machine load:

- plain: a one-step turn ("bench turn N": the fixture answers at once);
- subagent: a turn that asks the `helper` subagent ("ask helper bench N"):
  the parent's step 1 starts a new child session (CreateSession on hooks, its
  first commit, the work appended to its inbox), the child runs a one-step
  turn and reports through the parent's inbox, the parent's step 2 answers;
- continue: a turn that continues the parked helper ("continue bench N"):
  the same without creating a session.

Each turn is timed as in `bench.turn_latency` b: SendMessage start -> the
turn's SESSION_WAITING on an already-open following reader. A session asks
at most `--per-session` subagents before the next session takes over, so no
session reaches the 64 children it may hold (beyond them every new child
would also finalize the least recently used one). CPU milliseconds of every
process are reported per turn of each kind (sampled around each turn).

Target: subagent turn p50 <= 2.5 x plain turn p50.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from bench.common import log_dir, progress, write_json
from bench.measure import Dist, load_average
from bench.stack import BenchStack
from bench.turns import Follower, create_session, one_turn

TARGET_RATIO = 2.5
KINDS = ("plain", "subagent", "continue")


def _text(kind: str, n: int) -> str:
    if kind == "plain":
        return f"bench turn {n}"
    if kind == "subagent":
        return f"ask helper bench {n}"
    return f"continue bench {n}"


async def run(args: argparse.Namespace, logs: str) -> dict[str, Any]:
    stack = BenchStack(log_dir=logs, second_deployment=False)
    stack.start()
    channel = stack.public_channel("ingress")  # TLS, as every bench since issue 10
    stub = ingress_pb2_grpc.IngressServiceStub(channel)
    dists = {kind: Dist() for kind in KINDS}
    cpu_ms = {kind: {name: 0.0 for name in stack.cpu()} for kind in KINDS}
    results: dict[str, Any] = {"load_start": load_average(), "log_dir": logs}
    follower: Follower | None = None
    try:
        progress(
            f"{args.warmup} warm-up and {args.iterations} measured rounds of a plain, a "
            "subagent and a continue turn, interleaved"
        )
        for n in range(args.warmup + args.iterations):
            if n % args.per_session == 0:
                if follower is not None:
                    await follower.close()
                follower = Follower(stub, await create_session(stub))
                await asyncio.wait_for(follower.ready, 10)
            assert follower is not None
            for kind in KINDS:
                before = stack.cpu()
                _, took = await one_turn(stub, follower, _text(kind, n), f"{kind}-{n}")
                after = stack.cpu()
                if n >= args.warmup:
                    dists[kind].samples.append(took)
                    for name, spent in after.items():
                        cpu_ms[kind][name] += (spent - before.get(name, 0.0)) * 1000
        stack.check_alive()
    finally:
        if follower is not None:
            await follower.close()
        await channel.close()
        results["load_end"] = load_average()
        stack.stop()
    results.update(dists)
    results["cpu_ms_per_turn"] = {
        kind: {name: round(ms / max(1, args.iterations), 3) for name, ms in per.items()}
        for kind, per in cpu_ms.items()
    }
    results["iterations"] = args.iterations
    return results


def report(results: dict[str, Any]) -> str:
    plain = results["plain"].pct(50)
    lines = [
        f"load average at start {results['load_start']}, at end {results['load_end']}",
        "",
        f"{'':44}{'p50':>9}{'p90':>9}{'p99':>9}  (ms)   CPU ms per turn, all processes",
    ]
    for kind, label in (
        ("plain", "plain one-step turn"),
        ("subagent", "SUBAGENT TURN: asks a one-step subagent"),
        ("continue", "turn continuing the parked subagent"),
    ):
        dist = results[kind]
        cpu = sum(v for k, v in results["cpu_ms_per_turn"][kind].items() if k != "bench client")
        ratio = f"{dist.pct(50) / plain:.2f}x" if kind != "plain" else ""
        lines.append(
            f"{label:<44}{dist.pct(50):9.2f}{dist.pct(90):9.2f}{dist.pct(99):9.2f}  "
            f"{ratio:>6}   {cpu:.2f}"
        )
    per = results["cpu_ms_per_turn"]["subagent"]
    lines.append(
        "  subagent turn CPU ms by process: "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(per.items()))
    )
    ratio = results["subagent"].pct(50) / plain
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    lines += [
        "",
        "  targets",
        f"    {verdict}  subagent turn p50 <= {TARGET_RATIO} x plain turn p50"
        f"{'':12}measured {ratio:.3f}",
    ]
    return "\n".join(lines)


def to_json(results: dict[str, Any]) -> dict[str, Any]:
    out = {k: (v.summary() if isinstance(v, Dist) else v) for k, v in results.items()}
    plain = results["plain"].pct(50)
    out["targets"] = {
        "subagent_p50_over_plain_p50": round(results["subagent"].pct(50) / plain, 3),
        "continue_p50_over_plain_p50": round(results["continue"].pct(50) / plain, 3),
        "target": TARGET_RATIO,
    }
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.children", description=__doc__)
    parser.add_argument("--iterations", type=int, default=200, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--per-session", type=int, default=40, help="rounds per session (at most 64)"
    )
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: checks it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.iterations, args.warmup, args.per_session = 4, 1, 3
    if not 0 < args.per_session <= 64:
        parser.error("--per-session must be 1..64")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with log_dir(args.log_dir, "baton-bench-children-") as logs:
        results = asyncio.run(run(args, logs))
    print(report(results))
    write_json(args.json, to_json(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
