"""What a run is given and how it ends: the terms between the host
(sessions.py, host.py), which launches runs and acts on their ends, and the
run itself (`SessionRun`, session.py)."""

from __future__ import annotations

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


@dataclass(frozen=True)
class RunServices:
    """What the runs of one host share: the clients, the catalog subagents
    are looked up in, the handoff attempts (None: the session never hands
    off), the child sessions, the idle time before a park (None: never
    parks) and the clock."""

    hooks: HooksClient
    anchor: AnchorClient
    catalog: AgentCatalog
    attempts: HandoffAttempts | None = None
    children: Children | None = None
    park_after: float | None = None
    clock: Callable[[], float] = time.time


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
