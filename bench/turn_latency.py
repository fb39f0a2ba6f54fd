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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.owner.v1 import owner_pb2
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.etcd_auth import enable_auth
from baton_runtime.cli.system.etcd_binary import EtcdRefused, find_etcd
from baton_runtime.cli.system.etcd_process import EtcdProcess, EtcdTls
from baton_runtime.cli.system.processes import ServiceProcess, free_port, wait_serving
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import Keys, TokenRecord, fence_value
from baton_runtime.common.etcd.ops import (
    cmp_absent,
    cmp_present,
    cmp_value,
    op_get,
    op_put,
    single_value,
)
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.watch import create_watch
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security
from bench.common import apply_smoke, log_dir, write_json

# Targets from the project brief.
TARGET_RATIO = 2.5  # one-step turn p50 within 2.5x the floor p50
ETCD_NOTES_FLOOR_P50_MS = 1.11  # docs/etcd.md "one-step turn floor"
TARGET_ABS_P50_MS = TARGET_RATIO * ETCD_NOTES_FLOOR_P50_MS  # ~2.8 ms
TARGET_TURNS_PER_S = 700.0
TARGET_CPU_MS_PER_TURN = 1.5  # the four services together, throughput phase
SERVICES = ("hooks", "anchor", "owner", "ingress")
TARGET_UPGRADE_RATIO = 2.0  # upgrade turn p50 within 2x the one-step turn p50

API_KEY = "bench-key-00001-loopback-Zq4v"
CHANNEL = "bench"
METADATA = (("authorization", f"Bearer {API_KEY}"),)
# Every key the bench writes lives under this prefix (the etcd role's scope).
BENCH_PREFIX = "/b/"
DEPLOYMENT_ID = "bench-dep-1"
DEPLOYMENT_ID_B = "bench-dep-2"
WAIT_TIMEOUT_S = 30.0

SERVICE_NAMES = {
    "hooks": hooks_pb2.DESCRIPTOR.services_by_name["HookRegistryService"].full_name,
    "anchor": anchor_pb2.DESCRIPTOR.services_by_name["AnchorService"].full_name,
    "owner": owner_pb2.DESCRIPTOR.services_by_name["OwnerService"].full_name,
    "ingress": ingress_pb.DESCRIPTOR.services_by_name["IngressService"].full_name,
}
# Process name in the stack -> the service it runs. The second deployment
# (owner-b, ingress-b) shares hooks, anchor and etcd with the first.
PROCESSES = {
    "hooks": "hooks",
    "anchor": "anchor",
    "owner": "owner",
    "ingress": "ingress",
    "owner-b": "owner",
    "ingress-b": "ingress",
}
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# -- statistics ----------------------------------------------------------------


@dataclass
class Dist:
    """Latency samples in seconds, reported in ms."""

    samples: list[float] = field(default_factory=list)

    def pct(self, p: float) -> float:
        if not self.samples:
            return float("nan")
        ordered = sorted(self.samples)
        rank = (len(ordered) - 1) * p / 100.0
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        return (ordered[low] + (ordered[high] - ordered[low]) * (rank - low)) * 1000.0

    def summary(self) -> dict[str, float]:
        return {
            "n": len(self.samples),
            "p50_ms": round(self.pct(50), 3),
            "p90_ms": round(self.pct(90), 3),
            "p99_ms": round(self.pct(99), 3),
            "mean_ms": round(statistics.fmean(self.samples) * 1000, 3) if self.samples else 0.0,
            "max_ms": round(max(self.samples) * 1000, 3) if self.samples else 0.0,
        }


