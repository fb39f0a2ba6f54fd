"""A session's model history behind one small interface (docs/design.md §4, §13).

History entries are appended at consecutive indexes and never rewritten; the
snapshot keeps only the head (`HistoryLog`: next index, context start, context
size, retired mark). Three operations, and a shortcut for the second:

- `stage(session, first_index, entries)`: what the commit transaction must
  write for new entries. In etcd they are one key each, written by the
  step's fenced commit itself. A log or object store would write a
  content-addressed chunk here first and return the put of a pointer key, so
  fencing, the inbox and the handoff would not change.
- `read(session, start, end, revision)`: entries [start, end) in bounded
  batches, as of one etcd revision (the snapshot's read), complete or an
  error.
- `retire(session, from_index, below, guard)`: delete entries below an index
  in bounded transactions, each guarded by the owner's fence.
- `read_newest(txn, session)`: a read the snapshot's own transaction carries
  (in etcd, the newest page of entries); `read(..., carried=its result)`
  takes what it holds of the context from there, so a load whose context fits
  in one page is one round trip. A store that carries nothing adds no read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from aetcd import rpc

from baton_runtime.common import limits
from baton_runtime.common.errors import FailedPrecondition, InvalidArgument, Reason
from baton_runtime.common.etcd.keys import Keys, prefix_end, seq_of
from baton_runtime.common.etcd.ops import op_put
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Txn, TxnResult

_NEWEST = "history.newest"


class HistoryStore(Protocol):
    async def stage(
        self, session_id: str, first_index: int, entries: Sequence[bytes]
    ) -> list[rpc.RequestOp]: ...

    def read(
        self,
        session_id: str,
        start: int,
        end: int,
        revision: int,
        carried: TxnResult | None = None,
    ) -> AsyncIterator[list[bytes]]: ...

    def read_newest(self, txn: Txn, session_id: str) -> Txn: ...

    async def retire(
        self, session_id: str, from_index: int, below: int, guard: rpc.Compare
    ) -> int: ...


class GuardFailed(Exception):
    """A retire transaction's guard (the owner's fence) no longer holds."""


def check_entry(size: int, index: int) -> None:
    if size > limits.MAX_HISTORY_ENTRY_BYTES:
        raise InvalidArgument(
            Reason.HISTORY_ENTRY_TOO_LARGE,
            f"history entry {index} is {size} bytes; the limit is {limits.MAX_HISTORY_ENTRY_BYTES}",
        )


class EtcdHistory:
    """History entries as keys `s/{sid}/h/{index}` next to the session."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._keys = keys

    async def stage(
        self, session_id: str, first_index: int, entries: Sequence[bytes]
    ) -> list[rpc.RequestOp]:
        key = self._keys.history_entry
        return [
            op_put(key(session_id, first_index + offset), raw) for offset, raw in enumerate(entries)
        ]

    def read_newest(self, txn: Txn, session_id: str) -> Txn:
        """Add to `txn` a read of the session's newest READ_PAGE_ENTRIES
        entries (at most 16 MiB, see limits)."""
        prefix = self._keys.history_prefix(session_id)
        return txn.read(
            _NEWEST,
            prefix,
            prefix_end(prefix),
            limit=limits.READ_PAGE_ENTRIES,
            newest_first=True,
        )

    async def read(
        self,
        session_id: str,
        start: int,
        end: int,
        revision: int,
        carried: TxnResult | None = None,
    ) -> AsyncIterator[list[bytes]]:
        """Entries [start, end) as of `revision`: what `carried` (the result
        of a transaction `read_newest` added to, read at `revision`) holds
        of their tail, the rest first, read in pages."""
        tail = _tail(carried, start, end) if carried is not None else []
        async for batch in self._read_pages(session_id, start, end - len(tail), revision):
            yield batch
        if tail:
            yield tail

    async def _read_pages(
        self, session_id: str, start: int, end: int, revision: int
    ) -> AsyncIterator[list[bytes]]:
        key = self._keys.history_entry
        expected = start
        # Pages adapt to the entries' size: small entries (most messages) come
        # in pages of up to READ_PAGE_MAX_ENTRIES, large ones in smaller pages,
        # so a page stays around READ_PAGE_BYTES.
        limit = limits.READ_PAGE_ENTRIES
        while expected < end:
            txn = Txn().read(
                "entries",
                key(session_id, expected),
                key(session_id, end),
                limit=limit,
                revision=revision,
            )
            result = await txn.run(self._store)
            kvs = result.kvs("entries")
            batch: list[bytes] = []
            size = 0
            for kv in kvs:
                if seq_of(kv.key) != expected:
                    break
                batch.append(kv.value)
                size += len(kv.value)
                expected += 1
            if size < limits.READ_PAGE_BYTES // 2:
                limit = min(limit * 2, limits.READ_PAGE_MAX_ENTRIES)
            elif size > limits.READ_PAGE_BYTES:
                limit = max(limit // 2, limits.READ_PAGE_ENTRIES)
            if len(batch) != len(kvs) or not kvs:
                raise FailedPrecondition(
                    Reason.HISTORY_INCOMPLETE,
                    f"history entry {expected} of session {session_id} is missing "
                    f"(the context is [{start}, {end}))",
                )
            yield batch

    async def retire(self, session_id: str, from_index: int, below: int, guard: rpc.Compare) -> int:
        """Delete entries [from_index, below), at most RETIRE_BATCH per txn,
        each txn guarded. Starts at the lowest entry still present. Returns
        how many were deleted. Raises GuardFailed when the guard fails."""
        key = self._keys.history_entry
        lowest = (
            await Txn()
            .read(
                "lowest",
                key(session_id, from_index),
                key(session_id, below),
                keys_only=True,
                limit=1,
            )
            .run(self._store)
        )
        first = lowest.kv("lowest")
        if first is None:
            return 0
        deleted = 0
        low = seq_of(first.key)
        while low < below:
            high = min(low + limits.RETIRE_BATCH, below)
            result = await (
                Txn()
                .require(guard)
                .delete(key(session_id, low), key(session_id, high), name="entries")
                .run(self._store)
            )
            if not result.succeeded:
                raise GuardFailed()
            deleted += result.deleted("entries")
            low = high
        return deleted


def _tail(carried: TxnResult, start: int, end: int) -> list[bytes]:
    """The entries of [start, end) the newest-first read in `carried` holds
    without a gap down from end - 1, oldest first."""
    tail: list[bytes] = []
    for kv in carried.kvs(_NEWEST):
        index = end - 1 - len(tail)
        if index < start or seq_of(kv.key) != index:
            break
        tail.append(kv.value)
    tail.reverse()
    return tail
