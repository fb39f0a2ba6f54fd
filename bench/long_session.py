"""A session's cost does not grow with its age (DESIGN.md §4).

    python -m bench.long_session [--turns 5000] [--window 200] [--commits 300]
                                 [--upgrade-prelude 1000] [--upgrade-turns 30]
                                 [--json PATH] [--smoke]

Starts the same real stack as `bench.turn_latency` (etcd and every service as
separate processes, two deployments) and measures, in one run:

1. one session, `--turns` one-step turns back to back: the turn latency
   (SendMessage -> the turn's SESSION_WAITING on a following reader) over the
   `--window` turns from turn 10, and over the last `--window` turns;
2. at both points, the fenced commit through anchor (`CommitStep`, gRPC and
   the etcd txn), shaped as that session's commit of a one-step turn at that
   point: its current snapshot, 7 events and 2 history entries, replayed
   `--commits` times on a scratch session so the session itself is untouched;
   and the bytes the session's last real commit wrote (events + history
   entries + snapshot, read back from etcd);
3. upgrade turns of a session that first had `--upgrade-prelude` turns of
   4 KiB messages: each upgrade turn (sent through the other deployment's
   ingress, so the session hands off) is followed by a normal turn on the same
   session (the control), as in `bench.turn_latency` phase u.

Targets: turn p50 and commit p50 at the late point within 1.1x of the early
point; upgrade turn p50 within 2x the control turn p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import grpc

from baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton.ingress.v1 import ingress_pb2_grpc
from baton.session.v1 import session_pb2 as s
from bench.turn_latency import (
    DEPLOYMENT_ID,
    DEPLOYMENT_ID_B,
    BenchStack,
    Dist,
    Follower,
    create_session,
    load_average,
    measure_upgrades,
    one_turn,
    wait_registered,
)
from services.common import ids
from services.common.clients import AnchorClient, HooksClient
from services.common.etcd import Store, make_client
from services.common.keys import Keys
from services.common.txn import Txn
from services.owner.session import RunIdentity, make_event

TARGET_AGE_RATIO = 1.1
TARGET_UPGRADE_RATIO = 2.0
ONE_STEP_KINDS = (
    s.EVENT_KIND_TURN_STARTED,
    s.EVENT_KIND_MESSAGE_RECEIVED,
    s.EVENT_KIND_STEP_STARTED,
    s.EVENT_KIND_MESSAGE_COMPLETED,
    s.EVENT_KIND_STEP_COMPLETED,
    s.EVENT_KIND_TURN_COMPLETED,
    s.EVENT_KIND_SESSION_WAITING,
)


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def last_commit_bytes(store: Store, keys: Keys, session_id: str) -> dict[str, int]:
    """What the session's last turn commit wrote: its events, the history
    entries it appended, and the snapshot."""
    k = keys
    result = await Txn().read("snapshot", k.snapshot(session_id)).run(store)
    raw = result.value("snapshot")
    assert raw is not None
    snapshot = s.SessionSnapshot.FromString(raw)
    last = snapshot.next_event_seq - 1
    log = snapshot.history_log
    found = await (
        Txn()
        .read("events", k.event(session_id, last - 6), k.event(session_id, last + 1))
        .read(
            "history",
            k.history_entry(session_id, log.next_index - 2),
            k.history_entry(session_id, log.next_index),
        )
        .run(store)
    )
    events = sum(len(kv.value) for kv in found.kvs("events"))
    history = sum(len(kv.value) for kv in found.kvs("history"))
    return {
        "events": events,
        "history": history,
        "snapshot": len(raw),
        "total": events + history + len(raw),
        "history_head": log.next_index,
        "context_entries": log.next_index - log.context_start,
    }


async def commit_at(
    anchor: AnchorClient, hooks: HooksClient, template: s.SessionSnapshot, commits: int
) -> tuple[Dist, int]:
    """`commits` one-step-turn commits through anchor on a scratch session
    whose snapshot is a copy of `template`; (latency, request bytes)."""
    sid = ids.new_session_id()
    owner = s.OwnerIdentity(owner_run_id=ids.new_run_id(), deployment_id="bench-scratch")
    owner.instance_id = "scratch"
    created = await hooks.create_session(sid, owner, template.channel, [])
    identity = RunIdentity(created.fence, "bench-scratch", "scratch")
    snapshot = s.SessionSnapshot()
    snapshot.CopyFrom(template)
    snapshot.session_id = sid
    snapshot.next_event_seq = 0
    started = make_event(identity, s.EVENT_KIND_SESSION_STARTED)
    snapshot.next_event_seq = 1
    response = await anchor.commit(
        anchor_pb.CommitStepRequest(
            fence=created.fence, events=[started], snapshot=snapshot, expected_snapshot_revision=0
        )
    )
    revision = response.revision
    dist = Dist()
    size = 0
    for i in range(commits):
        events = []
        for kind in ONE_STEP_KINDS:
            event = make_event(identity, kind, f"turn_{i}", text="echo: bench turn")
            event.seq = snapshot.next_event_seq + len(events)
            events.append(event)
        snapshot.next_event_seq += len(events)
        snapshot.history_log.next_index += 2
        history = [
            s.ChatMessage(role=s.ROLE_USER, content=f"bench turn {i}"),
            s.ChatMessage(role=s.ROLE_ASSISTANT, content=f"echo: bench turn {i}"),
        ]
        request = anchor_pb.CommitStepRequest(
            fence=created.fence,
            events=events,
            snapshot=snapshot,
            expected_snapshot_revision=revision,
            history=history,
        )
        size = request.ByteSize()
        t0 = time.perf_counter()
        response = await anchor.commit(request)
        dist.samples.append(time.perf_counter() - t0)
        revision = response.revision
    return dist, size


async def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="baton-bench-long-")
    stack = BenchStack(log_dir=log_dir, second_deployment=args.upgrade_turns > 0)
    stack.start()
    assert stack.etcd is not None
    store = Store(make_client(stack.etcd.endpoint, 10.0), 10.0)
    await store.connect()
    keys = Keys(stack.prefix)
    anchor = AnchorClient(stack.addrs["anchor"], timeout=10)
    hooks = HooksClient(stack.addrs["hooks"], timeout=10)
    channel = grpc.aio.insecure_channel(stack.addrs["ingress"])
    stub = ingress_pb2_grpc.IngressServiceStub(channel)
    results: dict[str, Any] = {"load_start": load_average(), "log_dir": log_dir}
    try:
        session_id = await create_session(stub)
        follower = Follower(stub, session_id)
        await asyncio.wait_for(follower.ready, 10)
        early, late = Dist(), Dist()
        points: dict[str, dict[str, Any]] = {}
        first = 10
        _progress(f"1: {args.turns} one-step turns on one session")
        try:
            for turn in range(args.turns):
                _, took = await one_turn(stub, follower, f"bench turn {turn}", f"d-{turn}")
                if first <= turn < first + args.window:
                    early.samples.append(took)
                if turn >= args.turns - args.window:
                    late.samples.append(took)
                at_point = turn in (first + args.window - 1, args.turns - 1)
                if at_point:
                    name = "early" if turn < args.turns - 1 else "late"
                    _progress(f"2: commits shaped as turn {turn + 1}")
                    written = await last_commit_bytes(store, keys, session_id)
                    template = await anchor.snapshot(session_id)
                    commits, request_bytes = await commit_at(anchor, hooks, template, args.commits)
                    points[name] = {
                        "turn": turn + 1,
                        "written": written,
                        "commit": commits,
                        "commit_request_bytes": request_bytes,
                    }
        finally:
            await follower.close()
        stack.check_alive()
        results["turns"] = args.turns
        results["turn_early"] = early
        results["turn_late"] = late
        results["points"] = points
        if args.upgrade_turns > 0:
            _progress(
                f"3: a session of {args.upgrade_prelude} turns of 4 KiB, then "
                f"{args.upgrade_turns} upgrade turns, each with a control turn"
            )
            await wait_registered(stack.addrs["hooks"], (DEPLOYMENT_ID, DEPLOYMENT_ID_B))
            channel_b = grpc.aio.insecure_channel(stack.addrs["ingress-b"])
            try:
                stubs = {
                    DEPLOYMENT_ID: stub,
                    DEPLOYMENT_ID_B: ingress_pb2_grpc.IngressServiceStub(channel_b),
                }
                prelude = [f"prelude {n} " + "k" * 4096 for n in range(args.upgrade_prelude)]
                up = await measure_upgrades(
                    stubs, args.upgrade_turns, 3, 0.005, stack.cpu, prelude=prelude
                )
            finally:
                await channel_b.close()
            stack.check_alive()
            written = await last_commit_bytes(store, keys, up["session_id"])
            up["written"] = written
            results["upgrade"] = up
    finally:
        await channel.close()
        await anchor.close()
        await hooks.close()
        await store.close()
        results["load_end"] = load_average()
        stack.stop()
    return results


def _ms(dist: Dist, p: float = 50) -> float:
    return dist.pct(p)


def report(results: dict[str, Any]) -> str:
    early, late = results["turn_early"], results["turn_late"]
    pe, pl = results["points"]["early"], results["points"]["late"]
    lines = [
        f"load average at start {results['load_start']}, at end {results['load_end']}",
        "",
        f"{'':44}{'p50':>9}{'p90':>9}{'p99':>9}  (ms)",
    ]

    def row(label: str, dist: Dist, extra: str = "") -> str:
        return f"{label:<44}{_ms(dist):9.2f}{_ms(dist, 90):9.2f}{_ms(dist, 99):9.2f}  {extra}"

    lines += [
        row(f"one-step turn, turns {10}-{10 + len(early.samples) - 1}", early),
        row(
            f"one-step turn, turns {results['turns'] - len(late.samples)}-{results['turns'] - 1}",
            late,
            f"late/early p50 {_ms(late) / _ms(early):.3f}",
        ),
        row(f"commit shaped as turn {pe['turn']}", pe["commit"]),
        row(
            f"commit shaped as turn {pl['turn']}",
            pl["commit"],
            f"late/early p50 {_ms(pl['commit']) / _ms(pe['commit']):.3f}",
        ),
        "",
        "bytes written by the session's last commit (events + history + snapshot = total):",
    ]
    for point in (pe, pl):
        w = point["written"]
        lines.append(
            f"  at turn {point['turn']:>5}: {w['events']} + {w['history']} + {w['snapshot']} "
            f"= {w['total']} B (history head {w['history_head']}, "
            f"{w['context_entries']} entries in the context); "
            f"CommitStep request {point['commit_request_bytes']} B"
        )
    ratios = {
        "turn": _ms(late) / _ms(early),
        "commit": _ms(pl["commit"]) / _ms(pe["commit"]),
    }
    if "upgrade" in results:
        up = results["upgrade"]
        w = up["written"]
        lines += [
            "",
            row(f"upgrade turn ({len(up['turn'].samples)}), long session", up["turn"]),
            row("control: normal turn, same session", up["control"]),
            f"  the session's last commit wrote {w['total']} B; history head "
            f"{w['history_head']}, {w['context_entries']} entries in the context; "
            f"not handed off: {up['not_handed_off']}",
        ]
        ratios["upgrade"] = _ms(up["turn"]) / _ms(up["control"])
    lines += ["", "  targets"]
    lines.append(_target(f"turn p50 late/early <= {TARGET_AGE_RATIO}", ratios["turn"]))
    lines.append(_target(f"commit p50 late/early <= {TARGET_AGE_RATIO}", ratios["commit"]))
    if "upgrade" in ratios:
        lines.append(
            _target(
                f"upgrade turn p50 <= {TARGET_UPGRADE_RATIO} x control p50",
                ratios["upgrade"],
                TARGET_UPGRADE_RATIO,
            )
        )
    return "\n".join(lines)


def _target(label: str, ratio: float, limit: float = TARGET_AGE_RATIO) -> str:
    return f"    {'PASS' if ratio <= limit else 'FAIL'}  {label:<48} measured {ratio:.3f}"


def to_json(results: dict[str, Any]) -> dict[str, Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, Dist):
            return value.summary()
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    out: dict[str, Any] = convert(results)
    out["turn_late_over_early"] = round(
        statistics.median(results["turn_late"].samples)
        / statistics.median(results["turn_early"].samples),
        3,
    )
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.long_session", description=__doc__)
    parser.add_argument("--turns", type=int, default=5000)
    parser.add_argument("--window", type=int, default=200, help="turns per measured window")
    parser.add_argument("--commits", type=int, default=300, help="scratch commits per point")
    parser.add_argument("--upgrade-prelude", type=int, default=1000)
    parser.add_argument("--upgrade-turns", type=int, default=30, help="0 skips phase 3")
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: checks it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.turns, args.window, args.commits = 40, 10, 10
        args.upgrade_prelude, args.upgrade_turns = 10, 3
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    print(report(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(to_json(results), out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
