"""Claims: a session's creation with its first tokens (and, optionally, its
first inbox entry), and claiming and disposing tokens under its fence.

The session's own record of its claim set (`s/{sid}/hooks`) is compared by
every change of it, so concurrent claims and disposes retry instead of
losing each other's tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import AlreadyExists, Reason, Unavailable
from baton_runtime.common.etcd.keys import (
    ChannelEntry,
    Keys,
    TokenRecord,
    canonical_json,
    fence_value,
    parse_fence,
)
from baton_runtime.common.etcd.ops import cmp_absent, cmp_value
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Fence, Txn, TxnResult
from baton_runtime.hooks.expiry import ExpiryLeases
from baton_runtime.hooks.inbox import MAX_APPEND_ATTEMPTS, check_command
from baton_runtime.hooks.sessions import CachedSession, SessionCache, owner_record
from baton_runtime.hooks.tokens import TokenIndex, check_hook_count, check_unclaimed


@dataclass(frozen=True)
class NewSession:
    """A session to create: its id, its first owner (epoch 1), its channel
    and aliases; a child's link to its parent; and the command appended as
    inbox entry 0 by the creating transaction, if any."""

    session_id: str
    owner: s.OwnerIdentity
    channel: str
    aliases: tuple[str, ...] = ()
    parent: s.ParentLink | None = None
    first_command: s.Command | None = None


def session_tokens(new: NewSession) -> list[str]:
    """Validate a create's ids (InvalidArgument); the tokens the session
    claims: its inbox token first, then each alias once, at most
    MAX_HOOKS_PER_SESSION in all. Pure."""
    ids.validate_session_id(new.session_id)
    ids.validate_channel(new.channel)
    ids.validate_deployment_id(new.owner.deployment_id)
    ids.validate_id(new.owner.owner_run_id, "owner_run_id")
    ids.validate_id(new.owner.instance_id, "instance_id")
    tokens = [ids.inbox_token(new.session_id)]
    for alias in new.aliases:
        ids.split_token(alias)
        if alias not in tokens:
            tokens.append(alias)
    check_hook_count(len(tokens))
    return tokens


def _created_before(
    fence: Fence, tokens: list[str], first: s.InboxEntry | None, result: TxnResult
) -> tuple[s.Fence, list[str], s.InboxEntry | None]:
    """A refused create: a retry of the create that already succeeded
    answers as it did; otherwise SESSION_EXISTS, a claimed token, or a race."""
    existing = result.value("fence")
    if existing == fence.value:  # a retry of the create that already succeeded
        raw = result.value("first")
        entry = s.InboxEntry.FromString(raw) if raw is not None and first else None
        return fence.proto(), json.loads(result.value("hooks") or b"[]"), entry
    if existing is not None:
        raise AlreadyExists(
            Reason.SESSION_EXISTS,
            f"session {fence.session_id} already exists",
            session_id=fence.session_id,
            owner_run_id=parse_fence(existing)[1],
        )
    check_unclaimed(tokens, result.values("tokens"))
    raise Unavailable(Reason.CONFLICT, "create raced a concurrent change; retry")


class Claims:
    """CreateSession, ClaimHooks and DisposeHooks over one etcd store."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        tokens: TokenIndex,
        sessions: SessionCache,
        leases: ExpiryLeases,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._leases = leases
        self._store = store
        self._keys = keys
        self._tokens = tokens
        self._sessions = sessions

    async def create_session(
        self, new: NewSession
    ) -> tuple[s.Fence, list[str], s.InboxEntry | None]:
        """Create the session; with a first command, appended as inbox entry
        0 by the same transaction. Returns (fence, claimed tokens, that entry)."""
        tokens = session_tokens(new)
        session_id = new.session_id
        fence = Fence(session_id, new.owner.owner_run_id, 1)
        record = TokenRecord(
            session_id=session_id, channel=new.channel, parent=_link(new.parent)
        ).encode()
        owner_now = owner_record(new.owner, 1)
        first = _first_entry(new.first_command)
        created_ms = int(self._clock() * 1000)

        def create_txn(lease: int) -> Txn:
            return self._create_txn(new, tokens, record, first, created_ms, lease)

        delivery_id = first.command.delivery.delivery_id if first is not None else ""
        result = await self._leases.run(create_txn, leased=bool(delivery_id))
        if not result.succeeded:
            return _created_before(fence, tokens, first, result)
        head = 0 if first is None else 1
        self._sessions.remember(session_id, CachedSession(head, owner_now.encode(), owner_now))
        # (the first append to it, or a child's first report, reads no index entry)
        for token in tokens:
            self._tokens.remember(token, record)
        return fence.proto(), tokens, first

    def _create_txn(
        self,
        new: NewSession,
        tokens: list[str],
        record: bytes,
        first: s.InboxEntry | None,
        created_ms: int,
        lease: int,
    ) -> Txn:
        """Compares: no such session, every token unclaimed. Writes the
        session's records, its index entries and the first entry (its
        delivery id under the window lease). Reads on failure: what was
        compared, and entry 0 (a retry's)."""
        k = self._keys
        session_id, owner, channel = new.session_id, new.owner, new.channel
        fence = fence_value(1, owner.owner_run_id)
        txn = (
            Txn()
            .require(cmp_absent(k.fence(session_id)), *(cmp_absent(k.token(t)) for t in tokens))
            .put(k.fence(session_id), fence)
            .put(k.owner(session_id), owner_record(owner, 1).encode())
            .put(k.owned(owner.deployment_id, owner.instance_id, session_id), fence)
            .put(k.hooks(session_id), canonical_json(tokens))
            .put(k.inbox_head(session_id), b"0" if first is None else b"1")
            # The channel index entry: created with the session, deleted with
            # its token-index entries (services/anchor/retention.py).
            .put(
                k.channel_entry(channel, session_id),
                ChannelEntry(created_ms=created_ms).encode(),
            )
        )
        if first is not None:
            txn.put(k.inbox_entry(session_id, 0), first.SerializeToString())
            if first.command.delivery.delivery_id:
                txn.put(k.delivery(session_id, first.command.delivery.delivery_id), b"0", lease)
        for token in tokens:
            txn.put(k.token(token), record)
        txn.read_on_failure("fence", k.fence(session_id))
        txn.read_on_failure("hooks", k.hooks(session_id))
        txn.read_on_failure("first", k.inbox_entry(session_id, 0))
        txn.read_each("tokens", [k.token(t) for t in tokens], on="failure")
        return txn

    async def claim(self, fence: s.Fence, tokens: list[str], channel: str = "") -> list[str]:
        """Claim tokens for the fenced session, all or nothing."""
        for token in tokens:
            ids.split_token(token)
        k = self._keys
        sid = fence.session_id
        owner = Fence.of(fence)
        for _ in range(MAX_APPEND_ATTEMPTS):
            current_raw, current = await self._read_hooks(owner)
            new = [t for t in dict.fromkeys(tokens) if t not in current]
            if not new:
                return current
            updated = current + new
            check_hook_count(len(updated))
            record = await self._session_record(sid, channel)
            txn = (
                Txn()
                .require(
                    owner.compare(k),
                    cmp_value(k.hooks(sid), current_raw),
                    *(cmp_absent(k.token(t)) for t in new),
                )
                .put(k.hooks(sid), canonical_json(updated))
            )
            for token in new:
                txn.put(k.token(token), record)
            txn.read_on_failure("fence", k.fence(sid))
            txn.read_each("tokens", [k.token(t) for t in new], on="failure")
            result = await txn.run(self._store)
            if result.succeeded:
                return updated
            owner.check(result.value("fence"))
            check_unclaimed(new, result.values("tokens"))
        raise Unavailable(Reason.CONFLICT, "claim kept racing concurrent changes; retry")

    async def dispose(self, fence: s.Fence, tokens: list[str]) -> list[str]:
        """Release tokens (all when `tokens` is empty) held by the fenced session."""
        k = self._keys
        sid = fence.session_id
        owner = Fence.of(fence)
        for _ in range(MAX_APPEND_ATTEMPTS):
            current_raw, current = await self._read_hooks(owner)
            drop = [t for t in current if not tokens or t in tokens]
            remaining = [t for t in current if t not in drop]
            txn = (
                Txn()
                .require(owner.compare(k), cmp_value(k.hooks(sid), current_raw))
                .put(k.hooks(sid), canonical_json(remaining))
            )
            for token in drop:
                txn.delete(k.token(token))
            result = await txn.read_on_failure("fence", k.fence(sid)).run(self._store)
            if result.succeeded:
                for token in drop:
                    self._tokens.forget(token)
                return remaining
            owner.check(result.value("fence"))
        raise Unavailable(Reason.CONFLICT, "dispose kept racing concurrent changes; retry")

    async def _read_hooks(self, owner: Fence) -> tuple[bytes, list[str]]:
        """The session's claim set (raw, to compare, and parsed), fenced."""
        k = self._keys
        sid = owner.session_id
        result = (
            await Txn().read("fence", k.fence(sid)).read("hooks", k.hooks(sid)).run(self._store)
        )
        owner.check(result.value("fence"))
        raw = result.value("hooks") or b"[]"
        current: list[str] = json.loads(raw)
        return raw, current

    async def _session_record(self, session_id: str, channel: str) -> bytes:
        """The index entry a new alias gets: the session's own (its inbox token's)."""
        raw = await self._tokens.entry(ids.inbox_token(session_id))
        if raw is None:
            return TokenRecord(session_id=session_id, channel=channel).encode()
        return raw


def _link(parent: s.ParentLink | None) -> bytes:
    """A child session's parent link as its index entries keep it (no outbox)."""
    if parent is None or not parent.parent_session_id:
        return b""
    ids.validate_session_id(parent.parent_session_id)
    kept = s.ParentLink()
    kept.CopyFrom(parent)
    del kept.outbox[:]
    return kept.SerializeToString()


def _first_entry(command: s.Command | None) -> s.InboxEntry | None:
    """Inbox entry 0 for a session created with its first command."""
    if command is None or not command.WhichOneof("kind"):
        return None
    check_command(command)
    now = Timestamp()
    now.GetCurrentTime()
    return s.InboxEntry(seq=0, command=command, accepted_at=now)