# -- processes -----------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """user+system CPU of a process (all threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return float("nan")
    fields = data[data.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def context_switches(pid: int) -> int:
    """Voluntary + involuntary context switches over all threads of a process."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
    return total


Sample = dict[str, tuple[float, int]]


@dataclass
class BenchStack:
    """etcd + hooks + anchor + owner + ingress as separate processes; with
    `second_deployment`, also owner-b + ingress-b of deployment DEPLOYMENT_ID_B.

    With `tls` (the default, as in production): a throwaway CA in the log dir,
    TLS with client certificates on every hop, and etcd over TLS with
    client-certificate user/role auth (role limited to BENCH_PREFIX). Without
    it: everything plaintext (explicit `--plaintext`), etcd without auth."""

    log_dir: str
    second_deployment: bool = True
    log_level: str = "warning"
    tls: bool = True
    etcd: EtcdProcess | None = None
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    addrs: dict[str, str] = field(default_factory=dict)
    prefix: str = ""
    pki: LocalPki | None = None
    # Every service serves Prometheus metrics (--metrics-listen) on its own port.
    metrics: bool = False
    metrics_addrs: dict[str, str] = field(default_factory=dict)
    # Every service's extra environment (e.g. OTEL_* for tracing).
    env: dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [n for n in PROCESSES if self.second_deployment or not n.endswith("-b")]

    def security(self, role: Role, deployment_id: str = "") -> Security:
        return Security.plaintext() if self.pki is None else self.pki.security(role, deployment_id)

    @property
    def etcd_security(self) -> Security:
        """How the bench reads and writes etcd itself (as the hooks user)."""
        return self.security(Role.HOOKS)

    def public_channel(self, name: str) -> grpc.aio.Channel:
        """A gateway's channel to an ingress: TLS trusting the CA, no client cert."""
        if self.pki is None:
            return grpc.aio.insecure_channel(self.addrs[name])
        ca = Path(self.pki.ca_path).read_bytes()
        return grpc.aio.secure_channel(
            self.addrs[name], grpc.ssl_channel_credentials(root_certificates=ca)
        )

    def _tls_env(self, role: Role, deployment_id: str = "") -> dict[str, str]:
        files = self.security(role, deployment_id).files
        if files is None:
            return {"BATON_PLAINTEXT": "1"}
        return {"BATON_TLS_CERT": files.cert, "BATON_TLS_KEY": files.key, "BATON_TLS_CA": files.ca}

    def start(self) -> None:
        etcd_tls = None
        if self.tls:
            self.pki = LocalPki(os.path.join(self.log_dir, "certs"))
            etcd_tls = EtcdTls(server=self.pki.etcd_server(), root=self.pki.etcd_user("root"))
        self.etcd = EtcdProcess(
            log_path=os.path.join(self.log_dir, "etcd.log"), tls=etcd_tls
        ).start()
        if etcd_tls is not None:
            enable_auth(self.etcd.endpoint, etcd_tls.root, ("hooks", "anchor"), BENCH_PREFIX)
        self.prefix = f"{BENCH_PREFIX}bench/{uuid.uuid4().hex[:12]}/"
        self.addrs = {name: f"127.0.0.1:{free_port()}" for name in self.names}
        key_file = os.path.join(self.log_dir, "api-keys")
        with open(key_file, "w") as f:
            f.write(f"{CHANNEL}={API_KEY}\n")
        common = {
            "BATON_LOG_LEVEL": self.log_level,
            "BATON_ETCD_ENDPOINT": self.etcd.endpoint,
            "BATON_ETCD_PREFIX": self.prefix,
            "BATON_DEPLOYMENT_ID": DEPLOYMENT_ID,
            "BATON_INSTANCE_ID": f"{DEPLOYMENT_ID}-i1",
            "BATON_API_KEYS_FILE": key_file,
            # The bench drives one channel far past the default per-channel
            # rates; the checks still run on every call.
            "BATON_MAX_SENDS_PER_SECOND": "1000000",
            "BATON_MAX_SESSIONS_PER_MINUTE": "1000000",
            "BATON_HOOKS_ADDR": self.addrs["hooks"],
            "BATON_ANCHOR_ADDR": self.addrs["anchor"],
            "BATON_OWNER_ADDR": self.addrs["owner"],
        }
        deployment_b = {
            **common,
            "BATON_DEPLOYMENT_ID": DEPLOYMENT_ID_B,
            "BATON_INSTANCE_ID": f"{DEPLOYMENT_ID_B}-i1",
            "BATON_OWNER_ADDR": self.addrs.get("owner-b", ""),
        }
        for name in self.names:
            role = Role(PROCESSES[name])
            deployment = DEPLOYMENT_ID_B if name.endswith("-b") else DEPLOYMENT_ID
            own = deployment if role in (Role.OWNER, Role.INGRESS) else ""
            if self.metrics:
                self.metrics_addrs[name] = f"127.0.0.1:{free_port()}"
            metrics = {"BATON_METRICS_LISTEN": self.metrics_addrs.get(name, "")}
            proc = ServiceProcess(
                name=PROCESSES[name],
                listen=self.addrs[name],
                env={
                    **(deployment_b if name.endswith("-b") else common),
                    **self._tls_env(role, own),
                    **metrics,
                    **self.env,
                },
                log_path=os.path.join(self.log_dir, f"{name}.log"),
            ).start()
            self.services[name] = proc
        for name, proc in self.services.items():
            try:
                wait_serving(
                    self.addrs[name],
                    self.security(Role.OPERATOR),
                    SERVICE_NAMES[PROCESSES[name]],
                    timeout=30,
                )
            except TimeoutError:
                if proc.proc is not None and proc.proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.proc.returncode}; see {self.log_dir}/{name}.log"
                    ) from None
                raise

    def pids(self) -> dict[str, int]:
        out = {name: proc.pid for name, proc in self.services.items()}
        if self.etcd is not None and self.etcd.proc is not None:
            out["etcd"] = self.etcd.proc.pid
        return out

    def sample(self) -> Sample:
        """(CPU seconds, context switches) of every process, this client included."""
        pids = {**self.pids(), "bench client": os.getpid()}
        return {name: (cpu_seconds(pid), context_switches(pid)) for name, pid in pids.items()}

    def cpu(self) -> dict[str, float]:
        """CPU seconds of every process, this client included (cheaper than `sample`)."""
        pids = {**self.pids(), "bench client": os.getpid()}
        return {name: cpu_seconds(pid) for name, pid in pids.items()}

    def check_alive(self) -> None:
        for name, proc in self.services.items():
            if proc.proc is not None and proc.proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.proc.returncode}; see {self.log_dir}/{name}.log"
                )

    def stop(self) -> None:
        for name in ("ingress-b", "owner-b", "ingress", "owner", "anchor", "hooks"):
            proc = self.services.get(name)
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.stop(timeout=5)
                with contextlib.suppress(Exception):
                    proc.kill()
        if self.etcd is not None:
            self.etcd.stop()


