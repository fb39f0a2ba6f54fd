"""A session's cost does not grow with its age (docs/design.md §4).

    python -m bench.long_session [--turns 5000] [--window 200] [--commits 300]
                                 [--upgrade-prelude 1000] [--upgrade-turns 30]
                                 [--json PATH] [--smoke]

Starts the same real stack as `bench.turn_latency` (etcd and every service as
separate processes, two deployments) and measures, in one run:

1. one session, `--turns` one-step turns back to back (the turn latency,
   SendMessage -> the turn's SESSION_WAITING on a following reader, over the
   `--window` turns from turn 10 is reported as it ran); the bytes the
   session's last commit wrote (events + history entries + snapshot, read
   back from etcd) after turn 10 + window and at the end;
2. interleaved at the end, so both sides see the same etcd and the same load
   (this machine's load moves a lot within minutes): `--window` turns of a
   young session (its turns 10..) alternating with the old session's next
   turns; and the fenced commit through anchor (`CommitStep`, gRPC and the
   etcd txn) shaped as the session's one-step commit at each point (its
   snapshot then, 7 events and 2 history entries), `--commits` times each,
   alternating, on scratch sessions so the session itself is untouched;
3. upgrade turns of a session that first had `--upgrade-prelude` turns of
   4 KiB messages: each upgrade turn (sent through the other deployment's
   ingress, so the session hands off) is followed by a normal turn on the same
   session (the control), as in `bench.turn_latency` phase u.

Targets: the old session's turn p50 within 1.1x of the young one's, the
late-shaped commit p50 within 1.1x of the early-shaped one; upgrade turn p50
within 2x the control turn p50.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.security.identity import Role
from baton_runtime.owner.rules.held import RunIdentity, make_event
from bench.common import log_dir, progress, write_json
from bench.floor import ONE_STEP_KINDS
from bench.measure import Dist, load_average
from bench.stack import DEPLOYMENT_ID, DEPLOYMENT_ID_B, BenchStack
from bench.turns import Follower, create_session, measure_upgrades, one_turn, wait_registered

TARGET_AGE_RATIO = 1.1
TARGET_UPGRADE_RATIO = 2.0


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


SCRATCH_DEPLOYMENT = "bench-scratch"


class ScratchCommits:
    """One-step-turn commits through anchor on a scratch session whose
    snapshot is a copy of a real session's (`template`)."""

    def __init__(self, anchor: AnchorClient, hooks: HooksClient) -> None:
        self.anchor = anchor
        self.hooks = hooks
        self.dist = Dist()
        self.request_bytes = 0

    async def start(self, template: s.SessionSnapshot) -> None:
        sid = ids.new_session_id()
        owner = s.OwnerIdentity(
            owner_run_id=ids.new_run_id(), deployment_id=SCRATCH_DEPLOYMENT, instance_id="scratch"
        )
        created = await self.hooks.create_session(sid, owner, template.channel, [])
        self.fence = created.fence
        self.identity = RunIdentity(created.fence, SCRATCH_DEPLOYMENT, "scratch")
        self.snapshot = s.SessionSnapshot()
        self.snapshot.CopyFrom(template)
        self.snapshot.session_id = sid
        self.snapshot.next_event_seq = 1
        started = make_event(self.identity, s.EVENT_KIND_SESSION_STARTED, now=time.time())
        response = await self.anchor.commit(
            anchor_pb.CommitStepRequest(
                fence=self.fence,
                events=[started],
                snapshot=self.snapshot,
                expected_snapshot_revision=0,
            )
        )
        self.revision = response.revision
        self.count = 0

    async def commit(self) -> None:
        snapshot, i = self.snapshot, self.count
        events = []
        for kind in ONE_STEP_KINDS:
            event = make_event(
                self.identity, kind, f"turn_{i}", now=time.time(), text="echo: bench turn"
            )
            event.seq = snapshot.next_event_seq + len(events)
            events.append(event)
        snapshot.next_event_seq += len(events)
        snapshot.history_log.next_index += 2
        history = [
            s.ChatMessage(role=s.ROLE_USER, content=f"bench turn {i}"),
            s.ChatMessage(role=s.ROLE_ASSISTANT, content=f"echo: bench turn {i}"),
        ]
        request = anchor_pb.CommitStepRequest(
            fence=self.fence,
            events=events,
            snapshot=snapshot,
            expected_snapshot_revision=self.revision,
            history=history,
        )
        self.request_bytes = request.ByteSize()
        t0 = time.perf_counter()
        response = await self.anchor.commit(request)
        self.dist.samples.append(time.perf_counter() - t0)
        self.revision = response.revision
        self.count += 1


