"""A live session's etcd footprint and commit cost do not grow with its age
(issue 20); with the object store, etcd keeps a constant per session
whatever its stream and context (issue 34).

    python -m bench.storage [--turns 10000] [--early 1000] [--window 200]
                            [--keep-events 100000] [--dedupe-window 30]
                            [--seal-idle 5] [--sweep 30] [--off-every 1]
                            [--block 100] [--loads 20] [--json PATH] [--smoke]

Two stacks as `bench.turn_latency` starts them (etcd with TLS and auth, and
every service as its own process, one deployment each), in one run, both at
anchor's default stream retention (`--keep-events`, 100,000 events, and 7
days) and a `--dedupe-window` of delivery ids shorter than the run:

- `on`: anchor seals into an object store (`--object-store`, a file://
  directory of the run's log dir), a session quiet for `--seal-idle`
  seconds sealed whole;
- `off`: no object store: everything stays in etcd.

One session on `on` runs `--turns` one-step turns (each with its own
delivery id) in blocks of `--block`; after every `--off-every` blocks, one
block runs on a session of `off`. At turn `--early` and at the end, the bench
counts the keys and bytes under the session's prefix twice: active (right
after the block's last turn) and quiet (sending nothing until its delivery
ids expired and both tails are sealed), and etcd's `dbSize`,
`dbSizeInUse`, and `dbSizeInUse` once more after compacting etcd at its head.

At the end: `--loads` LoadSession calls of one context warm and cold (a new
session on `on` with `--load-turns` turns: loaded at once, its entries in
etcd's tail; then once it is sealed whole, from the object store), a read
of each stream from seq 0 (catch-up events/s), and the turn p50 of a young
session interleaved with the old one's.

The cost of the store: the turn p50 of every `off` block against the `on`
block just before it (same load, same minute).

Targets: the quiet session's keys at the end within 1.1x of those at
`--early`, its key and value bytes within 1 KiB of them (the segment index
holds up to 16 refs between two directories; seqs gain digits) and at most
8 KB; active at most 64 KB but the delivery ids of the dedupe window (they
are coordination data, as many as the window's messages: at this bench's
pace, thousands);
the turn p50 on/off at most 1.05; the old session's turn p50 within 1.1x
of the young one's, interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from aetcd import rpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import Keys, prefix_end
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.security.identity import Role
from baton_runtime.hooks.expiry import lease_ttl
from bench.common import apply_smoke, log_dir, progress, write_json
from bench.measure import Dist, load_average
from bench.stack import DEPLOYMENT_ID, METADATA, BenchStack
from bench.turns import Follower, create_session, one_turn

TARGET_RATIO = 1.1
TARGET_STORE_RATIO = 1.05
TARGET_IDLE_BYTES = 8 * 1024
TARGET_ACTIVE_BYTES = 64 * 1024


@dataclass
class Side:
    """One stack, one session on it, and a following reader."""

    stack: BenchStack
    store: Store | None = None
    channel: grpc.aio.Channel | None = None
    stub: ingress_pb2_grpc.IngressServiceStub | None = None
    follower: Follower | None = None
    turns: int = 0
    samples: list[float] = field(default_factory=list)

    async def open(self) -> None:
        etcd = self.stack.etcd
        assert etcd is not None
        self.store = Store(make_client(etcd.endpoint, 10.0, self.stack.etcd_security), 10.0)
        await self.store.connect()
        self.channel = self.stack.public_channel("ingress")
        self.stub = ingress_pb2_grpc.IngressServiceStub(self.channel)
        self.follower = Follower(self.stub, await create_session(self.stub))
        await asyncio.wait_for(self.follower.ready, 10)

    async def block(self, turns: int, label: str) -> list[float]:
        assert self.stub is not None and self.follower is not None
        took = []
        for _ in range(turns):
            _, turn = await one_turn(self.stub, self.follower, "hi", f"{label}-{self.turns}")
            took.append(turn)
            self.turns += 1
        self.samples += took
        self.stack.check_alive()
        return took

    async def close(self) -> None:
        if self.follower is not None:
            await self.follower.close()
        if self.channel is not None:
            await self.channel.close()
        if self.store is not None:
            await self.store.close()


async def _range(store: Store, prefix: bytes) -> Sequence[Any]:
    return (await Txn().read("all", prefix, prefix_end(prefix)).run(store)).kvs("all")


async def census(side: Side) -> dict[str, Any]:
    """Keys and value bytes under the session's prefix by part (the second
    path segment: `ev`, `h`, `dlv`, `c`, ...), under the stack's prefix, and
    etcd's database size."""
    assert side.store is not None and side.follower is not None
    keys = Keys(side.stack.prefix)
    prefix = keys.session_prefix(side.follower.session_id)
    parts: dict[str, list[int]] = {}
    key_bytes = 0
    for kv in await _range(side.store, prefix):
        part = kv.key[len(prefix) :].split(b"/", 1)[0].decode()
        counted = parts.setdefault(part, [0, 0])
        counted[0] += 1
        counted[1] += len(kv.value)
        key_bytes += len(kv.key)
    stack_kvs = await _range(side.store, side.stack.prefix.encode())
    client = side.store.client
    status = await client.maintenancestub.Status(rpc.StatusRequest(), timeout=10)
    # What etcd's periodic compaction (1 minute here) leaves once it has run
    # over the run so far: compacted at the head, the pages in use.
    request = rpc.CompactionRequest(revision=status.header.revision, physical=True)
    await client.kvstub.Compact(request, timeout=60)
    await asyncio.sleep(1.0)  # the backend commits its freed pages every 100 ms
    compacted = await client.maintenancestub.Status(rpc.StatusRequest(), timeout=10)
    history = parts.get("h", [0, 0])
    return {
        "turn": side.turns,
        "parts": {part: {"keys": n, "bytes": b} for part, (n, b) in sorted(parts.items())},
        "keys": sum(n for n, _ in parts.values()),
        "bytes": sum(b for _, b in parts.values()),
        "kv_bytes": key_bytes + sum(b for _, b in parts.values()),
        "keys_but_history": sum(n for n, _ in parts.values()) - history[0],
        "bytes_but_history": sum(b for _, b in parts.values()) - history[1],
        "stack_keys": len(stack_kvs),
        "stack_bytes": sum(len(kv.value) for kv in stack_kvs),
        "db_size": int(status.dbSize),
        "db_size_in_use": int(status.dbSizeInUse),
        "db_size_in_use_compacted": int(compacted.dbSizeInUse),
    }