class Profiler:
    """py-spy or perf attached to the stack's processes for one phase (optional).

    py-spy / py-spy-native: one raw collapsed-stack file per service
    (`<service>.<phase>.txt`, summarise with `python -m bench.profile_summary DIR`).
    perf: one `perf.<phase>.data` over every process including etcd and this
    client, with `pids.<phase>.json` naming the pids (`perf report --sort pid,dso`).
    """

    def __init__(self, out_dir: str, kind: str, rate: int, phase: str) -> None:
        self.out_dir = out_dir
        self.kind = kind
        self.rate = rate
        self.phase = phase
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def wants(self, tag: str) -> bool:
        return self.phase in (tag, "all")

    def start(self, pids: dict[str, int], tag: str) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        pids = {**pids, "bench client": os.getpid()}
        with open(os.path.join(self.out_dir, f"pids.{tag}.json"), "w") as f:
            json.dump(pids, f)
        if self.kind == "perf":
            exe = _require("perf")
            cmd = [
                exe,
                "record",
                "-F",
                str(self.rate),
                "-g",
                "-p",
                ",".join(str(p) for p in pids.values()),
                "-o",
                os.path.join(self.out_dir, f"perf.{tag}.data"),
            ]
            self._spawn("perf", cmd, tag)
        else:
            exe = _require("py-spy")
            for name, pid in pids.items():
                if name in ("etcd", "bench client"):
                    continue
                cmd = [
                    exe,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    str(self.rate),
                    "--format",
                    "raw",
                    "--threads",
                    "-o",
                    os.path.join(self.out_dir, f"{name}.{tag}.txt"),
                ]
                # --native cannot be combined with --nonblocking (py-spy pauses the target).
                cmd.append("--native" if self.kind == "py-spy-native" else "--nonblocking")
                self._spawn(name, cmd, tag)
        time.sleep(1.0)  # let the profilers attach before the measured phase

    def _spawn(self, name: str, cmd: list[str], tag: str) -> None:
        with open(os.path.join(self.out_dir, f"{name}.{tag}.log"), "wb") as log:
            self.procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()


def _require(tool: str) -> str:
    exe = shutil.which(tool)
    if exe is None:
        raise RuntimeError(f"{tool} not found (py-spy: pip install py-spy)")
    return exe


@contextlib.contextmanager
def profiled(profiler: Profiler | None, stack: BenchStack, tag: str) -> Iterator[None]:
    if profiler is None or not profiler.wants(tag):
        yield
        return
    profiler.start(stack.pids(), tag)
    try:
        yield
    finally:
        profiler.stop()


# -- a: the etcd floor -----------------------------------------------------------

FLOOR_SESSION = "ses_" + "f" * 26
FLOOR_RUN = "run_floorbench"
EVENTS_PER_TURN = 7


def _now() -> Any:
    from google.protobuf.timestamp_pb2 import Timestamp

    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


