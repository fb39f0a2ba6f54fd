"""One-step turn latency and throughput of a real Baton stack, next to the etcd floor.

    python -m bench.turn_latency [--turns 1000] [--sessions 32] [--concurrent-turns 3000]
                                 [--upgrade-turns 200] [--json PATH] [--smoke]
                                 [--profile DIR [--profiler perf]]

Starts a real etcd and the four services (hooks, anchor, owner, ingress) as
separate processes, exactly as in production (log level warning), plus the
owner and ingress of a second deployment (sharing hooks, anchor and etcd),
waits for SERVING, then measures, in one run:

a. the etcd floor: the two fenced transactions a turn needs (the inbox append
   and the fenced commit of 7 events + snapshot), shaped like the ones in
   services/hooks/inbox.py and services/anchor/journal.py, run back to back
   from this process with aetcd; plus the same pair with the watches in
   between (append -> inbox watch -> commit -> events watch), the "one-step
   turn floor" of docs/etcd.md;
b. one-step turn latency through the public API: SendMessage start -> the
   turn's SESSION_WAITING on an already-open following StreamEvents reader;
u. upgrade turns: a one-step message for a session idle on one deployment,
   sent through the other deployment's ingress, so the session hands off
   (its successor commits SESSION_HANDED_OFF, then the turn), timed the same
   way as b; the direction alternates (A -> B, B -> A) on one session. Each
   upgrade turn is followed by a same-deployment turn on the same session (the
   control), so history size and machine state are the same for both;
c. throughput: N sessions, each running turns back to back on its own reader.

CPU seconds of every process are sampled around phases b, u and c and reported
per turn. With --profile DIR, the processes are sampled by py-spy (or perf)
during the phase named by --profile-phase; summarise py-spy output with
`python -m bench.profile_summary DIR`. The client is this process (grpc.aio),
separate from the services.

This module is that one bench; what the other benches share with it is the
bench library: bench/stack.py (the stacks), bench/measure.py (samples, CPU,
profiling), bench/floor.py (the etcd floor) and bench/turns.py (turns through
the public API).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime.common.security.identity import Role
from bench.common import apply_smoke, log_dir, write_json
from bench.floor import commit_floor_at, measure_floor, measure_floor_throughput, snapshot_size
from bench.measure import (
    CLK_TCK,
    Dist,
    Profiler,
    Sample,
    load_average,
    per_turn,
    profiled,
    versions,
)
from bench.stack import DEPLOYMENT_ID, DEPLOYMENT_ID_B, SERVICES, BenchStack
from bench.turns import (
    Follower,
    create_session,
    measure_sequential,
    measure_throughput,
    measure_upgrades,
    one_turn,
    wait_registered,
)

# Targets from the project brief.
TARGET_RATIO = 2.5  # one-step turn p50 within 2.5x the floor p50
ETCD_NOTES_FLOOR_P50_MS = 1.11  # docs/etcd.md "one-step turn floor"
TARGET_ABS_P50_MS = TARGET_RATIO * ETCD_NOTES_FLOOR_P50_MS  # ~2.8 ms
TARGET_TURNS_PER_S = 700.0
TARGET_CPU_MS_PER_TURN = 1.5  # the four services together, throughput phase
TARGET_UPGRADE_RATIO = 2.0  # upgrade turn p50 within 2x the one-step turn p50


# -- the run ----------------------------------------------------------------------


async def measure_hop(channel: grpc.aio.Channel, stack: BenchStack, calls: int) -> dict[str, Any]:
    """A gRPC unary round trip with no work behind it: Health.Check on ingress."""
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="")
    for _ in range(100):
        await stub.Check(request, timeout=5)
    dist = Dist()
    before = stack.sample()
    for _ in range(calls):
        t0 = time.perf_counter()
        await stub.Check(request, timeout=5)
        dist.samples.append(time.perf_counter() - t0)
    costs = per_turn(before, stack.sample(), calls)
    return {
        "latency": dist,
        "ingress_cpu_ms_per_call": costs["cpu_ms"]["ingress"],
        "client_cpu_ms_per_call": costs["cpu_ms"]["bench client"],
    }


async def run(
    args: argparse.Namespace, stack: BenchStack, profiler: Profiler | None
) -> dict[str, Any]:
    assert stack.etcd is not None
    endpoint = stack.etcd.endpoint
    results: dict[str, Any] = {
        "versions": versions(),
        "args": vars(args).copy(),
        "load_start": load_average(),
        "processes": stack.names,
    }

    _progress("a: etcd floor")
    etcd_as = stack.etcd_security
    floor = await measure_floor(
        endpoint, args.floor_iterations, args.floor_warmup, args.snapshot_bytes, etcd_as
    )
    floor["throughput"] = await measure_floor_throughput(
        endpoint, args.sessions, args.concurrent_turns, args.snapshot_bytes, etcd_as
    )
    results["floor"] = floor

    channel = stack.public_channel("ingress")
    stub = ingress_pb2_grpc.IngressServiceStub(channel)
    try:
        results["hop"] = await measure_hop(channel, stack, args.floor_iterations)
        marks: dict[str, Sample] = {}

        def mark(name: str) -> Callable[[], None]:
            return lambda: marks.__setitem__(name, stack.sample())

        _progress(f"b: {args.turns} sequential one-step turns")
        with profiled(profiler, stack.pids, "latency"):
            seq = await measure_sequential(stub, args.turns, args.warmup_turns, mark("seq"))
            seq["per_turn"] = per_turn(marks["seq"], stack.sample(), args.turns)
        stack.check_alive()
        seq["final_snapshot_bytes"] = await snapshot_size(
            endpoint, stack.prefix, seq["session_id"], etcd_as
        )
        results["sequential"] = seq

        if args.upgrade_turns > 0:
            _progress(
                f"u: {args.upgrade_turns} upgrade turns {DEPLOYMENT_ID} <-> {DEPLOYMENT_ID_B}, "
                "each followed by a same-deployment control turn"
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
                with profiled(profiler, stack.pids, "upgrade"):
                    up = await measure_upgrades(
                        stubs,
                        args.upgrade_turns,
                        args.upgrade_warmup,
                        args.upgrade_idle_ms / 1000,
                        stack.cpu,
                    )
            finally:
                await channel_b.close()
            stack.check_alive()
            if not up["turn"].samples:
                raise RuntimeError("no upgrade turn handed off; see the owner logs")
            results["upgrade"] = up

        _progress(f"c: {args.concurrent_turns} turns over {args.sessions} concurrent sessions")
        with profiled(profiler, stack.pids, "throughput"):
            tput = await measure_throughput(
                stub, args.sessions, args.concurrent_turns, mark("tput"), mark("tput end")
            )
            tput["per_turn"] = per_turn(marks["tput"], marks["tput end"], args.concurrent_turns)
        stack.check_alive()
        results["throughput"] = tput
    finally:
        await channel.close()

    if seq["final_snapshot_bytes"] > 2 * args.snapshot_bytes:
        _progress(
            f"a': fenced commit floor at the final snapshot size ({seq['final_snapshot_bytes']} B)"
        )
        results["floor"]["commit_final_snapshot"] = await commit_floor_at(
            endpoint,
            args.floor_iterations // 2,
            args.floor_warmup,
            seq["final_snapshot_bytes"],
            etcd_as,
        )
    results["load_end"] = load_average()
    return results


# -- metrics on vs off (--metrics-compare) ---------------------------------------

SCRAPE_EVERY_S = 5.0  # a Prometheus scrape interval, shortened


async def _scrape_forever(urls: Sequence[str]) -> None:
    """What Prometheus does to the metrics-on stack during the comparison."""
    import httpx

    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            for url in urls:
                (await client.get(url)).raise_for_status()
            await asyncio.sleep(SCRAPE_EVERY_S)


async def compare_sides(
    args: argparse.Namespace, stacks: dict[str, BenchStack], blocks: int
) -> dict[str, Any]:
    """One-step turns on identical stacks that differ in one setting, in
    blocks whose order rotates (so drift in the machine's load hits every
    side alike): turn latency and the services' CPU per turn of each. Every
    stack that serves metrics is scraped meanwhile."""
    blocks = max(1, blocks)
    per_block = max(1, args.turns // blocks)
    sides: dict[str, dict[str, Any]] = {}
    channels = []
    try:
        for label, stack in stacks.items():
            channel = stack.public_channel("ingress")
            channels.append(channel)
            stub = ingress_pb2_grpc.IngressServiceStub(channel)
            follower = Follower(stub, await create_session(stub))
            await asyncio.wait_for(follower.ready, 10)
            for i in range(args.warmup_turns):
                await one_turn(stub, follower, f"warm {i}", f"w-{i}")
            sides[label] = {"stub": stub, "follower": follower, "turn": Dist(), "cpu_s": 0.0}
        urls = [f"http://{a}/metrics" for s in stacks.values() for a in s.metrics_addrs.values()]
        scraper = asyncio.get_running_loop().create_task(_scrape_forever(urls))
        labels = list(stacks)
        try:
            for block in range(blocks):
                shift = block % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    side, stack = sides[label], stacks[label]
                    before = stack.cpu()
                    for i in range(per_block):
                        delivery = f"{label}-{block}-{i}"
                        _, turn = await one_turn(side["stub"], side["follower"], "hi", delivery)
                        side["turn"].samples.append(turn)
                    after = stack.cpu()
                    side["cpu_s"] += sum(after[n] - before[n] for n in stack.names)
                    stack.check_alive()
            if scraper.done():
                scraper.result()  # a scrape failed: say so
        finally:
            scraper.cancel()
            await asyncio.gather(scraper, return_exceptions=True)
        for side in sides.values():
            await side["follower"].close()
    finally:
        for channel in channels:
            await channel.close()
    turns = blocks * per_block
    out: dict[str, Any] = {"turns_each": turns, "blocks": blocks, "load": load_average()}
    for label, side in sides.items():
        out[label] = {
            "turn": side["turn"],
            "services_cpu_ms_per_turn": side["cpu_s"] * 1000 / turns,
        }
    return out


# Fewer /proc clock ticks than this on the base side make a CPU ratio noise
# (a 4-turn smoke run often measures 0 or 1 tick).
MIN_CPU_TICKS = 5


def _ratios(out: dict[str, Any], label: str, base: str = "off") -> tuple[float, float | None]:
    """(p50, services CPU per turn) of `label` over `base`; the CPU ratio is
    None when `base` measured too few clock ticks to divide by."""
    p50 = out[label]["turn"].pct(50) / out[base]["turn"].pct(50)
    base_cpu = out[base]["services_cpu_ms_per_turn"]
    if base_cpu * out["turns_each"] / 1000 * CLK_TCK < MIN_CPU_TICKS:
        return p50, None
    return p50, out[label]["services_cpu_ms_per_turn"] / base_cpu


def _ratio_text(ratio: float | None) -> str:
    return "n/a (too few /proc clock ticks)" if ratio is None else f"{ratio:.3f}x"


async def compare_metrics(
    args: argparse.Namespace, stacks: dict[str, BenchStack]
) -> dict[str, Any]:
    """Metrics off and on (`compare_sides`), and the on/off ratios."""
    out = await compare_sides(args, stacks, args.metrics_blocks)
    out["p50_ratio"], out["cpu_ratio"] = _ratios(out, "on")
    return out


def report_metrics_compare(result: dict[str, Any]) -> str:
    lines = [
        f"metrics off vs on: {result['turns_each']} one-step turns each, in "
        f"{result['blocks']} alternating blocks (load {result['load']})",
    ]
    for label in ("off", "on"):
        side = result[label]
        lines.append(
            _row(f"  metrics {label:<3} turn", side["turn"])
            + f"  services CPU {side['services_cpu_ms_per_turn']:.2f} ms/turn"
        )
    lines.append(
        f"  ratio on/off: p50 {result['p50_ratio']:.3f}x, services CPU per turn "
        f"{_ratio_text(result['cpu_ratio'])} (aim: within 1.05x)"
    )
    return "\n".join(lines)


def main_metrics_compare(args: argparse.Namespace) -> int:
    with log_dir(args.log_dir, "baton-bench-") as logs:
        stacks: dict[str, BenchStack] = {}
        try:
            for label in ("off", "on"):
                directory = os.path.join(logs, f"metrics-{label}")
                os.makedirs(directory, exist_ok=True)
                stacks[label] = BenchStack(
                    directory,
                    second_deployment=False,
                    log_level=args.log_level,
                    tls=not args.plaintext,
                    metrics=label == "on",
                )
                _progress(f"starting the metrics-{label} stack (logs in {directory})")
                stacks[label].start()
            result = asyncio.run(compare_metrics(args, stacks))
        finally:
            for stack in stacks.values():
                stack.stop()
    print(report_metrics_compare(result), flush=True)
    figures = dict(result)
    for label in ("off", "on"):
        figures[label] = dict(result[label], turn=result[label]["turn"].summary())
    write_json(args.json, figures)
    return 0


# -- tracing off vs on (--tracing-compare) ----------------------------------------

TRACING_SIDES = ("off", "metrics", "tracing")


class _SpanSink:
    """An OTLP/gRPC trace collector in the bench process: receives (and
    counts) what the traced stack exports, as a collector would."""

    def __init__(self) -> None:
        self.spans = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

        sink = self

        class Servicer(otlp_grpc.TraceServiceServicer):
            async def Export(  # noqa: N802 - the proto's name
                self, request: otlp.ExportTraceServiceRequest, context: Any
            ) -> otlp.ExportTraceServiceResponse:
                sink.spans += sum(
                    len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans
                )
                return otlp.ExportTraceServiceResponse()

        self.server = grpc.aio.server()
        otlp_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(1)


def tracing_env(port: int) -> dict[str, str]:
    """Tracing on, every span sampled, exported to the bench's sink."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }


