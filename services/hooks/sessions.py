"""The per-session cache of this hooks process: each session's inbox head and
owner record as last seen, learned from reads and from the failure branches
of the transactions that compare them.

The floor below the inbox and ownership rooms: both read it and correct it,
and it imports neither. A stale entry costs a retry, never a wrong write:
every transaction that relies on it compares what it cached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import NotFound, Reason
from baton_runtime.common.etcd.keys import Keys, OwnerRecord
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn

_SESSION_CACHE_SIZE = 100_000


def owner_record(owner: s.OwnerIdentity, epoch: int, parked: bool = False) -> OwnerRecord:
    return OwnerRecord(
        owner_run_id=owner.owner_run_id,
        deployment_id=owner.deployment_id,
        instance_id=owner.instance_id,
        epoch=epoch,
        parked=parked,
    )


@dataclass(slots=True)
class CachedSession:
    """What this hooks process last saw of a session's head and owner record."""

    head: int
    owner_raw: bytes
    owner: OwnerRecord


class SessionCache:
    """Sessions' heads and owner records, least recently used dropped first."""

    def __init__(self, store: Store, keys: Keys, size: int = _SESSION_CACHE_SIZE) -> None:
        self._store = store
        self._keys = keys
        self._size = size
        self._sessions: OrderedDict[str, CachedSession] = OrderedDict()

    async def state(self, session_id: str) -> CachedSession:
        """The cached head and owner record; read both in one go when unknown."""
        state = self._sessions.get(session_id)
        if state is not None:
            self._sessions.move_to_end(session_id)
            return state
        k = self._keys
        result = await (
            Txn()
            .read("head", k.inbox_head(session_id))
            .read("owner", k.owner(session_id))
            .run(self._store)
        )
        return self.learn(session_id, result.value("head"), result.value("owner"))

    async def refresh(self, session_id: str) -> CachedSession:
        """Read the session again, whatever the cache holds."""
        self._sessions.pop(session_id, None)
        return await self.state(session_id)

    async def deployment_of(self, session_id: str, *, fresh: bool = False) -> str:
        """The deployment the session runs on, as cached or (`fresh`) read now."""
        state = await (self.refresh(session_id) if fresh else self.state(session_id))
        return state.owner.deployment_id

    def owner_moved(self, session_id: str, head: int, owner_raw: bytes) -> None:
        """Another component of this process (a transfer) wrote a new owner
        record: cache it, so the next append does not fail its compare first."""
        self.learn(session_id, str(head).encode(), owner_raw)

    def learn(self, session_id: str, head: bytes | None, owner: bytes | None) -> CachedSession:
        """Cache what a read (or a failure branch) returned; NotFound when
        the session is gone."""
        if head is None or owner is None:
            self._sessions.pop(session_id, None)
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} not found")
        state = self._sessions.get(session_id)
        if state is None or state.owner_raw != owner:
            state = CachedSession(int(head), owner, OwnerRecord.decode(owner))
        else:
            state.head = int(head)
        return self.remember(session_id, state)

    def remember(self, session_id: str, state: CachedSession) -> CachedSession:
        """Cache what this process just wrote."""
        self._sessions[session_id] = state
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self._size:
            self._sessions.popitem(last=False)
        return state