def turn_payloads(
    session_id: str, snapshot_bytes: int
) -> tuple[bytes, list[bytes], bytes, list[bytes]]:
    """An inbox entry, 7 events, a snapshot and the 2 history entries of a
    one-step turn, as the services build them (snapshot format 2: the history
    is appended as entries of its own; `snapshot_bytes` pads the snapshot's
    agent state to model a larger bounded state)."""
    delivery_id = "dlv_" + "x" * 26
    command = s.Command(
        delivery=s.DeliveryMetadata(
            delivery_id=delivery_id, channel=CHANNEL, accepted_deployment_id=DEPLOYMENT_ID
        ),
        send=s.SendCommand(text="bench turn 123", turn_policy=s.TURN_POLICY_STEER),
    )
    entry = s.InboxEntry(seq=123, command=command, accepted_at=_now()).SerializeToString()
    kinds = [
        s.EVENT_KIND_TURN_STARTED,
        s.EVENT_KIND_MESSAGE_RECEIVED,
        s.EVENT_KIND_STEP_STARTED,
        s.EVENT_KIND_MESSAGE_COMPLETED,
        s.EVENT_KIND_STEP_COMPLETED,
        s.EVENT_KIND_TURN_COMPLETED,
        s.EVENT_KIND_SESSION_WAITING,
    ]
    events = []
    for seq, kind in enumerate(kinds, start=1000):
        event = s.Event(
            session_id=session_id,
            seq=seq,
            kind=kind,
            time=_now(),
            turn_id="turn_123",
            step=1,
            owner_run_id="run_" + "r" * 26,
            deployment_id=DEPLOYMENT_ID,
            inbox_seq=123,
            delivery_id=delivery_id,
            text="echo: bench turn 123",
            usage=s.Usage(input_tokens=40, output_tokens=4, model_calls=1),
        )
        events.append(event.SerializeToString())
    snapshot = s.SessionSnapshot(
        format_version=2,
        session_id=session_id,
        channel=CHANNEL,
        deployment_id=DEPLOYMENT_ID,
        next_event_seq=1007,
        inbox_next_seq=124,
        turn_count=123,
        hooks=[f"session:{session_id}"],
        status=s.SESSION_STATUS_ACTIVE,
        history_log=s.HistoryLog(next_index=246, context_bytes=5000),
    )
    padding = snapshot_bytes - snapshot.ByteSize()
    if padding > 0:
        snapshot.agent_state["padding"] = "p" * padding
    history = [
        s.ChatMessage(role=s.ROLE_USER, content="bench turn 123").SerializeToString(),
        s.ChatMessage(role=s.ROLE_ASSISTANT, content="echo: bench turn 123").SerializeToString(),
    ]
    return entry, events, snapshot.SerializeToString(), history


class FloorSession:
    """One session's keys on etcd, driven with the txn shapes the services use."""

    def __init__(self, store: Store, keys: Keys, session_id: str, snapshot_bytes: int) -> None:
        self.store = store
        self.keys = keys
        self.sid = session_id
        self.entry, self.events, self.snapshot, self.history = turn_payloads(
            session_id, snapshot_bytes
        )
        self.fence = fence_value(1, FLOOR_RUN)
        self.token = f"session:{session_id}"
        self.token_value = TokenRecord(session_id=session_id, channel=CHANNEL).encode()
        self.head = 0
        self.next_event = 1
        self.next_entry = 0

    async def setup(self) -> None:
        k, sid = self.keys, self.sid
        await self.store.txn(
            [],
            [
                op_put(k.fence(sid), self.fence),
                op_put(k.inbox_head(sid), b"0"),
                op_put(k.token(self.token), self.token_value),
                op_put(k.owner(sid), b'{"owner_run_id":"' + FLOOR_RUN.encode() + b'"}'),
                op_put(k.event(sid, 0), self.events[0]),
            ],
        )

    async def append(self) -> None:
        """services/hooks/inbox.py Inbox._commit_batch for one command."""
        k, sid, head = self.keys, self.sid, self.head
        delivery = f"dlv_floor_{head}"
        response = await self.store.txn(
            [
                cmp_value(k.inbox_head(sid), str(head).encode()),
                cmp_absent(k.closed(sid)),
                cmp_value(k.token(self.token), self.token_value),
                cmp_absent(k.delivery(sid, delivery)),
            ],
            [
                op_put(k.inbox_entry(sid, head), self.entry),
                op_put(k.delivery(sid, delivery), str(head).encode()),
                op_put(k.inbox_head(sid), str(head + 1).encode()),
                op_get(k.owner(sid)),
            ],
            [
                op_get(k.inbox_head(sid)),
                op_get(k.closed(sid)),
                op_get(k.owner(sid)),
                op_get(k.token(self.token)),
                op_get(k.delivery(sid, delivery)),
            ],
        )
        if not response.succeeded:
            raise RuntimeError("floor append failed its compare")
        self.head = head + 1

    async def commit(self) -> None:
        """services/anchor/journal.py commit: 7 events + 2 history entries + snapshot."""
        k, sid, first, index = self.keys, self.sid, self.next_event, self.next_entry
        response = await self.store.txn(
            [
                cmp_value(k.fence(sid), self.fence),
                cmp_absent(k.closed(sid)),
                cmp_absent(k.event(sid, first)),
                cmp_present(k.event(sid, first - 1)),
            ],
            [op_put(k.snapshot(sid), self.snapshot)]
            + [op_put(k.event(sid, first + i), raw) for i, raw in enumerate(self.events)]
            + [op_put(k.history_entry(sid, index + i), raw) for i, raw in enumerate(self.history)]
            + [op_put(k.commit_marker(sid), str(first + len(self.events) - 1).encode())],
            [
                op_get(k.fence(sid)),
                op_get(k.closed(sid)),
                op_get(k.snapshot(sid)),
                op_get(k.event(sid, first)),
            ],
        )
        if not response.succeeded:
            raise RuntimeError("floor commit failed its compare")
        self.next_event = first + len(self.events)
        self.next_entry = index + len(self.history)


