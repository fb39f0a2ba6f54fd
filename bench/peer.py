"""Baton next to a peer runtime (Restate), in alternating pairs on one machine.

    python -m bench.peer --peer PATH [--pairs 3] [--out DIR] [--json PATH]
                         [--baton-args "--turns 1000 ..."]
    python -m bench.peer --from DIR [--json PATH]

Each pair runs the peer's `run.sh` (PATH/run.sh, e.g. ../shared/peers/restate:
it installs the peer, runs its load client and prints one JSON line) and then
`python -m bench.turn_latency --json ...`, one after the other, so both see
the same machine. The raw figures go to DIR as `restate-N.json` and
`baton-N.json` (N from 1); `--from DIR` rebuilds the table from such files
without running anything.

The table compares, per pair and as the median of the pairs' ratios:

- sequential one-step turn p50: Baton's phase b (SendMessage -> the turn's
  SESSION_WAITING on a following reader) against Restate's `c_seq_send_run`
  (the same echo turn with the model step journaled, `ctx.run`);
- 32 concurrent sessions, turns/s: Baton's phase c against `d_tp_send_run`;
- CPU per turn under load, servers + store: the four services and etcd in
  Baton's phase c against Restate's server and Python service in
  `d_tp_send_run` (the load clients are left out on both sides).

Targets (issue 39): turn p50 <= 1.0x, turns/s >= 1.2x, CPU <= 1.0x. Restate's
plain `send` (no journaled step) is shown for reference, and each pair's noise:
the load average around Baton's run and the CPU that other processes burnt per
turn during the peer's run (`other`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import progress, write_json

ROOT = Path(__file__).resolve().parents[1]
# Baton's servers and store: the processes a deployment runs (phase c).
BATON_SERVERS = ("hooks", "anchor", "owner", "ingress", "etcd")
RESTATE_SERVERS = ("server", "service")
TARGETS = {"turn_p50": 1.0, "turns_per_s": 1.2, "cpu_ms_per_turn": 1.0}
PEER_TIMEOUT_S = 400  # run.sh bounds itself at 290 s (+30 s before SIGKILL)
BATON_TIMEOUT_S = 600


# CPU ms per turn that other processes burnt during one of the peer's
# phases from which a pair is marked perturbed (the peer's README treats
# 0.7-2.9 ms as perturbed; a quiet run measures about 0.1).
PERTURBED_OTHER_MS = 0.7


@dataclass(frozen=True)
class Measure:
    """One row of the table: Baton's figure, the peer's, and which way is better."""

    key: str
    label: str
    unit: str
    higher_is_better: bool
    digits: int


MEASURES = (
    Measure("turn_p50", "sequential one-step turn p50", "ms", False, 2),
    Measure("turns_per_s", "32 concurrent sessions, turns/s", "turns/s", True, 0),
    Measure("cpu_ms_per_turn", "CPU per turn under load, servers + store", "ms", False, 2),
)


def baton_figures(figures: dict[str, Any]) -> dict[str, Any]:
    """The compared figures from `bench.turn_latency --json` output."""
    cpu = figures["throughput"]["per_turn"]["cpu_ms"]
    services = sum(cpu[name] for name in BATON_SERVERS if name != "etcd")
    return {
        "turn_p50": figures["sequential"]["turn"]["p50_ms"],
        "turns_per_s": figures["throughput"]["turns_per_s"],
        "cpu_ms_per_turn": services + cpu["etcd"],
        "cpu_split": {"services": round(services, 3), "etcd": cpu["etcd"]},
        "sessions": figures["throughput"]["sessions"],
        "load": f"{figures.get('load_start', '?')} -> {figures.get('load_end', '?')}",
    }


def peer_figures(figures: dict[str, Any]) -> dict[str, Any]:
    """The compared figures from the peer's run.sh JSON line (keys of Restate's bench.py)."""
    seq, tput = figures["c_seq_send_run"], figures["d_tp_send_run"]
    cpu = tput["cpu_ms_per_turn"]
    plain_seq, plain_tput = figures.get("a_seq_send", {}), figures.get("b_tp_send", {})
    return {
        "turn_p50": seq["p50_ms"],
        "turns_per_s": tput["turns_per_s"],
        "cpu_ms_per_turn": sum(cpu[name] for name in RESTATE_SERVERS),
        "cpu_split": {name: cpu[name] for name in RESTATE_SERVERS},
        "sessions": tput.get("clients"),
        "other_cpu_ms_per_turn": {"seq": seq["cpu_ms_per_turn"]["other"], "tp": cpu["other"]},
        "plain_send": {
            "turn_p50": plain_seq.get("p50_ms"),
            "turns_per_s": plain_tput.get("turns_per_s"),
        },
        "state_match": figures.get("state_check", {}).get("match"),
        "version": figures.get("restate_server", "?"),
    }


def compare(baton: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """One pair: both sides' figures and Baton / peer for every measure."""
    b, p = baton_figures(baton), peer_figures(peer)
    ratios = {m.key: round(b[m.key] / p[m.key], 3) for m in MEASURES}
    other = p["other_cpu_ms_per_turn"]
    perturbed = max(other["seq"], other["tp"]) >= PERTURBED_OTHER_MS
    return {"baton": b, "peer": p, "ratios": ratios, "perturbed": perturbed}


