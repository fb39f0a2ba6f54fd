"""The session directory: what hooks stores of a session, read for
introspection (DescribeSession), and the channel index (ListChannelSessions).

Reads only. Each description is one etcd read transaction inside one
session's keys plus the index entries pointing at it (its inbox token's
entry, which names the tenant, and its channel-index entry); a listing is
one range read of one channel's index (docs/design.md §10).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.bounds import MAX_LISTING_PAGE, check_range, check_seq
from baton_runtime.common.errors import InvalidArgument, NotFound, Reason
from baton_runtime.common.etcd.keys import ChannelEntry, Keys, OwnerRecord, TokenRecord, prefix_end
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn


@dataclass(frozen=True)
class SessionRecord:
    """What hooks stores of one session."""

    session_id: str
    channel: str
    owner: OwnerRecord
    inbox_head: int
    hooks: tuple[str, ...]
    parent: bytes
    created_ms: int
    oldest_unconsumed: s.InboxEntry | None


@dataclass(frozen=True)
class ChannelPage:
    """One page of a channel's index: (session id, created unix ms) pairs."""

    sessions: tuple[tuple[str, int], ...]
    more: bool


@dataclass(frozen=True)
class IndexPage:
    """One page of every channel's index: (channel, session id, created
    unix ms), in (channel, session id) order."""

    sessions: tuple[tuple[str, str, int], ...]
    more: bool


def timestamp_ms(ms: int) -> Timestamp:
    stamp = Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


class SessionDirectory:
    """Introspection reads over one etcd store."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._keys = keys

    async def describe(self, session_id: str, channel: str, consumed_seq: int) -> SessionRecord:
        """The session as hooks stores it; NOT_FOUND when it does not exist
        or (with `channel`) belongs to another channel (AIP-211)."""
        ids.validate_session_id(session_id)
        if channel:
            ids.validate_channel(channel)
        check_seq(consumed_seq, "consumed_seq")
        k = self._keys
        inbox = k.inbox_prefix(session_id)
        txn = (
            Txn()
            .read("token", k.token(ids.inbox_token(session_id)))
            .read("owner", k.owner(session_id))
            .read("head", k.inbox_head(session_id))
            .read("hooks", k.hooks(session_id))
            .read("oldest", k.inbox_entry(session_id, consumed_seq), prefix_end(inbox), limit=1)
        )
        if channel:
            txn.read("entry", k.channel_entry(channel, session_id))
        result = await txn.run(self._store)
        token, owner, head = result.value("token"), result.value("owner"), result.value("head")
        if token is None or owner is None or head is None:
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} not found")
        record = TokenRecord.decode(token)
        if channel and record.channel != channel:
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} not found")
        if channel:
            entry = result.value("entry")
        else:  # an internal caller: the tenant is known only now
            created = await (
                Txn().read("entry", k.channel_entry(record.channel, session_id)).run(self._store)
            )
            entry = created.value("entry")
        oldest = result.kvs("oldest")
        return SessionRecord(
            session_id=session_id,
            channel=record.channel,
            owner=OwnerRecord.decode(owner),
            inbox_head=int(head),
            hooks=tuple(json.loads(result.value("hooks") or b"[]")),
            parent=record.parent,
            created_ms=ChannelEntry.decode(entry).created_ms if entry is not None else 0,
            oldest_unconsumed=s.InboxEntry.FromString(oldest[0].value) if oldest else None,
        )

    async def list_channel(self, channel: str, after_session_id: str, limit: int) -> ChannelPage:
        """Up to `limit` sessions of `channel` after `after_session_id`, in
        session id order."""
        ids.validate_channel(channel)
        if after_session_id:
            ids.validate_session_id(after_session_id)
        check_range(limit, "limit", MAX_LISTING_PAGE, 1)
        k = self._keys
        prefix = k.channel_prefix(channel)
        start = k.channel_entry(channel, after_session_id) + b"\0" if after_session_id else prefix
        result = await Txn().read("page", start, prefix_end(prefix), limit=limit).run(self._store)
        sessions = tuple(
            (kv.key[len(prefix) :].decode(), ChannelEntry.decode(kv.value).created_ms)
            for kv in result.kvs("page")
        )
        return ChannelPage(sessions, result.more("page"))

    async def list_all_channels(
        self, after_channel: str, after_session_id: str, limit: int
    ) -> IndexPage:
        """Up to `limit` sessions of every channel after (after_channel,
        after_session_id), in (channel, session id) order: an operator's
        listing across tenants (one range read of the channel index)."""
        if bool(after_channel) != bool(after_session_id):
            raise InvalidArgument(
                Reason.INVALID_FIELD,
                "after_channel and after_session_id go together (both set, or both empty)",
            )
        if after_channel:
            ids.validate_channel(after_channel)
            ids.validate_session_id(after_session_id)
        check_range(limit, "limit", MAX_LISTING_PAGE, 1)
        k = self._keys
        prefix = k.channels_prefix()
        start = (
            k.channel_entry(after_channel, after_session_id) + b"\0" if after_channel else prefix
        )
        result = await Txn().read("page", start, prefix_end(prefix), limit=limit).run(self._store)
        sessions = []
        for kv in result.kvs("page"):
            channel, _, session_id = kv.key[len(prefix) :].decode().partition("/")
            sessions.append((channel, session_id, ChannelEntry.decode(kv.value).created_ms))
        return IndexPage(tuple(sessions), result.more("page"))
