"""An owner acts only for sessions of the deployment its certificate names.

A fenced call (commit, claim, dispose, park, inbox stream) names a session
and a fence `(epoch, owner run)`. The deployment a fence belongs to never
changes: epochs only grow, and each `(session, epoch)` is written once, by
the create, takeover or transfer that also wrote the owner record naming its
deployment. So the first call with a fence reads the owner record once, and
the answer is cached for good (bounded LRU).

A fence that is not the current one is let through unchecked: the domain
operation compares the fence in its own transaction and refuses it (FENCED),
and a fence that does not exist yet cannot become current without a create,
takeover or transfer, which are themselves scoped to the caller's deployment.

A write that compares its fence in its own transaction (anchor's commit)
checks the scope there too, with no read at all (`in_txn`,
`scope_compares`): the owner record is canonical JSON whose bytes begin
with its deployment and epoch, so two value compares (greater than that
beginning, less than its successor) hold exactly when the record at the
fence's epoch names the caller's deployment. A refused write reads the
record back and says which (`check_record`); a write that passed caches the
answer, so only the first write of a fence compares. A read that reads the
owner record itself (an inbox stream's first read) checks it there. Both
hold a `ScopeCheck` (`pending`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from aetcd import rpc

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.etcd.keys import Keys, OwnerRecord
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.security.identity import Caller, Role, deployment_not_allowed

_CACHE_SIZE = 100_000


class DeploymentScope:
    """Checks that a fence's session runs on the caller's deployment."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._keys = keys
        self._deployments: OrderedDict[tuple[str, int, str], str] = OrderedDict()

    def in_txn(self, caller: Caller, fence: s.Fence) -> str | None:
        """For a write or read of `fence` that checks the owner record itself:
        the deployment it must find there (`scope_compares`, `check_record`),
        or None when nothing is left to check: the caller is not scoped
        (plaintext mode, or a role the access table already limits), or the
        fence is known to be of the caller's deployment (one known to be of
        another is refused here)."""
        if not caller.verified or caller.role is not Role.OWNER:
            return None
        ids.validate_session_id(fence.session_id)
        key = (fence.session_id, fence.epoch, fence.owner_run_id)
        known = self._deployments.get(key)
        if known is None:
            return caller.deployment_id
        self._deployments.move_to_end(key)
        caller.require_deployment(known, f"session {fence.session_id}")
        return None

    def pending(self, caller: Caller, fence: s.Fence) -> ScopeCheck | None:
        """For a write or read that checks the owner record itself (a
        commit's txn, an inbox stream's first read): what checks it there and
        remembers the answer, or None when nothing is left to check (as
        `in_txn`)."""
        deployment = self.in_txn(caller, fence)
        return None if deployment is None else ScopeCheck(self, deployment)

    async def check(self, caller: Caller, fence: s.Fence) -> None:
        if not caller.verified or caller.role is not Role.OWNER:
            return  # plaintext mode, or a role the access table already limits
        deployment = await self.deployment_of(fence)
        if deployment is None:
            return  # not the current fence (or no session): the domain refuses it
        caller.require_deployment(deployment, f"session {fence.session_id}")

    async def deployment_of(self, fence: s.Fence) -> str | None:
        """The deployment the fence's session runs on while the fence is
        current; None when it is not (or there is no session)."""
        ids.validate_session_id(fence.session_id)
        key = (fence.session_id, fence.epoch, fence.owner_run_id)
        deployment = self._deployments.get(key)
        if deployment is not None:
            self._deployments.move_to_end(key)
            return deployment
        result = await Txn().read("owner", self._keys.owner(fence.session_id)).run(self._store)
        raw = result.value("owner")
        if raw is None:
            return None
        record = OwnerRecord.decode(raw)
        if record.epoch != fence.epoch or record.owner_run_id != fence.owner_run_id:
            return None
        self.learn(key, record.deployment_id)
        return record.deployment_id

    def learn(self, key: tuple[str, int, str], deployment_id: str) -> None:
        """Remember the deployment of fence `key` (session, epoch, owner run),
        read from its owner record."""
        self._deployments[key] = deployment_id
        if len(self._deployments) > _CACHE_SIZE:
            self._deployments.popitem(last=False)


@dataclass(frozen=True)
class ScopeCheck:
    """A caller's deployment, checked by the write or read of one fence
    itself, and the scope that remembers the answer."""

    scope: DeploymentScope
    deployment_id: str

    def compares(self, keys: Keys, session_id: str, epoch: int) -> list[rpc.Compare]:
        """For a write's txn: `scope_compares` of the caller's deployment."""
        return scope_compares(keys, session_id, epoch, self.deployment_id)

    def confirm(self, session_id: str, epoch: int, owner_run_id: str, record: bytes | None) -> None:
        """The owner record a read (or a refused write) found with the fence
        current: raise PermissionDenied unless it names the caller's
        deployment (`check_record`); remember it when it does."""
        check_record(self.deployment_id, session_id, epoch, record)
        self.passed(session_id, epoch, owner_run_id)

    def passed(self, session_id: str, epoch: int, owner_run_id: str) -> None:
        """A write with `compares` succeeded: the fence is of the caller's deployment."""
        self.scope.learn((session_id, epoch, owner_run_id), self.deployment_id)


def owner_record_start(deployment_id: str, epoch: int) -> bytes:
    """How the bytes of an owner record of `deployment_id` at `epoch` begin
    (`OwnerRecord.encode`: canonical JSON, keys sorted, so `deployment_id`
    then `epoch` come first)."""
    return b'{"deployment_id":%s,"epoch":%d,' % (json.dumps(deployment_id).encode(), epoch)


def scope_compares(
    keys: Keys, session_id: str, epoch: int, deployment_id: str
) -> list[rpc.Compare]:
    """Compares that hold exactly when the session's owner record begins
    with `owner_record_start(deployment_id, epoch)`: greater than that
    beginning (a record is always longer than it) and less than the same
    bytes with the last one raised (every longer string with that beginning
    sorts below). A missing record fails both."""
    start = owner_record_start(deployment_id, epoch)
    after = start[:-1] + bytes([start[-1] + 1])
    key = keys.owner(session_id)
    value = rpc.Compare.VALUE
    return [
        rpc.Compare(key=key, result=rpc.Compare.GREATER, target=value, value=start),
        rpc.Compare(key=key, result=rpc.Compare.LESS, target=value, value=after),
    ]


def check_record(caller_deployment: str, session_id: str, epoch: int, record: bytes | None) -> None:
    """After a write refused with `scope_compares` (and the fence found
    current): raise PermissionDenied when the owner record names another
    deployment, as `Caller.require_deployment` would have."""
    if record is not None and record.startswith(owner_record_start(caller_deployment, epoch)):
        return
    raise deployment_not_allowed(caller_deployment, f"session {session_id}")