async def active(side: Side) -> dict[str, int]:
    """Keys and bytes under the session now (a turn just ended); and the
    same but its delivery ids (the dedupe window's, not the logs')."""
    assert side.store is not None and side.follower is not None
    prefix = Keys(side.stack.prefix).session_prefix(side.follower.session_id)
    kvs = await _range(side.store, prefix)
    logs = [kv for kv in kvs if not kv.key[len(prefix) :].startswith(b"dlv/")]
    return {
        "keys": len(kvs),
        "bytes": sum(len(kv.value) for kv in kvs),
        "kv_bytes": sum(len(kv.key) + len(kv.value) for kv in kvs),
        "keys_but_deliveries": len(logs),
        "kv_bytes_but_deliveries": sum(len(kv.key) + len(kv.value) for kv in logs),
    }


async def wait_quiet(side: Side, window: float, idle: float) -> float:
    """Wait, sending nothing, until the session is quiet: no delivery id
    left (they expire within the lease TTL of the window) and both tails
    sealed (the stream's last event and no history entry left as keys).
    Seconds waited."""
    assert side.store is not None and side.follower is not None
    prefix = Keys(side.stack.prefix).session_prefix(side.follower.session_id)
    start = time.monotonic()
    # The TTL, the idle time, a sealing round and etcd's lease check.
    deadline = start + lease_ttl(window) + idle + 60
    while time.monotonic() < deadline:
        deliveries = await _range(side.store, prefix + b"dlv/")
        events = await _range(side.store, prefix + b"ev/")
        entries = await _range(side.store, prefix + b"h/")
        if not deliveries and len(events) <= 1 and not entries:
            return time.monotonic() - start
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the session was not quiet within {deadline - start:.0f} s")


async def loads(side: Side, count: int) -> dict[str, Any]:
    """`count` LoadSession calls of the session, as its owner would make
    them: the p50, and what the context held."""
    assert side.follower is not None
    anchor = AnchorClient(
        side.stack.addrs["anchor"],
        timeout=30,
        security=side.stack.security(Role.OWNER, DEPLOYMENT_ID),
    )
    took: list[float] = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            loaded = await anchor.load_session(side.follower.session_id)
            took.append(time.perf_counter() - started)
    finally:
        await anchor.close()
    return {
        **Dist(took).summary(),
        "entries": len(loaded.context),
        "context_bytes": sum(m.ByteSize() for m in loaded.context),
    }