async def run(args: argparse.Namespace, logs: str) -> dict[str, Any]:
    stack = BenchStack(log_dir=logs, second_deployment=args.upgrade_turns > 0)
    stack.start()
    assert stack.etcd is not None
    store = Store(make_client(stack.etcd.endpoint, 10.0, stack.etcd_security), 10.0)
    await store.connect()
    keys = Keys(stack.prefix)
    # The scratch session's owner (a deployment without processes).
    as_scratch = stack.security(Role.OWNER, SCRATCH_DEPLOYMENT)
    anchor = AnchorClient(stack.addrs["anchor"], timeout=10, security=as_scratch)
    hooks = HooksClient(stack.addrs["hooks"], timeout=10, security=as_scratch)
    channel = stack.public_channel("ingress")
    stub = ingress_pb2_grpc.IngressServiceStub(channel)
    results: dict[str, Any] = {"load_start": load_average(), "log_dir": logs}
    first = 10
    try:
        session_id = await create_session(stub)
        follower = Follower(stub, session_id)
        fresh_id = await create_session(stub)
        fresh = Follower(stub, fresh_id)
        await asyncio.wait_for(asyncio.gather(follower.ready, fresh.ready), 10)
        over_time, young, old = Dist(), Dist(), Dist()
        points: dict[str, dict[str, Any]] = {}
        progress(f"1: {args.turns} one-step turns on one session")
        try:
            for turn in range(args.turns):
                _, took = await one_turn(stub, follower, f"bench turn {turn}", f"d-{turn}")
                if first <= turn < first + args.window:
                    over_time.samples.append(took)
                if turn == first + args.window - 1:
                    points["early"] = {
                        "turn": turn + 1,
                        "written": await last_commit_bytes(store, keys, session_id),
                        "template": await anchor.snapshot(session_id),
                    }
            points["late"] = {
                "turn": args.turns,
                "written": await last_commit_bytes(store, keys, session_id),
                "template": await anchor.snapshot(session_id),
            }
            # 2: interleaved, so both sides see the same etcd and the same load:
            # a young session's turns 10.. against the old session's next turns.
            progress(f"2: {args.window} turns of a young session interleaved with the old one")
            for turn in range(first):
                await one_turn(stub, fresh, f"bench turn {turn}", f"f-{turn}")
            for turn in range(args.window):
                _, took = await one_turn(stub, fresh, "bench turn", f"fy-{turn}")
                young.samples.append(took)
                _, took = await one_turn(stub, follower, "bench turn", f"fo-{turn}")
                old.samples.append(took)
        finally:
            await follower.close()
            await fresh.close()
        progress(f"2: {args.commits} commits shaped as each point, interleaved")
        shaped = {name: ScratchCommits(anchor, hooks) for name in points}
        for name, commits in shaped.items():
            await commits.start(points[name]["template"])
        for _ in range(args.commits):
            for commits in shaped.values():
                await commits.commit()
        for name, commits in shaped.items():
            points[name]["commit"] = commits.dist
            points[name]["commit_request_bytes"] = commits.request_bytes
            points[name]["snapshot_bytes"] = points[name].pop("template").ByteSize()
        stack.check_alive()
        results.update(turns=args.turns, turn_over_time=over_time, turn_young=young, turn_old=old)
        results["points"] = points
        if args.upgrade_turns > 0:
            progress(
                f"3: a session of {args.upgrade_prelude} turns of 4 KiB, then "
                f"{args.upgrade_turns} upgrade turns, each with a control turn"
            )
            await wait_registered(
                stack.addrs["hooks"],
                (DEPLOYMENT_ID, DEPLOYMENT_ID_B),
                stack.security(Role.OPERATOR),
            )
            channel_b = stack.public_channel("ingress-b")
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
            up["written"] = await last_commit_bytes(store, keys, up["session_id"])
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
    young, old = results["turn_young"], results["turn_old"]
    pe, pl = results["points"]["early"], results["points"]["late"]
    n = results["turns"]
    lines = [
        f"load average at start {results['load_start']}, at end {results['load_end']}",
        "",
        f"{'':52}{'p50':>9}{'p90':>9}{'p99':>9}  (ms)",
    ]

    def row(label: str, dist: Dist, extra: str = "") -> str:
        return f"{label:<52}{_ms(dist):9.2f}{_ms(dist, 90):9.2f}{_ms(dist, 99):9.2f}  {extra}"

    window = len(young.samples)
    lines += [
        row(f"one-step turn, turns 10-{9 + window}, as they ran", results["turn_over_time"]),
        "interleaved at the end (same etcd, same load):",
        row(f"  young session, turns 10-{9 + window}", young),
        row(
            f"  old session, turns {n}-{n + window - 1}",
            old,
            f"old/young p50 {_ms(old) / _ms(young):.3f}",
        ),
        row(f"  commit shaped as turn {pe['turn']}", pe["commit"]),
        row(
            f"  commit shaped as turn {pl['turn']}",
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
        "turn": _ms(old) / _ms(young),
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
    lines.append(_target(f"turn p50 old/young <= {TARGET_AGE_RATIO}", ratios["turn"]))
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
    out["turn_old_over_young"] = round(
        statistics.median(results["turn_old"].samples)
        / statistics.median(results["turn_young"].samples),
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
    with log_dir(args.log_dir, "baton-bench-long-") as logs:
        results = asyncio.run(run(args, logs))
    print(report(results))
    write_json(args.json, to_json(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
