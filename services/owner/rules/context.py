"""What the model sees of a session's history (docs/design.md §4).

The history is appended as entries of their own (one per index) by the
commits that add them; the snapshot keeps only its head (`HistoryLog`). A
`ContextWindow` holds the entries the model sees, [context_start,
next_index), keeps the snapshot's `HistoryLog` in step with them, knows which
entries the next commit must write, and what the last commit left (a refused
commit rolls back to it; a handoff carries it).
"""

from __future__ import annotations

from collections.abc import Sequence

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits


class ContextWindow:
    """The model's view of one session's history, and its uncommitted tail."""

    def __init__(self, snapshot: s.SessionSnapshot, messages: Sequence[s.ChatMessage]) -> None:
        self._snapshot = snapshot
        self.messages: list[s.ChatMessage] = list(messages)
        self.appended: list[s.ChatMessage] = []  # written by the next commit
        self.largest_appended = 0
        self.committed_log = s.HistoryLog()
        self.mark_committed()

    @property
    def log(self) -> s.HistoryLog:
        return self._snapshot.history_log

    def remember(self, message: s.ChatMessage) -> None:
        """Append to the history: the model sees it now; the next commit
        writes it as an entry of its own."""
        log = self.log
        size = message.ByteSize()
        self.messages.append(message)
        self.appended.append(message)
        self.largest_appended = max(self.largest_appended, size)
        log.next_index += 1
        log.context_bytes += size

    def reset(self, messages: Sequence[s.ChatMessage] = ()) -> None:
        """Start a new context (clear, compaction, finalization): the model
        sees only `messages`; the entries before them can be retired once the
        reset is committed."""
        log = self.log
        log.context_start = log.next_index
        log.context_bytes = 0
        self.messages = []
        for message in messages:
            self.remember(message)

    def size(self) -> tuple[int, int]:
        """(entries, serialized bytes) the model sees."""
        return len(self.messages), self.log.context_bytes

    def over(self, budget_bytes: int, budget_entries: int) -> bool:
        """Larger than the agent's budget (0 = no bound of that kind)."""
        return bool(
            (budget_bytes and self.log.context_bytes > budget_bytes)
            or (budget_entries and len(self.messages) > budget_entries)
        )

    def oversized_entry(self) -> str:
        """Why the next commit can never succeed, or "" (an entry over the
        per-entry limit: refused before anything is written)."""
        if self.largest_appended <= limits.MAX_HISTORY_ENTRY_BYTES:
            return ""
        return (
            f"a history entry of {self.largest_appended} bytes is over the limit "
            f"of {limits.MAX_HISTORY_ENTRY_BYTES}"
        )

    def mark_committed(self) -> None:
        """The last commit wrote everything appended so far."""
        self.appended = []
        self.largest_appended = 0
        self.committed_log.CopyFrom(self.log)
        self._committed = (self.messages, len(self.messages))

    def rollback(self) -> None:
        """Back to what the last commit left: the uncommitted tail is dropped."""
        self.log.CopyFrom(self.committed_log)
        messages, length = self._committed
        self.messages = messages[:length]
        self.appended = []
        self.largest_appended = 0

    def committed_messages(self) -> list[s.ChatMessage]:
        """The context as the last commit left it (a handoff carries it)."""
        messages, length = self._committed
        return messages[:length]

    def retirable(self) -> tuple[int, int] | None:
        """(from, below): committed entries the model no longer sees and
        that are not retired yet; None when there are none."""
        below, start = self.committed_log.context_start, self.log.retired_below
        return (start, below) if below > start else None

    def retired(self, below: int) -> None:
        """Entries below `below` are deleted (persisted by the next commit)."""
        self.log.retired_below = max(self.log.retired_below, below)
