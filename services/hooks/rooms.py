"""The rooms of the hooks service over one etcd store, built once (by
services/hooks/server.py): the floors they share and the rooms the servicer
calls, each RPC in the room of its concern. No method here: the servicer
calls a room itself.

Every transaction stays inside one session's keys plus the index entries
pointing at it (token index, ownership index, bell; docs/design.md §10).
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.scope import DeploymentScope
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.security.permits import PermitVerifier
from baton_runtime.hooks.claims import Claims
from baton_runtime.hooks.consent import Consent
from baton_runtime.hooks.directory import SessionDirectory
from baton_runtime.hooks.expiry import ExpiryLeases
from baton_runtime.hooks.fleet_views import FleetViews
from baton_runtime.hooks.inbox import Inbox
from baton_runtime.hooks.instances import InstanceRegistry
from baton_runtime.hooks.owned_listing import OwnedListing
from baton_runtime.hooks.ownership import Ownership
from baton_runtime.hooks.sessions import SessionCache
from baton_runtime.hooks.tokens import TokenIndex
from baton_runtime.hooks.transfer import Transfers


@dataclass(frozen=True)
class HookRooms:
    """One hooks process's rooms."""

    # The floors: the deduplication window's leases (delivery ids and
    # handoff records), the per-session head and owner cache, the token
    # index (LookupHook).
    leases: ExpiryLeases
    sessions: SessionCache
    tokens: TokenIndex
    # The rooms the servicer calls.
    claims: Claims  # CreateSession, ClaimHooks, DisposeHooks
    inbox: Inbox  # ResumeHook(s), StreamInbox, FollowInboxes
    ownership: Ownership  # TakeOverSession, SetParked
    listing: OwnedListing  # ListInstanceSessions
    directory: SessionDirectory  # DescribeSession, ListChannelSessions
    transfers: Transfers  # Transfer, GetTransfer, GetOwner
    instances: InstanceRegistry  # owner instances' leases and drains, WatchBells
    fleet_views: FleetViews  # ListDeployments, DescribeDeployment
    scope: DeploymentScope  # an owner's fenced calls held to its deployment
    consent: Consent  # what an owner may deliver (and a transfer's permit)

    @classmethod
    def over(
        cls, store: Store, keys: Keys, window_seconds: float, permits: PermitVerifier
    ) -> HookRooms:
        """The rooms over `store`, with a deduplication window of
        `window_seconds` and the transfer permits `permits` verifies."""
        leases = ExpiryLeases(store, window_seconds)
        sessions = SessionCache(store, keys)
        tokens = TokenIndex(store, keys)
        scope = DeploymentScope(store, keys)
        consent = Consent(tokens, sessions, scope, permits)
        return cls(
            leases=leases,
            sessions=sessions,
            tokens=tokens,
            claims=Claims(store, keys, tokens, sessions, leases),
            inbox=Inbox(store, keys, tokens, sessions, leases),
            ownership=Ownership(store, keys, sessions),
            listing=OwnedListing(store, keys),
            directory=SessionDirectory(store, keys),
            transfers=Transfers(store, keys, leases, sessions, consent),
            instances=InstanceRegistry(store, keys),
            fleet_views=FleetViews(store, keys),
            scope=scope,
            consent=consent,
        )

    async def close(self) -> None:
        await self.inbox.close()
