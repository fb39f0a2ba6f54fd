"""What multiplexing buys: one-step turns with the owner's commits on one
CommitSteps stream and the ingress' appends on one ResumeHooks stream (the
default) against one unary CommitStep and ResumeHook call each
(`--commit-stream 0`, `--resume-stream 0`), in the same run.

    python -m bench.commit_stream [--rounds 4] [--turns 300] [--sessions 32]
                                  [--concurrent-turns 1500] [--json PATH] [--smoke]
                                  [--switch {streams,inbox-feed,feeds}]

`--switch inbox-feed` compares the owner's inbox streams instead: every
session's on one FollowInboxes stream ("streamed", the default) against one
StreamInbox call per session (`--inbox-feed 0`, "unary"), commits and
appends streamed in both; `--switch feeds` also the ingress' event reads
(one FollowEvents stream against one ReadEvents call each, `--event-feed 0`).

Two complete stacks side by side (bench.turn_latency's BenchStack, TLS on
every hop, one deployment each), identical but for the owner's
BATON_OWNER_COMMIT_STREAM and the ingress' BATON_INGRESS_RESUME_STREAM.
Each round measures on one and then the other (the order alternates), as
bench.tls_overhead does: sequential one-step turns on one session, then N
sessions running turns back to back, with
every process's CPU per turn under that load. It reports the medians over
rounds and the ratios streamed / unary, and, from the owners' metrics, how
many commits a CommitSteps message carried on average under load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from bench.common import log_dir, write_json
from bench.measure import Dist, load_average, versions
from bench.scrape import scrape
from bench.stack import BenchStack
from bench.tls_overhead import measure_round, parse_round_args, run_stacks, to_json

MODES = ("streamed", "unary")
_COMMITS = "/baton.anchor.v1.AnchorService/CommitSteps"
SERVICES = ("hooks", "anchor", "owner", "ingress")


def _progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


async def commits_per_message(stack: BenchStack) -> float:
    """Commits (anchor's served CommitStep calls) per CommitSteps message the
    owner sent, since the stack started; 0 without messages."""
    owner = await scrape(f"http://{stack.metrics_addrs['owner']}/metrics")
    anchor = await scrape(f"http://{stack.metrics_addrs['anchor']}/metrics")
    sent = owner.total("baton_rpc_client_stream_messages_sent_total", method=_COMMITS)
    served = anchor.total("baton_rpc_server_handled_total", method=_COMMITS[:-1])
    return served / sent if sent else 0.0


async def run(args: argparse.Namespace, stacks: dict[str, BenchStack]) -> dict[str, Any]:
    rounds = []
    for n in range(args.rounds):
        order = MODES if n % 2 == 0 else tuple(reversed(MODES))
        _progress(f"round {n + 1}/{args.rounds}: {' then '.join(order)}")
        rounds.append(await measure_round(stacks, order, args))
    summary: dict[str, Any] = {}
    for mode in MODES:
        cpu_rounds = [
            {**r[mode]["cpu_ms"], "4 services": sum(r[mode]["cpu_ms"][s] for s in SERVICES)}
            for r in rounds
        ]
        summary[mode] = {
            "turn": Dist([s for r in rounds for s in r[mode]["turn"].samples]),
            "turn_p50_rounds": [r[mode]["turn"].pct(50) for r in rounds],
            "turns_per_s": statistics.median(r[mode]["turns_per_s"] for r in rounds),
            "turns_per_s_rounds": [r[mode]["turns_per_s"] for r in rounds],
            "cpu_ms": {k: statistics.median(c[k] for c in cpu_rounds) for k in cpu_rounds[0]},
            "cpu_ms_4_services_rounds": [c["4 services"] for c in cpu_rounds],
        }
    streamed, unary = summary["streamed"], summary["unary"]
    return {
        "versions": versions(),
        "args": vars(args).copy(),
        "load": load_average(),
        "modes": summary,
        "commits_per_message": await commits_per_message(stacks["streamed"]),
        "ratios": {
            "turn_p50_streamed_over_unary": streamed["turn"].pct(50) / unary["turn"].pct(50),
            "throughput_streamed_over_unary": streamed["turns_per_s"] / unary["turns_per_s"],
            # (CPU time is counted in clock ticks: None when a count is 0, as
            # --smoke's few turns may give)
            **{
                f"cpu_{name}_streamed_over_unary": streamed["cpu_ms"][name] / unary["cpu_ms"][name]
                if unary["cpu_ms"][name]
                else None
                for name in ("hooks", "anchor", "owner", "ingress", "4 services")
            },
        },
    }


def report(results: dict[str, Any]) -> str:
    modes, a = results["modes"], results["args"]
    what = (
        "Commits and appends streamed (CommitSteps, ResumeHooks) vs unary"
        if a["switch"] == "streams"
        else "Inbox streams (and with --switch feeds event reads) on one stream (streamed) "
        "vs one call each (unary)"
    )
    lines = [
        f"{what}, same run: "
        f"{a['rounds']} rounds, {a['turns']} sequential turns and "
        f"{a['concurrent_turns']} turns over {a['sessions']} sessions per mode per round "
        f"(load average {results['load']})",
        "",
        f"  {'mode':<10} {'turn p50 ms':>12} {'p90 ms':>9} {'turns/s':>9}   "
        "per round: p50 ms / turns/s / CPU ms per turn, 4 services",
    ]
    for mode in MODES:
        m = modes[mode]
        per_round = ", ".join(
            f"{p:.2f}/{r:.0f}/{c:.2f}"
            for p, r, c in zip(
                m["turn_p50_rounds"],
                m["turns_per_s_rounds"],
                m["cpu_ms_4_services_rounds"],
                strict=True,
            )
        )
        lines.append(
            f"  {mode:<10} {m['turn'].pct(50):>12.3f} {m['turn'].pct(90):>9.3f} "
            f"{m['turns_per_s']:>9.0f}   {per_round}"
        )
    names = list(modes["streamed"]["cpu_ms"])
    lines += ["", "  CPU ms per turn under load (median) " + " ".join(f"{n:>10}" for n in names)]
    for mode in MODES:
        cpu = modes[mode]["cpu_ms"]
        lines.append(f"    {mode:<33} " + " ".join(f"{cpu[n]:>10.2f}" for n in names))
    lines += ["", f"  commits per CommitSteps message: {results['commits_per_message']:.2f}"]
    lines += [
        f"  {name:<40} " + ("n/a" if value is None else f"{value:.3f}x")
        for name, value in results["ratios"].items()
    ]
    return "\n".join(lines)


# What each --switch turns off in the "unary" stack.
SWITCHES = {
    "streams": ("BATON_OWNER_COMMIT_STREAM", "BATON_INGRESS_RESUME_STREAM"),
    "inbox-feed": ("BATON_OWNER_INBOX_FEED",),
    "feeds": ("BATON_OWNER_INBOX_FEED", "BATON_INGRESS_EVENT_FEED"),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    switch = "streams"
    if "--switch" in argv:
        at = argv.index("--switch")
        switch = argv[at + 1] if at + 1 < len(argv) else ""
        del argv[at : at + 2]
    if switch not in SWITCHES:
        raise SystemExit(f"--switch: one of {', '.join(SWITCHES)}")
    args = parse_round_args(
        argv, prog="python -m bench.commit_stream", description=__doc__, rounds=4
    )
    args.switch = switch
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with log_dir(args.log_dir, "baton-bench-commits-") as logs:
        stacks = {
            mode: BenchStack(
                os.path.join(logs, mode),
                second_deployment=False,
                tls=True,
                env={name: "1" if mode == "streamed" else "0" for name in SWITCHES[args.switch]},
                metrics=True,
            )
            for mode in MODES
        }
        results = run_stacks(stacks, run, args)
    print(report(results), flush=True)
    write_json(args.json, to_json(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
