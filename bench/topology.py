"""What the replicated topology costs: one run, three topologies side by side.

    python -m bench.topology [--turns 300] [--sessions 16] [--concurrent-turns 1600]
                             [--rounds 2] [--json PATH] [--smoke]

Each topology is started as real processes (log level warning), measured,
and stopped, in turn, `--rounds` times (A B C A B C ...), so that drift of
the machine's load shows up as spread between rounds rather than as a
difference between topologies:

  1x/1  one etcd member; one hooks, anchor, owner and ingress (the default
        `baton up`)
  1x/3  three etcd members (one cluster, every client given every member);
        one of each service
  2x/1  one etcd member; two replicas of each service, every client given
        every replica (round-robin); the bench client balances over both
        ingresses

For each: the one-step turn (SendMessage -> SESSION_WAITING on a following
reader, as `bench.turn_latency` phase b) over `--turns` sequential turns, and
throughput with `--sessions` sessions running `--concurrent-turns` turns back
to back (phase c). Reported: the one-step p50 on three etcd members against
one (1x/3 vs 1x/1) and the throughput of two replicas against one (2x/1 vs
1x/1), each with the ratio, per round and as the median over rounds.

On a 2-core machine every process competes for the same two cores, so more
replicas cannot add capacity; the figures show what the topology costs
(more processes, more connections, a quorum write per etcd commit), not a
speed-up. bench/README.md explains the output.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime.cli.system.etcd_process import EtcdCluster, EtcdProcess
from baton_runtime.cli.system.service_env import wiring_env
from baton_runtime.cli.system.service_launcher import (
    ServiceLauncher,
    start_etcd,
    start_etcd_cluster,
)
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security, tls_options
from bench.common import apply_smoke, log_dir, write_json
from bench.measure import Dist, load_average, versions
from bench.stack import BENCH_PREFIX, UNLIMITED_RATES, bench_pki, key_file
from bench.turns import measure_sequential, measure_throughput

DEPLOYMENT_ID = "bench-topology"
SMOKE = {"turns": 5, "warmup_turns": 2, "sessions": 2, "concurrent_turns": 6, "rounds": 1}


@dataclass(frozen=True)
class Topology:
    name: str
    etcd_members: int
    replicas: int
    description: str


TOPOLOGIES = (
    Topology("1x/1", 1, 1, "1 etcd member, 1 of each service"),
    Topology("1x/3", 3, 1, "3 etcd members, 1 of each service"),
    Topology("2x/1", 1, 2, "1 etcd member, 2 of each service"),
)


@dataclass
class TopologyStack:
    """etcd (one member or a cluster) and `replicas` processes of each service,
    with TLS on every hop and etcd over TLS with auth (as in production),
    started by the one launcher (services/cli/system/service_launcher.py)."""

    topology: Topology
    log_dir: str
    etcd: EtcdProcess | EtcdCluster | None = None
    launcher: ServiceLauncher = field(init=False)

    def __post_init__(self) -> None:
        self.launcher = ServiceLauncher(Path(self.log_dir), log_level="warning")

    @property
    def pki(self) -> LocalPki | None:
        return self.launcher.pki

    def security(self, role: Role) -> Security:
        return self.launcher.security(role, DEPLOYMENT_ID)

    def ca(self) -> bytes:
        assert self.pki is not None
        return Path(self.pki.ca_path).read_bytes()

    def names(self, kind: str) -> list[str]:
        return [f"{kind}{i}" for i in range(1, self.topology.replicas + 1)]

    def joined(self, kind: str) -> str:
        return self.launcher.addrs(self.names(kind))

    def start(self) -> None:
        pki = self.launcher.pki = bench_pki(os.path.join(self.log_dir, "certs"))
        if self.topology.etcd_members == 1:
            etcd_log = os.path.join(self.log_dir, "etcd.log")
            self.etcd = start_etcd(pki, BENCH_PREFIX, log_path=etcd_log)
        else:
            self.etcd = start_etcd_cluster(
                pki, BENCH_PREFIX, self.topology.etcd_members, log_dir=self.log_dir
            )
        keys = key_file(self.log_dir)
        prefix = f"{BENCH_PREFIX}topology/{uuid.uuid4().hex[:12]}/"
        kinds = ("hooks", "anchor", "owner", "ingress")
        for kind in kinds:
            for name in self.names(kind):
                wiring = wiring_env(
                    kind,
                    etcd=self.etcd.endpoint,
                    prefix=prefix,
                    hooks=self.joined("hooks"),
                    anchor=self.joined("anchor"),
                    deployment_id=DEPLOYMENT_ID,
                    owners=self.joined("owner"),
                    api_keys_file=keys,
                )
                if kind == "owner":
                    wiring["BATON_INSTANCE_ID"] = name
                if kind == "ingress":
                    wiring |= UNLIMITED_RATES
                self.launcher.start(name, kind, wiring, deployment_id=DEPLOYMENT_ID, wait=False)
        self.launcher.wait_serving(timeout=60)

    def check_alive(self) -> None:
        self.launcher.check_alive()

    def stop(self) -> None:
        self.launcher.stop(timeout=5)
        if self.etcd is not None:
            self.etcd.stop()


async def wait_owners(stack: TopologyStack) -> None:
    hooks = HooksClient(stack.joined("hooks"), timeout=5, security=stack.security(Role.OPERATOR))
    try:
        deadline = time.monotonic() + 30
        want = set(stack.names("owner"))
        while {i.instance_id for i in await hooks.list_instances(DEPLOYMENT_ID)} < want:
            if time.monotonic() > deadline:
                raise RuntimeError("owners did not register")
            await asyncio.sleep(0.1)
    finally:
        await hooks.close()


async def measure(stack: TopologyStack, args: argparse.Namespace) -> dict[str, Any]:
    await wait_owners(stack)
    # The bench client is a gateway: one channel balanced over every ingress.
    target = f"ipv4:{stack.joined('ingress')}"
    channel = grpc.aio.secure_channel(
        target,
        grpc.ssl_channel_credentials(root_certificates=stack.ca()),
        options=tls_options(target, [("grpc.lb_policy_name", "round_robin")]),
    )
    stub = ingress_pb2_grpc.IngressServiceStub(channel)
    try:
        seq = await measure_sequential(stub, args.turns, args.warmup_turns, lambda: None)
        stack.check_alive()
        tput = await measure_throughput(stub, args.sessions, args.concurrent_turns, lambda: None)
        stack.check_alive()
    finally:
        await channel.close()
    return {"turn": seq["turn"], "turns_per_s": tput["turns_per_s"], "load_turn": tput["turn"]}


async def run_all(args: argparse.Namespace, log_root: str) -> dict[str, Any]:
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        figures: dict[str, dict[str, Any]] = {}
        for topology in TOPOLOGIES:
            log_dir = os.path.join(log_root, f"round{r + 1}-{topology.name.replace('/', '-')}")
            os.makedirs(log_dir, exist_ok=True)
            _progress(f"round {r + 1}: {topology.name} ({topology.description})")
            stack = TopologyStack(topology, log_dir)
            try:
                stack.start()
                figures[topology.name] = await measure(stack, args)
            finally:
                stack.stop()
        rounds.append(figures)
    return {"rounds": rounds}


def ratios(figures: dict[str, dict[str, Any]]) -> dict[str, float]:
    base = figures["1x/1"]
    return {
        "p50_3_members_over_1": figures["1x/3"]["turn"].pct(50) / base["turn"].pct(50),
        "throughput_2x_over_1x": figures["2x/1"]["turns_per_s"] / base["turns_per_s"],
    }


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "TOPOLOGY COST: one-step turn and throughput, same run",
        f"  turns {args.turns} sequential; throughput {args.concurrent_turns} turns over "
        f"{args.sessions} sessions; {args.rounds} round(s); load average "
        f"{results['load_start']} at the start, {results['load_end']} at the end",
        "",
        f"  {'round':<6}{'topology':<9}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
        f"{'turns/s':>10}{'load p50 ms':>13}",
    ]
    for r, figures in enumerate(results["rounds"], 1):
        for topology in TOPOLOGIES:
            f = figures[topology.name]
            lines.append(
                f"  {r:<6}{topology.name:<9}{f['turn'].pct(50):>9.2f}{f['turn'].pct(90):>9.2f}"
                f"{f['turn'].pct(99):>9.2f}{f['turns_per_s']:>10.1f}{f['load_turn'].pct(50):>13.2f}"
            )
    per_round = [ratios(figures) for figures in results["rounds"]]
    p50 = [r["p50_3_members_over_1"] for r in per_round]
    tput = [r["throughput_2x_over_1x"] for r in per_round]
    lines += [
        "",
        "  one-step turn p50, 3 etcd members / 1:     "
        + ", ".join(f"{x:.2f}x" for x in p50)
        + f"  (median {statistics.median(p50):.2f}x)",
        "  throughput, 2 replicas of each / 1:         "
        + ", ".join(f"{x:.2f}x" for x in tput)
        + f"  (median {statistics.median(tput):.2f}x)",
    ]
    return "\n".join(lines)


def to_json(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, Dist):
            return value.summary()
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    out = convert(results)
    out["args"] = vars(args)
    out["ratios"] = [ratios(figures) for figures in results["rounds"]]
    return out


def _progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.topology",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--turns", type=int, default=300, help="sequential one-step turns")
    parser.add_argument("--warmup-turns", type=int, default=30)
    parser.add_argument("--sessions", type=int, default=16, help="concurrent sessions")
    parser.add_argument("--concurrent-turns", type=int, default=1600)
    parser.add_argument("--rounds", type=int, default=2, help="A B C repeated this often")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--log-dir", help="keep the logs here")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: checks it runs")
    args = parser.parse_args(argv)
    apply_smoke(parser, args, SMOKE)
    if args.turns < 1 or args.rounds < 1 or args.concurrent_turns < args.sessions:
        parser.error("need --turns >= 1, --rounds >= 1, --concurrent-turns >= --sessions")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with log_dir(args.log_dir, "baton-bench-topology-") as log_root:
        load_start = load_average()
        results = asyncio.run(run_all(args, log_root))
        results["load_start"], results["load_end"] = load_start, load_average()
        results["versions"] = versions()
    print(report(results, args), flush=True)
    write_json(args.json, to_json(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
