"""Operator views of the owner fleets (ListDeployments, DescribeDeployment):
each deployment's status, its live instances with their leases, and how many
sessions each owns.

A deployment is known to the registry while it has a live instance (`d/`) or
sessions in its ownership index (`i/`); its status follows from those two
(`fleet_status`). An instance working on an operator's drain announces its
target in its registry record (SetInstanceDrain), which makes the fleet
DRAINING.

Reads only: the registry keys of live instances (`d/`, each under its
instance's lease), the lease's remaining TTL, and the deployment's ownership
index (`i/{deployment}/{instance}/{sid}`, read keys-only in bounded chunks),
so a listing costs one small range per deployment plus the index's keys,
never a session's own keys (docs/design.md §10).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from baton_runtime.common import ids
from baton_runtime.common.errors import NotFound, Reason
from baton_runtime.common.etcd.keys import InstanceRecord, Keys, prefix_end
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn

MAX_DEPLOYMENTS = 1000
"""Deployments one ListDeployments answers at most."""
INDEX_CHUNK = 5000
"""Ownership-index keys read per range (keys-only, well under etcd's limits)."""


class FleetStatus(enum.Enum):
    """What the registry knows of a deployment's fleet."""

    ACTIVE = "active"  # a live owner instance
    DRAINING = "draining"  # live, and an instance works on an operator's drain
    RETIRED = "retired"  # no live instance, sessions left in its index
    DRAINED = "drained"  # no session left: drained by an operator (or nothing at all)


def fleet_status(live_instances: int, sessions: int, draining: bool = False) -> FleetStatus:
    """A deployment's status from its live instances (whether one drains)
    and its indexed sessions (pure)."""
    if live_instances and not draining:
        return FleetStatus.ACTIVE
    if live_instances:  # an operator's drain: done once nothing is left
        return FleetStatus.DRAINING if sessions else FleetStatus.DRAINED
    return FleetStatus.RETIRED if sessions else FleetStatus.DRAINED


@dataclass(frozen=True)
class InstanceLease:
    """A live owner instance, its lease, and the sessions it owns."""

    record: InstanceRecord
    lease_id: int
    ttl_seconds: int
    granted_ttl_seconds: int
    sessions: int


@dataclass(frozen=True)
class Fleet:
    """A deployment's live instances and the sessions its index holds."""

    deployment_id: str
    instances: tuple[InstanceLease, ...]
    sessions: int
    sessions_of_gone_instances: int

    @property
    def status(self) -> FleetStatus:
        draining = any(i.record.drain_to for i in self.instances)
        return fleet_status(len(self.instances), self.sessions, draining)


class FleetViews:
    """Operator reads of owner fleets over one etcd store."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._keys = keys

    async def describe(self, deployment_id: str) -> Fleet:
        """One exact deployment; NOT_FOUND when the registry does not know
        it (no live instance, no session: a typo, or a deployment retired
        and emptied)."""
        fleet = await self._read(deployment_id)
        if not fleet.instances and not fleet.sessions:
            raise NotFound(
                Reason.DEPLOYMENT_NOT_FOUND,
                f"deployment {deployment_id} is not known: no live owner instance and no session",
            )
        return fleet

    async def _read(self, deployment_id: str) -> Fleet:
        """One exact deployment as the registry has it (empty when unknown)."""
        ids.validate_deployment_id(deployment_id)
        prefix = self._keys.deployment_prefix(deployment_id)
        live = await Txn().read("live", prefix, prefix_end(prefix)).run(self._store)
        kvs = live.kvs("live")
        owned = await self._owned_counts(deployment_id)
        leases = await asyncio.gather(*(self._lease(int(kv.lease)) for kv in kvs))
        instances = []
        for kv, (ttl, granted) in zip(kvs, leases, strict=True):
            record = InstanceRecord.decode(kv.value)
            instances.append(
                InstanceLease(record, int(kv.lease), ttl, granted, owned.get(record.instance_id, 0))
            )
        live_ids = {lease.record.instance_id for lease in instances}
        return Fleet(
            deployment_id=deployment_id,
            instances=tuple(sorted(instances, key=lambda i: i.record.instance_id)),
            sessions=sum(owned.values()),
            sessions_of_gone_instances=sum(n for i, n in owned.items() if i not in live_ids),
        )

    async def list_all(self) -> list[Fleet]:
        """Every deployment the registry knows (a live instance, or sessions
        in its ownership index), in deployment id order (at most
        MAX_DEPLOYMENTS)."""
        prefix = self._keys.instances_prefix()
        result = (
            await Txn().read("live", prefix, prefix_end(prefix), keys_only=True).run(self._store)
        )
        live = {kv.key[len(prefix) :].decode().partition("/")[0] for kv in result.kvs("live")}
        indexed = await self._indexed_deployments()
        deployments = sorted(live | indexed)[:MAX_DEPLOYMENTS]
        fleets = [await self._read(deployment) for deployment in deployments]
        return [f for f in fleets if f.instances or f.sessions]  # gone since the listing

    async def _indexed_deployments(self) -> set[str]:
        """The deployments with sessions in the ownership index: one
        one-key read per deployment, skipping each one's entries (at most
        MAX_DEPLOYMENTS + 1 reads)."""
        prefix = self._keys.ownership_prefix()
        end = prefix_end(prefix)
        start = prefix
        found: set[str] = set()
        while len(found) <= MAX_DEPLOYMENTS:
            page = await Txn().read("owned", start, end, keys_only=True, limit=1).run(self._store)
            kvs = page.kvs("owned")
            if not kvs:
                return found
            deployment = kvs[0].key[len(prefix) :].decode().partition("/")[0]
            found.add(deployment)
            start = prefix_end(self._keys.owned_prefix(deployment))
        return found

    async def _lease(self, lease_id: int) -> tuple[int, int]:
        if lease_id <= 0:
            return 0, 0
        return await self._store.lease_time_to_live(lease_id)

    async def _owned_counts(self, deployment_id: str) -> dict[str, int]:
        """Sessions per instance in the deployment's ownership index."""
        prefix = self._keys.owned_prefix(deployment_id)
        end = prefix_end(prefix)
        start = prefix
        counts: dict[str, int] = {}
        while True:
            page = await (
                Txn().read("owned", start, end, keys_only=True, limit=INDEX_CHUNK).run(self._store)
            )
            kvs = page.kvs("owned")
            for kv in kvs:
                instance = kv.key[len(prefix) :].decode().partition("/")[0]
                counts[instance] = counts.get(instance, 0) + 1
            if not kvs or not page.more("owned"):
                return counts
            start = kvs[-1].key + b"\0"
