"""The oldest unanswered message of each deployment, from the inboxes
themselves: `baton_oldest_unanswered_seconds{deployment}`.

A session's unconsumed commands are exactly the keys left in its inbox
(`s/{sid}/c/in/`: the commit that consumes a command deletes it,
docs/storage.md), so the first key there is its oldest unanswered message,
whoever holds the session: a running owner, a stalled one, one that died and
was not taken over yet, a parked session whose bell rang. The sessions of a
deployment are its ownership index (`i/{deployment}/{instance}/{sid}`). A
sweep reads the index keys-only in chunks, then each session's first inbox
key, SWEEP_BATCH sessions to a read-only transaction; the gauge is set from
each completed sweep, every SWEEP_SECONDS. Every hooks replica sweeps and
reports the same numbers (aggregate with max), as for baton_live_instances.

Cost per sweep: one keys-only range per INDEX_CHUNK index entries and one
transaction of SWEEP_BATCH single-key ranges per SWEEP_BATCH sessions
(100 000 sessions: 20 + 1 563 requests, every 15 s per hooks replica).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import BatonError
from baton_runtime.common.etcd.keys import Keys, prefix_end
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn
from baton_runtime.common.observability import metrics

SWEEP_SECONDS = 15.0
SWEEP_BATCH = 64  # single-key ranges per transaction (etcd allows 128 operations)
INDEX_CHUNK = 5000

log = structlog.get_logger("baton.hooks.unanswered")


class OldestUnanswered:
    """Sweeps every deployment's sessions for their oldest unconsumed command."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        *,
        every: float = SWEEP_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self._every = every
        self._clock = clock

    async def run(self) -> None:
        """Sweep, set the gauge, wait; a failed sweep keeps the last values."""
        while True:
            try:
                ages = await self.sweep()
            except BatonError as exc:
                log.warning("unanswered sweep failed", reason=exc.reason, error=exc.message)
            else:
                metrics.OLDEST_UNANSWERED.clear()
                for deployment, age in ages.items():
                    metrics.OLDEST_UNANSWERED.labels(deployment).set(age)
            await asyncio.sleep(self._every)

    async def sweep(self) -> dict[str, float]:
        """Seconds the oldest unconsumed command of each deployment's
        sessions has waited (0 when none waits), for every deployment with
        sessions in its ownership index."""
        ages: dict[str, float] = {}
        batch: list[tuple[str, str]] = []
        async for deployment, session_id in self._indexed():
            ages.setdefault(deployment, 0.0)
            batch.append((deployment, session_id))
            if len(batch) == SWEEP_BATCH:
                await self._oldest(batch, ages)
                batch = []
        if batch:
            await self._oldest(batch, ages)
        return ages

    async def _indexed(self) -> AsyncIterator[tuple[str, str]]:
        """(deployment, session id) of every ownership index entry."""
        prefix = self._keys.ownership_prefix()
        start, end = prefix, prefix_end(prefix)
        while True:
            page = await (
                Txn().read("owned", start, end, keys_only=True, limit=INDEX_CHUNK).run(self._store)
            )
            kvs = page.kvs("owned")
            for kv in kvs:
                deployment, _, rest = kv.key[len(prefix) :].decode().partition("/")
                yield deployment, rest.rpartition("/")[2]
            if not kvs or not page.more("owned"):
                return
            start = kvs[-1].key + b"\0"

    async def _oldest(self, batch: list[tuple[str, str]], ages: dict[str, float]) -> None:
        """Each session's first inbox entry, in one read-only transaction."""
        txn = Txn()
        for n, (_, session_id) in enumerate(batch):
            inbox = self._keys.inbox_prefix(session_id)
            txn.read(f"in{n}", inbox, prefix_end(inbox), limit=1)
        result = await txn.run(self._store)
        now = self._clock()
        for n, (deployment, _) in enumerate(batch):
            for kv in result.kvs(f"in{n}"):
                entry = s.InboxEntry.FromString(kv.value)
                if entry.HasField("accepted_at"):
                    accepted = entry.accepted_at.seconds + entry.accepted_at.nanos / 1e9
                    ages[deployment] = max(ages[deployment], now - accepted)
