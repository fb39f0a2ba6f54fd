"""The token index: which session a hook token names, who may address it
(tenancy, docs/design.md §2), and how many a session may hold.

Lookups read etcd; only the inbox append reads this process's cache of index
entries, because its transaction compares the entry it used (a stale one
costs a retry, never a wrong append).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Reason,
)
from baton_runtime.common.etcd.keys import Keys, TokenRecord
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn

_TOKEN_CACHE_SIZE = 100_000


def check_tenant(namespace: str, record: TokenRecord, channel: str, token: str) -> None:
    """A channel may address only its own aliases and its own sessions.

    An empty channel addresses every tenant: the servicer lets only internal
    callers (owners, by certificate) leave it empty. Another channel's alias
    is refused as such (its namespace says so without a lookup), but another
    channel's session id answers exactly like an unknown one (Google
    AIP-211: no existence leak).
    """
    if not channel:
        return
    if namespace == ids.INBOX_NAMESPACE:
        if record.channel != channel:
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {record.session_id} not found")
        return
    if namespace != channel:
        raise PermissionDenied(
            Reason.CROSS_TENANT,
            f"token {ids.brief(token)} belongs to another channel",
            token=token,
        )


def check_unclaimed(tokens: Sequence[str], entries: Sequence[bytes | None]) -> None:
    """Raise TOKEN_CLAIMED for the first token whose index entry (read in the
    same order) says another session holds it."""
    for token, entry in zip(tokens, entries, strict=True):
        if entry is not None:
            held_by = TokenRecord.decode(entry).session_id
            raise AlreadyExists(
                Reason.TOKEN_CLAIMED,
                f"token {token!r} is held by session {held_by}",
                token=token,
                session_id=held_by,
            )


def check_hook_count(count: int) -> None:
    if count > ids.MAX_HOOKS_PER_SESSION:
        raise InvalidArgument(
            Reason.TOO_MANY_HOOKS,
            f"a session may hold at most {ids.MAX_HOOKS_PER_SESSION} addresses; "
            f"this would make {count}",
        )


class TokenIndex:
    """Token resolution over one etcd store, with a cache of index entries."""

    def __init__(self, store: Store, keys: Keys, size: int = _TOKEN_CACHE_SIZE) -> None:
        self._store = store
        self._keys = keys
        self._size = size
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        # Each cached entry decoded once (a receipt resolves its token from
        # the cache; decoding the JSON every time was a tenth of its Python).
        self._records: dict[str, tuple[bytes, TokenRecord]] = {}

    async def entry(self, token: str, *, cached: bool = True) -> bytes | None:
        """The token's index entry: from the cache when `cached` (only for
        callers whose txn compares the value, see `resolve`), else from etcd
        (refreshing the cache)."""
        hit = self._entries.get(token) if cached else None
        if hit is not None:
            self._entries.move_to_end(token)
            return hit
        result = await Txn().read("token", self._keys.token(token)).run(self._store)
        value = result.value("token")
        if value is not None:
            self.remember(token, value)
        else:
            self.forget(token)
        return value

    def remember(self, token: str, entry: bytes) -> None:
        """`entry` is the token's index entry as just read or written."""
        self._entries[token] = entry
        self._entries.move_to_end(token)
        if len(self._entries) > self._size:
            evicted, _ = self._entries.popitem(last=False)
            self._records.pop(evicted, None)

    def forget(self, token: str) -> None:
        """The entry changed (disposed, or found moved by a compare)."""
        self._entries.pop(token, None)
        self._records.pop(token, None)

    def _record(self, token: str, entry: bytes) -> TokenRecord:
        """`entry` decoded, once per cached entry."""
        known = self._records.get(token)
        if known is not None and known[0] == entry:
            return known[1]
        record = TokenRecord.decode(entry)
        if self._entries.get(token) == entry:
            self._records[token] = (entry, record)
        return record

    async def lookup(self, token: str, channel: str) -> TokenRecord:
        """The session `token` names, checked against the caller's tenancy.

        Read from etcd: another hooks replica may have disposed the token (or
        it may name another session since), and this process's cache would
        not know."""
        record, _ = await self.resolve(token, channel, cached=False)
        return record

    async def resolve(self, token: str, channel: str, *, cached: bool) -> tuple[TokenRecord, bytes]:
        """`lookup`, also returning the raw index entry. Only the inbox
        append reads the cache (`cached=True`): its txn compares the entry."""
        namespace, raw_token = ids.split_token(token)
        if channel and namespace not in (channel, ids.INBOX_NAMESPACE):
            raise PermissionDenied(
                Reason.CROSS_TENANT, f"token {token!r} belongs to another channel", token=token
            )
        entry = await self.entry(token, cached=cached)
        if entry is None:
            if namespace == ids.INBOX_NAMESPACE:  # the raw token is the session id
                raise NotFound(Reason.SESSION_NOT_FOUND, f"session {raw_token} not found")
            raise NotFound(Reason.TOKEN_NOT_FOUND, f"no session holds token {token!r}", token=token)
        record = self._record(token, entry)
        check_tenant(namespace, record, channel, token)
        return record, entry

    async def parent_of(self, session_id: str) -> s.ParentLink | None:
        """A child session's parent link as created (its inbox token's index
        entry, from the cache when known: an inbox token names its session
        for good); None for other sessions, and for no session."""
        try:
            record, _ = await self.resolve(ids.inbox_token(session_id), "", cached=True)
        except NotFound:
            return None
        return s.ParentLink.FromString(record.parent) if record.parent else None
