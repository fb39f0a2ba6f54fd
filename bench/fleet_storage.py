"""What a fleet of quiet sessions costs etcd with the object store on (issue 34).

    python -m bench.fleet_storage [--sessions 2000] [--turns 100]
                                  [--concurrency 16] [--seal-idle 5]
                                  [--json PATH] [--smoke]

One stack as `bench.turn_latency` starts it (etcd with TLS and auth, every
service its own process), anchor sealing into a file:// object store in the
run's log dir, at its default stream retention. The bench plays the owners
of a deployment without processes (so nobody else touches the sessions):
it creates `--sessions` sessions through hooks and commits `--turns` turns
to each through anchor, each turn shaped as a one-step echo turn's commit
(7 events of an echo turn's size, 2 history entries, the snapshot),
`--concurrency` sessions at a time. Then it waits until every session is
sealed whole (quiet for `--seal-idle`: the stream's last event and no
history entry left in etcd) and reads etcd: the keys and key+value bytes
under the stack's prefix, and `dbSizeInUse` after compacting at the head,
against the same before the sessions existed.

Reported: per session, the keys, key and value bytes, and etcd bytes in use;
the sessions one 8 GiB etcd would hold at that figure (and at half of it,
the headroom docs/storage.md advises for compaction windows and
fragmentation). Target: at least 500,000 in 8 GiB.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from aetcd import rpc

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.keys import prefix_end
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.security.identity import Role
from baton_runtime.owner.rules.held import RunIdentity, make_event
from baton_runtime.owner.run.snapshots import initial_snapshot
from bench.common import apply_smoke, log_dir, progress, write_json
from bench.floor import ONE_STEP_KINDS
from bench.measure import load_average
from bench.stack import BenchStack

GIB8 = 8 * 1024**3
TARGET_SESSIONS = 500_000
# A deployment without processes: the bench is its only owner.
PLAYED = "bench-dep-w"


class PlayedOwner:
    """Creates sessions and commits turns to them, as an owner of PLAYED."""

    def __init__(self, stack: BenchStack) -> None:
        security = stack.security(Role.OWNER, PLAYED)
        self.hooks = HooksClient(stack.addrs["hooks"], timeout=30, security=security)
        self.anchor = AnchorClient(stack.addrs["anchor"], timeout=30, security=security)

    async def close(self) -> None:
        await self.hooks.close()
        await self.anchor.close()

    async def session(self, turns: int) -> None:
        sid = ids.new_session_id()
        owner = s.OwnerIdentity(owner_run_id=f"run_{sid[4:]}", deployment_id=PLAYED)
        owner.instance_id = "w1"
        created = await self.hooks.create_session(sid, owner, "slack", [])
        identity = RunIdentity(created.fence, PLAYED, "w1")
        snapshot = initial_snapshot(sid, "slack", PLAYED, list(created.hooks))
        started = make_event(identity, s.EVENT_KIND_SESSION_STARTED)
        snapshot.next_event_seq = 1
        revision = (
            await self.anchor.commit(
                anchor_pb.CommitStepRequest(
                    fence=created.fence,
                    events=[started],
                    snapshot=snapshot,
                    expected_snapshot_revision=0,
                )
            )
        ).revision
        for turn in range(turns):
            events = [make_event(identity, kind) for kind in ONE_STEP_KINDS]
            for offset, event in enumerate(events):
                event.seq = snapshot.next_event_seq + offset
                event.turn_id = f"turn_{turn}"
                if event.kind in (s.EVENT_KIND_MESSAGE_RECEIVED, s.EVENT_KIND_MESSAGE_COMPLETED):
                    event.text = f"echo: hi {turn}"
            history = [
                s.ChatMessage(role=s.ROLE_USER, content=f"hi {turn}"),
                s.ChatMessage(role=s.ROLE_ASSISTANT, content=f"echo: hi {turn}"),
            ]
            snapshot.next_event_seq += len(events)
            log = snapshot.history_log
            log.next_index += len(history)
            log.context_bytes += sum(m.ByteSize() for m in history)
            revision = (
                await self.anchor.commit(
                    anchor_pb.CommitStepRequest(
                        fence=created.fence,
                        events=events,
                        snapshot=snapshot,
                        history=history,
                        expected_snapshot_revision=revision,
                    )
                )
            ).revision


async def footprint(store: Store, prefix: bytes) -> dict[str, int]:
    """Keys and key+value bytes under `prefix` (in pages), and etcd's bytes
    in use once compacted at the head."""
    keys = kv_bytes = 0
    start, end = prefix, prefix_end(prefix)
    events = entries = 0
    while True:
        page = await Txn().read("kvs", start, end, limit=5000).run(store)
        kvs = page.kvs("kvs")
        for kv in kvs:
            keys += 1
            kv_bytes += len(kv.key) + len(kv.value)
            events += b"/ev/" in kv.key
            entries += b"/h/" in kv.key
        if not page.more("kvs"):
            break
        start = kvs[-1].key + b"\0"
    client = store.client
    status = await client.maintenancestub.Status(rpc.StatusRequest(), timeout=10)
    await client.kvstub.Compact(
        rpc.CompactionRequest(revision=status.header.revision, physical=True), timeout=120
    )
    await asyncio.sleep(1.0)  # the backend commits its freed pages every 100 ms
    compacted = await client.maintenancestub.Status(rpc.StatusRequest(), timeout=10)
    return {
        "keys": keys,
        "kv_bytes": kv_bytes,
        "event_keys": events,
        "history_keys": entries,
        "db_size": int(compacted.dbSize),
        "db_size_in_use": int(compacted.dbSizeInUse),
    }


async def run(args: argparse.Namespace, logs: str) -> dict[str, Any]:
    stack = BenchStack(
        log_dir=logs,
        second_deployment=False,
        env={
            "BATON_OBJECT_STORE": f"file://{logs}/objects",
            "BATON_SEAL_IDLE": str(args.seal_idle),
        },
    )
    results: dict[str, Any] = {"load_start": load_average(), "args": vars(args)}
    stack.start()
    assert stack.etcd is not None
    store = Store(make_client(stack.etcd.endpoint, 30.0, stack.etcd_security), 30.0)
    await store.connect()
    owner = PlayedOwner(stack)
    prefix = stack.prefix.encode()
    try:
        results["before"] = await footprint(store, prefix)
        progress(f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} at a time")
        started = time.monotonic()
        queue: asyncio.Queue[int] = asyncio.Queue()
        for n in range(args.sessions):
            queue.put_nowait(n)

        async def worker() -> None:
            while not queue.empty():
                n = queue.get_nowait()
                await owner.session(args.turns)
                if (n + 1) % max(args.sessions // 10, 1) == 0:
                    progress(f"{n + 1} sessions written")

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        results["write_seconds"] = round(time.monotonic() - started, 1)
        progress("waiting for every session to be sealed whole")
        deadline = time.monotonic() + args.seal_idle + 600
        while True:
            now = await footprint(store, prefix)
            if now["event_keys"] <= args.sessions and now["history_keys"] == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not sealed within the deadline: {now}")
            await asyncio.sleep(2.0)
        results["sealed_after_s"] = round(time.monotonic() - started, 1)
        results["after"] = now
        stack.check_alive()
    finally:
        await owner.close()
        await store.close()
        stack.stop()
    before, after = results["before"], results["after"]
    n = args.sessions
    per = {
        "keys": (after["keys"] - before["keys"]) / n,
        "kv_bytes": (after["kv_bytes"] - before["kv_bytes"]) / n,
        "db_in_use_bytes": (after["db_size_in_use"] - before["db_size_in_use"]) / n,
    }
    results["per_session"] = per
    results["sessions_in_8gib"] = GIB8 / per["db_in_use_bytes"]
    results["sessions_in_8gib_half"] = GIB8 / 2 / per["db_in_use_bytes"]
    results["objects"] = sum(len(files) for _, _, files in os.walk(f"{logs}/objects"))
    results["load_end"] = load_average()
    return results


def report(results: dict[str, Any]) -> str:
    args = results["args"]
    per = results["per_session"]
    before, after = results["before"], results["after"]
    half = results["sessions_in_8gib_half"]
    lines = [
        f"load average at start {results['load_start']}, at end {results['load_end']}",
        f"{args['sessions']} sessions x {args['turns']} one-step turns (written in "
        f"{results['write_seconds']} s, every one sealed whole {results['sealed_after_s']} s "
        f"after the first commit); {results['objects']} objects in the store",
        f"etcd under the stack's prefix: {before['keys']} -> {after['keys']} keys, "
        f"{before['kv_bytes']} -> {after['kv_bytes']} key and value bytes; dbSizeInUse "
        f"(compacted) {before['db_size_in_use']} -> {after['db_size_in_use']}",
        f"per session: {per['keys']:.1f} keys, {per['kv_bytes']:.0f} key and value bytes, "
        f"{per['db_in_use_bytes']:.0f} bytes of etcd's database in use",
        f"sessions in 8 GiB: {results['sessions_in_8gib']:,.0f} "
        f"(with half of it kept free: {half:,.0f})",
        "",
        "  targets",
        f"    {'PASS' if half >= TARGET_SESSIONS else 'FAIL'}  sessions in 8 GiB, half free, "
        f">= {TARGET_SESSIONS:,}   measured {half:,.0f}",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_storage", description=__doc__)
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=100, help="turns per session")
    parser.add_argument("--concurrency", type=int, default=16, help="sessions written at once")
    parser.add_argument(
        "--seal-idle", type=float, default=5.0, help="anchor's --seal-idle (seconds)"
    )
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: checks it runs")
    args = parser.parse_args(argv)
    apply_smoke(parser, args, {"sessions": 20, "turns": 20, "seal_idle": 1.0})
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with log_dir(args.log_dir, "baton-bench-fleet-storage-") as logs:
        results = asyncio.run(run(args, os.path.abspath(logs)))
    print(report(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