async def compare_tracing(args: argparse.Namespace, logs: str) -> dict[str, Any]:
    """Three stacks, same run: everything off; metrics on, tracing off;
    metrics and tracing on (always-sample). Ratios against all off."""
    sink = _SpanSink()
    await sink.start()
    stacks: dict[str, BenchStack] = {}
    try:
        for label in TRACING_SIDES:
            directory = os.path.join(logs, f"tracing-{label}")
            os.makedirs(directory, exist_ok=True)
            stacks[label] = BenchStack(
                directory,
                second_deployment=False,
                log_level=args.log_level,
                tls=not args.plaintext,
                metrics=label != "off",
                env=tracing_env(sink.port) if label == "tracing" else {},
            )
            _progress(f"starting the {label} stack (logs in {directory})")
            # Blocking starts (they wait for health): the sink serves meanwhile.
            await asyncio.get_running_loop().run_in_executor(None, stacks[label].start)
        out = await compare_sides(args, stacks, args.metrics_blocks)
    finally:
        loop = asyncio.get_running_loop()
        for stack in stacks.values():
            # The traced services export what they buffered on SIGTERM: the
            # sink serves meanwhile.
            await loop.run_in_executor(None, stack.stop)
        await sink.stop()
    for label in ("metrics", "tracing"):
        out[f"{label}_p50_ratio"], out[f"{label}_cpu_ratio"] = _ratios(out, label)
    out["spans_exported"] = sink.spans
    if not sink.spans:
        raise RuntimeError("the traced stack exported no spans")
    return out


