"""What every benchmark measures alike: latency samples (`Dist`), the CPU
seconds and context switches of a process (from /proc), per-turn costs
between two samples, the machine's load and versions, and an optional
profiler (py-spy or perf) attached to a stack's processes for one phase."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata

from baton_runtime.cli.system.etcd_binary import EtcdRefused, find_etcd

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


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


def per_turn(before: Sample, after: Sample, turns: int) -> dict[str, dict[str, float]]:
    """CPU ms and context switches per turn, by process."""
    return {
        "cpu_ms": {n: round((after[n][0] - before[n][0]) * 1000 / turns, 3) for n in before},
        "ctx_switches": {n: round((after[n][1] - before[n][1]) / turns, 1) for n in before},
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


# -- profiling -------------------------------------------------------------------


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
def profiled(
    profiler: Profiler | None, pids: Callable[[], Mapping[str, int]], tag: str
) -> Iterator[None]:
    """`profiler` attached to the processes `pids` names during the block,
    if it profiles phase `tag`."""
    if profiler is None or not profiler.wants(tag):
        yield
        return
    profiler.start(dict(pids()), tag)
    try:
        yield
    finally:
        profiler.stop()
