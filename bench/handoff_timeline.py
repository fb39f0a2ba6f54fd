"""Where an upgrade turn's time goes, from the service logs of a bench run.

    python -m bench.turn_latency --log-level debug --log-dir DIR [--json PATH] [...]
    python -m bench.handoff_timeline DIR [--json PATH]

At log level debug every service logs each RPC it served (`rpc`, with
`duration_ms` and the session, run and handoff ids it carried), and the owners
log the handoff steps: the old owner (A) `session handed off` (with `took_ms`,
`successor_run_id`), or `handoff refused; processing here`, `handoff outcome
uncertain; settling it` then `handoff settled: ...`, or `handoff skipped: ...`;
the new owner (B) `handoff checkpoint validated`, `session transferred here`
and, when it replayed the Transfer, `transfer outcome settled by a replay`
(the warnings of uncertain outcomes are counted too). All processes run on one machine, so
their timestamps share a clock.

For every handoff this lines the steps up: the trigger's SendMessage (its
inbox append on hooks), A's inbox delivery (A starts the handoff), A's
AcceptHandoff call to B (B validates the checkpoint A sent, calls Transfer on
hooks, starts the successor run with the trigger in hand), and the
successor's first commit (`session.handed_off` and the trigger's turn). It
does the same for the same-deployment turns of the sessions that were handed
off (the bench's control turns). The last step, the commit's events reaching
the client's StreamEvents reader, is not in the server logs: with `--json`
(the bench's output of the same run) the client-measured latencies are
printed next to the server-side ones.

Debug logging costs CPU in every process: the absolute figures are higher
than in a run at log level warning; use the split, not the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import Counter, defaultdict
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


def _by_key(entries: list[Entry], method: str, key: str) -> dict[str, list[Entry]]:
    """The calls of `method` that carried `key`, by its value, in start order."""
    out: dict[str, list[Entry]] = defaultdict(list)
    for entry in entries:
        if _rpc(entry, method) and key in entry:
            out[entry[key]].append(entry)
    for calls in out.values():
        calls.sort(key=lambda e: e["t0"])
    return out


def _events(entries: list[Entry], event: str) -> dict[str, Entry]:
    """Owner log lines named `event`, by handoff id (the last one wins)."""
    return {e["handoff_id"]: e for e in entries if e.get("event") == event and "handoff_id" in e}


def _started_last_before(calls: list[Entry], t: float) -> Entry | None:
    best = None
    for call in calls:
        if call["t0"] > t:
            break
        best = call
    return best


def _first_started_after(calls: list[Entry], t: float) -> Entry | None:
    return next((call for call in calls if call["t0"] >= t), None)


# The upgrade turn's critical path, in order; the steps before TOTAL add up to it.
UPGRADE_STEPS = (
    "SendMessage start -> inbox append answered (hooks ResumeHook end)",
    "ResumeHook end -> A starts the handoff (A's inbox delivery)",
    "handoff start -> AcceptHandoff starts on B (A -> B hop)",
    "  ListInstances, hooks server time (cache misses only)",
    "AcceptHandoff start -> B: 'handoff checkpoint validated'",
    "validated -> Transfer starts on hooks (B -> hooks hop)",
    "Transfer, hooks server time (one etcd txn)",
    "Transfer end -> B: 'session transferred here'",
    "transferred -> the successor's first CommitStep starts",
    "the successor's first CommitStep, anchor server time",
    "TOTAL: SendMessage start -> successor's commit answered",
)
# The rest of the handoff, off the turn's critical path.
HANDOFF_STEPS = (
    "AcceptHandoff, B server time (validate + Transfer + start)",
    "AcceptHandoff end on B -> A logs 'session handed off'",
    "= took_ms (A: [ListInstances +] AcceptHandoff round trip)",
    "transferred -> the successor's StreamInbox starts",
)
CONTROL_STEPS = (
    "SendMessage start -> inbox append answered (hooks ResumeHook end)",
    "ResumeHook end -> the owner's CommitStep starts (delivery, step)",
    "CommitStep, anchor server time",
    "TOTAL: SendMessage start -> commit answered",
)
# Owner log lines of the handoff (both sides), counted by outcome. Matched
# by prefix: the successor run's own lines carry the handoff id too (its task
# inherits the AcceptHandoff call's log context), so the id alone is no test.
OUTCOME_PREFIXES = (
    "session handed off",
    "handoff ",
    "session transferred here",
    "transfer outcome",
    "settling commit",
)

Steps = dict[str, list[float]]


def _add(rows: Steps, names: Sequence[str], values: Sequence[float | None]) -> None:
    for name, value in zip(names, values, strict=True):
        if value is not None:
            rows[name].append(float(value))


def timelines(entries: list[Entry]) -> tuple[Steps, Steps, Steps, int]:
    """(upgrade steps, the rest of the handoff, control steps, handoffs that
    could not be lined up): per step, one duration (ms) per turn."""
    sends = _by_key(entries, "SendMessage", "session_id")
    resumes = _by_key(entries, "ResumeHook", "session_id")
    commits = _by_key(entries, "CommitStep", "session_id")
    accepts = _by_key(entries, "AcceptHandoff", "handoff_id")
    transfers = _by_key(entries, "Transfer", "handoff_id")
    inboxes = _by_key(entries, "StreamInbox", "run_id")
    listings = sorted((e for e in entries if _rpc(e, "ListInstances")), key=lambda e: e["t0"])
    validated = _events(entries, "handoff checkpoint validated")
    transferred = _events(entries, "session transferred here")
    first_commit: dict[str, Entry] = {}
    for calls in commits.values():
        for call in calls:
            first_commit.setdefault(call.get("run_id", ""), call)

    upgrade: Steps = {step: [] for step in UPGRADE_STEPS}
    handoff: Steps = {step: [] for step in HANDOFF_STEPS}
    triggers: set[str] = set()
    missed = 0
    moved: set[str] = set()
    for done in (e for e in entries if e.get("event") == "session handed off"):
        sid, hid = done["session_id"], done["handoff_id"]
        moved.add(sid)
        start = done["t"] - float(done["took_ms"])
        send = _started_last_before(sends.get(sid, []), start)
        resume = _started_last_before(resumes.get(sid, []), start)
        accept = next((c for c in accepts.get(hid, []) if c.get("code") == "OK"), None)
        transfer = next(
            (c for c in reversed(transfers.get(hid, [])) if c.get("code") == "OK"), None
        )
        check, moved_here = validated.get(hid), transferred.get(hid)
        successor = done.get("successor_run_id", "")
        commit = first_commit.get(successor)
        if not (send and resume and accept and transfer and check and moved_here and commit):
            missed += 1
            continue
        triggers.add(send["request_id"])
        listing = next((e for e in listings if start <= e["t0"] <= accept["t0"]), None)
        inbox = next(iter(inboxes.get(successor, [])), None)
        _add(
            upgrade,
            UPGRADE_STEPS,
            (
                resume["t"] - send["t0"],
                start - resume["t"],
                accept["t0"] - start,
                listing["duration_ms"] if listing else None,
                check["t"] - accept["t0"],
                transfer["t0"] - check["t"],
                transfer["duration_ms"],
                moved_here["t"] - transfer["t"],
                commit["t0"] - moved_here["t"],
                commit["duration_ms"],
                commit["t"] - send["t0"],
            ),
        )
        _add(
            handoff,
            HANDOFF_STEPS,
            (
                accept["duration_ms"],
                done["t"] - accept["t"],
                float(done["took_ms"]),
                inbox["t0"] - moved_here["t"] if inbox else None,
            ),
        )

    control: Steps = {step: [] for step in CONTROL_STEPS}
    for sid in moved:
        for send in sends.get(sid, []):
            if send["request_id"] in triggers:
                continue
            resume = _first_started_after(resumes.get(sid, []), send["t0"])
            if resume is None:
                continue
            commit = _first_started_after(commits.get(sid, []), resume["t"])
            if commit is None:
                continue
            _add(
                control,
                CONTROL_STEPS,
                (
                    resume["t"] - send["t0"],
                    commit["t0"] - resume["t"],
                    commit["duration_ms"],
                    commit["t"] - send["t0"],
                ),
            )
    return upgrade, handoff, control, missed


def outcomes(entries: list[Entry]) -> Counter[str]:
    """The owners' handoff log lines, by event (with the reason, if any)."""
    counts: Counter[str] = Counter()
    for e in entries:
        event = str(e.get("event", ""))
        if e["log"].startswith("owner") and event.startswith(OUTCOME_PREFIXES):
            counts[f"{event} ({e['reason']})" if e.get("reason") else event] += 1
    return counts


