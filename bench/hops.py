"""The hop map: every gRPC message between Baton processes and every etcd
request and watch event of six paths, counted on a real stack.

    python -m bench.hops            # count, print the table and the diff to docs/hops.json
    python -m bench.hops --write    # count and rewrite docs/hops.json and docs/hops.md

Starts a TLS etcd and real processes, each serving its metrics: hooks,
anchor, owners a1 and a2 of deployment dep-a (ingress ing-a), owner b1 of
dep-b (ingress ing-b), and owner p1 of dep-p (ingress ing-p), the only one
that parks sessions (idle PARK_AFTER seconds: no park lands in another
path's window, and the wake's session parks again only after its window). Each
path runs between two scrapes of every process and is the difference of the
counters (README "Metrics"):

- a gRPC call between Baton processes is counted by its caller
  (`baton_rpc_client_handled_total`, one request and one answer) and the
  messages of a server stream by their receiver
  (`baton_rpc_client_stream_messages_received_total`); the public edge (this
  process calling ingress) by ingress as a server;
- etcd requests by hooks and anchor, by kind (`baton_etcd_txn_seconds_count`:
  txn_write, txn_read - Baton's ranges are read-only txns -, lease_*), watch
  creations and the watch responses and events they received.

What varies with time rather than with the path is left out (BACKGROUND;
printed per window, never written): lease keep-alives of the owners' instance
leases (KeepAliveInstance, lease_keepalive), store health's alarm checks, an
ingress' orphan-liveness rechecks, and the read a hooks scrape does for
`baton_live_instances` (one per scrape, measured first and subtracted);
owners' reconciliation and anchor's sweeps are stretched past the run. The
counts settle before the second scrape: the non-hooks processes are scraped
until two scrapes agree.

This process is the client of the public API only: it follows each session
through ingress (StreamEvents, opened before the first scrape) and never calls
hooks or anchor inside a measured window. tests/test_hops.py runs the same
paths and compares them with docs/hops.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.owner.v1 import owner_pb2
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.service_launcher import start_etcd
from baton_runtime.cli.system.service_stack import ServiceStack
from baton_runtime.common.security.pki import LocalPki
from bench.scrape import Scrape, scrape
from bench.stack import (
    BENCH_PREFIX,
    METADATA,
    bench_pki,
    bench_service_stack,
    eventually,
    public_channel,
)

K = s.EventKind
DOCS = Path(__file__).resolve().parent.parent / "docs"
JSON_PATH = DOCS / "hops.json"
MD_PATH = DOCS / "hops.md"
# The wake's session parks again PARK_AFTER after its turn: its window must
# have settled by then, which took more than 5 s on a loaded machine.
PARK_AFTER = 10.0
# Each owner lists its own index every reconcile interval (services/owner/
# fleet.py): one ListInstanceSessions and its read in hooks, at any time. The
# hop stack stretches the interval past the run; docs/hops.md lists the cost.
RECONCILE_INTERVAL = 3600
# Anchor's retention and stream-horizon sweeps read etcd every sweep interval
# (services/anchor/retention.py, horizon.py), and anchor seals a session
# quiet for its seal idle time (services/anchor/segments/): stretched the same
# way.
RETENTION_SWEEP = 3600
UNANSWERED_SWEEP = 3600  # hooks' sweep for baton_oldest_unanswered_seconds
PATHS = (
    "one_step_turn",
    "steered_turn",
    "subagent_turn",
    "upgrade_turn",
    "wake_from_parking",
    "takeover",
)
# Counted, but by time rather than by path (see the module docstring).
BACKGROUND = (
    "rpc owner -> hooks KeepAliveInstance",
    "etcd hooks lease_keepalive",
    "etcd hooks alarm",
    "etcd anchor alarm",
    # hooks puts delivery ids under a lease of the current time bucket
    # (dedupe window / 16) and grants one at each bucket's first append.
    "etcd hooks lease_grant",
    # An ingress that accepted a command for a session of another deployment
    # checks that deployment is still live right after and again 3, 10 and
    # 30 s later, cached for 2 s (services/ingress/orphans.py): these land in
    # whichever window runs then, each one read in hooks (subtracted, see
    # `orphan_checks`).
    "rpc ingress -> hooks ListInstances",
    # A multiplexed stream (an owner's CommitSteps to anchor, a ResumeHooks
    # of an ingress or an owner to hooks, an owner's FollowInboxes, a
    # FollowEvents of an ingress or an owner to anchor) opens
    # once per process and lane, at its first use, and stays open: whichever
    # path uses it first on a process sees it (opening sends headers only).
    "open owner -> anchor CommitSteps",
    "open owner -> hooks ResumeHooks",
    "open ingress -> hooks ResumeHooks",
    "open owner -> hooks FollowInboxes",
    "open ingress -> anchor FollowEvents",
    "open owner -> anchor FollowEvents",
    # (an owner's live items ride one PublishLive stream per anchor replica)
    "open owner -> anchor PublishLive",
    "served hooks ListInstances",
)
_SERVED_LIST = BACKGROUND[-1]


def orphan_checks(diff: Counts) -> int:
    """The ingress' liveness checks hooks served in a window: the
    ListInstances calls it served less the owners' (which are path hops).
    Counted by hooks as it answers, right after its read: the ingress' own
    count, at the answer's arrival, could miss one at a window's end."""
    return diff.get(_SERVED_LIST, 0) - diff.get("rpc owner -> hooks ListInstances", 0)


_INGRESSES = ("ing-a", "ing-b", "ing-p")
_ROLE = {"hooks": "hooks", "anchor": "anchor", **{i: "ingress" for i in _INGRESSES}}
_OWNERS = ("a1", "a2", "b1", "p1")
# The order the paths run in: the wake last, as its session's first park
# takes PARK_AFTER (the takeover kills a1 and leaves p1 alone).
RUN_ORDER = (
    "one_step_turn",
    "steered_turn",
    "subagent_turn",
    "upgrade_turn",
    "takeover",
    "wake_from_parking",
)
_ETCD_COUNTERS = {
    "baton_etcd_watches_created_total": "watch_create",
    "baton_etcd_watch_responses_total": "watch_responses",
    "baton_etcd_watch_events_total": "watch_events",
}

Counts = dict[str, int]

# Server-streaming methods: their calls are counted when opened ("open", one
# message) and their messages as received ("stream"); their ends ("end", with
# the code) are no messages.
STREAMING = frozenset(
    f"/{service.full_name}/{method.name}"
    for module in (anchor_pb2, hooks_pb2, owner_pb2, ingress_pb)
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
    if method.server_streaming
)


def role(process: str) -> str:
    return _ROLE.get(process, "owner")


def _method(full: str) -> str:
    return full.rsplit("/", 1)[-1]


def counts_of(process: str, scraped: Scrape) -> Counts:
    """What one process's scrape says, as hop-map keys."""
    me = role(process)
    out: Counts = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0) + int(round(value))

    for sample in scraped.samples:
        labels = sample.labels
        if sample.name == "baton_rpc_client_handled_total":
            code = "" if labels["code"] == "OK" else f" [{labels['code']}]"
            kind = "end" if labels["method"] in STREAMING else "rpc"
            add(
                f"{kind} {me} -> {labels['target']} {_method(labels['method'])}{code}", sample.value
            )
        elif sample.name == "baton_rpc_client_streams_opened_total":
            add(f"open {me} -> {labels['target']} {_method(labels['method'])}", sample.value)
        elif sample.name == "baton_rpc_client_stream_messages_received_total":
            add(f"stream {labels['target']} -> {me} {_method(labels['method'])}", sample.value)
        elif sample.name == "baton_rpc_client_stream_messages_sent_total":
            add(f"send {me} -> {labels['target']} {_method(labels['method'])}", sample.value)
        elif me == "ingress" and labels.get("method", "").startswith("/baton.ingress."):
            if sample.name == "baton_rpc_server_handled_total":
                code = "" if labels["code"] == "OK" else f" [{labels['code']}]"
                add(f"edge client -> ingress {_method(labels['method'])}{code}", sample.value)
            elif sample.name == "baton_rpc_server_stream_messages_sent_total":
                add(f"edge ingress -> client {_method(labels['method'])}", sample.value)
        elif (
            me == "hooks"
            and sample.name == "baton_rpc_server_handled_total"
            and labels["method"].endswith("/ListInstances")
        ):
            add(_SERVED_LIST, sample.value)
        elif sample.name == "baton_etcd_txn_seconds_count":
            add(f"etcd {me} {labels['op']}", sample.value)
        elif sample.name in _ETCD_COUNTERS:
            add(f"etcd {me} {_ETCD_COUNTERS[sample.name]}", sample.value)
    return out


