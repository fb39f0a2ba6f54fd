"""What live items cost (issue 35, docs/design.md "Live items"): streaming
turns (the fixture model writes its answer as --deltas text deltas over
--stream-ms) against plain one-step turns, in one run on one stack.

    python -m bench.live_stream [--turns 30] [--deltas 100] [--stream-ms 1000]
                                [--plain-turns 300] [--warmup-turns 10]
                                [--json PATH] [--smoke] [--log-dir DIR] [--plaintext]

One stack of real processes (bench.turn_latency's BenchStack: etcd, hooks,
anchor, owner, ingress, TLS on every hop, one deployment), the bench
process as the grpc.aio client. Phases, each after --warmup-turns
unmeasured turns:

p. plain: --plain-turns one-step turns on one session, followed without
   live items (bench.turn_latency's Follower): the one-step turn p50 and
   the services' CPU per turn, as bench.turn_latency's phase b;
s. streaming: --turns turns of "stream <deltas> <stream-ms>" on another
   session, followed with live items (StreamEvents `live`): turn latency,
   the services' CPU per turn, and from each live item:
   - owner item -> follower: the item's `time` (the owner stamps it when it
     closes a coalesced item and queues it for anchor) to its arrival at
     the follower: the path owner -> anchor -> ingress -> follower;
   - delta -> follower: each delta's production (the fixture paces delta i
     at the step's start + i/deltas of --stream-ms; the step's start is its
     LIVE_KIND_STEP_STARTED item's time) to the arrival of the item that
     carries it: the above plus the owner's coalescing (up to 50 ms) and
     any lateness of the fixture's pacing (so an upper bound).

Services' CPU per delta = (CPU per streaming turn - CPU per plain turn) /
--deltas. Every clock is this machine's (time.time in every process).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from bench.common import apply_smoke, log_dir, write_json
from bench.measure import Dist, Sample, load_average, per_turn, versions
from bench.stack import METADATA, SERVICES, BenchStack
from bench.turns import WAIT_TIMEOUT_S, create_session, measure_sequential

SMOKE = {"turns": 3, "plain_turns": 5, "warmup_turns": 1, "stream_ms": 300}


def _progress(message: str) -> None:
    print(f"[bench.live_stream] {message}", file=sys.stderr, flush=True)


@dataclass
class LiveTimes:
    """What a live follower measured."""

    item: Dist = field(default_factory=Dist)  # owner item -> follower
    delta: Dist = field(default_factory=Dist)  # delta production -> follower
    deltas: int = 0  # deltas that arrived as live text
    items: int = 0
    dropped: int = 0  # items announced as dropped


class LiveFollower:
    """A following StreamEvents reader with live items: times each turn's
    SESSION_WAITING (by the delivery id of its MESSAGE_RECEIVED, as
    bench.turn_latency's Follower) and each live item's arrival."""

    def __init__(
        self,
        stub: ingress_pb2_grpc.IngressServiceStub,
        session_id: str,
        deltas: int,
        stream_ms: float,
    ) -> None:
        self.session_id = session_id
        self.call = stub.StreamEvents(
            ingress_pb.StreamEventsRequest(
                session_id=session_id, start_seq=0, follow=True, live=True
            ),
            metadata=METADATA,
        )
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self._pending: dict[str, asyncio.Future[float]] = {}
        self._current = ""
        self._deltas = deltas
        self._stream_s = stream_ms / 1000
        self._step_started: dict[tuple[str, int, int], float] = {}  # step run -> its start
        self.times = LiveTimes()
        self.measuring = False
        self.next_seq = 0
        self.task = loop.create_task(self._run())

    def expect(self, delivery_id: str) -> asyncio.Future[float]:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pending[delivery_id] = future
        return future

    def _events(self, events: Sequence[s.Event], now: float) -> None:
        for event in events:
            if event.seq != self.next_seq:
                raise RuntimeError(f"stream gap: got seq {event.seq}, wanted {self.next_seq}")
            self.next_seq += 1
            if event.kind == s.EVENT_KIND_SESSION_STARTED and not self.ready.done():
                self.ready.set_result(None)
            elif event.kind == s.EVENT_KIND_MESSAGE_RECEIVED:
                self._current = event.delivery_id
            elif event.kind == s.EVENT_KIND_SESSION_WAITING:
                future = self._pending.pop(self._current, None)
                if future is not None and not future.done():
                    future.set_result(now)

    def _live(self, batch: s.LiveBatch, arrived: float) -> None:
        run = (batch.step.owner_run_id, batch.step.base_seq, batch.step.attempt)
        times = self.times
        for item in batch.items:
            produced = item.time.ToNanoseconds() / 1e9
            if item.kind == s.LIVE_KIND_STEP_STARTED:
                self._step_started[run] = produced
            if not self.measuring:
                continue
            times.items += 1
            if item.kind == s.LIVE_KIND_DROPPED:
                times.dropped += int(item.dropped)
                continue
            times.item.samples.append(arrived - produced)
            start = self._step_started.get(run)
            if item.kind != s.LIVE_KIND_TEXT or start is None:
                continue
            for part in item.text.split(",")[:-1]:  # the fixture's deltas: "<i>,"
                scheduled = start + self._stream_s * int(part) / self._deltas
                times.delta.samples.append(arrived - scheduled)
                times.deltas += 1

    async def _run(self) -> None:
        error: BaseException = RuntimeError(f"stream of {self.session_id} ended")
        try:
            async for response in self.call:
                if response.HasField("live"):
                    self._live(response.live, time.time())
                else:
                    self._events(response.events, time.perf_counter())
        except asyncio.CancelledError:
            raise
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            error = exc
        for future in (self.ready, *self._pending.values()):
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        self.call.cancel()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def streamed_turn(
    stub: ingress_pb2_grpc.IngressServiceStub, follower: LiveFollower, text: str, delivery_id: str
) -> float:
    """Seconds from SendMessage to the turn's SESSION_WAITING."""
    waiting = follower.expect(delivery_id)
    start = time.perf_counter()
    await stub.SendMessage(
        ingress_pb.SendMessageRequest(
            session_id=follower.session_id, text=text, delivery_id=delivery_id
        ),
        metadata=METADATA,
        timeout=10,
    )
    return await asyncio.wait_for(waiting, WAIT_TIMEOUT_S) - start


async def measure_streaming(
    stub: ingress_pb2_grpc.IngressServiceStub,
    args: argparse.Namespace,
    on_measure_start: Callable[[], None],
) -> dict[str, Any]:
    session_id = await create_session(stub)
    follower = LiveFollower(stub, session_id, args.deltas, args.stream_ms)
    text = f"stream {args.deltas} {args.stream_ms}"
    try:
        await asyncio.wait_for(follower.ready, 10)
        for i in range(args.warmup_turns):
            await streamed_turn(stub, follower, text, f"sw-{i}")
        follower.measuring = True
        on_measure_start()
        turn = Dist()
        for i in range(args.turns):
            turn.samples.append(await streamed_turn(stub, follower, text, f"s-{i}"))
        return {"session_id": session_id, "turn": turn, "live": follower.times}
    finally:
        await follower.close()


async def run(args: argparse.Namespace, stack: BenchStack) -> dict[str, Any]:
    results: dict[str, Any] = {
        "versions": versions(),
        "args": vars(args).copy(),
        "load_start": load_average(),
    }
    marks: dict[str, Sample] = {}

    def mark(name: str) -> Callable[[], None]:
        return lambda: marks.__setitem__(name, stack.sample())

    channel = stack.public_channel("ingress")
    stub = ingress_pb2_grpc.IngressServiceStub(channel)
    try:
        _progress(f"p: {args.plain_turns} plain one-step turns")
        plain = await measure_sequential(stub, args.plain_turns, args.warmup_turns, mark("p"))
        plain["per_turn"] = per_turn(marks["p"], stack.sample(), args.plain_turns)
        stack.check_alive()
        _progress(f"s: {args.turns} streaming turns of {args.deltas} deltas")
        streaming = await measure_streaming(stub, args, mark("s"))
        streaming["per_turn"] = per_turn(marks["s"], stack.sample(), args.turns)
        stack.check_alive()
    finally:
        await channel.close()
    results["plain"] = plain
    results["streaming"] = streaming
    results["load_end"] = load_average()
    return results


def services_cpu_ms(phase: dict[str, Any]) -> float:
    cpu: dict[str, float] = phase["per_turn"]["cpu_ms"]
    return sum(cpu.get(name, 0.0) for name in SERVICES)


def cpu_per_delta_ms(results: dict[str, Any]) -> float:
    extra = services_cpu_ms(results["streaming"]) - services_cpu_ms(results["plain"])
    return float(extra / results["args"]["deltas"])


def _row(label: str, dist: Dist) -> str:
    return (
        f"  {label:<46} n={len(dist.samples):<6} p50 {dist.pct(50):8.3f}  "
        f"p99 {dist.pct(99):8.3f}  max {max(dist.samples, default=0) * 1000:8.3f} ms"
    )


def report(results: dict[str, Any]) -> str:
    args = results["args"]
    plain, streaming = results["plain"], results["streaming"]
    live: LiveTimes = streaming["live"]
    lines = [
        f"LIVE ITEMS: streaming turns ({args['deltas']} deltas over {args['stream_ms']:g} ms) "
        "against plain one-step turns, one run",
        f"  load average: start {results['load_start']}, end {results['load_end']}",
        "ONE-STEP TURN (plain, no live items): SendMessage -> SESSION_WAITING",
        _row("turn", plain["turn"]),
        "STREAMING TURN: SendMessage -> SESSION_WAITING",
        _row("turn", streaming["turn"]),
        "LIVE ITEM LATENCY (to the follower, through ingress)",
        _row("owner item -> follower", live.item),
        _row("delta produced -> follower (incl. coalescing)", live.delta),
        f"  deltas seen live {live.deltas} of {args['deltas'] * args['turns']}, "
        f"items {live.items}, dropped {live.dropped}",
        "SERVICES' CPU (hooks + anchor + owner + ingress)",
        f"  per plain turn      {services_cpu_ms(plain):8.3f} ms",
        f"  per streaming turn  {services_cpu_ms(streaming):8.3f} ms",
        f"  per delta           {cpu_per_delta_ms(results):8.4f} ms"
        "  ((streaming - plain) / deltas)",
        "  by process, per streaming turn: "
        + ", ".join(f"{n} {streaming['per_turn']['cpu_ms'].get(n, 0.0):.2f}" for n in SERVICES),
    ]
    return "\n".join(lines)


def to_json(results: dict[str, Any]) -> dict[str, Any]:
    plain, streaming = results["plain"], results["streaming"]
    live: LiveTimes = streaming["live"]
    return {
        "versions": results["versions"],
        "args": results["args"],
        "load_start": results["load_start"],
        "load_end": results["load_end"],
        "plain": {
            "turn": plain["turn"].summary(),
            "per_turn": plain["per_turn"],
            "services_cpu_ms_per_turn": round(services_cpu_ms(plain), 3),
        },
        "streaming": {
            "turn": streaming["turn"].summary(),
            "per_turn": streaming["per_turn"],
            "services_cpu_ms_per_turn": round(services_cpu_ms(streaming), 3),
            "item_to_follower": live.item.summary(),
            "delta_to_follower": live.delta.summary(),
            "deltas_seen": live.deltas,
            "items": live.items,
            "dropped": live.dropped,
        },
        "services_cpu_ms_per_delta": round(cpu_per_delta_ms(results), 4),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.live_stream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--turns", type=int, default=30, help="measured streaming turns (s)")
    parser.add_argument("--deltas", type=int, default=100, help="text deltas a streaming turn")
    parser.add_argument(
        "--stream-ms", type=int, default=1000, help="how long the model writes them"
    )
    parser.add_argument("--plain-turns", type=int, default=300, help="measured plain turns (p)")
    parser.add_argument("--warmup-turns", type=int, default=10, help="unmeasured turns first")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--log-dir", help="keep service and etcd logs here")
    parser.add_argument(
        "--plaintext", action="store_true", help="no TLS and no etcd auth (default: both)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny counts: checks the bench runs, nothing more"
    )
    args = parser.parse_args(argv)
    apply_smoke(parser, args, SMOKE)
    if args.turns < 1 or args.plain_turns < 1 or args.deltas < 1 or args.warmup_turns < 0:
        parser.error("need --turns, --plain-turns, --deltas >= 1 and --warmup-turns >= 0")
    if args.stream_ms < 0:
        parser.error("need --stream-ms >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with log_dir(args.log_dir, "baton-bench-live-") as logs:
        stack = BenchStack(logs, second_deployment=False, tls=not args.plaintext)
        try:
            _progress(f"starting etcd and services (logs in {logs})")
            stack.start()
            results = asyncio.run(run(args, stack))
        finally:
            stack.stop()
    print(report(results), flush=True)
    write_json(args.json, to_json(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
