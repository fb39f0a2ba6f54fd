"""What a run hands to the handoff broker (DESIGN.md §6): its fence, its
last commit, and how to settle an uncertain outcome. A value and a callable,
so the broker never holds the run."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from baton.session.v1 import session_pb2 as s


@dataclass(frozen=True)
class Checkpoint:
    """A run's last commit, as a handoff carries it."""

    fence: s.Fence
    revision: int | None
    """The committed snapshot's mod revision; None when unknown (skip)."""
    snapshot: bytes
    """That snapshot, serialized."""
    context: Sequence[s.ChatMessage]
    """The history entries of its context, as committed."""
    context_bytes: int
    settle: Callable[[], Awaitable[None]]
    """Commit the snapshot unchanged, fenced: succeeds when the session did
    not move (and now cannot move on this attempt); raises Fenced when it did."""
