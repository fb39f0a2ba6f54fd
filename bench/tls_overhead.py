"""What TLS on every hop costs: one-step turn latency and throughput, TLS vs
plaintext, in the same run.

    python -m bench.tls_overhead [--rounds 3] [--turns 300] [--sessions 32]
                                 [--concurrent-turns 1500] [--json PATH] [--smoke]

Starts two complete stacks side by side (bench.turn_latency's BenchStack,
one deployment each), every service a separate process:

- TLS: mutual TLS on every internal hop with role certificates checked per
  RPC, TLS from the client to ingress, etcd over TLS with client-certificate
  user/role auth (its role limited to the bench prefix);
- plaintext: the same processes with `--plaintext`, etcd without TLS or auth.

Then, for each round, measures on one stack and then the other (the order
alternates between rounds, so drift in the machine's load hits both):

b. sequential one-step turns: SendMessage -> the turn's SESSION_WAITING on an
   already-open following reader, one session;
c. throughput: N sessions running turns back to back.

It reports p50/p90 and turns/s per mode over all rounds, and the ratios
TLS / plaintext (latency) and plaintext / TLS (throughput: how many times
slower). The target from issue 10 is 1.15x.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from bench.common import apply_smoke, log_dir, write_json
from bench.measure import Dist, load_average, versions
from bench.stack import BenchStack
from bench.turns import measure_sequential, measure_throughput

TARGET_RATIO = 1.15
MODES = ("tls", "plaintext")
SMOKE = {"rounds": 1, "turns": 5, "warmup_turns": 2, "sessions": 2, "concurrent_turns": 4}


def _progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


async def measure_round(
    stacks: dict[str, BenchStack], order: Sequence[str], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for mode in order:
        stack = stacks[mode]
        channel = stack.public_channel("ingress")
        stub = ingress_pb2_grpc.IngressServiceStub(channel)
        try:
            _progress(f"{mode}: {args.turns} sequential one-step turns")
            seq = await measure_sequential(stub, args.turns, args.warmup_turns, lambda: None)
            _progress(f"{mode}: {args.concurrent_turns} turns over {args.sessions} sessions")
            marks: dict[str, dict[str, float]] = {}
            tput = await measure_throughput(
                stub,
                args.sessions,
                args.concurrent_turns,
                lambda marks=marks, stack=stack: marks.__setitem__("start", stack.cpu()),
            )
            after = stack.cpu()
        finally:
            await channel.close()
        stack.check_alive()
        cpu = {
            name: (after[name] - marks["start"][name]) * 1000 / args.concurrent_turns
            for name in after
        }
        out[mode] = {"turn": seq["turn"], "turns_per_s": tput["turns_per_s"], "cpu_ms": cpu}
    return out


async def run(args: argparse.Namespace, stacks: dict[str, BenchStack]) -> dict[str, Any]:
    rounds = []
    for n in range(args.rounds):
        order = MODES if n % 2 == 0 else tuple(reversed(MODES))
        _progress(f"round {n + 1}/{args.rounds}: {' then '.join(order)}")
        rounds.append(await measure_round(stacks, order, args))
    summary: dict[str, Any] = {}
    for mode in MODES:
        turns = Dist([s for r in rounds for s in r[mode]["turn"].samples])
        rates = [r[mode]["turns_per_s"] for r in rounds]
        names = rounds[0][mode]["cpu_ms"].keys()
        summary[mode] = {
            "turn": turns,
            "turns_per_s": statistics.median(rates),
            "turns_per_s_rounds": rates,
            "turn_p50_rounds": [r[mode]["turn"].pct(50) for r in rounds],
            # CPU ms per turn under load, by process (median over rounds):
            # the cost, less sensitive than wall time to other load.
            "cpu_ms": {n: statistics.median(r[mode]["cpu_ms"][n] for r in rounds) for n in names},
        }
    tls, plain = summary["tls"], summary["plaintext"]
    return {
        "versions": versions(),
        "args": vars(args).copy(),
        "load": load_average(),
        "modes": summary,
        "ratios": {
            "turn_p50_tls_over_plaintext": tls["turn"].pct(50) / plain["turn"].pct(50),
            "turn_p90_tls_over_plaintext": tls["turn"].pct(90) / plain["turn"].pct(90),
            "throughput_plaintext_over_tls": plain["turns_per_s"] / tls["turns_per_s"],
            # (CPU time is counted in clock ticks: meaningless for --smoke counts)
            "cpu_per_turn_tls_over_plaintext": sum(tls["cpu_ms"].values())
            / max(sum(plain["cpu_ms"].values()), 1e-9),
        },
    }


def report(results: dict[str, Any]) -> str:
    modes, ratios, a = results["modes"], results["ratios"], results["args"]
    lines = [
        f"TLS vs plaintext, same run: {a['rounds']} rounds, {a['turns']} sequential turns "
        f"and {a['concurrent_turns']} turns over {a['sessions']} sessions per mode per round "
        f"(load average {results['load']})",
        "",
        f"  {'mode':<10} {'turn p50 ms':>12} {'p90 ms':>9} {'p99 ms':>9} {'turns/s':>9}   "
        "per round: p50 ms / turns/s",
    ]
    for mode in MODES:
        m = modes[mode]
        t = m["turn"]
        per_round = ", ".join(
            f"{p:.2f}/{r:.0f}"
            for p, r in zip(m["turn_p50_rounds"], m["turns_per_s_rounds"], strict=True)
        )
        lines.append(
            f"  {mode:<10} {t.pct(50):>12.3f} {t.pct(90):>9.3f} {t.pct(99):>9.3f} "
            f"{m['turns_per_s']:>9.0f}   {per_round}"
        )
    names = list(modes["tls"]["cpu_ms"])
    lines += [
        "",
        "  CPU ms per turn under load " + " ".join(f"{n:>9}" for n in names) + "     total",
    ]
    for mode in MODES:
        cpu = modes[mode]["cpu_ms"]
        lines.append(
            f"    {mode:<25} "
            + " ".join(f"{cpu[n]:>9.2f}" for n in names)
            + f" {sum(cpu.values()):>9.2f}"
        )
    p50 = ratios["turn_p50_tls_over_plaintext"]
    tput = ratios["throughput_plaintext_over_tls"]
    lines += [
        "",
        f"  turn p50, TLS / plaintext           {p50:.3f}x  "
        f"({'within' if p50 <= TARGET_RATIO else 'OVER'} the {TARGET_RATIO}x target)",
        f"  turn p90, TLS / plaintext           {ratios['turn_p90_tls_over_plaintext']:.3f}x",
        f"  throughput, plaintext / TLS         {tput:.3f}x  "
        f"({'within' if tput <= TARGET_RATIO else 'OVER'} the {TARGET_RATIO}x target)",
        f"  CPU per turn, TLS / plaintext       {ratios['cpu_per_turn_tls_over_plaintext']:.3f}x",
    ]
    return "\n".join(lines)


def to_json(results: dict[str, Any]) -> dict[str, Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, Dist):
            return value.summary()
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    converted: dict[str, Any] = convert(results)
    return converted


def parse_round_args(
    argv: Sequence[str] | None, *, prog: str, description: str | None, rounds: int
) -> argparse.Namespace:
    """The arguments of a same-run comparison of two stacks in alternating
    rounds (this bench and bench.commit_stream)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=rounds, help="alternating rounds per mode")
    parser.add_argument("--turns", type=int, default=300, help="sequential turns per round")
    parser.add_argument("--warmup-turns", type=int, default=30)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--concurrent-turns", type=int, default=1500)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--log-dir", help="keep service and etcd logs (and certificates) here")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: checks the bench runs")
    args = parser.parse_args(argv)
    apply_smoke(parser, args, SMOKE)
    if args.rounds < 1 or args.turns < 1 or args.concurrent_turns < args.sessions:
        parser.error("need --rounds >= 1, --turns >= 1, --concurrent-turns >= --sessions")
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return parse_round_args(
        argv, prog="python -m bench.tls_overhead", description=__doc__, rounds=3
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with log_dir(args.log_dir, "baton-bench-tls-") as logs:
        stacks = {
            mode: BenchStack(os.path.join(logs, mode), second_deployment=False, tls=mode == "tls")
            for mode in MODES
        }
        results = run_stacks(stacks, run, args)
    print(report(results), flush=True)
    write_json(args.json, to_json(results))
    return 0


def run_stacks(
    stacks: dict[str, BenchStack],
    run: Callable[[argparse.Namespace, dict[str, BenchStack]], Awaitable[dict[str, Any]]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Start every stack, `run` the comparison on them, stop them all."""
    try:
        for mode, stack in stacks.items():
            os.makedirs(stack.log_dir, exist_ok=True)
            _progress(f"starting the {mode} stack (logs in {stack.log_dir})")
            stack.start()
        return asyncio.run(run(args, stacks))
    finally:
        for stack in stacks.values():
            stack.stop()


if __name__ == "__main__":
    sys.exit(main())