async def cold_and_warm(args: argparse.Namespace, stack: BenchStack) -> dict[str, Any]:
    """One context loaded warm (its entries in etcd's tail: fewer than a
    segment's worth, right after its turns) and cold (the same entries once
    the quiet session is sealed whole: read from the object store)."""
    side = Side(stack)
    await side.open()
    try:
        await side.block(args.load_turns, "lw")
        warm = await loads(side, args.loads)
        await wait_quiet(side, args.dedupe_window, args.seal_idle)
        cold = await loads(side, args.loads)
    finally:
        await side.close()
    return {"warm": warm, "cold": cold}


async def catch_up(side: Side) -> dict[str, Any]:
    """The whole stream read from seq 0 through ingress: events/s."""
    assert side.stub is not None and side.follower is not None
    started = time.perf_counter()
    events = 0
    call = side.stub.StreamEvents(
        ingress_pb.StreamEventsRequest(
            session_id=side.follower.session_id, start_seq=0, follow=False
        ),
        metadata=METADATA,
    )
    async for response in call:
        events += len(response.events)
    took = time.perf_counter() - started
    return {"events": events, "seconds": round(took, 3), "events_per_s": events / took}


def _p50(samples: Sequence[float]) -> float:
    return Dist(list(samples)).pct(50)


Pairs = list[tuple[list[float], list[float]]]


async def drive(
    args: argparse.Namespace, on: Side, off: Side
) -> tuple[dict[str, dict[str, Any]], Pairs]:
    """The run: `on`'s turns in blocks, an `off` block after every
    `--off-every` of them; `on`'s session counted quiet at both points."""
    points: dict[str, dict[str, Any]] = {}
    pairs: Pairs = []
    progress(f"{args.turns} turns on the clean-up stack, blocks of {args.block}")
    blocks = 0
    while on.turns < args.turns:
        size = min(args.block, args.turns - on.turns)
        if on.turns < args.early < on.turns + size:
            size = args.early - on.turns  # a block ends at the first point
        on_block = await on.block(size, "d")
        blocks += 1
        if blocks % args.off_every == 0:
            pairs.append((on_block, await off.block(args.block, "d")))
        if on.turns in (args.early, args.turns):
            name = "early" if on.turns == args.early else "late"
            points[name] = await quiet_point(args, on)
    return points, pairs


async def quiet_point(args: argparse.Namespace, on: Side) -> dict[str, Any]:
    """The turn p50 of the window before now, the census as the turns left
    it, then once quiet."""
    window = on.samples[-args.window :]
    busy = await active(on)
    progress(f"turn {on.turns}: waiting for the session to be quiet")
    waited = await wait_quiet(on, args.dedupe_window, args.seal_idle)
    point = {
        **await census(on),
        "active": busy,
        "turn_p50_ms": _p50(window),
        "window": len(window),
        "quiet_after_s": round(waited, 1),
    }
    progress(f"turn {on.turns}: {point['keys']} keys")
    return point


