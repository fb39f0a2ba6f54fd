"""Deleting finalized sessions after their retention (docs/design.md §4).

The commit that closes a session's stream also writes a retention-index entry
`gc/{expires}/{sid}`. Every anchor replica sweeps the index now and then;
for each expired entry it deletes the session's index entries that point at
it (token index, channel index, ownership index, bell), then the session's own keys in
bounded transactions (its fence first: no seal records an object after
that), then its objects in the object store (services/anchor/segments/), then
the entry itself. Every step is idempotent, so
replicas sweeping at once, or a sweep cut short by a crash, are harmless: the
entry stays until the session is gone. Afterwards every read of the session
answers NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import structlog
from google.protobuf.message import DecodeError

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.segments.sweep import ObjectSweep
from baton_runtime.common import ids, limits
from baton_runtime.common.errors import BatonError
from baton_runtime.common.etcd.keys import (
    Keys,
    OwnerRecord,
    TokenRecord,
    parse_retention,
    prefix_end,
)
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn

log = structlog.get_logger("baton.anchor.retention")

SWEEP_BATCH = 32


class Retention:
    """Sweeps the retention index of one etcd store."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        *,
        interval_seconds: float,
        objects: ObjectSweep | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self._interval = interval_seconds
        self._objects = objects
        self._clock = clock

    async def run(self) -> None:
        """Sweep every interval until cancelled; failures are logged and
        retried at the next sweep."""
        while True:
            try:
                await self.sweep()
            except BatonError as exc:
                log.warning("retention sweep failed", reason=exc.reason, error=exc.message)
            await asyncio.sleep(self._interval)

    async def sweep(self) -> int:
        """Delete every session whose retention has passed; returns how many."""
        k = self._keys
        now_ms = int(self._clock() * 1000)
        deleted = 0
        while True:
            result = await (
                Txn()
                .read(
                    "due",
                    k.retention_prefix(),
                    k.retention(now_ms + 1, ""),
                    keys_only=True,
                    limit=SWEEP_BATCH,
                )
                .run(self._store)
            )
            due = result.kvs("due")
            for kv in due:
                _, session_id = parse_retention(kv.key)
                await self.delete_session(session_id)
                await Txn().delete(kv.key).run(self._store)
                deleted += 1
                log.info("finalized session deleted after its retention", session_id=session_id)
            if not result.more("due"):
                return deleted

    async def delete_session(self, session_id: str) -> None:
        """Every key of the session, every index entry pointing at it, and
        every object it sealed."""
        ids.validate_session_id(session_id)
        await self._delete_index_entries(session_id)
        await self._delete_keys(session_id)
        if self._objects is not None:
            await self._objects.delete_session(session_id)

    async def _delete_index_entries(self, session_id: str) -> None:
        """The token-index entries still naming the session, with its
        channel-index entries (one txn: one never outlives the other), its
        ownership-index entry and bell."""
        k = self._keys
        found = await (
            Txn()
            .read("owner", k.owner(session_id))
            .read("hooks", k.hooks(session_id))
            .read("snapshot", k.snapshot(session_id))
            .run(self._store)
        )
        tokens = {ids.inbox_token(session_id)}
        raw_hooks = found.value("hooks")
        if raw_hooks:
            tokens.update(json.loads(raw_hooks))
        index = Txn()
        for token in sorted(tokens):
            index.read(token, k.token(token))
        pointing = await index.run(self._store)
        cleanup = Txn()
        channels: set[str] = set()
        raw_snapshot = found.value("snapshot")
        if raw_snapshot:
            channels.add(_snapshot_channel(raw_snapshot))
        for token in sorted(tokens):
            raw = pointing.value(token)
            if raw is not None and TokenRecord.decode(raw).session_id == session_id:
                cleanup.delete(k.token(token))
                channels.add(TokenRecord.decode(raw).channel)
        for channel in sorted(c for c in channels if c):
            cleanup.delete(k.channel_entry(channel, session_id))
        raw_owner = found.value("owner")
        if raw_owner:
            owner = OwnerRecord.decode(raw_owner)
            cleanup.delete(k.owned(owner.deployment_id, owner.instance_id, session_id))
            cleanup.delete(k.bell(owner.instance_id, session_id))
        if cleanup.success:
            await cleanup.run(self._store)

    async def _delete_keys(self, session_id: str) -> None:
        """The session's own keys, in bounded txns (DELETE_BATCH keys each)."""
        prefix = self._keys.session_prefix(session_id)
        end = prefix_end(prefix)
        while True:
            page = await (
                Txn()
                .read("keys", prefix, end, keys_only=True, limit=limits.DELETE_BATCH)
                .run(self._store)
            )
            kvs = page.kvs("keys")
            if not kvs:
                return
            await Txn().delete(kvs[0].key, kvs[-1].key + b"\0").run(self._store)


def _snapshot_channel(raw: bytes) -> str:
    """The tenant a stored snapshot names ("" when it cannot be read)."""
    try:
        return s.SessionSnapshot.FromString(raw).channel
    except DecodeError:
        return ""
