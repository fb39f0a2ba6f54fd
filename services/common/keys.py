"""The etcd key schema, shared by hooks and anchor.

Every transaction stays inside one session's keys (plus, for claims and
disposal, the token-index entries pointing at that session):

    {root}s/{sid}/c/fence          "{epoch}/{owner_run_id}"   compared by every owner write
    {root}s/{sid}/c/in/{seq:020d}  InboxEntry                 the durable inbox (c/ = owner watch)
    {root}s/{sid}/owner            OwnerRecord JSON           who owns the session
    {root}s/{sid}/inhead           "{next inbox seq}"         the inbox head, compared by appends
    {root}s/{sid}/dlv/{delivery}   Receipt                    delivery-id deduplication
    {root}s/{sid}/hooks            JSON list of tokens        the session's own record of its claims
    {root}s/{sid}/ev/{seq:020d}    Event                      the public stream
    {root}s/{sid}/snap             SessionSnapshot            the last committed snapshot
    {root}s/{sid}/closed           "{terminal seq}"           present once the stream closed
    {root}t/{token}                TokenRecord JSON           token index: token -> session
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SEQ_WIDTH = 20


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def seq_suffix(seq: int) -> bytes:
    return str(seq).zfill(SEQ_WIDTH).encode()


@dataclass(frozen=True)
class Keys:
    """Key builder under one root prefix (tests use a unique root each)."""

    root: str = "/baton/"

    def _s(self, session_id: str, rest: str) -> bytes:
        return f"{self.root}s/{session_id}/{rest}".encode()

    def session_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "")

    def control_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "c/")

    def fence(self, session_id: str) -> bytes:
        return self._s(session_id, "c/fence")

    def inbox_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "c/in/")

    def inbox_entry(self, session_id: str, seq: int) -> bytes:
        return self.inbox_prefix(session_id) + seq_suffix(seq)

    def owner(self, session_id: str) -> bytes:
        return self._s(session_id, "owner")

    def inbox_head(self, session_id: str) -> bytes:
        return self._s(session_id, "inhead")

    def delivery(self, session_id: str, delivery_id: str) -> bytes:
        return self._s(session_id, f"dlv/{delivery_id}")

    def hooks(self, session_id: str) -> bytes:
        return self._s(session_id, "hooks")

    def events_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "ev/")

    def event(self, session_id: str, seq: int) -> bytes:
        return self.events_prefix(session_id) + seq_suffix(seq)

    def snapshot(self, session_id: str) -> bytes:
        return self._s(session_id, "snap")

    def closed(self, session_id: str) -> bytes:
        return self._s(session_id, "closed")

    def token(self, token: str) -> bytes:
        return f"{self.root}t/{token}".encode()


def seq_of(key: bytes) -> int:
    """The seq encoded in an inbox or event key."""
    return int(key[-SEQ_WIDTH:])


def fence_value(epoch: int, owner_run_id: str) -> bytes:
    """Canonical fence bytes; value compares are byte-exact."""
    return f"{epoch}/{owner_run_id}".encode()


def parse_fence(value: bytes) -> tuple[int, str]:
    epoch, _, run = value.decode().partition("/")
    return int(epoch), run


def canonical_json(data: object) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class TokenRecord:
    """What a token-index entry holds: the session and its tenant channel."""

    session_id: str
    channel: str

    def encode(self) -> bytes:
        return canonical_json({"channel": self.channel, "session_id": self.session_id})

    @classmethod
    def decode(cls, value: bytes) -> TokenRecord:
        data = json.loads(value)
        return cls(session_id=data["session_id"], channel=data["channel"])