async def measure_floor(
    endpoint: str, iterations: int, warmup: int, snapshot_bytes: int, security: Security
) -> dict[str, Any]:
    """Sequential append+commit txns; then the same with watches in between."""
    keys = Keys(f"{BENCH_PREFIX}floor/{uuid.uuid4().hex[:12]}/")
    store = Store(make_client(endpoint, 5.0, security), 5.0)
    await store.connect()
    try:
        session = FloorSession(store, keys, FLOOR_SESSION, snapshot_bytes)
        await session.setup()
        append, commit, both = Dist(), Dist(), Dist()
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            await session.append()
            t1 = time.perf_counter()
            await session.commit()
            t2 = time.perf_counter()
            if i >= warmup:
                append.samples.append(t1 - t0)
                commit.samples.append(t2 - t1)
                both.samples.append(t2 - t0)
        pipeline = await _floor_pipeline(
            endpoint, keys, iterations, warmup, snapshot_bytes, security
        )
        return {
            "sizes_bytes": {
                "inbox_entry": len(session.entry),
                "event_avg": round(sum(map(len, session.events)) / len(session.events)),
                "snapshot": len(session.snapshot),
            },
            "append": append,
            "commit": commit,
            "two_txns": both,
            "pipeline": pipeline,
        }
    finally:
        await store.close()


async def _floor_pipeline(
    endpoint: str,
    keys: Keys,
    iterations: int,
    warmup: int,
    snapshot_bytes: int,
    security: Security,
) -> Dist:
    """append -> inbox watch sees it -> fenced commit -> events watch sees the last event.

    Two clients, like hooks (append, inbox watch) and anchor (commit, events watch)."""
    sid = "ses_" + "p" * 26
    hooks_store = Store(make_client(endpoint, 5.0, security), 5.0)
    anchor_store = Store(make_client(endpoint, 5.0, security), 5.0)
    await hooks_store.connect()
    await anchor_store.connect()
    inbox_seen: asyncio.Queue[bytes] = asyncio.Queue()
    events_seen: asyncio.Queue[bytes] = asyncio.Queue()
    appender = FloorSession(hooks_store, keys, sid, snapshot_bytes)
    committer = FloorSession(anchor_store, keys, sid, snapshot_bytes)
    await appender.setup()
    watches: list[Any] = []
    both_started = asyncio.Event()

    async def pump(store: Store, prefix: bytes, out: asyncio.Queue[bytes]) -> None:
        watch = await create_watch(store.client, prefix)
        watches.append(watch)
        if len(watches) == 2:
            both_started.set()
        async for event in watch:
            out.put_nowait(event.kv.key)

    tasks = [
        asyncio.create_task(pump(hooks_store, keys.control_prefix(sid), inbox_seen)),
        asyncio.create_task(pump(anchor_store, keys.events_prefix(sid), events_seen)),
    ]
    try:
        await asyncio.wait_for(both_started.wait(), 10)
        await asyncio.sleep(0.1)
        dist = Dist()
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            entry_key = keys.inbox_entry(sid, appender.head)
            await appender.append()
            while await inbox_seen.get() != entry_key:
                pass
            last_key = keys.event(sid, committer.next_event + EVENTS_PER_TURN - 1)
            await committer.commit()
            while await events_seen.get() != last_key:
                pass
            if i >= warmup:
                dist.samples.append(time.perf_counter() - t0)
        return dist
    finally:
        for watch in watches:
            with contextlib.suppress(Exception):
                await watch.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await hooks_store.close()
        await anchor_store.close()


async def commit_floor_at(
    endpoint: str, iterations: int, warmup: int, snapshot_bytes: int, security: Security
) -> Dist:
    """The fenced commit alone with a snapshot of the given size."""
    keys = Keys(f"{BENCH_PREFIX}floor/{uuid.uuid4().hex[:12]}/")
    store = Store(make_client(endpoint, 5.0, security), 5.0)
    await store.connect()
    try:
        session = FloorSession(store, keys, "ses_" + "g" * 26, snapshot_bytes)
        await session.setup()
        dist = Dist()
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            await session.commit()
            if i >= warmup:
                dist.samples.append(time.perf_counter() - t0)
        return dist
    finally:
        await store.close()


# -- b and c: turns through the public API ----------------------------------------