def report_tracing_compare(result: dict[str, Any]) -> str:
    lines = [
        f"tracing off vs on: {result['turns_each']} one-step turns each, in "
        f"{result['blocks']} rotating blocks (load {result['load']}); "
        f"{result['spans_exported']} spans exported",
    ]
    names = {
        "off": "metrics off, tracing off",
        "metrics": "metrics on, tracing off",
        "tracing": "metrics on, tracing on",
    }
    for label in TRACING_SIDES:
        side = result[label]
        lines.append(
            _row(f"  {names[label]} turn", side["turn"])
            + f"  services CPU {side['services_cpu_ms_per_turn']:.2f} ms/turn"
        )
    for label in ("metrics", "tracing"):
        lines.append(
            f"  ratio {names[label]} / all off: p50 {result[f'{label}_p50_ratio']:.3f}x, "
            f"services CPU per turn {_ratio_text(result[f'{label}_cpu_ratio'])}"
        )
    return "\n".join(lines)


def main_tracing_compare(args: argparse.Namespace) -> int:
    with log_dir(args.log_dir, "baton-bench-") as logs:
        result = asyncio.run(compare_tracing(args, logs))
    print(report_tracing_compare(result), flush=True)
    figures = dict(result)
    for label in TRACING_SIDES:
        figures[label] = dict(result[label], turn=result[label]["turn"].summary())
    write_json(args.json, figures)
    return 0


