"""Owner instances on etcd: leases, the deployment registry, bells.

An owner instance registers `d/{deployment}/{instance}` under an etcd lease
that it keeps alive through hooks; when the lease expires the key vanishes and
the instances of the same deployment take its sessions over. The registry is
small and global (docs/design.md §10); bells are per instance (`bell/{instance}/`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from baton_runtime.common import ids
from baton_runtime.common.errors import Aborted, FailedPrecondition, InvalidArgument, Reason
from baton_runtime.common.etcd.keys import (
    NO_AGENT,
    AgentLabel,
    Bell,
    InstanceRecord,
    Keys,
    prefix_end,
)
from baton_runtime.common.etcd.ops import cmp_mod
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.etcd.watch import follow_range
from baton_runtime.common.observability import metrics

MIN_TTL_SECONDS = 1
MAX_TTL_SECONDS = 300
MAX_LABEL_CHARS = 256  # an address, and each part of an instance's agent label


@dataclass(frozen=True)
class InstanceSet:
    """A deployment's live instances, and instances that died owning sessions."""

    live: list[InstanceRecord]
    dead: list[str]


class InstanceRegistry:
    """Domain operations on owner instances over one etcd store."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._keys = keys

    async def register(
        self,
        deployment_id: str,
        instance_id: str,
        ttl_seconds: int,
        address: str,
        agent: AgentLabel = NO_AGENT,
    ) -> tuple[int, int]:
        """Grant a lease and put the instance's registry key under it, with
        the agent code it loaded (for operators).

        Returns (lease_id, granted ttl). Registering again (a restarted
        process with a fixed instance id) simply replaces the key and lease."""
        ids.validate_deployment_id(deployment_id)
        ids.validate_id(instance_id, "instance_id")
        if not MIN_TTL_SECONDS <= ttl_seconds <= MAX_TTL_SECONDS:
            raise InvalidArgument(
                Reason.INVALID_FIELD,
                f"ttl_seconds must be in [{MIN_TTL_SECONDS}, {MAX_TTL_SECONDS}]",
            )
        for name, value in (
            ("address", address),
            ("agent.spec", agent.spec),
            ("agent.name", agent.name),
            ("agent.version", agent.version),
        ):
            if len(value) > MAX_LABEL_CHARS:
                raise InvalidArgument(
                    Reason.INVALID_FIELD, f"{name} is longer than {MAX_LABEL_CHARS} characters"
                )
        lease_id, ttl = await self._store.grant_lease(ttl_seconds)
        record = InstanceRecord(deployment_id, instance_id, address, agent=agent)
        key = self._keys.instance(deployment_id, instance_id)
        await Txn().put(key, record.encode(), lease=lease_id).run(self._store)
        return lease_id, ttl

    async def keep_alive(self, lease_id: int) -> int:
        """Refresh a lease; the remaining TTL, 0 when it expired (or never was)."""
        if lease_id <= 0:
            raise InvalidArgument(Reason.INVALID_LEASE, "lease_id must be positive")
        return await self._store.keep_lease_alive(lease_id)

    async def deregister(self, lease_id: int) -> None:
        """Revoke a lease: its registry key goes at once (the watchers take
        the instance's sessions over). An unknown or expired lease is fine."""
        if lease_id <= 0:
            raise InvalidArgument(Reason.INVALID_LEASE, "lease_id must be positive")
        await self._store.revoke_lease(lease_id)

    async def set_drain(
        self, deployment_id: str, instance_id: str, lease_id: int, drain_to: str
    ) -> None:
        """Record in the instance's registry key the drain target it works
        on ("" = none), so the registry can say a deployment is draining.
        The key stays under its lease; refused (FAILED_PRECONDITION) when the
        instance is not registered under `lease_id`."""
        ids.validate_deployment_id(deployment_id)
        ids.validate_id(instance_id, "instance_id")
        if lease_id <= 0:
            raise InvalidArgument(Reason.INVALID_LEASE, "lease_id must be positive")
        if drain_to:
            ids.validate_deployment_id(drain_to)
            if drain_to == deployment_id:
                raise InvalidArgument(
                    Reason.INVALID_FIELD, f"deployment {drain_to} cannot be drained to itself"
                )
        key = self._keys.instance(deployment_id, instance_id)
        found = (await Txn().read("instance", key).run(self._store)).kv("instance")
        if found is None or int(found.lease) != lease_id:
            raise FailedPrecondition(
                Reason.INVALID_LEASE,
                f"instance {instance_id} of {deployment_id} is not registered under lease "
                f"{lease_id}",
            )
        record = InstanceRecord.decode(found.value)
        changed = dataclasses.replace(record, drain_to=drain_to)
        if changed == record:
            return
        result = await (
            Txn()
            .require(cmp_mod(key, int(found.mod_revision)))
            .put(key, changed.encode(), lease=lease_id)
            .run(self._store)
        )
        if not result.succeeded:  # registered again meanwhile: its new record rules
            raise Aborted(Reason.INVALID_LEASE, f"instance {instance_id} registered again; retry")

    async def live(self, deployment_id: str) -> list[InstanceRecord]:
        ids.validate_deployment_id(deployment_id)
        prefix = self._keys.deployment_prefix(deployment_id)
        result = await Txn().read("live", prefix, prefix_end(prefix)).run(self._store)
        return [InstanceRecord.decode(kv.value) for kv in result.kvs("live")]

    async def count_live(self) -> dict[str, int]:
        """Live instances per deployment (one keys-only range read)."""
        prefix = self._keys.instances_prefix()
        result = (
            await Txn().read("live", prefix, prefix_end(prefix), keys_only=True).run(self._store)
        )
        counts: dict[str, int] = {}
        for kv in result.kvs("live"):
            deployment = kv.key[len(prefix) :].decode().partition("/")[0]
            counts[deployment] = counts.get(deployment, 0) + 1
        return counts

    async def refresh_metrics(self) -> None:
        """baton_live_instances{deployment}, read from etcd (before a scrape)."""
        counts = await self.count_live()
        metrics.LIVE_INSTANCES.clear()
        for deployment, count in counts.items():
            metrics.LIVE_INSTANCES.labels(deployment).set(count)

    async def watch(self, deployment_id: str) -> AsyncIterator[InstanceSet]:
        """The live set now (with every indexed instance that is not live),
        then again after each change (with the instance whose lease expired)."""
        ids.validate_deployment_id(deployment_id)
        k = self._keys
        prefix = k.deployment_prefix(deployment_id)
        owned = k.owned_prefix(deployment_id)
        result = await (
            Txn()
            .read("live", prefix, prefix_end(prefix))
            .read("owned", owned, prefix_end(owned), keys_only=True)
            .run(self._store)
        )
        live = {
            record.instance_id: record
            for record in (InstanceRecord.decode(kv.value) for kv in result.kvs("live"))
        }
        indexed = {kv.key[len(owned) :].decode().partition("/")[0] for kv in result.kvs("owned")}
        yield InstanceSet(list(live.values()), sorted(indexed - live.keys()))
        async for event in follow_range(self._store.client, prefix, result.revision + 1):
            instance_id = event.kv.key[len(prefix) :].decode()
            if event.kv.value:
                live[instance_id] = InstanceRecord.decode(event.kv.value)
                yield InstanceSet(list(live.values()), [])
            elif live.pop(instance_id, None) is not None:
                yield InstanceSet(list(live.values()), [instance_id])

    async def watch_bells(self, instance_id: str) -> AsyncIterator[list[Bell]]:
        """Bells already rung for the instance, then each new one, live.

        A bell may repeat (on reconnect) or be stale (its session already
        woke): the owner compares heads."""
        ids.validate_id(instance_id, "instance_id")
        prefix = self._keys.bell_prefix(instance_id)
        result = await Txn().read("bells", prefix, prefix_end(prefix)).run(self._store)
        initial = [
            Bell(kv.key[len(prefix) :].decode(), int(kv.value)) for kv in result.kvs("bells")
        ]
        if initial:
            yield initial
        async for event in follow_range(self._store.client, prefix, result.revision + 1):
            if event.kv.value:  # deletes (unpark, takeover) are not bells
                yield [Bell(event.kv.key[len(prefix) :].decode(), int(event.kv.value))]