class Follower:
    """An open following StreamEvents reader that times each turn's SESSION_WAITING.

    A turn is identified by the delivery id on its MESSAGE_RECEIVED event. For
    each turn it also records the deployment that committed its SESSION_WAITING
    (`deployment`) and, when a SESSION_HANDED_OFF event came between the
    previous turn and this one, the deployment it came from (`handed_off`)."""

    def __init__(self, stub: ingress_pb2_grpc.IngressServiceStub, session_id: str) -> None:
        self.session_id = session_id
        self.call = stub.StreamEvents(
            ingress_pb.StreamEventsRequest(session_id=session_id, start_seq=0, follow=True),
            metadata=METADATA,
        )
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self._pending: dict[str, asyncio.Future[float]] = {}
        self._current = ""
        self._handed_from: str | None = None
        self.handed_off: dict[str, str] = {}
        self.deployment: dict[str, str] = {}
        self.next_seq = 0
        self.task = loop.create_task(self._run())

    def expect(self, delivery_id: str) -> asyncio.Future[float]:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pending[delivery_id] = future
        return future

    def _observe(self, events: Sequence[s.Event], now: float) -> bool:
        """Track a batch of events; True once the stream's terminal event came."""
        for event in events:
            if event.seq != self.next_seq:
                raise RuntimeError(f"stream gap: got seq {event.seq}, wanted {self.next_seq}")
            self.next_seq += 1
            kind = event.kind
            if kind == s.EVENT_KIND_SESSION_STARTED:
                if not self.ready.done():
                    self.ready.set_result(None)
            elif kind == s.EVENT_KIND_MESSAGE_RECEIVED:
                self._current = event.delivery_id
                if self._handed_from is not None:
                    self.handed_off[self._current] = self._handed_from
                    self._handed_from = None
            elif kind == s.EVENT_KIND_SESSION_HANDED_OFF:
                self._handed_from = event.text  # the deployment it came from
            elif kind == s.EVENT_KIND_SESSION_WAITING:
                self.deployment[self._current] = event.deployment_id
                future = self._pending.pop(self._current, None)
                if future is not None and not future.done():
                    future.set_result(now)
            elif kind in (s.EVENT_KIND_SESSION_COMPLETED, s.EVENT_KIND_SESSION_FAILED):
                return True
        return False

    async def _run(self) -> None:
        error: BaseException = RuntimeError(f"stream of {self.session_id} ended")
        try:
            async for response in self.call:
                now = time.perf_counter()
                if self._observe(response.events, now):
                    break
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


async def create_session(stub: ingress_pb2_grpc.IngressServiceStub) -> str:
    response = await stub.CreateSession(
        ingress_pb.CreateSessionRequest(), metadata=METADATA, timeout=10
    )
    return str(response.session_id)


async def send_turn(
    stub: ingress_pb2_grpc.IngressServiceStub, follower: Follower, text: str, delivery_id: str
) -> tuple[float, float, ingress_pb.SendMessageResponse]:
    """(receipt latency, turn latency, receipt): send through `stub` (any
    deployment's ingress) and wait for the turn's SESSION_WAITING on `follower`."""
    waiting = follower.expect(delivery_id)
    t0 = time.perf_counter()
    response = await stub.SendMessage(
        ingress_pb.SendMessageRequest(
            session_id=follower.session_id, text=text, delivery_id=delivery_id
        ),
        metadata=METADATA,
        timeout=10,
    )
    t1 = time.perf_counter()
    done = await asyncio.wait_for(waiting, WAIT_TIMEOUT_S)
    return t1 - t0, done - t0, response


async def one_turn(
    stub: ingress_pb2_grpc.IngressServiceStub, follower: Follower, text: str, delivery_id: str
) -> tuple[float, float]:
    """(receipt latency, turn latency) in seconds."""
    receipt, turn, _ = await send_turn(stub, follower, text, delivery_id)
    return receipt, turn


async def measure_sequential(
    stub: ingress_pb2_grpc.IngressServiceStub,
    turns: int,
    warmup: int,
    on_measure_start: Callable[[], None],
) -> dict[str, Any]:
    session_id = await create_session(stub)
    follower = Follower(stub, session_id)
    try:
        await asyncio.wait_for(follower.ready, 10)
        turn, receipt, after = Dist(), Dist(), Dist()
        for i in range(warmup):
            await one_turn(stub, follower, f"warm {i}", f"w-{i}")
        on_measure_start()
        start = time.perf_counter()
        for i in range(turns):
            r, t = await one_turn(stub, follower, f"bench turn {i}", f"d-{i}")
            receipt.samples.append(r)
            turn.samples.append(t)
            after.samples.append(t - r)
        elapsed = time.perf_counter() - start
        return {
            "session_id": session_id,
            "turn": turn,
            "receipt": receipt,
            "receipt_to_waiting": after,
            "elapsed_s": elapsed,
        }
    finally:
        await follower.close()


async def open_followers(
    stub: ingress_pb2_grpc.IngressServiceStub, sessions: int, ready_timeout: float = 20.0
) -> list[Follower]:
    """`sessions` new sessions, each with a following reader open that has
    seen its SESSION_STARTED (the caller closes them)."""
    session_ids = await asyncio.gather(*(create_session(stub) for _ in range(sessions)))
    followers = [Follower(stub, sid) for sid in session_ids]
    try:
        await asyncio.wait_for(asyncio.gather(*(f.ready for f in followers)), ready_timeout)
    except BaseException:
        await asyncio.gather(*(f.close() for f in followers))
        raise
    return followers


