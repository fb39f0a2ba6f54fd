"""A live session's storage and commit cost do not grow with its age (issue 20).

    python -m bench.storage [--turns 10000] [--early 1000] [--window 200]
                            [--keep-events 1000] [--dedupe-window 30]
                            [--sweep 30] [--off-every 5] [--block 100]
                            [--json PATH] [--smoke]

Two stacks as `bench.turn_latency` starts them (etcd with TLS and auth, and
every service as its own process, one deployment each), in one run:

- `on`: the clean-up as an operator would set it: `--stream-retention-events
  --keep-events`, `--stream-retention 0` (the count alone decides) and
  `--dedupe-window` seconds of delivery ids, shorter than the run, so keys
  expire while it runs; anchor's sweep every `--sweep` seconds (its default);
- `off`: the same, with the clean-up effectively off (a horizon of 10^9
  events, a dedupe window of 10^8 s).

One session on `on` runs `--turns` one-step turns (each with its own
delivery id) in blocks of `--block`; after every `--off-every` blocks, one
block runs on a session of `off`. At turn `--early` and at the end, the bench
stops sending until the session is quiet (the delivery ids of the window
expired, the stream trimmed to its horizon) and counts the keys and value
bytes under the session's prefix (and under the stack's prefix; etcd's
`dbSize` and `dbSizeInUse`, then `dbSizeInUse` once more after compacting
etcd at its head, which is what the periodic compaction leaves once it has
caught up: etcd's in-use size otherwise follows the writes of the last
compaction window, not the session's age).

The turn p50 (SendMessage -> the turn's SESSION_WAITING on a following
reader; it contains the turn's one CommitStep) over the `--window` turns
before each point is reported as it ran; since the load of a shared machine
moves within minutes, the target compares the two ages side by side: at the
end, a young session on the same stack runs to turn `--early - --window`
and then `--window` turns, one each in turn with the old session's next.

The cost of the clean-up: the turn p50 of every `off` block against the `on`
block just before it (same load, same minute). Consumed inbox entries are
deleted by every commit on both stacks (that is not a setting;
`bench.inbox_cleanup` measures it on its own).

Targets: keys and bytes (but for the model history, which the agent's
context budget bounds and which is compacted in a saw-tooth) at the end
within 1.1x of those at `--early`; the old session's turn p50 within 1.1x of
the young one's, interleaved.
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

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import Keys, prefix_end
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.hooks.expiry import lease_ttl
from bench.common import apply_smoke, log_dir, write_json
from bench.turn_latency import BenchStack, Dist, Follower, create_session, load_average, one_turn

TARGET_RATIO = 1.1
OFF = {"BATON_STREAM_RETENTION_EVENTS": str(10**9), "BATON_DEDUPE_WINDOW": str(10**8)}


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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
    for kv in await _range(side.store, prefix):
        part = kv.key[len(prefix) :].split(b"/", 1)[0].decode()
        counted = parts.setdefault(part, [0, 0])
        counted[0] += 1
        counted[1] += len(kv.value)
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
        "keys_but_history": sum(n for n, _ in parts.values()) - history[0],
        "bytes_but_history": sum(b for _, b in parts.values()) - history[1],
        "stack_keys": len(stack_kvs),
        "stack_bytes": sum(len(kv.value) for kv in stack_kvs),
        "db_size": int(status.dbSize),
        "db_size_in_use": int(status.dbSizeInUse),
        "db_size_in_use_compacted": int(compacted.dbSizeInUse),
    }


async def wait_quiet(side: Side, keep_events: int, window: float, sweep: float) -> float:
    """Wait, sending nothing, until the session is quiet: no delivery id
    left (they expire within the lease TTL of the window) and the stream at
    its horizon (anchor's sweep trims it). Seconds waited."""
    assert side.store is not None and side.follower is not None
    prefix = Keys(side.stack.prefix).session_prefix(side.follower.session_id)
    start = time.monotonic()
    # The TTL, a sweep round and etcd's lease check.
    deadline = start + lease_ttl(window) + sweep + 60
    while time.monotonic() < deadline:
        deliveries = await _range(side.store, prefix + b"dlv/")
        events = await _range(side.store, prefix + b"ev/")
        if not deliveries and len(events) <= keep_events:
            return time.monotonic() - start
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the session was not quiet within {deadline - start:.0f} s")


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
    _progress(f"{args.turns} turns on the clean-up stack, blocks of {args.block}")
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
    """The turn p50 of the window before now, then the census once quiet."""
    window = on.samples[-args.window :]
    _progress(f"turn {on.turns}: waiting for the session to be quiet")
    waited = await wait_quiet(on, args.keep_events, args.dedupe_window, args.sweep)
    point = {
        **await census(on),
        "turn_p50_ms": _p50(window),
        "window": len(window),
        "quiet_after_s": round(waited, 1),
    }
    _progress(f"turn {on.turns}: {point['keys']} keys")
    return point


async def run(args: argparse.Namespace, logs: str) -> dict[str, Any]:
    on_env = {
        "BATON_STREAM_RETENTION_EVENTS": str(args.keep_events),
        "BATON_STREAM_RETENTION": "0",
        "BATON_DEDUPE_WINDOW": str(args.dedupe_window),
        "BATON_RETENTION_SWEEP": str(args.sweep),
    }
    stacks = {
        "on": BenchStack(log_dir=f"{logs}/on", second_deployment=False, env=on_env),
        "off": BenchStack(log_dir=f"{logs}/off", second_deployment=False, env={**on_env, **OFF}),
    }
    results: dict[str, Any] = {"load_start": load_average(), "settings": on_env}
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
        _progress(
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
        results["pairs"] = len(pairs)
        on_turns = [t for pair in pairs for t in pair[0]]
        off_turns = [t for pair in pairs for t in pair[1]]
        results["cleanup"] = {
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
        for name in ("keys_but_history", "bytes_but_history", "keys", "bytes", "turn_p50_ms")
        + ("db_size", "db_size_in_use", "db_size_in_use_compacted")
    }


def report(results: dict[str, Any]) -> str:
    early, late = results["points"]["early"], results["points"]["late"]
    interleaved = results["interleaved"]
    lines = [
        f"load average at start {results['load_start']}, at end {results['load_end']}",
        "settings (on): " + ", ".join(f"{k}={v}" for k, v in results["settings"].items()),
        "",
        f"{'the session, quiet after turn':<40}{early['turn']:>12}{late['turn']:>12}  ratio",
    ]
    r = ratios(results)
    rows = [
        ("keys, but the model history", "keys_but_history"),
        ("value bytes, but the model history", "bytes_but_history"),
        ("keys", "keys"),
        ("value bytes", "bytes"),
        ("turn p50 ms (the window before, as run)", "turn_p50_ms"),
        ("etcd dbSize", "db_size"),
        ("etcd dbSizeInUse", "db_size_in_use"),
        ("etcd dbSizeInUse, compacted at the head", "db_size_in_use_compacted"),
    ]
    for label, name in rows:
        a, b = early[name], late[name]
        fmt = "{:>12.2f}" if isinstance(a, float) else "{:>12}"
        lines.append(f"{label:<40}{fmt.format(a)}{fmt.format(b)}  {r[name]:.3f}")
    for part in sorted(set(early["parts"]) | set(late["parts"])):
        a = early["parts"].get(part, {"keys": 0, "bytes": 0})
        b = late["parts"].get(part, {"keys": 0, "bytes": 0})
        lines.append(
            f"  {part:<10} keys {a['keys']:>6} -> {b['keys']:>6}, "
            f"bytes {a['bytes']:>8} -> {b['bytes']:>8}"
        )
    off = results["off_end"]
    cleanup = results["cleanup"]
    lines += [
        f"(quiet after {early['quiet_after_s']} s and {late['quiet_after_s']} s)",
        f"off stack after {off['turn']} turns: {off['keys']} keys, {off['bytes']} B "
        f"under the session (ev/ {off['parts'].get('ev', {}).get('keys', 0)}, "
        f"dlv/ {off['parts'].get('dlv', {}).get('keys', 0)})",
        "",
        f"interleaved at the end, {interleaved['young']['n']} turns each: young session "
        f"(turns {interleaved['young_from']}..) p50 {interleaved['young']['p50_ms']:.2f} ms, "
        f"old (turns {interleaved['old_from']}..) {interleaved['old']['p50_ms']:.2f} ms: "
        f"old/young {interleaved['p50_ratio']:.3f}",
        f"clean-up cost: {results['pairs']} off blocks, each against the on block before it",
        f"  turn p50 on {cleanup['on']['p50_ms']:.2f} ms, off {cleanup['off']['p50_ms']:.2f} ms"
        f": on/off {cleanup['p50_ratio']:.3f}",
        "",
        "  targets",
    ]
    for label, ratio in (
        ("keys (but history) late/early", r["keys_but_history"]),
        ("bytes (but history) late/early", r["bytes_but_history"]),
        ("turn p50 old/young, interleaved", interleaved["p50_ratio"]),
    ):
        verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
        lines.append(
            f"    {verdict}  {label + ' <= ' + str(TARGET_RATIO):<44} measured {ratio:.3f}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.storage", description=__doc__)
    parser.add_argument("--turns", type=int, default=10_000, help="turns of the session")
    parser.add_argument("--early", type=int, default=1_000, help="the first point (turn)")
    parser.add_argument("--window", type=int, default=200, help="turns before a point timed")
    parser.add_argument("--keep-events", type=int, default=1_000, help="stream horizon (events)")
    parser.add_argument("--dedupe-window", type=float, default=30.0, help="seconds")
    parser.add_argument(
        "--sweep", type=float, default=30.0, help="seconds between anchor's sweeps (its default)"
    )
    parser.add_argument("--block", type=int, default=100, help="turns per block")
    parser.add_argument("--off-every", type=int, default=5, help="an off block every N blocks")
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: checks it runs")
    args = parser.parse_args(argv)
    apply_smoke(
        parser,
        args,
        {"turns": 60, "early": 20, "window": 10, "keep_events": 30, "dedupe_window": 2.0}
        | {"sweep": 1.0}
        | {"block": 10, "off_every": 2},
    )
    if not 0 < args.early < args.turns:
        parser.error("--early must be between 0 and --turns")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with log_dir(args.log_dir, "baton-bench-storage-") as logs:
        results = asyncio.run(run(args, logs))
    print(report(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
