"""One-step turns through the public API, as the benchmarks time them: a
following StreamEvents reader that times each turn's SESSION_WAITING
(`Follower`), sequential turns, concurrent turns over many sessions, and
upgrade turns that hand a session between two deployments."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.security.tls import Security
from bench.measure import Dist
from bench.stack import METADATA

WAIT_TIMEOUT_S = 30.0


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
