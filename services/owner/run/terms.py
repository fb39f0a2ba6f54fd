"""What a run is given and how it ends: the terms between the host
(sessions.py, host.py), which launches runs and acts on their ends, and the
run itself (`SessionRun`, session.py)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.owner.agents.api import AgentCatalog
from baton_runtime.owner.handoff.attempt import HandoffAttempts
from baton_runtime.owner.run.children import Children


class RunExit(enum.Enum):
    """Why a run ended."""

    FENCED = "fenced"
    FINALIZED = "finalized"
    PARKED = "parked"
    HANDED_OFF = "handed_off"
    FAILED = "failed"


class Lease:
    """The instance's lease as the instance can know it, by its own
    monotonic clock: held until the send time of the last keep-alive
    answered with a TTL, plus that TTL (etcd renewed it no earlier). Past
    that, a successor may hold the sessions and may have run a step this
    instance is about to run (a paused owner, docs/recovery.md): a run
    starts no model or tool call until a keep-alive answers again (the
    lease is lost: the host stops every run) or renews it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until = -float("inf")
        self._renewal = asyncio.Event()

    def now(self) -> float:
        """The clock renewals are dated by (what to read before sending one)."""
        return self._clock()

    def renewed(self, sent_at: float, ttl_seconds: float) -> None:
        """A registration or keep-alive sent at `sent_at` (this clock) was
        answered with `ttl_seconds` left."""
        self._until = max(self._until, sent_at + ttl_seconds)
        self._renewal.set()
        self._renewal = asyncio.Event()

    def may_have_expired(self) -> bool:
        return self._clock() >= self._until

    async def held(self) -> None:
        """Return at once while the lease surely holds; else wait for a
        renewal that makes it hold (or for the run to be stopped)."""
        while self.may_have_expired():
            await self._renewal.wait()


@dataclass(frozen=True)
class RunServices:
    """What the runs of one host share: the clients, the catalog subagents
    are looked up in, the handoff attempts (None: the session never hands
    off), the child sessions, the idle time before a park (None: never
    parks), the clock, and the instance's lease (None: no lease, as in
    tests that run a host without a fleet)."""

    hooks: HooksClient
    anchor: AnchorClient
    catalog: AgentCatalog
    attempts: HandoffAttempts | None = None
    children: Children | None = None
    park_after: float | None = None
    clock: Callable[[], float] = time.time
    lease: Lease | None = None


@dataclass(frozen=True)
class RunStart:
    """How one run begins: the snapshot it loaded and its revision (None:
    unknown), inbox entries already in hand (`seed`: a child's first work, a
    handoff's trigger), the handoff that moved it here, the context window
    the snapshot refers to, and whether session.started is still to be
    committed (`unstarted`)."""

    snapshot: s.SessionSnapshot
    revision: int | None = None
    seed: Sequence[s.InboxEntry] = ()
    handoff_id: str = ""
    context: Sequence[s.ChatMessage] = ()
    unstarted: bool = False