def combined(per_process: dict[str, Counts]) -> Counts:
    out: Counts = {}
    for counts in per_process.values():
        for key, value in counts.items():
            out[key] = out.get(key, 0) + value
    return out


def difference(after: Counts, before: Counts) -> Counts:
    keys = sorted(set(after) | set(before))
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)
    }


def split(counts: Counts) -> tuple[Counts, Counts]:
    """(the path's own counts, the background's)."""
    own = {k: v for k, v in counts.items() if k not in BACKGROUND}
    background = {k: v for k, v in counts.items() if k in BACKGROUND}
    return own, background


def messages(counts: Counts) -> int:
    """gRPC messages between Baton processes: two per unary call (request
    and answer), one per stream opened (its request), one per stream message
    received, one per message sent on a multiplexed stream."""
    total = 0
    for key, value in counts.items():
        if key.startswith("rpc "):
            total += 2 * value
        elif key.startswith(("open ", "stream ", "send ")):
            total += value
    return total


def etcd_requests(counts: Counts) -> int:
    """etcd requests by hooks and anchor: transactions, reads, lease calls and
    watch creations (watch responses are etcd's messages, not requests)."""
    return sum(
        v
        for k, v in counts.items()
        if k.startswith("etcd ") and not k.endswith(("watch_responses", "watch_events"))
    )