async def run(args: argparse.Namespace, logs: str) -> dict[str, Any]:
    off_env = {
        "BATON_STREAM_RETENTION_EVENTS": str(args.keep_events),
        "BATON_DEDUPE_WINDOW": str(args.dedupe_window),
        "BATON_RETENTION_SWEEP": str(args.sweep),
    }
    on_env = {
        **off_env,
        "BATON_OBJECT_STORE": f"file://{logs}/on/objects",
        "BATON_SEAL_IDLE": str(args.seal_idle),
    }
    if args.calibrate:
        # A/A: the store on both stacks, to see what the comparison itself
        # measures between two stacks alike.
        off_env = {**on_env, "BATON_OBJECT_STORE": f"file://{logs}/off/objects"}
    stacks = {
        "on": BenchStack(log_dir=f"{logs}/on", second_deployment=False, env=on_env),
        "off": BenchStack(log_dir=f"{logs}/off", second_deployment=False, env=off_env),
    }
    results: dict[str, Any] = {"load_start": load_average(), "settings": off_env}
    sides: dict[str, Side] = {}
    try:
        for name, stack in stacks.items():
            os.makedirs(stack.log_dir, exist_ok=True)
            stack.start()
            sides[name] = Side(stack)
            await sides[name].open()
        on, off = sides["on"], sides["off"]
        for side in (on, off):  # warm-up, not counted
            await side.block(20, "warm")
            side.samples.clear()
            side.turns = 0
        points, pairs = await drive(args, on, off)
        # The same ages side by side, so both see the same load (it moves a
        # lot within minutes here): a young session at --early, one turn
        # each in turn with the old one.
        progress(
            f"a young session's turns {args.early - args.window}.. interleaved with the old one's"
        )
        sides["young"] = young = Side(stacks["on"])
        await young.open()
        await young.block(args.early - args.window, "y")
        young.samples.clear()
        old_turn = on.turns
        for _ in range(args.window):
            await young.block(1, "y")
            await on.block(1, "d")
        results["interleaved"] = {
            "young_from": args.early - args.window,
            "old_from": old_turn,
            "young": Dist(young.samples).summary(),
            "old": Dist(on.samples[-args.window :]).summary(),
            "p50_ratio": _p50(on.samples[-args.window :]) / _p50(young.samples),
        }
        results["points"] = points
        results["off_end"] = await census(off)
        progress("loads and catch-up reads")
        results["loads"] = await cold_and_warm(args, stacks["on"])
        results["loads"]["off"] = await loads(off, args.loads)
        await wait_quiet(on, args.dedupe_window, args.seal_idle)
        results["catch_up"] = {"on": await catch_up(on), "off": await catch_up(off)}
        results["pairs"] = len(pairs)
        results["pair_p50s_ms"] = [(_p50(a) * 1000, _p50(b) * 1000) for a, b in pairs]
        on_turns = [t for pair in pairs for t in pair[0]]
        off_turns = [t for pair in pairs for t in pair[1]]
        results["store_cost"] = {
            "on": Dist(on_turns).summary(),
            "off": Dist(off_turns).summary(),
            "p50_ratio": _p50(on_turns) / _p50(off_turns) if off_turns else float("nan"),
        }
        results["load_end"] = load_average()
    finally:
        for side in sides.values():
            await side.close()
        for stack in stacks.values():
            stack.stop()
    return results


def ratios(results: dict[str, Any]) -> dict[str, float]:
    early, late = results["points"]["early"], results["points"]["late"]
    return {
        name: late[name] / early[name] if early[name] else float("nan")
        for name in ("keys_but_history", "bytes_but_history", "keys", "bytes", "kv_bytes")
        + ("turn_p50_ms", "db_size", "db_size_in_use", "db_size_in_use_compacted")
    }


