"""The hook registry: one object over the hooks service's rooms, so the
servicer has one thing to call and the server one thing to close.

The rooms, each over the same etcd store:

- `tokens.TokenIndex` — which session a token names, tenancy, the cache of
  index entries;
- `sessions.SessionCache` — each session's inbox head and owner record as
  last seen (the floor below inbox and ownership, which both correct it);
- `claims.Claims` — CreateSession, ClaimHooks, DisposeHooks;
- `inbox.Inbox` — ResumeHook (group-committed appends) and StreamInbox;
- `ownership.Ownership` — takeover, parking, the ownership index;
- `expiry.ExpiryLeases` (shared with transfers) — the deduplication
  window's etcd leases, which expire delivery ids and handoff records;
- `directory.SessionDirectory` — introspection reads (DescribeSession) and
  the channel index (ListChannelSessions).

Every transaction stays inside one session's keys plus the index entries
pointing at it (token index, ownership index, bell; docs/design.md §10).
Owner instances (`instances.py`) and transfers (`transfer.py`) are rooms of
their own, beside this one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.etcd.keys import Keys, TokenRecord
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.security.scope import ScopeCheck
from baton_runtime.hooks.claims import Claims, NewSession
from baton_runtime.hooks.directory import ChannelPage, IndexPage, SessionDirectory, SessionRecord
from baton_runtime.hooks.expiry import ExpiryLeases
from baton_runtime.hooks.inbox import Inbox
from baton_runtime.hooks.owned_listing import OwnedListing, OwnedPage
from baton_runtime.hooks.ownership import Ownership, TakeOver
from baton_runtime.hooks.sessions import SessionCache
from baton_runtime.hooks.tokens import TokenIndex


class HookRegistry:
    """Domain operations of the hooks service over one etcd store; each
    method is one room's."""

    def __init__(self, store: Store, keys: Keys, leases: ExpiryLeases) -> None:
        self.leases = leases
        self.sessions = SessionCache(store, keys)
        self.tokens = TokenIndex(store, keys)
        self.claims = Claims(store, keys, self.tokens, self.sessions, leases)
        self.inbox = Inbox(store, keys, self.tokens, self.sessions, leases)
        self.ownership = Ownership(store, keys, self.sessions)
        self.listing = OwnedListing(store, keys)
        self.directory = SessionDirectory(store, keys)

    async def create_session(
        self, new: NewSession
    ) -> tuple[s.Fence, list[str], s.InboxEntry | None]:
        return await self.claims.create_session(new)

    async def claim(self, fence: s.Fence, tokens: list[str], channel: str = "") -> list[str]:
        return await self.claims.claim(fence, tokens, channel)

    async def dispose(self, fence: s.Fence, tokens: list[str]) -> list[str]:
        return await self.claims.dispose(fence, tokens)

    async def lookup(self, token: str, channel: str) -> TokenRecord:
        return await self.tokens.lookup(token, channel)

    async def resume(self, token: str, command: s.Command, channel: str) -> s.Receipt:
        return await self.inbox.resume(token, command, channel)

    def stream_inbox(
        self, fence: s.Fence, from_seq: int, scope: ScopeCheck | None = None
    ) -> AsyncIterator[list[s.InboxEntry]]:
        return self.inbox.stream(fence, from_seq, scope)

    async def take_over(
        self, expected: s.Fence, expected_instance_id: str, successor: s.OwnerIdentity
    ) -> TakeOver:
        return await self.ownership.take_over(expected, expected_instance_id, successor)

    async def set_parked(self, fence: s.Fence, parked: bool, inbox_next_seq: int) -> int:
        return await self.ownership.set_parked(fence, parked, inbox_next_seq)

    async def list_owned(
        self,
        deployment_id: str,
        instance_id: str,
        page_token: str = "",
        page_size: int = 0,
        *,
        index_only: bool = False,
    ) -> OwnedPage:
        return await self.listing.page(
            deployment_id, instance_id, page_token, page_size, index_only=index_only
        )

    async def describe(self, session_id: str, channel: str, consumed_seq: int) -> SessionRecord:
        return await self.directory.describe(session_id, channel, consumed_seq)

    async def list_channel(self, channel: str, after_session_id: str, limit: int) -> ChannelPage:
        return await self.directory.list_channel(channel, after_session_id, limit)

    async def list_all_channels(
        self, after_channel: str, after_session_id: str, limit: int
    ) -> IndexPage:
        return await self.directory.list_all_channels(after_channel, after_session_id, limit)

    async def close(self) -> None:
        await self.inbox.close()
