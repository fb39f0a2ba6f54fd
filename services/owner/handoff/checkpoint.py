"""A session's checkpoint as a handoff carries it (docs/design.md §6), and the
checks every owner that takes one over makes — the new owner of a handoff
(acceptance.py) and an adopting owner (adoption.py) alike: the snapshot is
the named session's, in a format this build reads, not finalized, and a
child session's code exists here. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.answers import LoadedSession
from baton_runtime.common.errors import FailedPrecondition, Reason
from baton_runtime.owner.agents.api import AgentCatalog


@dataclass(frozen=True)
class Checkpoint:
    """A run's last commit, as the old owner offers it."""

    fence: s.Fence
    revision: int | None
    """The committed snapshot's mod revision; None when unknown (skip)."""
    snapshot: bytes
    """That snapshot, serialized."""
    context: Sequence[s.ChatMessage]
    """The history entries of its context, as committed."""
    context_bytes: int


@dataclass(frozen=True)
class Arrival:
    """A session whose checkpoint was validated here: the Transfer that
    moves it, what to run it from, and the trigger in hand (`seed`)."""

    transfer: hooks_pb.TransferRequest
    loaded: LoadedSession
    seed: tuple[s.InboxEntry, ...] = ()

    @property
    def session_id(self) -> str:
        return self.transfer.expected.session_id


class CheckpointRules:
    """What this build accepts as a checkpoint."""

    def __init__(
        self,
        deployment_id: str,
        readable_formats: frozenset[int],
        catalog: AgentCatalog | None = None,
    ) -> None:
        self.deployment_id = deployment_id
        self.readable_formats = readable_formats
        self.catalog = catalog

    def check_session(self, snapshot: s.SessionSnapshot, session_id: str) -> None:
        if snapshot.session_id != session_id:
            raise FailedPrecondition(
                Reason.CHECKPOINT_UNREADABLE,
                f"the checkpoint names session {snapshot.session_id!r}",
            )

    def check_format(self, snapshot: s.SessionSnapshot) -> None:
        if snapshot.format_version not in self.readable_formats:
            raise FailedPrecondition(
                Reason.CHECKPOINT_INCOMPATIBLE,
                f"snapshot format {snapshot.format_version} is not one deployment "
                f"{self.deployment_id} reads ({sorted(self.readable_formats)})",
            )

    def check_active(self, snapshot: s.SessionSnapshot, session_id: str) -> None:
        if snapshot.status != s.SESSION_STATUS_ACTIVE:
            raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {session_id} is finalized")

    def check_child_code(self, snapshot: s.SessionSnapshot) -> None:
        """A child session moves (by a drain or an adoption, never by an
        upgrade trigger) only to a build that has its subagent or tool."""
        if not snapshot.parent.parent_session_id or self.catalog is None:
            return
        try:
            self.catalog.agent_for(snapshot.parent)
        except LookupError as exc:
            raise FailedPrecondition(
                Reason.CHECKPOINT_INCOMPATIBLE,
                f"child session {snapshot.session_id}: {exc} (deployment {self.deployment_id})",
            ) from exc
