"""CPU per SendMessage receipt, in ingress and hooks, next to one gRPC hop.

    python -m bench.receipt_cost [--sends 1000] [--profile DIR]

Starts a TLS etcd and real processes (hooks, anchor, one owner, ingress),
creates a session and runs one turn, then stops the owner (SIGSTOP; its lease
TTL is long enough not to expire), so a send costs only its receipt: ingress
serves SendMessage and calls ResumeHook; hooks appends in one txn (and writes
the entry to the stopped owner's inbox stream, a few bytes into its socket).
Measured in one run, from /proc (user + system CPU of every thread):

- `Health.Check` on ingress and on hooks, `--sends` each: the CPU of a hop
  with no work behind it, the unit of the issue's targets;
- `--sends` sequential SendMessage calls: CPU per receipt in ingress, hooks
  and etcd, and the same as a multiple of each one's Health.Check.

CPU figures hold on a busy machine better than wall times (which are printed
for reference only). With `--profile DIR` py-spy samples ingress and hooks
during the sends (`<service>.receipt.txt`; `python -m bench.profile_summary DIR`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime.cli.system.service_launcher import start_etcd
from baton_runtime.cli.system.service_stack import ServiceStack
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.security.pki import LocalPki
from bench.measure import cpu_seconds
from bench.stack import (
    BENCH_PREFIX,
    METADATA,
    bench_pki,
    bench_service_stack,
    eventually,
    public_channel,
)

_SERVICES = ("ingress", "hooks")


def _pids(stack: ServiceStack, etcd_pid: int) -> dict[str, int]:
    assert stack.ingress is not None and stack.hooks is not None
    return {"ingress": stack.ingress.pid, "hooks": stack.hooks.pid, "etcd": etcd_pid}


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def _per_call_ms(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {name: round((after[name] - before[name]) * 1000 / n, 4) for name in before}


async def _checks(stub: health_pb2_grpc.HealthStub, n: int) -> None:
    request = health_pb2.HealthCheckRequest(service="")
    for _ in range(n):
        await stub.Check(request, timeout=5)


async def measure(
    etcd_endpoint: str,
    etcd_pid: int,
    workdir: Path,
    pki: LocalPki,
    sends: int,
    profile: str = "",
    native: bool = False,
) -> Any:
    # Log level warning, as in production and bench.turn_latency: no info
    # lines per call.
    stack = bench_service_stack(etcd_endpoint, workdir, pki, lease_ttl=120, log_level="warning")
    stack.start_deployments(owners={"o1": (stack.deployment_id, "")}, ingresses={})
    # No channel send limit in the way (the default is 200 a second).
    stack.start_ingress(
        "ingress", stack.deployment_id, ["o1"], env={"BATON_MAX_SENDS_PER_SECOND": "100000"}
    )
    channel = public_channel(stack.addr("ingress"), pki)
    ingress = ingress_pb2_grpc.IngressServiceStub(channel)
    hooks = HooksClient(stack.addr("hooks"), timeout=5, security=stack.probe)

    async def registered() -> bool:
        return bool(await hooks.list_instances(stack.deployment_id))

    await eventually(registered, "o1 registered")
    pids = _pids(stack, etcd_pid)
    try:
        created = await ingress.CreateSession(
            ingress_pb.CreateSessionRequest(), metadata=METADATA, timeout=10
        )
        sid = created.session_id

        async def send(n: int) -> None:
            await ingress.SendMessage(
                ingress_pb.SendMessageRequest(
                    session_id=sid, text="hello", delivery_id=f"dlv_cost_{n}"
                ),
                metadata=METADATA,
                timeout=10,
            )

        await send(0)
        await asyncio.sleep(1.0)  # the turn (the owner runs it) before the owner stops
        stack.pause("o1")
        ingress_health = health_pb2_grpc.HealthStub(channel)
        hooks_health = health_pb2_grpc.HealthStub(hooks.channel)  # type: ignore[arg-type]
        for n in range(1, 51):  # warm: channels, caches, the token index
            await send(n)
        await _checks(ingress_health, 50)
        await _checks(hooks_health, 50)

        figures: dict[str, Any] = {"sends": sends}
        for name, stub in (("ingress", ingress_health), ("hooks", hooks_health)):
            before = _cpu(pids)
            await _checks(stub, sends)
            figures[f"health_check_{name}_cpu_ms"] = _per_call_ms(before, _cpu(pids), sends)

        profilers = _profile(profile, pids, native) if profile else []
        before, start = _cpu(pids), time.perf_counter()
        for n in range(1000, 1000 + sends):
            await send(n)
        wall = time.perf_counter() - start
        after = _cpu(pids)
        for proc in profilers:
            proc.send_signal(signal.SIGINT)
        for proc in profilers:
            proc.wait(timeout=60)
        figures["receipt_cpu_ms"] = _per_call_ms(before, after, sends)
        figures["receipt_wall_ms_mean"] = round(wall * 1000 / sends, 3)
        for name in _SERVICES:
            hop = figures[f"health_check_{name}_cpu_ms"][name]
            figures[f"receipt_vs_health_check_{name}"] = round(
                figures["receipt_cpu_ms"][name] / hop, 2
            )
        return figures
    finally:
        stack.resume("o1")
        await hooks.close()
        await channel.close()
        stack.stop()


def _profile(out_dir: str, pids: dict[str, int], native: bool) -> list[subprocess.Popen[bytes]]:
    exe = shutil.which("py-spy")
    if exe is None:
        raise RuntimeError("py-spy not found (pip install py-spy)")
    os.makedirs(out_dir, exist_ok=True)
    procs = []
    for name in _SERVICES:
        # --native (C frames too) pauses the targets: proportions, not CPU figures.
        mode = "--native" if native else "--nonblocking"
        cmd = [exe, "record", mode, "--threads", "--format", "raw", "--rate", "250"]
        cmd += ["--pid", str(pids[name]), "-o", f"{out_dir}/{name}.receipt.txt"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # attached before the sends
    return procs


def _etcd_pid(server: Any) -> int:
    assert server.proc is not None
    return int(server.proc.pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sends", type=int, default=1000)
    parser.add_argument("--profile", metavar="DIR", default="")
    parser.add_argument("--native", action="store_true", help="py-spy with C frames (pauses)")
    parser.add_argument("--json", metavar="PATH", default="")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="baton-receipt-") as workdir:
        pki = bench_pki(Path(workdir) / "certs")
        server = start_etcd(pki, BENCH_PREFIX, log_path=str(Path(workdir) / "etcd.log"))
        try:
            figures = asyncio.run(
                measure(
                    server.endpoint,
                    _etcd_pid(server),
                    Path(workdir),
                    pki,
                    args.sends,
                    args.profile,
                    args.native,
                )
            )
        finally:
            server.stop()
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