def report(results: dict[str, Any]) -> str:
    early, late = results["points"]["early"], results["points"]["late"]
    interleaved = results["interleaved"]
    lines = [
        f"load average at start {results['load_start']}, at end {results['load_end']}",
        "settings (both): " + ", ".join(f"{k}={v}" for k, v in results["settings"].items()),
        "",
        f"{'the session (store on), quiet after turn':<44}{early['turn']:>12}{late['turn']:>12}"
        "  ratio",
    ]
    r = ratios(results)
    rows = [
        ("keys", "keys"),
        ("value bytes", "bytes"),
        ("key and value bytes", "kv_bytes"),
        ("keys, but the model history", "keys_but_history"),
        ("value bytes, but the model history", "bytes_but_history"),
        ("turn p50 ms (the window before, as run)", "turn_p50_ms"),
        ("etcd dbSize", "db_size"),
        ("etcd dbSizeInUse", "db_size_in_use"),
        ("etcd dbSizeInUse, compacted at the head", "db_size_in_use_compacted"),
    ]
    for label, name in rows:
        a, b = early[name], late[name]
        fmt = "{:>12.2f}" if isinstance(a, float) else "{:>12}"
        lines.append(f"{label:<44}{fmt.format(a)}{fmt.format(b)}  {r[name]:.3f}")
    for part in sorted(set(early["parts"]) | set(late["parts"])):
        a = early["parts"].get(part, {"keys": 0, "bytes": 0})
        b = late["parts"].get(part, {"keys": 0, "bytes": 0})
        lines.append(
            f"  {part:<10} keys {a['keys']:>6} -> {b['keys']:>6}, "
            f"bytes {a['bytes']:>8} -> {b['bytes']:>8}"
        )
    off = results["off_end"]
    cleanup = results["store_cost"]
    cold, warm = results["loads"]["cold"], results["loads"]["warm"]
    caught = results["catch_up"]
    lines += [
        f"active (right after turn {early['turn']} / {late['turn']}): "
        f"{early['active']['keys']} / {late['active']['keys']} keys, "
        f"{early['active']['kv_bytes']} / {late['active']['kv_bytes']} key and value bytes; "
        f"but the delivery ids of the window: {early['active']['keys_but_deliveries']} / "
        f"{late['active']['keys_but_deliveries']} keys, "
        f"{early['active']['kv_bytes_but_deliveries']} / "
        f"{late['active']['kv_bytes_but_deliveries']} bytes",
        f"(quiet after {early['quiet_after_s']} s and {late['quiet_after_s']} s)",
        f"store off, after {off['turn']} turns: {off['keys']} keys, {off['kv_bytes']} key and "
        f"value bytes under the session (ev/ {off['parts'].get('ev', {}).get('keys', 0)}, "
        f"h/ {off['parts'].get('h', {}).get('keys', 0)})",
        "",
        f"LoadSession p50 of one context ({cold['entries']} entries, {cold['context_bytes']} B): "
        f"warm (in etcd's tail) {warm['p50_ms']:.2f} ms, cold (sealed, from the object store) "
        f"{cold['p50_ms']:.2f} ms: cold/warm {cold['p50_ms'] / warm['p50_ms']:.2f}",
        f"catch-up from seq 0: store on {caught['on']['events']} events in "
        f"{caught['on']['seconds']} s ({caught['on']['events_per_s']:.0f} events/s); "
        f"store off {caught['off']['events']} in {caught['off']['seconds']} s "
        f"({caught['off']['events_per_s']:.0f} events/s)",
        "",
        f"interleaved at the end, {interleaved['young']['n']} turns each: young session "
        f"(turns {interleaved['young_from']}..) p50 {interleaved['young']['p50_ms']:.2f} ms, "
        f"old (turns {interleaved['old_from']}..) {interleaved['old']['p50_ms']:.2f} ms: "
        f"old/young {interleaved['p50_ratio']:.3f}",
        f"store cost: {results['pairs']} off blocks, each against the on block before it",
        f"  turn p50 on {cleanup['on']['p50_ms']:.2f} ms, off {cleanup['off']['p50_ms']:.2f} ms"
        f": on/off {cleanup['p50_ratio']:.3f}",
        "",
        "  targets",
    ]
    checks = [
        ("keys (quiet) late/early", r["keys"], TARGET_RATIO),
        ("key and value bytes (quiet) late - early", late["kv_bytes"] - early["kv_bytes"], 1024),
        ("quiet key and value bytes at the end", late["kv_bytes"], TARGET_IDLE_BYTES),
        (
            "active key and value bytes at the end, but delivery ids",
            late["active"]["kv_bytes_but_deliveries"],
            TARGET_ACTIVE_BYTES,
        ),
        ("turn p50 store on/off", cleanup["p50_ratio"], TARGET_STORE_RATIO),
        ("turn p50 old/young, interleaved", interleaved["p50_ratio"], TARGET_RATIO),
    ]
    for label, measured, target in checks:
        verdict = "PASS" if measured <= target else "FAIL"
        shown = f"{measured:.3f}" if isinstance(measured, float) else str(measured)
        lines.append(f"    {verdict}  {label + ' <= ' + str(target):<52} measured {shown}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.storage", description=__doc__)
    parser.add_argument("--turns", type=int, default=10_000, help="turns of the session")
    parser.add_argument("--early", type=int, default=1_000, help="the first point (turn)")
    parser.add_argument("--window", type=int, default=200, help="turns before a point timed")
    parser.add_argument(
        "--keep-events", type=int, default=100_000, help="stream horizon (events; anchor's default)"
    )
    parser.add_argument("--dedupe-window", type=float, default=30.0, help="seconds")
    parser.add_argument(
        "--seal-idle", type=float, default=5.0, help="seconds quiet before a session is sealed"
    )
    parser.add_argument("--loads", type=int, default=20, help="LoadSession calls timed per side")
    parser.add_argument(
        "--load-turns", type=int, default=50, help="turns of the session loaded cold and warm"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="A/A: the object store on both stacks (the noise of the on/off comparison)",
    )
    parser.add_argument(
        "--sweep", type=float, default=30.0, help="seconds between anchor's sweeps (its default)"
    )
    parser.add_argument("--block", type=int, default=100, help="turns per block")
    parser.add_argument("--off-every", type=int, default=1, help="an off block every N blocks")
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: checks it runs")
    args = parser.parse_args(argv)
    apply_smoke(
        parser,
        args,
        {"turns": 60, "early": 20, "window": 10, "dedupe_window": 2.0}
        | {"sweep": 1.0, "seal_idle": 1.0, "loads": 3, "load_turns": 5}
        | {"block": 10, "off_every": 2},
    )
    if not 0 < args.early < args.turns:
        parser.error("--early must be between 0 and --turns")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with log_dir(args.log_dir, "baton-bench-storage-") as logs:
        results = asyncio.run(run(args, os.path.abspath(logs)))
    print(report(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
