"""What one message costs (issue 21): the CPU of each kind of message a
one-step turn passes between Baton's processes, each measured alone in one
run, and what the turn's four services would spend if that were all they did.

    python -m bench.message_costs [--calls 2000] [--json PATH] [--smoke]

Two processes over TLS on loopback, with the channel and server options the
services use, and a TLS etcd with auth:

- a gRPC server in a child process (generic handlers over raw bytes: no
  protobuf work beyond gRPC's own), and this process as its client:
  `Health.Check` (the unit of issue 21's CPU target), a unary call of 400
  bytes answered with 100, and request/answer pairs of the same sizes on one
  open bidirectional stream (a multiplexed call unbatched; each pair is two
  messages);
- etcd through Baton's own `Store`: a write transaction of about 1 KiB (the
  client's CPU and etcd's), and the same writes with a watch of their prefix
  open in this process (the difference is one watch response received),
  counting how often the watch's event reached this process before the
  txn's own answer (a writer's local followers would gain nothing from
  being handed the write directly: docs/design.md §15).

CPU comes from /proc for the server and etcd and from the process clock for
this process, per call; the kinds run interleaved, in rounds, so that a
drift of the machine's speed weighs on each alike. The report then adds up what a one-step turn's
messages cost on that scale, from docs/hops.json's counts, next to one
`Health.Check`: the part of a turn's CPU that the messages alone explain.
Only ratios carry over between machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.cli.system.service_launcher import start_etcd
from baton_runtime.common.clients.channels import open_channel
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.ops import op_put
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.watch import watch_then_read
from baton_runtime.common.rpc.server import server_options
from baton_runtime.common.security import tls
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.tls import Security
from bench.common import apply_smoke, write_json
from bench.hops import JSON_PATH as HOPS_JSON
from bench.measure import cpu_seconds
from bench.stack import BENCH_PREFIX, bench_pki

REQUEST = b"r" * 400
ANSWER = b"a" * 100
ENTRY = b"e" * 1024
_SERVICE = "bench.Echo"


# -- the server (the child process) -----------------------------------------


def _identity(payload: bytes) -> bytes:
    return payload


async def serve(cert: str, key: str, ca: str) -> None:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return ANSWER

    async def pairs(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for _ in requests:
            yield ANSWER

    handler = grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
            "Pairs": grpc.stream_stream_rpc_method_handler(pairs, _identity, _identity),
        },
    )
    server = grpc.aio.server(options=server_options(4 * 1024 * 1024))
    server.add_generic_rpc_handlers((handler,))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    credentials, _ = tls.server_credentials(
        tls.Security.tls(cert, key, ca), require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


# -- the client (this process) ------------------------------------------------


BLOCKS = 10


async def _interleaved(
    server_pid: int, calls: int, kinds: dict[str, Callable[[], Awaitable[Any]]]
) -> dict[str, dict[str, float]]:
    """CPU ms per call of each kind in the server and in this process: the
    kinds run in BLOCKS rounds of calls / BLOCKS each, round-robin, so a
    drift of the machine's speed weighs on every kind alike."""
    for once in kinds.values():
        for _ in range(max(calls // 10, 5)):
            await once()
    spent = {name: [0.0, 0.0] for name in kinds}
    per_block = max(calls // BLOCKS, 1)
    for _ in range(BLOCKS):
        for name, once in kinds.items():
            server0, client0 = cpu_seconds(server_pid), time.process_time()
            for _ in range(per_block):
                await once()
            spent[name][0] += cpu_seconds(server_pid) - server0
            spent[name][1] += time.process_time() - client0
    n = per_block * BLOCKS
    return {
        name: {"server_ms": round(s * 1000 / n, 4), "client_ms": round(c * 1000 / n, 4)}
        for name, (s, c) in spent.items()
    }


async def measure_grpc(
    server_pid: int, port: int, calls: int, security: Security
) -> dict[str, Any]:
    channel = open_channel(f"127.0.0.1:{port}", security, service="hooks")
    try:
        check = health_pb2_grpc.HealthStub(channel).Check
        unary = channel.unary_unary(f"/{_SERVICE}/Unary", _identity, _identity)
        stream = channel.stream_stream(f"/{_SERVICE}/Pairs", _identity, _identity)()

        async def pair() -> None:
            await stream.write(REQUEST)
            await stream.read()

        figures = await _interleaved(
            server_pid,
            calls,
            {
                "health_check": lambda: check(health_pb2.HealthCheckRequest(), timeout=5),
                "unary": lambda: unary(REQUEST, timeout=5),
                "stream_pair": pair,
            },
        )
        await stream.done_writing()
        return figures
    finally:
        await channel.close()


async def measure_etcd(etcd: EtcdProcess, calls: int, security: Security) -> dict[str, Any]:
    """Write txns to an unwatched prefix, and to a watched one (each waiting
    for its event: one watch response each), interleaved; the difference is
    the watch response."""
    store = Store(make_client(etcd.endpoint, 5.0, security), 5.0)
    await store.connect()
    root = f"{BENCH_PREFIX}costs/{uuid.uuid4().hex}/"
    quiet, watched = f"{root}quiet/".encode(), f"{root}watched/".encode()
    counter = iter(range(10**9))
    seen: asyncio.Queue[None] = asyncio.Queue()

    async def write(prefix: bytes) -> None:
        await store.txn([], [op_put(prefix + str(next(counter)).encode(), ENTRY)], [])

    order = {"writes": 0, "watch_first": 0}

    async def watched_write() -> None:
        await write(watched)
        # Did the watch response get here before the txn's own answer? (Both
        # come over the one connection; a queued event was read first.)
        order["writes"] += 1
        order["watch_first"] += not seen.empty()
        await seen.get()

    try:
        async with watch_then_read(store.client, watched) as follower:
            events = follower.events(0)

            async def drain() -> None:
                async for _ in events:
                    seen.put_nowait(None)

            draining = asyncio.create_task(drain())
            try:
                got = await _interleaved(
                    _etcd_pid(etcd),
                    calls,
                    {"alone": lambda: write(quiet), "watched": watched_write},
                )
            finally:
                draining.cancel()
        alone, with_watch = got["alone"], got["watched"]
        return {
            "txn_write": {"client_ms": alone["client_ms"], "etcd_ms": alone["server_ms"]},
            "watch_response": {
                "client_ms": round(with_watch["client_ms"] - alone["client_ms"], 4),
                "etcd_ms": round(with_watch["server_ms"] - alone["server_ms"], 4),
            },
            "watch_before_answer": order,
        }
    finally:
        await store.close()


def _etcd_pid(etcd: EtcdProcess) -> int:
    assert etcd.proc is not None
    return int(etcd.proc.pid)


# -- what a one-step turn's messages add up to ----------------------------------


def turn_estimate(costs: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    """The four services' CPU for a one-step turn if it were only its
    messages: each unary call served or made, each stream message sent or
    received (half a pair, on either side), each etcd transaction and each
    watch response, by the hop map's counts (the edge included: ingress
    serves SendMessage and writes the follower's events)."""
    g, e = costs["grpc"], costs["etcd"]
    stream_end = (g["stream_pair"]["server_ms"] + g["stream_pair"]["client_ms"]) / 4
    unary_served, unary_made = g["unary"]["server_ms"], g["unary"]["client_ms"]
    parts: dict[str, float] = {}

    def add(part: str, ms: float) -> None:
        parts[part] = parts.get(part, 0.0) + ms

    for key, n in counts.items():
        kind = key.split(" ")[0]
        if kind == "rpc":
            add("unary calls (served and made)", n * (unary_served + unary_made))
        elif kind in ("send", "stream"):
            add("stream messages (sent and received)", 2 * n * stream_end)
        elif kind == "edge":
            one = unary_served if key.endswith("SendMessage") else stream_end
            add("the edge (SendMessage served, events written)", n * one)
        elif key.endswith((" txn_write", " txn_read")):
            add("etcd transactions (client side)", n * e["txn_write"]["client_ms"])
        elif key.endswith(" watch_responses"):
            add("watch responses received", n * e["watch_response"]["client_ms"])
    total = sum(parts.values())
    unit = g["health_check"]["server_ms"]
    return {
        "parts_ms": {name: round(ms, 4) for name, ms in parts.items()},
        "total_ms": round(total, 4),
        "health_check_server_ms": unit,
        "total_in_health_checks": round(total / unit, 2) if unit else None,
    }


def _in_units(ms: float, unit: float) -> str:
    """`ms` in Health.Checks; n/a when the unit measured 0 (a smoke run's
    few calls can fall within one /proc clock tick)."""
    return f"{ms / unit:>5.2f}" if unit else "  n/a"


def report(figures: dict[str, Any]) -> str:
    g, e, t = figures["grpc"], figures["etcd"], figures["one_step_turn"]
    unit = g["health_check"]["server_ms"]
    lines = ["CPU ms per message (TLS on loopback)        server/etcd   client   x Health.Check"]
    for name, label in (
        ("health_check", "Health.Check (the unit)"),
        ("unary", "unary call, 400 B -> 100 B"),
        ("stream_pair", "request+answer on an open stream"),
    ):
        row = g[name]
        server, client = row["server_ms"], row["client_ms"]
        lines.append(f"  {label:<40} {server:>9.3f} {client:>8.3f}   {_in_units(server, unit)}")
    for name, label in (
        ("txn_write", "etcd write txn, 1 KiB"),
        ("watch_response", "etcd watch response received"),
    ):
        row = e[name]
        server, client = row["etcd_ms"], row["client_ms"]
        lines.append(f"  {label:<40} {server:>9.3f} {client:>8.3f}   {_in_units(client, unit)}")
    order = e["watch_before_answer"]
    lines.append(
        f"  the watch's event came before its own txn's answer in "
        f"{order['watch_first']} of {order['writes']} watched writes"
    )
    lines.append("")
    lines.append("a one-step turn's messages (docs/hops.json), in the four services:")
    for name, ms in t["parts_ms"].items():
        lines.append(f"  {name:<48} {ms:>7.3f} ms")
    hops = t["total_in_health_checks"]
    lines.append(f"  {'total':<48} {t['total_ms']:>7.3f} ms = {hops} Health.Check hops")
    return "\n".join(lines)


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The server process and etcd, as hooks' certificate from a throwaway
    PKI in `workdir` sees them."""
    pki = bench_pki(workdir / "certs")
    files = pki.files(Role.HOOKS)
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "bench.message_costs", "--serve", files.cert, files.key, files.ca),
        stdout=asyncio.subprocess.PIPE,
    )
    etcd = start_etcd(pki, BENCH_PREFIX, log_path=str(workdir / "etcd.log"))
    as_hooks = pki.security(Role.HOOKS)
    try:
        assert server.stdout is not None
        port = int(await asyncio.wait_for(server.stdout.readline(), 30))
        figures = {
            "calls": args.calls,
            "grpc": await measure_grpc(server.pid, port, args.calls, as_hooks),
            "etcd": await measure_etcd(etcd, args.calls, as_hooks),
        }
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), 10)
        etcd.stop()
    counts = json.loads(HOPS_JSON.read_text())["paths"]["one_step_turn"]["counts"]
    figures["one_step_turn"] = turn_estimate(figures, counts)
    return figures


def parse_args(
    argv: Sequence[str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m bench.message_costs", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--smoke", action="store_true", help="a few calls: the bench runs")
    parser.add_argument("--serve", nargs=3, metavar=("CERT", "KEY", "CA"), help=argparse.SUPPRESS)
    return parser, parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = parse_args(argv)
    if args.serve:
        asyncio.run(serve(*args.serve))
        return 0
    apply_smoke(parser, args, {"calls": 50})
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="baton-costs-") as workdir:
        figures = asyncio.run(run(args, Path(workdir)))
    figures["load_average_end"] = list(os.getloadavg())
    print(report(figures))
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
