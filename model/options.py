"""What the model explores: its bounds, and the variants of the protocol
that are known to be wrong (each off is Baton's protocol as built)."""

from __future__ import annotations

from dataclasses import dataclass


def deployment_of(instance: str) -> str:
    """An instance's deployment: its name's letter ("a1" -> "A")."""
    return instance[0].upper()


@dataclass(frozen=True)
class Bounds:
    """The size of the world explored. The session starts on the first
    instance (of deployment A) with session.started committed."""

    instances: tuple[str, ...] = ("a1", "a2", "b1")
    messages: int = 3
    crashes: int = 2  # kill -9s and pauses past the lease, in all
    lost: int = 1  # lost replies (and lost calls), in all
    handoffs: int = 1  # handoff ids: handoff, drain and adoption attempts
    steps: int = 1  # steps per turn (2: a turn stays open between commits)
    drain: bool = False  # an operator may drain deployment A to B

    def __post_init__(self) -> None:
        if not self.instances or deployment_of(self.instances[0]) != "A":
            raise ValueError("the first instance is of deployment A: the session starts there")
        if any(deployment_of(i) not in ("A", "B") for i in self.instances):
            raise ValueError("instances belong to deployment A or B")


@dataclass(frozen=True)
class Variant:
    """Known-bad variants: each one a mistake the protocol must not make,
    which the checker must catch (tests/test_model.py). `reconciler` is not
    a mistake: the periodic safety net (services/owner/host/reconcile.py),
    off by default so that the protocol is shown live without it."""

    commit_without_fence: bool = False  # anchor's commit does not compare the fence
    dedupe_by_attempt: bool = False  # appends deduplicated per attempt, not per delivery id
    release_then_claim: bool = False  # the seed's handoff: A releases, then B claims
    takeover_replay_head_now: bool = False  # issue 32 defect 3 (fixed): replay answers head now
    park_without_head_compare: bool = False  # SetParked(true) does not compare the inbox head
    transfer_without_head_compare: bool = False  # Transfer does not compare the inbox head
    transfer_without_revision_compare: bool = False  # Transfer does not compare the checkpoint
    reconciler: bool = False  # the reconciliation rounds run

    def name(self) -> str:
        on = [field for field, value in vars(self).items() if value]
        return "+".join(on) or "protocol"


# The bounds the suite explores exhaustively (tests/test_model.py; their
# state counts are in docs/testing.md): together they take every step.
EXHAUSTIVE: dict[str, Bounds] = {
    "crashes": Bounds(messages=3, crashes=2, lost=0),
    "lost replies": Bounds(messages=3, crashes=1, lost=1),
    "drain, two handoffs, two-step turns": Bounds(
        messages=2, crashes=1, lost=1, handoffs=2, steps=2, drain=True
    ),
}

# Larger: every state (`-m slow`), and random walks.
SLOW_EXHAUSTIVE = Bounds(messages=3, crashes=2, lost=1)
WALKS = Bounds(
    instances=("a1", "a2", "a3", "b1", "b2"),
    messages=6,
    crashes=4,
    lost=3,
    handoffs=3,
    steps=2,
    drain=True,
)