WIDTH = 68


def table(title: str, rows: Steps) -> list[str]:
    lines = [f"  {title:<{WIDTH}}{'n':>6}{'p50':>9}{'p90':>9}"]
    for step, values in rows.items():
        if not values:
            continue
        p90 = statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]
        lines.append(
            f"  {step:<{WIDTH}}{len(values):>6}{statistics.median(values):>9.2f}{p90:>9.2f}"
        )
    return lines


def client_lines(path: str) -> list[str]:
    """The client-measured figures of the same run, from the bench's --json."""
    with open(path) as f:
        report = json.load(f)
    upgrade = report.get("upgrade") or {}
    rows = (
        ("UPGRADE TURN: SendMessage -> SESSION_WAITING", upgrade.get("turn")),
        ("control turn: SendMessage -> SESSION_WAITING", upgrade.get("control")),
        ("one-step turn (phase b)", (report.get("sequential") or {}).get("turn")),
    )
    lines = [f"  {'at the client (bench --json, same run)':<{WIDTH}}{'n':>6}{'p50':>9}{'p90':>9}"]
    for name, figures in rows:
        if figures:
            lines.append(
                f"  {name:<{WIDTH}}{figures['n']:>6}"
                f"{figures['p50_ms']:>9.2f}{figures['p90_ms']:>9.2f}"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.handoff_timeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("log_dir", help="--log-dir of a bench run at --log-level debug")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="the --json output of the same bench run: adds the client-measured latencies",
    )
    args = parser.parse_args(argv)
    entries = load(args.log_dir)
    if not any(e.get("event") == "rpc" and e.get("code") == "OK" for e in entries):
        print("no debug rpc lines: run the bench with --log-level debug", file=sys.stderr)
        return 1
    upgrade, handoff, control, missed = timelines(entries)
    counts = outcomes(entries)
    lines = [
        "",
        "handoff log lines (A: the old owner, B: the new owner)",
        *(f"  {count:>6}  {event}" for event, count in sorted(counts.items())),
    ]
    if missed:
        lines.append(f"  {missed:>6}  handed off, but some of its log lines are missing: not timed")
    lines += [
        "",
        "ms, from server log timestamps (one clock; debug logging inflates every figure)",
        *table("upgrade turns (the critical path, in order)", upgrade),
        "",
        *table("the rest of the handoff (off the turn's critical path)", handoff),
        "",
        *table("same-deployment turns of the same sessions (controls)", control),
        "",
    ]
    if args.json:
        lines += [*client_lines(args.json), ""]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