async def run_concurrent_turns(
    stub: ingress_pb2_grpc.IngressServiceStub,
    followers: Sequence[Follower],
    total_turns: int,
    on_measure_start: Callable[[], None],
    on_measure_end: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Phase c on open followers: one warm-up turn per session, then
    `total_turns` turns shared out over the sessions, each session's back to
    back. `on_measure_start` / `on_measure_end` run right around the measured
    turns (CPU samples taken there leave out the warm-up and the teardown)."""
    sessions = len(followers)
    # Warm-up: one turn per session (creates caches, opens inbox streams).
    await asyncio.gather(*(one_turn(stub, f, "warm", f"w-{n}") for n, f in enumerate(followers)))
    shares = [
        total_turns // sessions + (1 if n < total_turns % sessions else 0) for n in range(sessions)
    ]
    latency = Dist()

    async def worker(n: int, follower: Follower, count: int) -> None:
        for i in range(count):
            _, t = await one_turn(stub, follower, f"load turn {i}", f"d-{n}-{i}")
            latency.samples.append(t)

    on_measure_start()
    start = time.perf_counter()
    await asyncio.gather(
        *(worker(n, f, c) for n, (f, c) in enumerate(zip(followers, shares, strict=True)))
    )
    elapsed = time.perf_counter() - start
    on_measure_end()
    return {
        "sessions": sessions,
        "turns": total_turns,
        "elapsed_s": elapsed,
        "turns_per_s": total_turns / elapsed,
        "turn": latency,
    }


async def measure_throughput(
    stub: ingress_pb2_grpc.IngressServiceStub,
    sessions: int,
    total_turns: int,
    on_measure_start: Callable[[], None],
    on_measure_end: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Phase c: `sessions` new sessions running `total_turns` turns (see
    `run_concurrent_turns`)."""
    followers = await open_followers(stub, sessions)
    try:
        return await run_concurrent_turns(
            stub, followers, total_turns, on_measure_start, on_measure_end
        )
    finally:
        await asyncio.gather(*(f.close() for f in followers))


async def wait_registered(hooks_addr: str, deployments: Sequence[str], security: Security) -> None:
    """Until an owner instance of every deployment is live in the registry
    (a handoff to a deployment with none is skipped)."""
    hooks = HooksClient(hooks_addr, timeout=5, security=security)
    try:
        deadline = time.monotonic() + 30
        for deployment in deployments:
            while not await hooks.list_instances(deployment):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no owner instance of {deployment} registered")
                await asyncio.sleep(0.1)
    finally:
        await hooks.close()


def _add_cpu(total: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    for name, value in after.items():
        total[name] = total.get(name, 0.0) + value - before[name]


async def measure_upgrades(
    stubs: dict[str, ingress_pb2_grpc.IngressServiceStub],
    iterations: int,
    warmup: int,
    idle_s: float,
    cpu: Callable[[], dict[str, float]],
    *,
    prelude: Sequence[str] = (),
) -> dict[str, Any]:
    """Upgrade turns on one session that alternates between the deployments.

    `prelude`: messages sent (one turn each, through the first deployment)
    before the measured loop, to give the session a history.

    Each iteration: the session is idle on deployment X; after `idle_s` a
    one-step message goes through the other deployment's ingress (the upgrade
    turn: it hands the session off), then one through the new owner's own
    ingress (the control: a same-deployment turn on the same session). Both are
    timed from the start of SendMessage to the turn's SESSION_WAITING on one
    follower opened before the loop (through the first deployment's ingress;
    the stream is the same from either). An upgrade send that did not hand off
    (it arrived before the owner was idle again after its commit, or the
    handoff was skipped) is counted in `not_handed_off`, not timed as upgrade."""
    first, second = list(stubs)
    session_id = await create_session(stubs[first])
    follower = Follower(stubs[first], session_id)
    try:
        await asyncio.wait_for(follower.ready, 10)
        for n, text in enumerate(prelude):
            await one_turn(stubs[first], follower, text, f"up-{n}")
        await one_turn(stubs[first], follower, "warm", "uw-0")
        current = follower.deployment.pop("uw-0")
        upgrade, control, receipt = Dist(), Dist(), Dist()
        by_direction: dict[str, Dist] = {}
        cpu_upgrade: dict[str, float] = {}
        cpu_control: dict[str, float] = {}
        not_handed_off = 0
        elapsed = 0.0
        for i in range(warmup + iterations):
            measured = i >= warmup
            target = second if current == first else first
            await asyncio.sleep(idle_s)
            c0 = cpu()
            t_start = time.perf_counter()
            r, t, response = await send_turn(stubs[target], follower, f"upgrade {i}", f"u-{i}")
            c1 = cpu()
            if response.accepted_deployment_id != target:
                raise RuntimeError(
                    f"ingress of {target} stamped {response.accepted_deployment_id!r}"
                )
            came_from = follower.handed_off.pop(f"u-{i}", None)
            now_on = follower.deployment.pop(f"u-{i}")
            if came_from is None or now_on != target:
                if now_on != current:
                    raise RuntimeError(f"session moved to {now_on} without a handoff event")
                not_handed_off += measured
            else:
                if came_from != current:
                    raise RuntimeError(f"handed off from {came_from}, expected {current}")
                current = now_on
                if measured:
                    upgrade.samples.append(t)
                    receipt.samples.append(r)
                    by_direction.setdefault(f"{came_from} -> {now_on}", Dist()).samples.append(t)
                    _add_cpu(cpu_upgrade, c0, c1)
            _, t, _ = await send_turn(stubs[current], follower, f"control {i}", f"c-{i}")
            c2 = cpu()
            if follower.handed_off.pop(f"c-{i}", None) is not None:
                raise RuntimeError("a same-deployment send handed the session off")
            if follower.deployment.pop(f"c-{i}") != current:
                raise RuntimeError("a same-deployment send moved the session")
            if measured:
                control.samples.append(t)
                _add_cpu(cpu_control, c1, c2)
                elapsed += time.perf_counter() - t_start
        n_up, n_ctl = max(1, len(upgrade.samples)), max(1, len(control.samples))
        return {
            "session_id": session_id,
            "iterations": iterations,
            "idle_ms": idle_s * 1000,
            "not_handed_off": not_handed_off,
            "turn": upgrade,
            "receipt": receipt,
            "by_direction": by_direction,
            "control": control,
            "elapsed_s": elapsed,
            "cpu_ms": {
                "upgrade": {n: round(v * 1000 / n_up, 3) for n, v in cpu_upgrade.items()},
                "control": {n: round(v * 1000 / n_ctl, 3) for n, v in cpu_control.items()},
            },
        }
    finally:
        await follower.close()


async def snapshot_size(endpoint: str, prefix: str, session_id: str, security: Security) -> int:
    store = Store(make_client(endpoint, 5.0, security), 5.0)
    await store.connect()
    try:
        response = await store.txn([], [op_get(Keys(prefix).snapshot(session_id))])
        value = single_value(response.responses[0])
        return len(value) if value else 0
    finally:
        await store.close()


# -- the run ----------------------------------------------------------------------


def per_turn(before: Sample, after: Sample, turns: int) -> dict[str, dict[str, float]]:
    """CPU ms and context switches per turn, by process."""
    return {
        "cpu_ms": {n: round((after[n][0] - before[n][0]) * 1000 / turns, 3) for n in before},
        "ctx_switches": {n: round((after[n][1] - before[n][1]) / turns, 1) for n in before},
    }


async def measure_floor_throughput(
    endpoint: str, sessions: int, total: int, snapshot_bytes: int, security: Security
) -> dict[str, Any]:
    """etcd alone: `sessions` concurrent append+commit pairs over one client, no watches."""
    keys = Keys(f"{BENCH_PREFIX}floor/{uuid.uuid4().hex[:12]}/")
    store = Store(make_client(endpoint, 5.0, security), 5.0)
    await store.connect()
    try:
        floor_sessions = [
            FloorSession(store, keys, "ses_" + str(n).zfill(26), snapshot_bytes)
            for n in range(sessions)
        ]
        await asyncio.gather(*(f.setup() for f in floor_sessions))
        shares = [total // sessions + (1 if n < total % sessions else 0) for n in range(sessions)]

        async def worker(session: FloorSession, count: int) -> None:
            for _ in range(count):
                await session.append()
                await session.commit()

        await asyncio.gather(*(worker(f, 2) for f in floor_sessions))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker(f, c) for f, c in zip(floor_sessions, shares, strict=True)))
        elapsed = time.perf_counter() - start
        return {
            "sessions": sessions,
            "pairs": total,
            "elapsed_s": elapsed,
            "pairs_per_s": total / elapsed,
        }
    finally:
        await store.close()


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


def load_average() -> str:
    with contextlib.suppress(OSError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "?"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "cpus": str(os.cpu_count())}
    for package in ("grpcio", "protobuf", "aetcd", "structlog"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[package] = metadata.version(package)
    # The etcd release started (find_etcd's choice), not a wheel's version.
    with contextlib.suppress(EtcdRefused):
        out["etcd"] = str(find_etcd().version)
    return out


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
        with profiled(profiler, stack, "latency"):
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
                with profiled(profiler, stack, "upgrade"):
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
        with profiled(profiler, stack, "throughput"):
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
    if base_cpu * out["turns_each"] / 1000 * _CLK_TCK < MIN_CPU_TICKS:
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
