"""A 100,000-event stream read from cursor 0 by a slow reader, through real
anchor and ingress processes: the reader sees every event once, in order,
and neither serving process holds the stream in memory (anchor reads it in
pages; gRPC flow control paces both hops). The figures are printed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.security.identity import Role
from baton_runtime.owner.rules.held import RunIdentity, make_event
from baton_runtime.owner.run.snapshots import initial_snapshot
from tests.procs import SLACK, ProcessStack
from tests.stack import public_channel

EVENTS = 100_000
PER_COMMIT = 100
# Far below what holding the stream would take (100,000 parsed events are
# well over 100 MB of Python objects in a process).
MAX_GROWTH_BYTES = 48 * 1024 * 1024


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def write_stream(stack: ProcessStack, session_id: str) -> None:
    """Play an owner of dep-w (a deployment without processes, so nobody takes
    the session over): create the session and commit EVENTS events."""
    as_w = stack.security(Role.OWNER, "dep-w")
    hooks = HooksClient(stack.addr("hooks"), timeout=5, security=as_w)
    anchor = AnchorClient(stack.addr("anchor"), timeout=5, security=as_w)
    try:
        owner = s.OwnerIdentity(owner_run_id="run_w1", deployment_id="dep-w", instance_id="w1")
        created = await hooks.create_session(session_id, owner, "slack", [])
        identity = RunIdentity(created.fence, "dep-w", "w1")
        snapshot = initial_snapshot(session_id, "slack", "dep-w", list(created.hooks))
        revision = 0
        for first in range(0, EVENTS, PER_COMMIT):
            kind = s.EVENT_KIND_SESSION_STARTED if first == 0 else s.EVENT_KIND_MESSAGE_COMPLETED
            events = [
                make_event(
                    identity,
                    kind if i == 0 else s.EVENT_KIND_MESSAGE_COMPLETED,
                    now=time.time(),
                )
                for i in range(PER_COMMIT)
            ]
            for offset, event in enumerate(events):
                event.seq = first + offset
                if event.kind == s.EVENT_KIND_MESSAGE_COMPLETED:
                    event.text = f"event {event.seq} " + "w" * 64
            snapshot.next_event_seq = first + PER_COMMIT
            response = await anchor.commit(
                anchor_pb.CommitStepRequest(
                    fence=created.fence,
                    events=events,
                    snapshot=snapshot,
                    expected_snapshot_revision=revision,
                )
            )
            revision = response.revision
    finally:
        await hooks.close()
        await anchor.close()


async def test_a_100k_event_stream_read_slowly_from_zero(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    stack = ProcessStack(etcd_endpoint, tmp_path).start(owners=1)
    try:
        sid = ids.new_session_id()
        started = time.monotonic()
        await write_stream(stack, sid)
        wrote = time.monotonic() - started
        assert stack.anchor is not None and stack.ingress is not None
        pids = {"anchor": stack.anchor.pid, "ingress": stack.ingress.pid}
        base = {name: rss(pid) for name, pid in pids.items()}
        peak = dict(base)
        async with public_channel(stack.addr("ingress")) as channel:
            stub = ingress_pb2_grpc.IngressServiceStub(channel)
            call = stub.StreamEvents(
                ingress_pb.StreamEventsRequest(session_id=sid, follow=True), metadata=SLACK
            )
            seqs: list[int] = []
            messages = 0
            started = time.monotonic()
            async for response in call:
                messages += 1
                seqs.extend(e.seq for e in response.events)
                if messages % 25 == 0:
                    for name, pid in pids.items():
                        peak[name] = max(peak[name], rss(pid))
                if len(seqs) >= EVENTS:
                    break
                await asyncio.sleep(0.002)  # a slow reader: the servers must wait for it
            call.cancel()
            read = time.monotonic() - started
        assert seqs == list(range(EVENTS)), "an event was lost, repeated or reordered"
        growth = {name: peak[name] - base[name] for name in pids}
        print(
            f"wrote {EVENTS} events in {wrote:.1f}s; read them in {messages} messages in "
            f"{read:.1f}s; RSS growth while reading: "
            + ", ".join(
                f"{n} {g / 1e6:.1f} MB (from {base[n] / 1e6:.0f})" for n, g in growth.items()
            )
        )
        for name, grew in growth.items():
            assert grew < MAX_GROWTH_BYTES, f"{name} grew {grew / 1e6:.0f} MB"
    finally:
        stack.stop()
