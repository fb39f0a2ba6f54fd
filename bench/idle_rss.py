"""Memory of idle sessions: RSS of one owner holding 10 vs 10,000 parked sessions.

    python -m bench.idle_rss [--sessions 10000] [--baseline 10] [--park-after 0.5]
                             [--settle 12] [--concurrency 64] [--send] [--takeover [--active 4]]
                             [--idle-cpu SECONDS] [--json PATH] [--keep-logs]
                             [--log-level LEVEL]

Starts a real etcd, hooks, anchor and one owner as separate processes (log
level warning). Creates `--baseline` sessions through OwnerService.StartSession,
waits until every one is parked (the owner drops an idle session's snapshot and
inbox stream and keeps only its fence and inbox position), and reads the
owner's VmRSS from /proc then and `--settle` seconds later (the later one
counts: the owner gives freed heap back to the OS at most every 10 s after a
park). Then creates sessions up to `--sessions` in total (bounded
concurrency), waits until all are parked, and reads VmRSS again.
With --send, every session first answers one message (so it parks with a
history). Prints both figures, the difference per session and the target:
10,000 parked idle sessions add less than 20 MB.

With --takeover, a second owner instance is started, the first is killed
(-9), and two times are reported: until the active sessions are answered
(`--active` sessions sent a one-step tool turn just before the kill, and as
many sent a message just after it, while no owner is live), as a ratio to
the lease TTL (target: within TTL + 1 s, whatever the number of parked
sessions; the successor claims active sessions first and the quiet parked
ones lazily), and until the second holds every session (parked: a quiet
parked session is taken over without loading its snapshot; the sweep claims
them at a bounded rate, so this grows with --sessions), with the second
owner's RSS.

With --idle-cpu SECONDS, the CPU that hooks, etcd and the owner use over that
long once every session is parked and nothing is sent (the owner's periodic
reconciliation, lease keep-alives, etcd's own timers), in ms per second, after
the RSS reading: what a fleet of quiet parked sessions costs the services.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from baton_runtime._proto.baton.owner.v1 import owner_pb2
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.cli.system.processes import ServiceProcess
from baton_runtime.cli.system.service_env import wiring_env
from baton_runtime.cli.system.service_launcher import ServiceLauncher, start_etcd
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.tls import Security
from bench.common import write_json
from bench.measure import cpu_seconds
from bench.stack import BENCH_PREFIX, bench_pki

DEPLOYMENT_ID = "bench-idle"
INSTANCE_ID = "bench-idle-i1"
SUCCESSOR_ID = "bench-idle-i2"
LEASE_TTL = 2
TARGET_BYTES = 20 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class IdleStack:
    """etcd + hooks + anchor + one owner, as processes, with TLS on every hop
    and etcd over TLS with auth (as in production), started by the one
    launcher (services/cli/system/service_launcher.py)."""

    log_dir: str
    park_after: float
    log_level: str = "warning"
    etcd: EtcdProcess | None = None
    prefix: str = ""
    # More environment for every service (e.g. BATON_OWNER_INBOX_FEED).
    extra_env: dict[str, str] = field(default_factory=dict)
    launcher: ServiceLauncher = field(init=False)

    def __post_init__(self) -> None:
        self.launcher = ServiceLauncher(Path(self.log_dir), None, self.log_level, self.extra_env)

    @property
    def services(self) -> dict[str, ServiceProcess]:
        return self.launcher.processes

    @property
    def addrs(self) -> dict[str, str]:
        return {name: self.launcher.addr(name) for name in ("hooks", "anchor", "owner")}

    def security(self, role: Role, deployment_id: str = "") -> Security:
        return self.launcher.security(role, deployment_id)

    def _wiring(self, kind: str, instance_id: str = INSTANCE_ID) -> dict[str, str]:
        assert self.etcd is not None
        wiring = wiring_env(
            kind,
            etcd=self.etcd.endpoint,
            prefix=self.prefix,
            hooks=self.launcher.addr("hooks"),
            anchor=self.launcher.addr("anchor"),
            deployment_id=DEPLOYMENT_ID,
        )
        if kind != "owner":
            return wiring
        return wiring | {
            "BATON_INSTANCE_ID": instance_id,
            "BATON_OWNER_PARK_AFTER": str(self.park_after),
            "BATON_OWNER_LEASE_TTL": str(LEASE_TTL),
        }

    def start(self) -> None:
        self.launcher.pki = pki = bench_pki(os.path.join(self.log_dir, "certs"))
        etcd_log = os.path.join(self.log_dir, "etcd.log")
        self.etcd = start_etcd(pki, BENCH_PREFIX, log_path=etcd_log)
        self.prefix = f"{BENCH_PREFIX}idle/{uuid.uuid4().hex[:12]}/"
        for name in ("hooks", "anchor", "owner"):
            self.launcher.start(
                name, name, self._wiring(name), deployment_id=DEPLOYMENT_ID, wait=False
            )
        self.launcher.wait_serving(timeout=30)

    @property
    def owner_pid(self) -> int:
        return self.services["owner"].pid

    def start_successor(self) -> ServiceProcess:
        wiring = self._wiring("owner", SUCCESSOR_ID)
        return self.launcher.start("successor", "owner", wiring, deployment_id=DEPLOYMENT_ID)

    def stop(self) -> None:
        self.launcher.stop()
        if self.etcd is not None:
            self.etcd.stop()


async def create_sessions(
    owner: OwnerClient, hooks: HooksClient, count: int, concurrency: int, send: bool
) -> list[str]:
    created: list[str] = []

    async def worker() -> None:
        while len(created) < count:
            sid = ids.new_session_id()
            created.append(sid)
            await owner.start_session(
                owner_pb2.StartSessionRequest(
                    session_id=sid, deployment_id=DEPLOYMENT_ID, channel="bench"
                )
            )
            if send:
                await hooks.append(ids.inbox_token(sid), s.Command(send=s.SendCommand(text="hi")))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return created


async def wait_parked(
    hooks: HooksClient, count: int, limit_s: float, instance_id: str = INSTANCE_ID
) -> float:
    """Seconds until `count` sessions of the instance are parked."""
    start = time.monotonic()
    while True:
        owned = await hooks.list_instance_sessions(DEPLOYMENT_ID, instance_id)
        parked = sum(1 for o in owned if o.parked)
        if parked >= count:
            return time.monotonic() - start
        if time.monotonic() - start > limit_s:
            raise TimeoutError(f"only {parked} of {count} sessions parked after {limit_s}s")
        await asyncio.sleep(0.5 if count > 100 else 0.05)


async def answered(anchor: AnchorClient, sid: str, seq: int) -> bool:
    """Whether the session's last snapshot consumed inbox entry `seq` and
    settled its turn."""
    snapshot, _ = await anchor.snapshot_with_revision(sid)
    return snapshot.inbox_next_seq > seq and not snapshot.HasField("open_turn")


async def send(hooks: HooksClient, sid: str, text: str) -> int:
    receipt = await hooks.append(ids.inbox_token(sid), s.Command(send=s.SendCommand(text=text)))
    return receipt.seq


async def time_takeover(
    args: argparse.Namespace,
    stack: IdleStack,
    hooks: HooksClient,
    anchor: AnchorClient,
    sessions: list[str],
) -> dict[str, float]:
    """kill -9 the owner under a successor: seconds until the active
    sessions are answered, and until every session is parked there."""
    running, woken = sessions[: args.active], sessions[args.active : 2 * args.active]
    sent = {sid: await send(hooks, sid, "sleep 2 100") for sid in running}
    successor = stack.start_successor()
    stack.services["owner"].kill()
    start = time.monotonic()
    sent |= {sid: await send(hooks, sid, "while dead") for sid in woken}
    waiting = dict(sent)
    limit = max(120, args.sessions / 20)
    while waiting:
        for sid, seq in list(waiting.items()):
            if await answered(anchor, sid, seq):
                del waiting[sid]
        if time.monotonic() - start > limit:
            raise TimeoutError(f"{len(waiting)} active sessions unanswered after {limit}s")
        await asyncio.sleep(0.02)
    active_s = time.monotonic() - start
    verdict = "meets" if active_s <= LEASE_TTL + 1 else "MISSES"
    print(
        f"kill -9 -> {len(sent)} active sessions answered by the successor: {active_s:.2f}s "
        f"= {active_s / LEASE_TTL:.2f}x the lease TTL ({LEASE_TTL}s) with "
        f"{args.sessions - len(sent)} parked; target <= TTL + 1s: {verdict}"
    )
    await wait_parked(hooks, args.sessions, limit, SUCCESSOR_ID)
    took = time.monotonic() - start
    rss_successor = rss_bytes(successor.pid)
    print(
        f"kill -9 -> {args.sessions} sessions parked on a successor: {took:.1f}s "
        f"(lease TTL {LEASE_TTL}s); successor RSS {rss_successor / 2**20:.1f} MiB"
    )
    return {
        "active_sessions": len(sent),
        "active_answered_seconds": active_s,
        "active_answered_ttl_ratio": active_s / LEASE_TTL,
        "active_meets_target": active_s <= LEASE_TTL + 1,
        "takeover_seconds": took,
        "rss_successor_bytes": rss_successor,
    }


async def settled_rss(pid: int, parked: int, settle: float) -> int:
    """The owner's RSS once `parked` sessions are parked, and again `settle`
    seconds later (the owner gives freed heap back to the OS at most every
    10 s after a park: services/owner/host/heap.py); the later one counts."""
    at_park = rss_bytes(pid)
    await asyncio.sleep(settle)
    settled = rss_bytes(pid)
    print(
        f"{parked:>6} parked sessions: owner RSS {at_park / 2**20:8.1f} MiB, "
        f"{settled / 2**20:8.1f} MiB {settle:g}s later"
    )
    return settled


async def idle_cpu(stack: IdleStack, seconds: float, parked: int) -> dict[str, float]:
    """ms of CPU per second that hooks, etcd and the owner use over
    `seconds` with `parked` sessions parked and nothing sent."""
    assert stack.etcd is not None and stack.etcd.proc is not None
    pids = {name: stack.services[name].pid for name in ("hooks", "owner")}
    pids["etcd"] = stack.etcd.proc.pid
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    await asyncio.sleep(seconds)
    per_s = {name: (cpu_seconds(pid) - before[name]) * 1000 / seconds for name, pid in pids.items()}
    print(
        f"idle CPU with {parked} parked sessions over {seconds:g}s, ms per second: "
        + ", ".join(f"{name} {ms:.1f}" for name, ms in per_s.items())
    )
    return {f"idle_cpu_ms_per_s_{name}": ms for name, ms in per_s.items()}


async def measure(args: argparse.Namespace, stack: IdleStack) -> dict[str, float]:
    # As the deployment's ingress (starts sessions) and owner (lists, sends).
    owner = OwnerClient(
        stack.addrs["owner"], timeout=30, security=stack.security(Role.INGRESS, DEPLOYMENT_ID)
    )
    hooks = HooksClient(
        stack.addrs["hooks"], timeout=60, security=stack.security(Role.OWNER, DEPLOYMENT_ID)
    )
    anchor = AnchorClient(
        stack.addrs["anchor"], timeout=30, security=stack.security(Role.OWNER, DEPLOYMENT_ID)
    )
    try:
        created = await create_sessions(owner, hooks, args.baseline, args.concurrency, args.send)
        await wait_parked(hooks, args.baseline, 60)
        rss_small = await settled_rss(stack.owner_pid, args.baseline, args.settle)

        more = args.sessions - args.baseline
        start = time.monotonic()
        created += await create_sessions(owner, hooks, more, args.concurrency, args.send)
        create_s = time.monotonic() - start
        print(f"created {more} more sessions in {create_s:.1f}s ({more / create_s:.0f}/s)")
        park_s = await wait_parked(hooks, args.sessions, max(120, args.sessions / 20))
        rss_big = await settled_rss(stack.owner_pid, args.sessions, args.settle)
        idle = await idle_cpu(stack, args.idle_cpu, args.sessions) if args.idle_cpu else {}
        takeover: dict[str, float] = {}
        if args.takeover:
            takeover = await time_takeover(args, stack, hooks, anchor, created)
    finally:
        await owner.close()
        await hooks.close()
        await anchor.close()
    added = rss_big - rss_small
    per_session = added / more
    verdict = "meets" if added < TARGET_BYTES else "MISSES"
    print(
        f"added by {more} parked sessions: {added / 2**20:.1f} MiB, "
        f"{per_session:.0f} bytes per session"
    )
    print(
        f"target: < {TARGET_BYTES / 2**20:.0f} MiB added for 10,000 parked idle sessions: {verdict}"
    )
    return {
        "baseline_sessions": args.baseline,
        "sessions": args.sessions,
        "rss_baseline_bytes": rss_small,
        "rss_bytes": rss_big,
        "added_bytes": added,
        "bytes_per_session": per_session,
        "create_seconds": create_s,
        "park_wait_seconds": park_s,
        "target_bytes": TARGET_BYTES,
        "meets_target": added < TARGET_BYTES,
        **idle,
        **takeover,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.idle_rss", description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000, help="sessions in total")
    parser.add_argument("--baseline", type=int, default=10, help="sessions at the first reading")
    parser.add_argument("--park-after", type=float, default=0.5, help="owner idle park delay, s")
    parser.add_argument(
        "--settle", type=float, default=12.0, help="seconds between parking and the RSS reading"
    )
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent StartSession calls")
    parser.add_argument("--send", action="store_true", help="answer one message per session")
    parser.add_argument(
        "--takeover", action="store_true", help="then kill the owner; time a successor's takeover"
    )
    parser.add_argument(
        "--active",
        type=int,
        default=4,
        help="with --takeover: busy sessions at the kill, and as many sent a message after it",
    )
    parser.add_argument(
        "--idle-cpu",
        type=float,
        default=0.0,
        help="then measure the services' CPU over this many seconds of parked idleness",
    )
    parser.add_argument("--json", help="also write the figures as JSON here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the service logs")
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="the services' log level (info: every session started, parked, taken over)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.baseline < args.sessions:
        parser.error("need 0 < --baseline < --sessions")
    if not 0 < 2 * args.active < args.sessions:
        parser.error("need 0 < 2 * --active < --sessions")
    log_dir = tempfile.mkdtemp(prefix="baton-idle-rss-")
    stack = IdleStack(log_dir, args.park_after, args.log_level)
    try:
        stack.start()
        result = asyncio.run(measure(args, stack))
    finally:
        stack.stop()
        if args.keep_logs:
            print(f"logs: {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    write_json(args.json, result)
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
