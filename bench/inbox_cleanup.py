"""What deleting consumed inbox entries costs a commit, two ways (issue 20).

    python -m bench.inbox_cleanup [--turns 2000] [--block 50] [--json PATH] [--smoke]

On a real etcd (plaintext, fsync on, started here; its periodic compaction
does not run within the bench, so the tombstones of every deleted entry stay
in etcd's index for the whole run: the worst case of a range that starts at
the inbox's first key), one session per way does `--turns` "turns": an inbox
append (entry + head) and then the shaped one-step commit (fence compare;
a 1 KiB snapshot, 3 events and the commit marker), in alternating blocks of
`--block` turns so every way sees the same load:

- `none`: the commit only (the entries stay: today's growth);
- `in_txn`: the commit's txn also range-deletes the entries consumed since
  the previous commit (`consumed_inbox_from`: what anchor does);
- `in_txn_from_start`: the same range from the inbox's first key (what a
  run's first commit does): etcd walks every tombstone left since its last
  compaction;
- `after`: the commit, then a second txn deleting the entries consumed since
  the last one (bounded batches right after the commit).

Reported: p50/p99 of the commit (for `after`, the commit and its delete
together: what a turn waits for) and of the last 10 % of turns (tombstones
at their most).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence

from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.ops import cmp_value, op_delete, op_put
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.security.tls import Security
from bench.common import apply_smoke, write_json

WAYS = ("none", "in_txn", "in_txn_from_start", "after")
SNAPSHOT = b"s" * 1024
EVENT = b"e" * 200


async def turn(store: Store, keys: Keys, sid: str, way: str, seq: int) -> float:
    """One append and one commit consuming it; the commit's seconds."""
    await store.txn(
        [],
        [
            op_put(keys.inbox_entry(sid, seq), b"c" * 120),
            op_put(keys.inbox_head(sid), str(seq + 1).encode()),
        ],
    )
    start = time.perf_counter()
    ops = [op_put(keys.snapshot(sid), SNAPSHOT)]
    ops += [op_put(keys.event(sid, 3 * seq + i), EVENT) for i in range(3)]
    ops.append(op_put(keys.commit_marker(sid), str(3 * seq + 2).encode()))
    if way == "in_txn":
        ops.append(op_delete(keys.inbox_entry(sid, seq), keys.inbox_entry(sid, seq + 1)))
    if way == "in_txn_from_start":
        ops.append(op_delete(keys.inbox_prefix(sid), keys.inbox_entry(sid, seq + 1)))
    await store.txn([cmp_value(keys.fence(sid), b"1/run")], ops)
    if way == "after":
        await store.txn(
            [cmp_value(keys.fence(sid), b"1/run")],
            [op_delete(keys.inbox_entry(sid, seq), keys.inbox_entry(sid, seq + 1))],
        )
    return time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run(turns: int, block: int) -> dict[str, dict[str, float]]:
    etcd = EtcdProcess().start()
    store = Store(make_client(etcd.endpoint, 10.0, Security.plaintext()), 10.0)
    try:
        await store.connect()
        keys = Keys("/bench/")
        sids = {way: f"ses_{way}" for way in WAYS}
        for sid in sids.values():
            await store.txn([], [op_put(keys.fence(sid), b"1/run")])
        for seq in range(20):  # warm-up
            for way in WAYS:
                await turn(store, keys, sids[way], way, seq)
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        seq = 20
        while len(times["none"]) < turns:
            for way in WAYS:
                for offset in range(block):
                    times[way].append(await turn(store, keys, sids[way], way, seq + offset))
            seq += block
        tail = max(1, turns // 10)
        return {
            way: {
                "p50_ms": statistics.median(t) * 1000,
                "p99_ms": pct(t, 0.99),
                "last_10pct_p50_ms": statistics.median(t[-tail:]) * 1000,
            }
            for way, t in times.items()
        }
    finally:
        await store.close()
        etcd.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inbox_cleanup")
    parser.add_argument("--turns", type=int, default=2000, help="turns per way")
    parser.add_argument("--block", type=int, default=50, help="turns per alternating block")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--smoke", action="store_true", help="a tiny run")
    args = parser.parse_args(argv)
    apply_smoke(parser, args, {"turns": 60, "block": 10})
    figures = asyncio.run(run(args.turns, args.block))
    for way, f in figures.items():
        print(
            f"{way:7s} commit p50 {f['p50_ms']:.3f} ms  p99 {f['p99_ms']:.3f} ms  "
            f"last 10% p50 {f['last_10pct_p50_ms']:.3f} ms"
        )
    base = figures["none"]["p50_ms"]
    for way in WAYS[1:]:
        print(f"{way} / none p50: {figures[way]['p50_ms'] / base:.3f}x")
    if args.json:
        write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
