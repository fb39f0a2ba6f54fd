"""Where an upgrade turn's time goes, from the service logs of a bench run.

    python -m bench.turn_latency --log-level debug --log-dir DIR [...]
    python -m bench.handoff_timeline DIR

At log level debug every service logs each RPC it served (`rpc`, with
`duration_ms` and the session, run and handoff ids it carried), and the owners
log the handoff steps (`session handed off` with `took_ms`, `handoff candidate
prepared`, `handoff candidate activated`). All processes run on one machine, so
their timestamps share a clock. For every handoff this lines the steps up, from
the trigger's SendMessage to the successor's first commit, and does the same
for the same-deployment turns of the sessions that were handed off (the bench's
control turns). Debug logging costs CPU in every process: the absolute figures
are higher than in a run at log level warning; use the split, not the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from typing import Any

LOGS = ("hooks", "anchor", "owner", "owner-b", "ingress", "ingress-b")

Entry = dict[str, Any]


def load(log_dir: str) -> list[Entry]:
    """Every JSON log line of the services, with `t` (end, ms) and `t0` (start, ms)."""
    out: list[Entry] = []
    for name in LOGS:
        path = os.path.join(log_dir, f"{name}.log")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(entry, dict) or "timestamp" not in entry:
                    continue
                stamp = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00"))
                entry["t"] = stamp.timestamp() * 1000
                entry["t0"] = entry["t"] - float(entry.get("duration_ms", 0.0))
                entry["log"] = name
                out.append(entry)
    return out


def _rpc(entry: Entry, method: str) -> bool:
    return entry.get("event") == "rpc" and str(entry.get("rpc", "")).endswith("/" + method)


def _by_session(entries: list[Entry], method: str) -> dict[str, list[Entry]]:
    out: dict[str, list[Entry]] = defaultdict(list)
    for entry in entries:
        if _rpc(entry, method) and "session_id" in entry:
            out[entry["session_id"]].append(entry)
    for calls in out.values():
        calls.sort(key=lambda e: e["t0"])
    return out


def _started_last_before(calls: list[Entry], t: float) -> Entry | None:
    best = None
    for call in calls:
        if call["t0"] > t:
            break
        best = call
    return best


def _first_started_after(calls: list[Entry], t: float) -> Entry | None:
    return next((call for call in calls if call["t0"] >= t), None)


UPGRADE_STEPS = (
    "SendMessage start -> inbox append answered (hooks ResumeHook end)",
    "ResumeHook end -> old owner starts the handoff (inbox delivery)",
    "  ListInstances, hooks server time",
    "handoff start -> PrepareHandoff answered (new owner's server end)",
    "  PrepareHandoff, new owner server time (includes GetSnapshot)",
    "  GetSnapshot, anchor server time",
    "PrepareHandoff end -> Transfer answered (hooks server end)",
    "  Transfer, hooks server time",
    "= took_ms (old owner: ListInstances + PrepareHandoff + Transfer)",
    "Transfer end -> ActivateHandoff answered (new owner's server end)",
    "ActivateHandoff end -> successor's first CommitStep starts",
    "successor's CommitStep, anchor server time",
    "TOTAL: SendMessage start -> successor's commit answered",
)
CONTROL_STEPS = (
    "SendMessage start -> inbox append answered (hooks ResumeHook end)",
    "ResumeHook end -> the owner's CommitStep starts",
    "CommitStep, anchor server time",
    "TOTAL: SendMessage start -> commit answered",
)


def timelines(entries: list[Entry]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(upgrade steps, control steps): per step, one duration (ms) per turn."""
    sends = _by_session(entries, "SendMessage")
    resumes = _by_session(entries, "ResumeHook")
    commits = _by_session(entries, "CommitStep")
    snapshots = _by_session(entries, "GetSnapshot")
    by_request = {e["request_id"]: e for e in entries if e.get("event") == "rpc"}
    transfers = {e["handoff_id"]: e for e in entries if _rpc(e, "Transfer") and "handoff_id" in e}
    listings = sorted((e for e in entries if _rpc(e, "ListInstances")), key=lambda e: e["t0"])
    first_commit: dict[str, Entry] = {}
    for calls in commits.values():
        for call in calls:
            first_commit.setdefault(call.get("run_id", ""), call)
    steps: dict[str, Entry] = {}
    for e in entries:
        if e.get("event") in ("handoff candidate prepared", "handoff candidate activated"):
            steps[f"{e['event']} {e['handoff_id']}"] = e

    upgrade: dict[str, list[float]] = {step: [] for step in UPGRADE_STEPS}
    triggers: set[str] = set()
    for done in (e for e in entries if e.get("event") == "session handed off"):
        sid, hid = done["session_id"], done["handoff_id"]
        start = done["t"] - float(done["took_ms"])
        prepared = steps.get(f"handoff candidate prepared {hid}")
        activated = steps.get(f"handoff candidate activated {hid}")
        transfer = transfers.get(hid)
        send = _started_last_before(sends.get(sid, []), start)
        resume = _started_last_before(resumes.get(sid, []), start)
        commit = first_commit.get(done.get("successor_run_id", ""))
        if not (prepared and activated and transfer and send and resume and commit):
            continue
        prepare = by_request.get(prepared.get("request_id", ""))
        activate = by_request.get(activated.get("request_id", ""))
        if prepare is None or activate is None:
            continue
        triggers.add(send["request_id"])
        listing = next((e for e in listings if start <= e["t0"] <= prepare["t"]), None)
        snapshot = next(
            (e for e in snapshots.get(sid, []) if start <= e["t0"] <= prepare["t"]), None
        )
        values = (
            resume["t"] - send["t0"],
            start - resume["t"],
            listing["duration_ms"] if listing else None,
            prepare["t"] - start,
            prepare["duration_ms"],
            snapshot["duration_ms"] if snapshot else None,
            transfer["t"] - prepare["t"],
            transfer["duration_ms"],
            float(done["took_ms"]),
            activate["t"] - transfer["t"],
            commit["t0"] - activate["t"],
            commit["duration_ms"],
            commit["t"] - send["t0"],
        )
        for step, value in zip(UPGRADE_STEPS, values, strict=True):
            if value is not None:
                upgrade[step].append(float(value))

    control: dict[str, list[float]] = {step: [] for step in CONTROL_STEPS}
    moved = {e["session_id"] for e in entries if e.get("event") == "session handed off"}
    for sid in moved:
        for send in sends.get(sid, []):
            if send["request_id"] in triggers:
                continue
            resume = _first_started_after(resumes.get(sid, []), send["t0"])
            if resume is None:
                continue
            commit = next((c for c in commits.get(sid, []) if c["t0"] >= resume["t"]), None)
            if commit is None:
                continue
            values = (
                resume["t"] - send["t0"],
                commit["t0"] - resume["t"],
                commit["duration_ms"],
                commit["t"] - send["t0"],
            )
            for step, value in zip(CONTROL_STEPS, values, strict=True):
                control[step].append(float(value))
    return upgrade, control


def table(title: str, rows: dict[str, list[float]]) -> list[str]:
    lines = [f"  {title:<70}{'n':>6}{'p50':>9}{'p90':>9}"]
    for step, values in rows.items():
        if not values:
            continue
        p90 = statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]
        lines.append(f"  {step:<70}{len(values):>6}{statistics.median(values):>9.2f}{p90:>9.2f}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.handoff_timeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("log_dir", help="--log-dir of a bench run at --log-level debug")
    args = parser.parse_args(argv)
    entries = load(args.log_dir)
    if not any(e.get("event") == "rpc" and e.get("code") == "OK" for e in entries):
        print("no debug rpc lines: run the bench with --log-level debug", file=sys.stderr)
        return 1
    upgrade, control = timelines(entries)
    lines = [
        "",
        "ms, from server log timestamps (one clock; debug logging inflates every figure)",
        *table("upgrade turns", upgrade),
        "",
        *table("same-deployment turns of the same sessions (controls)", control),
        "",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