def summarise(pairs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the per-pair ratios (and of each side's figures), with the targets."""
    medians = {m.key: statistics.median(pair["ratios"][m.key] for pair in pairs) for m in MEASURES}
    ok = {
        m.key: (medians[m.key] >= TARGETS[m.key])
        if m.higher_is_better
        else (medians[m.key] <= TARGETS[m.key])
        for m in MEASURES
    }
    return {
        "pairs": list(pairs),
        "median_ratio": {k: round(v, 3) for k, v in medians.items()},
        "median_baton": {
            m.key: round(statistics.median(p["baton"][m.key] for p in pairs), 3) for m in MEASURES
        },
        "median_peer": {
            m.key: round(statistics.median(p["peer"][m.key] for p in pairs), 3) for m in MEASURES
        },
        "targets": TARGETS,
        "target_ok": ok,
    }


def table(summary: dict[str, Any]) -> str:
    """The issue's table (markdown): per-pair figures and ratios, then the medians."""
    pairs = summary["pairs"]
    runs = " / ".join(str(n + 1) for n in range(len(pairs)))
    lines = [
        f"| measure (same pair) | Baton, pair {runs} | Restate `send_run`, pair {runs} "
        f"| ratio, pair {runs} | median ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    for m in MEASURES:
        baton = " / ".join(f"{p['baton'][m.key]:.{m.digits}f}" for p in pairs)
        peer = " / ".join(f"{p['peer'][m.key]:.{m.digits}f}" for p in pairs)
        ratios = " / ".join(f"{p['ratios'][m.key]:.2f}×" for p in pairs)
        target = f"{'≥' if m.higher_is_better else '≤'} {TARGETS[m.key]:.1f}×"
        verdict = "met" if summary["target_ok"][m.key] else "not met"
        lines.append(
            f"| {m.label} | {baton} {m.unit} | {peer} {m.unit} | {ratios} "
            f"| **{summary['median_ratio'][m.key]:.2f}×** | {target} ({verdict}) |"
        )
    lines.append("")
    for n, p in enumerate(pairs, 1):
        b, r = p["baton"], p["peer"]
        plain = r["plain_send"]
        other = r["other_cpu_ms_per_turn"]
        lines.append(
            f"- pair {n}{' (PERTURBED)' if p['perturbed'] else ''}: Baton CPU services "
            f"{b['cpu_split']['services']:.2f} + etcd {b['cpu_split']['etcd']:.2f} ms, "
            f"load {b['load']}; Restate CPU server {r['cpu_split']['server']:.2f} + service "
            f"{r['cpu_split']['service']:.2f} ms, other processes {other['seq']:.2f} (seq) / "
            f"{other['tp']:.2f} (load) ms per turn; Restate plain `send` "
            f"{plain['turn_p50'] or float('nan'):.2f} ms, "
            f"{plain['turns_per_s'] or float('nan'):.0f} turns/s; "
            f"state check {'ok' if r['state_match'] else 'FAILED'}"
        )
    if any(p["perturbed"] for p in pairs):
        lines.append("")
        lines.append(
            f"(PERTURBED: other processes burnt {PERTURBED_OTHER_MS} ms of CPU per turn or more "
            "during the peer's run; rerun on a quiet machine)"
        )
    return "\n".join(lines)


def load_pairs(directory: Path) -> list[dict[str, Any]]:
    """The pairs recorded in `directory` (restate-N.json + baton-N.json, N = 1, 2, ...)."""
    pairs = []
    n = 1
    while (directory / f"baton-{n}.json").exists() and (directory / f"restate-{n}.json").exists():
        baton = json.loads((directory / f"baton-{n}.json").read_text())
        peer = last_json_line((directory / f"restate-{n}.json").read_text())
        pairs.append(compare(baton, peer))
        n += 1
    if not pairs:
        raise SystemExit(f"no restate-1.json + baton-1.json pair in {directory}")
    return pairs


def last_json_line(text: str) -> dict[str, Any]:
    """The peer's result: the last line of its stdout that is a JSON object."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            return result
    raise ValueError("no JSON line in the peer's output")


def run_pairs(peer: Path, pairs: int, out: Path, baton_args: Sequence[str]) -> None:
    """Peer, then Baton, `pairs` times; raw outputs into `out`."""
    run_sh = peer / "run.sh"
    if not run_sh.is_file():
        raise SystemExit(f"{run_sh} not found (--peer is the peer's directory)")
    for n in range(1, pairs + 1):
        progress(f"pair {n}/{pairs}: peer ({run_sh})")
        with (out / f"restate-{n}.err").open("w") as err:
            peer_run = subprocess.run(
                ["bash", str(run_sh)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=PEER_TIMEOUT_S,
                check=False,
            )
        (out / f"restate-{n}.json").write_text(peer_run.stdout)
        if peer_run.returncode != 0:
            raise SystemExit(f"the peer failed ({peer_run.returncode}); see {out}/restate-{n}.err")
        progress(f"pair {n}/{pairs}: Baton (python -m bench.turn_latency)")
        with (out / f"baton-{n}.out").open("w") as log:
            baton_run = subprocess.run(
                [sys.executable, "-m", "bench.turn_latency"]
                + ["--json", str(out / f"baton-{n}.json"), *baton_args],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=BATON_TIMEOUT_S,
                check=False,
            )
        if baton_run.returncode != 0:
            raise SystemExit(f"bench.turn_latency failed; see {out}/baton-{n}.out")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--peer", type=Path, help="the peer's directory (holds run.sh)")
    source.add_argument("--from", dest="recorded", type=Path, help="table of recorded pairs")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs to run")
    parser.add_argument("--out", type=Path, help="raw outputs here (default: a new temp dir)")
    parser.add_argument(
        "--baton-args", default="", help="extra arguments for bench.turn_latency (one string)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the pairs and medians as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.recorded is not None:
        directory = args.recorded
    else:
        directory = args.out or Path(tempfile.mkdtemp(prefix="baton-peer-"))
        os.makedirs(directory, exist_ok=True)
        run_pairs(args.peer, args.pairs, directory, shlex.split(args.baton_args))
        progress(f"raw outputs in {directory}")
    summary = summarise(load_pairs(directory))
    print(table(summary), flush=True)
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