def _progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


# -- report -------------------------------------------------------------------------


def _row(label: str, dist: Dist, extra: str = "") -> str:
    return (
        f"  {label:<46}{len(dist.samples):>6}{dist.pct(50):>9.3f}{dist.pct(90):>9.3f}"
        f"{dist.pct(99):>9.3f}  {extra}"
    ).rstrip()


COLUMN = 10  # width of a per-process column


def _by_process(label: str, values: dict[str, float], fmt: str) -> str:
    return f"    {label:<26}" + "".join(format(x, fmt).rjust(COLUMN) for x in values.values())


def report(results: dict[str, Any]) -> str:
    floor, seq, tput, hop = (
        results["floor"],
        results["sequential"],
        results["throughput"],
        results["hop"],
    )
    v = results["versions"]
    floor_p50 = floor["two_txns"].pct(50)
    turn: Dist = seq["turn"]
    turn_p50 = turn.pct(50)
    ratio = turn_p50 / floor_p50
    sizes = floor["sizes_bytes"]
    tenth = max(1, len(turn.samples) // 10)
    first, last = Dist(turn.samples[:tenth]), Dist(turn.samples[-tenth:])
    names = list(seq["per_turn"]["cpu_ms"])
    ftp = floor["throughput"]
    lines = [
        "",
        f"Baton one-step turn benchmark: {len(results['processes'])} service processes "
        f"({', '.join(results['processes'])}) + etcd "
        f"{v.get('etcd', '?')}; {v['cpus']} CPUs; Python {v['python']}, "
        f"grpcio {v.get('grpcio', '?')}, protobuf {v.get('protobuf', '?')}, "
        f"aetcd {v.get('aetcd', '?')}",
        f"load average (1/5/15 min) at start {results['load_start']}, at end "
        f"{results['load_end']}: other work on the machine skews every figure",
        "",
        f"  {'latency, ms':<46}{'n':>6}{'p50':>9}{'p90':>9}{'p99':>9}",
        f"  etcd floor (aetcd from the bench process; entry {sizes['inbox_entry']} B, "
        f"7 events x {sizes['event_avg']} B, snapshot {sizes['snapshot']} B)",
        _row("inbox append txn", floor["append"]),
        _row("fenced commit txn (7 events + snapshot)", floor["commit"]),
        _row("FLOOR: append + commit, back to back", floor["two_txns"]),
        _row("floor + both watches (docs/etcd.md definition)", floor["pipeline"]),
    ]
    if "commit_final_snapshot" in floor:
        lines.append(
            _row(
                f"fenced commit, snapshot {seq['final_snapshot_bytes']} B",
                floor["commit_final_snapshot"],
            )
        )
    lines += [
        "  gRPC baseline",
        _row(
            "Health.Check on ingress (a hop, no work)",
            hop["latency"],
            f"ingress CPU {hop['ingress_cpu_ms_per_call']:.3f} ms/call",
        ),
        "  one-step turns through ingress (grpc.aio client in the bench process)",
        _row("ONE-STEP TURN: SendMessage -> SESSION_WAITING", turn, f"= {ratio:.2f} x floor p50"),
        _row("  SendMessage alone (receipt)", seq["receipt"]),
        _row("  receipt -> SESSION_WAITING", seq["receipt_to_waiting"]),
        _row("  first 10% of the turns", first),
        _row(
            "  last 10% of the turns", last, f"(snapshot grew to {seq['final_snapshot_bytes']} B)"
        ),
        _row(f"  turn under load ({tput['sessions']} sessions)", tput["turn"]),
    ]
    up = results.get("upgrade")
    if up is not None:
        up_p50 = up["turn"].pct(50)
        lines += [
            f"  upgrade turns: one session, idle {up['idle_ms']:.0f} ms on one deployment, gets a "
            "message through the other's ingress",
            _row(
                "UPGRADE TURN: SendMessage -> SESSION_WAITING",
                up["turn"],
                f"= {up_p50 / turn_p50:.2f} x one-step turn p50",
            ),
        ]
        lines += [_row(f"  {d}", dist) for d, dist in sorted(up["by_direction"].items())]
        lines += [
            _row("  SendMessage alone (receipt)", up["receipt"]),
            _row(
                "  control: same-deployment turn, same session",
                up["control"],
                f"upgrade p50 = {up_p50 / up['control'].pct(50):.2f} x this",
            ),
        ]
        if up["not_handed_off"]:
            lines.append(
                f"  ({up['not_handed_off']} of {up['iterations']} upgrade sends did not hand off "
                "and are not counted: the owner was not idle yet)"
            )
    lines += [
        "",
        "  throughput",
        f"    Baton: {tput['turns']} turns over {tput['sessions']} concurrent sessions in "
        f"{tput['elapsed_s']:.2f} s = {tput['turns_per_s']:.0f} turns/s",
        f"    etcd alone: {ftp['pairs']} append+commit pairs over {ftp['sessions']} sessions, "
        f"one client = {ftp['pairs_per_s']:.0f} pairs/s",
        "",
        f"  {'per turn, by process':<28}"
        + "".join(n.replace("bench client", "client").rjust(COLUMN) for n in names)
        + "     total",
        _by_process("CPU ms, sequential", seq["per_turn"]["cpu_ms"], ".2f")
        + f"{sum(seq['per_turn']['cpu_ms'].values()):10.2f}",
        _by_process("CPU ms, throughput", tput["per_turn"]["cpu_ms"], ".2f")
        + f"{sum(tput['per_turn']['cpu_ms'].values()):10.2f}",
        *(
            [
                _by_process("CPU ms, upgrade turn", _in(names, up["cpu_ms"]["upgrade"]), ".2f")
                + f"{sum(up['cpu_ms']['upgrade'].values()):10.2f}",
                _by_process("CPU ms, control turn", _in(names, up["cpu_ms"]["control"]), ".2f")
                + f"{sum(up['cpu_ms']['control'].values()):10.2f}",
            ]
            if up is not None
            else []
        ),
        _by_process("ctx switches, sequential", seq["per_turn"]["ctx_switches"], ".0f")
        + f"{sum(seq['per_turn']['ctx_switches'].values()):10.0f}",
        _by_process("ctx switches, throughput", tput["per_turn"]["ctx_switches"], ".0f")
        + f"{sum(tput['per_turn']['ctx_switches'].values()):10.0f}",
        "",
        "  targets",
        _target(
            f"turn p50 <= {TARGET_RATIO:g} x measured floor p50 ({floor_p50:.3f} ms)",
            f"{turn_p50:.3f} ms ({ratio:.2f}x)",
            ratio <= TARGET_RATIO,
        ),
        _target(
            f"turn p50 <= {TARGET_ABS_P50_MS:.2f} ms ({TARGET_RATIO:g} x docs/etcd.md floor "
            f"{ETCD_NOTES_FLOOR_P50_MS} ms)",
            f"{turn_p50:.3f} ms",
            turn_p50 <= TARGET_ABS_P50_MS,
        ),
        _target(
            f">= {TARGET_TURNS_PER_S:.0f} turns/s with {tput['sessions']} sessions",
            f"{tput['turns_per_s']:.0f} turns/s",
            tput["turns_per_s"] >= TARGET_TURNS_PER_S,
        ),
        _target(
            f"<= {TARGET_CPU_MS_PER_TURN} ms CPU per turn in the four services (throughput)",
            f"{services_cpu_ms(tput):.2f} ms",
            services_cpu_ms(tput) <= TARGET_CPU_MS_PER_TURN,
        ),
    ]
    if up is not None:
        up_p50 = up["turn"].pct(50)
        lines.append(
            _target(
                f"upgrade turn p50 <= {TARGET_UPGRADE_RATIO:g} x one-step turn p50 "
                f"({turn_p50:.3f} ms)",
                f"{up_p50:.3f} ms ({up_p50 / turn_p50:.2f}x)",
                up_p50 <= TARGET_UPGRADE_RATIO * turn_p50,
            )
        )
    lines.append("")
    return "\n".join(lines)


def services_cpu_ms(phase: dict[str, Any]) -> float:
    """CPU ms per turn of hooks, anchor, owner and ingress together."""
    cpu: dict[str, float] = phase["per_turn"]["cpu_ms"]
    return sum(cpu.get(name, 0.0) for name in SERVICES)


def _in(names: list[str], values: dict[str, float]) -> dict[str, float]:
    """`values` in the column order `names`."""
    return {n: values.get(n, float("nan")) for n in names}


def _target(label: str, measured: str, ok: bool) -> str:
    return f"    {'PASS' if ok else 'FAIL'}  {label:<62} measured {measured}"


def to_json(results: dict[str, Any]) -> dict[str, Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, Dist):
            return value.summary()
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, float):
            return round(value, 4)
        return value

    out: dict[str, Any] = convert(results)
    floor_p50 = results["floor"]["two_txns"].pct(50)
    turn_p50 = results["sequential"]["turn"].pct(50)
    out["targets"] = {
        "turn_p50_over_floor_p50": round(turn_p50 / floor_p50, 3),
        "ratio_target": TARGET_RATIO,
        "ratio_ok": turn_p50 / floor_p50 <= TARGET_RATIO,
        "turn_p50_abs_target_ms": round(TARGET_ABS_P50_MS, 3),
        "turn_p50_abs_ok": turn_p50 <= TARGET_ABS_P50_MS,
        "turns_per_s_target": TARGET_TURNS_PER_S,
        "turns_per_s_ok": results["throughput"]["turns_per_s"] >= TARGET_TURNS_PER_S,
        "services_cpu_ms_per_turn": round(services_cpu_ms(results["throughput"]), 3),
        "services_cpu_ms_target": TARGET_CPU_MS_PER_TURN,
        "services_cpu_ms_ok": services_cpu_ms(results["throughput"]) <= TARGET_CPU_MS_PER_TURN,
    }
    if "upgrade" in results:
        up = results["upgrade"]
        up_p50 = up["turn"].pct(50)
        out["targets"].update(
            {
                "upgrade_p50_over_turn_p50": round(up_p50 / turn_p50, 3),
                "upgrade_p50_over_control_p50": round(up_p50 / up["control"].pct(50), 3),
                "upgrade_ratio_target": TARGET_UPGRADE_RATIO,
                "upgrade_ratio_ok": up_p50 <= TARGET_UPGRADE_RATIO * turn_p50,
            }
        )
    return out


