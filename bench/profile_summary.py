"""Summarise py-spy raw (collapsed) stacks written by `bench.turn_latency --py-spy DIR`.

    python -m bench.profile_summary DIR [--top 25] [--match throughput]

For each file: the hottest functions by self samples (the leaf frame) and by
inclusive samples (anywhere on the stack), as % of the process's non-idle
samples, plus a coarse split by library (grpc, protobuf, aetcd, structlog,
asyncio, Baton code).

`perf.<phase>.data` files (from `--profiler perf`) are summarised too: the share
of every process (named via `pids.<phase>.json`), split by thread and by shared
object of the sampled instruction (kernel, libpython, cygrpc, protobuf, etcd).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence

_LINE = re.compile(r":\d+\)$")

# (bucket, substring of a frame's file); the first match from the leaf wins.
BUCKETS: tuple[tuple[str, str], ...] = (
    ("structlog", "structlog/"),
    ("aetcd", "aetcd/"),
    ("protobuf", "google/protobuf/"),
    ("protobuf", "protobuf/"),
    ("grpc", "grpc/"),
    ("grpc", "_cygrpc"),
    ("baton code", "services/"),
    ("baton code", "baton/"),
    ("asyncio", "asyncio/"),
    ("asyncio", "selectors.py"),
)


def function_of(frame: str) -> str:
    """`name (path:line)` -> `name (path)`."""
    return _LINE.sub(")", frame.strip())


def bucket_of(stack: list[str]) -> str:
    for frame in reversed(stack):
        for name, needle in BUCKETS:
            if needle in frame:
                return name
    return "other"


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            frames, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            stacks.append((frames.split(";"), int(count)))
    return stacks


def summarise(path: str, top: int) -> str:
    stacks = read_stacks(path)
    total = sum(count for _, count in stacks)
    if not total:
        return f"{path}: no samples"
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    buckets: Counter[str] = Counter()
    for frames, count in stacks:
        names = [function_of(f) for f in frames]
        self_counts[names[-1]] += count
        for name in set(names):
            incl_counts[name] += count
        buckets[bucket_of(frames)] += count
    lines = [f"== {os.path.basename(path)}: {total} samples", "  by library (leaf-most match):"]
    lines += [f"    {100 * c / total:5.1f}%  {name}" for name, c in buckets.most_common()]
    lines.append(f"  top {top} self:")
    lines += [f"    {100 * c / total:5.1f}%  {name}" for name, c in self_counts.most_common(top)]
    lines.append(f"  top {top} inclusive (excluding the event loop's own frames):")
    shown = 0
    for name, c in incl_counts.most_common():
        if _is_scaffolding(name):
            continue
        lines.append(f"    {100 * c / total:5.1f}%  {name}")
        shown += 1
        if shown >= top:
            break
    lines.append("  Baton code (services/), inclusive:")
    shown = 0
    for name, c in incl_counts.most_common():
        if "(services/" not in name or _is_scaffolding(name):
            continue
        lines.append(f"    {100 * c / total:5.1f}%  {name}")
        shown += 1
        if shown >= top:
            break
    return "\n".join(lines)


def _is_scaffolding(name: str) -> bool:
    return any(
        needle in name
        for needle in (
            "<frozen runpy>",
            "__main__.py",
            "run_main (",
            "asyncio/runners.py",
            "run_until_complete",
            "run_forever",
            "_run_once",
            "Handle._run",
            "<module>",
            "thread (",
            "process ",
        )
    )


_PERF_HEADER = re.compile(r"\s*(\S+)\s+(\d+)/(\d+)")
_PERF_FRAME = re.compile(r"\s[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")


def summarise_perf(data_path: str, pids_path: str) -> str:
    """Share of each process, by thread and by the leaf frame's shared object."""
    perf = shutil.which("perf")
    if perf is None:
        return f"{data_path}: perf not found"
    with open(pids_path) as f:
        name_of = {pid: name for name, pid in json.load(f).items()}
    script = subprocess.run(
        [perf, "script", "-i", data_path, "-F", "pid,tid,comm,ip,sym,dso"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    procs: Counter[str] = Counter()
    threads: Counter[tuple[str, str]] = Counter()
    objects: Counter[tuple[str, str]] = Counter()
    for block in script.split("\n\n"):
        lines = [line for line in block.split("\n") if line.strip()]
        header = _PERF_HEADER.match(lines[0]) if lines else None
        if header is None:
            continue
        comm, pid, tid = header.group(1), int(header.group(2)), int(header.group(3))
        proc = name_of.get(pid, f"other ({comm})")
        procs[proc] += 1
        threads[(proc, "main" if pid == tid else comm)] += 1
        frame = _PERF_FRAME.search(lines[1]) if len(lines) > 1 else None
        dso = frame.group(2).rsplit("/", 1)[-1] if frame else "?"
        objects[(proc, "kernel" if "kernel" in dso else dso)] += 1
    total = sum(procs.values())
    if not total:
        return f"{data_path}: no samples"
    out = [f"== {os.path.basename(data_path)}: {total} samples (all processes)"]
    for proc, count in procs.most_common():
        out.append(f"  {100 * count / total:5.1f}%  {proc}")
        out += [
            f"           thread {100 * c / total:5.1f}%  {t}"
            for (p, t), c in threads.most_common()
            if p == proc and c / total >= 0.003
        ]
        out += [
            f"           object {100 * c / total:5.1f}%  {d}"
            for (p, d), c in objects.most_common()
            if p == proc and c / total >= 0.003
        ]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_summary")
    parser.add_argument("dir")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", default="", help="only files whose name contains this")
    args = parser.parse_args(argv)
    names = sorted(os.listdir(args.dir))
    files = [f for f in names if f.endswith(".txt") and args.match in f]
    perf_files = [
        f for f in names if f.startswith("perf.") and f.endswith(".data") and args.match in f
    ]
    if not files and not perf_files:
        print(f"no py-spy or perf files in {args.dir}", file=sys.stderr)
        return 1
    for name in files:
        print(summarise(os.path.join(args.dir, name), args.top))
        print()
    for name in perf_files:
        tag = name.removeprefix("perf.").removesuffix(".data")
        print(
            summarise_perf(os.path.join(args.dir, name), os.path.join(args.dir, f"pids.{tag}.json"))
        )
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