# -- the stack and the client ------------------------------------------------------


class Follower:
    """A StreamEvents reader of one session through an ingress (the public
    API): every event it has seen, and a way to wait for one."""

    def __init__(self, stub: ingress_pb2_grpc.IngressServiceStub, session_id: str) -> None:
        self.events: list[s.Event] = []
        self._changed = asyncio.Event()
        self._call = stub.StreamEvents(
            ingress_pb.StreamEventsRequest(session_id=session_id, follow=True), metadata=METADATA
        )
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            async for page in self._call:
                self.events.extend(page.events)
                self._changed.set()
        except grpc.aio.AioRpcError:
            pass

    async def wait(
        self, done: Callable[[list[s.Event]], bool], what: str, within: float = 30
    ) -> None:
        deadline = time.monotonic() + within
        while not done(self.events):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._task.done():
                raise AssertionError(f"timed out waiting for {what}: {self.kinds()[-12:]}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass

    def kinds(self) -> list[str]:
        return [K.Name(e.kind) for e in self.events]

    async def close(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def waiting_after(count: int) -> Callable[[list[s.Event]], bool]:
    """The session waits for the `count`th time."""
    return lambda events: sum(e.kind == K.EVENT_KIND_SESSION_WAITING for e in events) >= count


@dataclass
class HopRun:
    """The stack, its public clients, and the counting."""

    stack: ServiceStack
    channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    ingress: dict[str, ingress_pb2_grpc.IngressServiceStub] = field(default_factory=dict)
    scrape_read: int = 0  # the etcd reads one hooks scrape does (measured)
    sent: int = 0

    @classmethod
    def start(cls, etcd_endpoint: str, workdir: Path, pki: LocalPki, prefix: str) -> HopRun:
        stack = bench_service_stack(
            etcd_endpoint,
            workdir,
            pki,
            prefix=prefix,
            deployment_id="dep-a",
            serve_metrics=True,
            owner_env={"BATON_OWNER_RECONCILE_INTERVAL": str(RECONCILE_INTERVAL)},
            anchor_env={
                "BATON_RETENTION_SWEEP": str(RETENTION_SWEEP),
                "BATON_SEAL_IDLE": str(RETENTION_SWEEP),
            },
            env={"BATON_UNANSWERED_SWEEP": str(UNANSWERED_SWEEP)},
        )
        stack.start_deployments(
            owners={"a1": ("dep-a", ""), "a2": ("dep-a", "")},
            ingresses={"ing-a": ("dep-a", "a1")},
        )
        stack.start_owner("b1", deployment_id="dep-b")
        stack.start_owner(
            "p1", deployment_id="dep-p", env={"BATON_OWNER_PARK_AFTER": str(PARK_AFTER)}
        )
        stack.start_ingress("ing-b", "dep-b", ["b1"])
        stack.start_ingress("ing-p", "dep-p", ["p1"])
        run = cls(stack)
        for name in _INGRESSES:
            run.channels[name] = public_channel(stack.addr(name), pki)
            run.ingress[name] = ingress_pb2_grpc.IngressServiceStub(run.channels[name])
        return run

    @property
    def processes(self) -> list[str]:
        return ["hooks", "anchor", *_INGRESSES, *(o for o in _OWNERS if self.alive(o))]

    def alive(self, process: str) -> bool:
        proc = self.stack.owners.get(process)
        return proc is not None and proc.proc is not None and proc.proc.poll() is None

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        self.stack.stop()

    async def wait_registered(self) -> None:
        from baton_runtime.common.clients.hooks import HooksClient

        hooks = HooksClient(self.stack.addr("hooks"), timeout=5, security=self.stack.probe)
        try:
            deployments = (("dep-a", {"a1", "a2"}), ("dep-b", {"b1"}), ("dep-p", {"p1"}))
            for deployment, want in deployments:

                async def registered(d: str = deployment, w: set[str] = want) -> bool:
                    return w <= {i.instance_id for i in await hooks.list_instances(d)}

                await eventually(registered, f"{deployment}'s owners registered")
        finally:
            await hooks.close()

    async def scrape(self, names: list[str]) -> dict[str, Scrape]:
        got = await asyncio.gather(*(scrape(self.stack.metrics_url(n)) for n in names))
        return dict(zip(names, got, strict=True))

    async def counts(self, names: list[str]) -> dict[str, Counts]:
        return {n: counts_of(n, scraped) for n, scraped in (await self.scrape(names)).items()}

    async def calibrate(self) -> None:
        """How many etcd reads one hooks scrape does itself (its refresh)."""
        first = (await self.counts(["hooks"]))["hooks"]
        second = (await self.counts(["hooks"]))["hooks"]
        self.scrape_read = difference(second, first).get("etcd hooks txn_read", 0)

    async def settled(self, within: float = 10.0) -> dict[str, Counts]:
        """Counts of every live process once the processes other than hooks
        agree twice in a row (minus the background); hooks last, once (each
        hooks scrape reads etcd itself)."""
        others = [n for n in self.processes if n != "hooks"]
        last: Counts | None = None
        deadline = time.monotonic() + within
        while True:
            await asyncio.sleep(0.3)
            counted = await self.counts(others)
            now, _ = split(combined(counted))
            if now == last or time.monotonic() > deadline:
                break
            last = now
        counted.update(await self.counts(["hooks"]))
        return counted

    @asynccontextmanager
    async def window(
        self, into: dict[str, Any], follower: Follower | None = None
    ) -> AsyncIterator[None]:
        """Counts what runs inside into `into` ("path", "background"): the
        differences of the processes alive at both ends (a process killed in
        the window counts for nothing), once the stack is quiet before: p1
        parked every session it holds (a park is a path of its own, never
        part of another's window) and the counts settled."""
        await self.all_parked()
        await self.settled()
        before = await self.counts(self.processes)
        seen = len(follower.events) if follower is not None else 0
        yield
        if follower is not None:
            into["events"] = follower.kinds()[seen:]
        after = await self.settled()
        both = set(before) & set(after)
        diff = difference(
            combined({n: after[n] for n in both}), combined({n: before[n] for n in both})
        )
        background_reads = orphan_checks(diff)
        if self.scrape_read or background_reads:
            reads = diff.get("etcd hooks txn_read", 0) - self.scrape_read - background_reads
            diff["etcd hooks txn_read"] = reads
            if not reads:
                del diff["etcd hooks txn_read"]
        own, background = split(diff)
        into["path"], into["background"] = own, background

    async def create(self, via: str) -> str:
        response = await self.ingress[via].CreateSession(
            ingress_pb.CreateSessionRequest(), metadata=METADATA, timeout=10
        )
        return str(response.session_id)

    async def send(
        self, via: str, sid: str, text: str, *, caller: str = "", steer: bool = False
    ) -> None:
        self.sent += 1
        await self.ingress[via].SendMessage(
            ingress_pb.SendMessageRequest(
                session_id=sid,
                text=text,
                delivery_id=f"dlv_hops_{self.sent}",
                caller=caller,
                turn_policy=s.TURN_POLICY_STEER if steer else s.TURN_POLICY_QUEUE,
            ),
            metadata=METADATA,
            timeout=10,
        )

    @asynccontextmanager
    async def session(self, via: str, warmup: str = "hello") -> AsyncIterator[tuple[str, Follower]]:
        """A new session (created through `via`) that ran one turn, and its
        follower through `via`."""
        sid = await self.create(via)
        follower = Follower(self.ingress[via], sid)
        try:
            await self.send(via, sid, warmup)
            await follower.wait(waiting_after(1), "the warm-up turn")
            yield sid, follower
        finally:
            await follower.close()

    async def owner_scrape(self, owner: str) -> Scrape:
        return (await self.scrape([owner]))[owner]

    async def all_parked(self) -> None:
        """p1 (which parks idle sessions) holds none unparked."""

        async def parked() -> bool:
            scraped = await self.owner_scrape("p1")
            return scraped.total("baton_sessions") == scraped.total(
                "baton_sessions", state="parked"
            )

        await eventually(parked, "p1 parked every session it holds", PARK_AFTER + 30)


# -- the paths ---------------------------------------------------------------------

Path_ = Callable[[HopRun, dict[str, Any]], Awaitable[None]]


async def one_step_turn(run: HopRun, into: dict[str, Any]) -> None:
    async with run.session("ing-a") as (sid, follower):
        async with run.window(into, follower):
            await run.send("ing-a", sid, "hello again")
            await follower.wait(waiting_after(2), "the turn")


async def steered_turn(run: HopRun, into: dict[str, Any]) -> None:
    async with run.session("ing-a") as (sid, follower):
        calls = "baton_model_call_seconds_count"
        base = (await run.owner_scrape("a1")).total(calls)

        async def step_two_running() -> bool:
            # Step 2's model call is done, its 600 ms tool call runs: a steer
            # message now joins at step 3's boundary. (Sent as soon as step 1
            # was on the stream, it could reach a1 before step 2's model call
            # and end the turn a step early.)
            return (await run.owner_scrape("a1")).total(calls) >= base + 2

        async with run.window(into, follower):
            await run.send("ing-a", sid, "sleep 3 600", caller="alice")
            await eventually(step_two_running, "step 2's tool call")
            await run.send("ing-a", sid, "hello", caller="bob", steer=True)
            await follower.wait(waiting_after(2), "the steered turn")


async def subagent_turn(run: HopRun, into: dict[str, Any]) -> None:
    async with run.session("ing-a") as (sid, follower):
        async with run.window(into, follower):
            await run.send("ing-a", sid, "ask helper what is 6*7")
            await follower.wait(waiting_after(2), "the parent's turn")


async def upgrade_turn(run: HopRun, into: dict[str, Any]) -> None:
    async with run.session("ing-a") as (sid, follower):
        async with run.window(into, follower):
            await run.send("ing-b", sid, "hello from b")
            await follower.wait(waiting_after(2), "the upgrade turn")


async def wake_from_parking(run: HopRun, into: dict[str, Any]) -> None:
    async with run.session("ing-p") as (sid, follower):
        async with run.window(into, follower):  # (after p1 parked the session)
            await run.send("ing-p", sid, "wake up")
            await follower.wait(waiting_after(2), "the turn after the wake")


async def takeover(run: HopRun, into: dict[str, Any]) -> None:
    # a1 holds the sessions of the paths before (one-step, steered, the
    # subagent's parent and child); one more, idle, for the takeover's turn.
    async with run.session("ing-a") as (sid, follower):
        held = int((await run.owner_scrape("a1")).total("baton_sessions"))
        base = (await run.owner_scrape("a2")).total("baton_takeovers_total")
        into["held"] = {"sessions": held}
        async with run.window(into, follower):
            run.stack.kill("a1")

            async def taken() -> bool:
                scraped = await run.owner_scrape("a2")
                return scraped.total("baton_takeovers_total") >= base + held

            await eventually(taken, "a2 took a1's sessions over")
            await run.send("ing-a", sid, "after the takeover")
            await follower.wait(waiting_after(2), "the turn on a2")


# What each path is (docs/hops.md).
WHAT = {
    "one_step_turn": (
        "An idle, unparked session on a1: SendMessage through ing-a until the "
        "follower (StreamEvents through ing-a) sees SESSION_WAITING."
    ),
    "steered_turn": (
        "`sleep 3 600` (three steps: two 600 ms tool steps, then the answer); "
        "once step 1 is on the stream a second principal's steer message joins "
        "the open turn at the next model-call boundary (two sends, one turn)."
    ),
    "subagent_turn": (
        "`ask helper what is 6*7`: the parent's turn starts a child session "
        "(the helper), which runs its own two-step turn (calculator, answer); its "
        "result comes back as the parent's tool result, the parent answers. "
        "Counted until the child's tail settled too."
    ),
    "upgrade_turn": (
        "A session idle on a1 (dep-a) gets a message through ing-b (dep-b). "
        "It is appended like any other, stamped with dep-b; a1 reads it, finds "
        "it accepted by another deployment and hands the session over: it looks "
        "up dep-b's instances, calls AcceptHandoff on b1, the fence moves by "
        "Transfer, a1's inbox stream ends (FAILED_PRECONDITION) and b1 opens its "
        "own and runs the turn. Counted until SESSION_WAITING on b1 and the tail "
        "settled."
    ),
    "wake_from_parking": (
        f"A session on p1 parked after {PARK_AFTER:g} s idle: a message through "
        "ing-p rings p1's bell (WatchBells), p1 resumes the session and runs the "
        "turn. Counted until SESSION_WAITING; the session parks again later, "
        "outside the window."
    ),
    "takeover": (
        "kill -9 of a1 while it holds idle sessions (the held count below): "
        "a2 learns of the dead lease (WatchInstances), lists a1's sessions and "
        "takes each over; then one turn on a taken-over session through ing-a "
        "(whose ResumeHook finds the new owner). Lease expiry takes the "
        "instance lease TTL; the wait is not counted, the keep-alives during it "
        "are background."
    ),
}

RUNS: dict[str, Path_] = {
    "one_step_turn": one_step_turn,
    "steered_turn": steered_turn,
    "subagent_turn": subagent_turn,
    "upgrade_turn": upgrade_turn,
    "wake_from_parking": wake_from_parking,
    "takeover": takeover,
}


async def measure(etcd_endpoint: str, workdir: Path, pki: LocalPki, prefix: str) -> dict[str, Any]:
    """Every path, run in RUN_ORDER, reported in PATHS order, on a stack
    whose certificates `pki` issues (the one etcd trusts), under `prefix`."""
    run = HopRun.start(etcd_endpoint, workdir, pki, prefix)
    try:
        await run.wait_registered()
        await run.calibrate()
        # One turn first so every process has its channels, streams and
        # caches as in steady state (p1's first is the wake's own).
        async with run.session("ing-a"):
            pass
        async with run.session("ing-b"):
            pass
        paths: dict[str, Any] = {}
        for name in RUN_ORDER:
            into: dict[str, Any] = {}
            await RUNS[name](run, into)
            paths[name] = {
                "messages": messages(into["path"]),
                "etcd_requests": etcd_requests(into["path"]),
                "counts": into["path"],
                "background": into["background"],
                "events": [k.removeprefix("EVENT_KIND_") for k in into.get("events", [])],
                **({"held_sessions": into["held"]["sessions"]} if "held" in into else {}),
            }
        ordered = {name: paths[name] for name in PATHS}
        return {"scrape_reads_subtracted": run.scrape_read, "paths": ordered}
    finally:
        await run.close()


# -- the documents -----------------------------------------------------------------


def as_json(measured: dict[str, Any]) -> str:
    """What a run counted, without the background (it differs every run;
    the committed file changes only when a path does)."""
    paths = {
        name: {k: v for k, v in path.items() if k != "background"}
        for name, path in measured["paths"].items()
    }
    doc = {
        "about": "Generated by `python -m bench.hops --write` (see docs/hops.md); "
        "tests/test_hops.py compares a counted run with `counts`.",
        "background_keys": list(BACKGROUND),
        "scrape_reads_subtracted": measured["scrape_reads_subtracted"],
        "paths": paths,
    }
    return json.dumps(doc, indent=2, sort_keys=False) + "\n"


_MD_HEAD = """# The hop map

Every gRPC message between Baton processes and every etcd request and watch
event of six paths, counted on a real stack (TLS everywhere, separate
processes) by `python -m bench.hops --write`, which also writes
[hops.json](hops.json). `tests/test_hops.py` counts the same paths and fails
when one adds (or drops) a message or a request: regenerate both files with
`python -m bench.hops --write` when a change does so on purpose, and let the
diff of hops.json show it.

How a row reads:

- `rpc A -> B Method`: unary calls A made to B (each one request and one
  answer: two messages); ` [CODE]` when they failed.
- `open A -> B Method`: server streams A opened to B (one request message);
  `stream B -> A Method`: messages A received on such streams; `end A -> B
  Method [CODE]`: streams that ended (no message; e.g. an inbox stream
  cancelled when its session parks).
- `send A -> B Method`: messages A sent to B on a multiplexed stream (an
  owner's commits on CommitSteps, an ingress' or an owner's appends on
  ResumeHooks: one or more calls each, answered by `stream B -> A Method`
  messages, one or more answers each; an owner's inbox follows, their
  stops and grants on FollowInboxes, and an ingress' event reads on
  FollowEvents, answered by `stream hooks -> owner FollowInboxes` and
  `stream anchor -> ingress FollowEvents` messages, each with the pages and
  ends of one or more follows). The
  stream opens once per process and stays open, so its opening is left
  out.
- `edge ...`: the public API (the test client and ingress): not between Baton
  processes, listed for scale.
- `etcd S op`: requests service S made to etcd: `txn_write` (a transaction
  that writes), `txn_read` (a read: Baton's ranges are read-only
  transactions), `lease_*`, `watch_create`; and what its watches received:
  `watch_responses` (etcd's messages) carrying `watch_events` (one per key
  written or deleted).
- messages = 2 x rpc + open + stream + send; etcd requests = every `etcd` row except the
  watch responses and events.

Left out, as they run by the clock and not by the path (`bench.hops` prints
what each window saw of them): owner instances' lease keep-alives
(`KeepAliveInstance` and hooks' `lease_keepalive`), store health's `alarm`
checks, the dedupe lease hooks grants at the first append of each time
bucket (`lease_grant`), and an ingress' orphan-liveness checks after it
accepted a command for another deployment's session (`ListInstances` at 0,
3, 10 and 30 s, cached 2 s; each one hooks read, subtracted with it). The
one read each hooks scrape does for `baton_live_instances` is measured and
subtracted. Owners' reconciliation
(one `ListInstanceSessions` and its read per owner every
`BATON_OWNER_RECONCILE_INTERVAL`, 15 s by default), anchor's retention and
horizon sweeps (reads every `BATON_RETENTION_SWEEP`, 30 s) and its sealing of
quiet sessions into the object store (`BATON_SEAL_IDLE`, 300 s; a seal is a
read and a write, docs/storage.md), and hooks' sweep of the inboxes
(`BATON_UNANSWERED_SWEEP`, 15 s) are stretched past the run.

The stack: hooks, anchor, owners a1 and a2 of deployment dep-a with ingress
ing-a, owner b1 of dep-b with ingress ing-b, owner p1 of dep-p (the only
one parking sessions, idle 5 s) with ingress ing-p; TLS
everywhere. Each path runs on a session that ran one turn before (warm
channels and caches), between two scrapes of every process, once the stack
is quiet. Counts of a process killed in the window (takeover) are left out.
"""


_KINDS = ("rpc", "open", "send", "stream", "end", "etcd", "edge")


def _row_order(item: tuple[str, int]) -> tuple[int, str]:
    """Between processes first (calls, streams), then etcd, then the edge."""
    kind = item[0].split(" ", 1)[0]
    return (_KINDS.index(kind) if kind in _KINDS else len(_KINDS), item[0])


def as_markdown(measured: dict[str, Any]) -> str:
    lines = [_MD_HEAD]
    paths = measured["paths"]
    lines.append("## Summary\n")
    lines.append("| path | messages between processes | etcd requests | etcd txn_write |")
    lines.append("|---|---|---|---|")
    for name in PATHS:
        p = paths[name]
        writes = sum(v for k, v in p["counts"].items() if k.endswith(" txn_write"))
        lines.append(f"| {name} | {p['messages']} | {p['etcd_requests']} | {writes} |")
    for name in PATHS:
        p = paths[name]
        lines.append(f"\n## {name}\n")
        lines.append(WHAT[name])
        lines.append("\nEvents the follower saw: " + ", ".join(p["events"]) + ".")
        if "held_sessions" in p:
            lines.append(f"\nSessions a1 held when killed: {p['held_sessions']}.")
        lines.append("\n| hop | count |")
        lines.append("|---|---|")
        for key, value in sorted(p["counts"].items(), key=_row_order):
            lines.append(f"| `{key}` | {value} |")
    return "\n".join(lines) + "\n"


def compare(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Readable differences between two measurements' path counts."""
    out: list[str] = []
    for name in PATHS:
        want = expected["paths"].get(name, {}).get("counts", {})
        have = got["paths"][name]["counts"]
        for key in sorted(set(want) | set(have)):
            if want.get(key, 0) != have.get(key, 0):
                out.append(f"{name}: {key}: {want.get(key, 0)} -> {have.get(key, 0)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/hops.json and .md")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite docs/hops.md from docs/hops.json"
    )
    args = parser.parse_args(argv)
    if args.render:
        MD_PATH.write_text(as_markdown(json.loads(JSON_PATH.read_text())))
        return 0
    with tempfile.TemporaryDirectory(prefix="baton-hops-") as workdir:
        pki = bench_pki(Path(workdir) / "certs")
        server = start_etcd(pki, BENCH_PREFIX, log_path=str(Path(workdir) / "etcd.log"))
        try:
            prefix = f"{BENCH_PREFIX}hops/"
            measured = asyncio.run(measure(server.endpoint, Path(workdir), pki, prefix))
        finally:
            server.stop()
    print(as_markdown(measured))
    for name in PATHS:
        background = measured["paths"][name]["background"]
        print(f"background in {name} (not compared):", json.dumps(background))
    if JSON_PATH.exists():
        changes = compare(json.loads(JSON_PATH.read_text()), measured)
        print("\n".join(changes) if changes else "docs/hops.json: no change in the counts")
    if args.write:
        JSON_PATH.write_text(as_json(measured))
        MD_PATH.write_text(as_markdown(measured))
        print(f"wrote {JSON_PATH} and {MD_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