SMOKE = {
    "turns": 5,
    "warmup_turns": 2,
    "sessions": 2,
    "concurrent_turns": 4,
    "floor_iterations": 20,
    "floor_warmup": 5,
    "upgrade_turns": 4,
    "upgrade_warmup": 1,
    "metrics_blocks": 2,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.turn_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--turns", type=int, default=1000, help="sequential turns (b)")
    parser.add_argument("--warmup-turns", type=int, default=50, help="unmeasured turns first")
    parser.add_argument("--sessions", type=int, default=32, help="concurrent sessions (c)")
    parser.add_argument("--concurrent-turns", type=int, default=3000, help="total turns in (c)")
    parser.add_argument(
        "--upgrade-turns",
        type=int,
        default=200,
        help="measured upgrade turns (u), each handing a session to the other deployment; "
        "0 skips the phase and the second deployment",
    )
    parser.add_argument("--upgrade-warmup", type=int, default=10, help="unmeasured upgrades first")
    parser.add_argument(
        "--upgrade-idle-ms",
        type=float,
        default=5.0,
        help="pause before each upgrade send, so the session is idle on its owner",
    )
    parser.add_argument("--floor-iterations", type=int, default=1000)
    parser.add_argument("--floor-warmup", type=int, default=200)
    parser.add_argument(
        "--snapshot-bytes", type=int, default=400, help="snapshot size of the floor commit"
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--log-dir", help="keep service and etcd logs here")
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="service log level (info logs each handoff's took_ms; it slows every figure)",
    )
    parser.add_argument(
        "--plaintext",
        action="store_true",
        help="run the stack without TLS and etcd auth (default: TLS on every hop, "
        "etcd over TLS with auth, as in production)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny iteration counts everywhere (a few seconds; checks the bench runs, "
        "its figures mean nothing)",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="profile the processes during --profile-phase into DIR"
    )
    parser.add_argument("--profiler", choices=("py-spy", "py-spy-native", "perf"), default="py-spy")
    parser.add_argument(
        "--profile-phase",
        choices=("latency", "upgrade", "throughput", "all"),
        default="throughput",
    )
    parser.add_argument("--profile-rate", type=int, default=250, help="samples per second")
    parser.add_argument(
        "--metrics-compare",
        action="store_true",
        help="instead of the phases above: --turns one-step turns on each of two identical "
        "stacks, metrics off and on (every service with --metrics-listen, scraped every "
        f"{SCRAPE_EVERY_S:g} s), in alternating blocks; turn latency and services' CPU per "
        "turn of each, and the on/off ratios",
    )
    parser.add_argument(
        "--metrics-blocks",
        type=int,
        default=10,
        help="alternating blocks of --metrics-compare and --tracing-compare",
    )
    parser.add_argument(
        "--tracing-compare",
        action="store_true",
        help="instead of the phases above: --turns one-step turns on each of three identical "
        "stacks: metrics and tracing off; metrics on; metrics and tracing on (OTLP to a "
        "collector in the bench, every span sampled), in rotating blocks; turn latency and "
        "services' CPU per turn of each, and the ratios against all off",
    )
    args = parser.parse_args(argv)
    apply_smoke(parser, args, SMOKE)
    if args.upgrade_turns < 0 or args.upgrade_warmup < 0:
        parser.error("need --upgrade-turns >= 0 and --upgrade-warmup >= 0")
    if args.turns < 1 or args.sessions < 1 or args.concurrent_turns < args.sessions:
        parser.error("need --turns >= 1, --sessions >= 1, --concurrent-turns >= --sessions")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.metrics_compare:
        return main_metrics_compare(args)
    if args.tracing_compare:
        return main_tracing_compare(args)
    profiler = (
        Profiler(args.profile, args.profiler, args.profile_rate, args.profile_phase)
        if args.profile
        else None
    )
    with log_dir(args.log_dir, "baton-bench-") as logs:
        stack = BenchStack(
            logs,
            second_deployment=args.upgrade_turns > 0,
            log_level=args.log_level,
            tls=not args.plaintext,
        )
        try:
            _progress(f"starting etcd and services (logs in {logs})")
            stack.start()
            results = asyncio.run(run(args, stack, profiler))
        finally:
            if profiler is not None:
                profiler.stop()
            stack.stop()
    print(report(results), flush=True)
    write_json(args.json, to_json(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
