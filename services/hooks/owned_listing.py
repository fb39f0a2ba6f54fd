"""Listing an instance's sessions from the ownership index
(ListInstanceSessions; docs/design.md §5), a page at a time.

A page is one read of up to `page_size` index entries after the page token,
then their owner records and, for one instance, their bells, read together
in chunks (one read txn each, a few in flight): a parked session whose bell
rang (input waiting) is `input_waiting`, so a successor tells the sessions
to claim first (running, or parked with input) from the quiet parked ones,
from the owner records' `parked` flags and the bells, each written in the
txn of the state it describes (the park, the append).

Paged because one answer holding every session of a big instance would
outgrow the answer's size limit (4 MiB: about 28,000 sessions), and a
takeover or reconciliation of that instance could then never list it.
The token is the last index entry read, `{instance id}/{session id}`, so a
page of entries that all moved away is empty and still names the next.
`page_size` 0 is the unpaged listing of older clients.

An `index_only` page reads no owner record: the index entries and, for one
instance, one keys-only range of the bells over the page's sessions, two
reads a page. It is what the owner's periodic reconciliation checks (its
own sessions' fences, and bells that rang), at a small part of the cost.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import NamedTuple

from baton_runtime.common import ids
from baton_runtime.common.bounds import MAX_LISTING_PAGE, check_range
from baton_runtime.common.errors import InvalidArgument, Reason
from baton_runtime.common.etcd.keys import Keys, OwnerRecord, parse_fence, prefix_end
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Fence, Txn
from baton_runtime.hooks.ownership import OwnedSession

MAX_PAGE_TOKEN = 256  # an instance id (at most 128) / a session id
_CHUNK = 64
_READS = 4  # chunk reads of one page in flight at once


@dataclass(frozen=True)
class OwnedPage:
    sessions: list[OwnedSession]
    next_page_token: str  # empty: the last page


class _IndexEntry(NamedTuple):
    """One ownership index entry: the session, the instance it is indexed
    under, and the fence the index names."""

    session_id: str
    holder: str
    fence: bytes


def check_page(instance_id: str, page_token: str, page_size: int) -> None:
    """A page request's bounds (InvalidArgument): the size, and a token that
    names an instance (this one, when one is named) and a session."""
    check_range(page_size, "page_size", MAX_LISTING_PAGE)
    if not page_token:
        return
    holder, _, session_id = page_token.rpartition("/")
    if len(page_token) > MAX_PAGE_TOKEN or not holder or not session_id:
        raise InvalidArgument(Reason.INVALID_PAGE_TOKEN, "page_token is not one a listing gave")
    ids.validate_id(holder, "page_token's instance id")
    ids.validate_session_id(session_id)
    if instance_id and holder != instance_id:
        raise InvalidArgument(Reason.INVALID_PAGE_TOKEN, "page_token is of another instance")


class OwnedListing:
    """The pages of an instance's (or a deployment's) ownership index."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._keys = keys

    async def page(
        self,
        deployment_id: str,
        instance_id: str,
        page_token: str = "",
        page_size: int = 0,
        *,
        index_only: bool = False,
    ) -> OwnedPage:
        """Up to `page_size` (0: every one) of the sessions an instance owns,
        after `page_token`, with their current owner records (`index_only`:
        as the index names them); every instance's, live or gone, when
        `instance_id` is empty."""
        ids.validate_deployment_id(deployment_id)
        if instance_id:
            ids.validate_id(instance_id, "instance_id")
        check_page(instance_id, page_token, page_size)
        entries, next_token = await self._read_index(
            deployment_id, instance_id, page_token, page_size
        )
        if index_only:
            rung = await self._read_bells(entries, instance_id)
            return OwnedPage(
                [_indexed(deployment_id, e, e.session_id in rung) for e in entries], next_token
            )
        chunks = [entries[i : i + _CHUNK] for i in range(0, len(entries), _CHUNK)]
        slots = asyncio.Semaphore(_READS)
        read = await asyncio.gather(
            *(self._read_chunk(chunk, instance_id, slots) for chunk in chunks)
        )
        sessions = [
            owned
            for chunk, (raws, rung) in zip(chunks, read, strict=True)
            for entry, raw, bell in zip(chunk, raws, rung, strict=True)
            if (owned := _owned_session(entry, raw, bell)) is not None
        ]
        return OwnedPage(sessions, next_token)

    async def _read_index(
        self, deployment_id: str, instance_id: str, page_token: str, page_size: int
    ) -> tuple[list[_IndexEntry], str]:
        """One read: the page's index entries (session, the instance it is
        indexed under, fence), and the token of the page after it."""
        every = self._keys.owned_prefix(deployment_id)
        prefix = self._keys.owned_prefix(deployment_id, instance_id)
        start = every + page_token.encode() + b"\x00" if page_token else prefix
        listed = (
            await Txn().read("owned", start, prefix_end(prefix), limit=page_size).run(self._store)
        )
        entries = []
        last = ""
        for kv in listed.kvs("owned"):
            last = kv.key[len(every) :].decode()
            holder, _, sid = last.rpartition("/")
            entries.append(_IndexEntry(sid, holder, kv.value))
        full = page_size > 0 and len(entries) == page_size
        return entries, last if full else ""

    async def _read_chunk(
        self, chunk: list[_IndexEntry], instance_id: str, slots: asyncio.Semaphore
    ) -> tuple[list[bytes | None], list[bool]]:
        """The chunk's owner records and, for one instance, whether each
        session's bell rang: one read txn, with the bells as one keys-only
        range over the chunk's sessions (the index lists them in key order)."""
        k = self._keys
        txn = Txn().read_each("owners", [k.owner(e.session_id) for e in chunk])
        if instance_id:
            txn.read("bells", *_bell_span(k, instance_id, chunk), keys_only=True)
        async with slots:
            read = await txn.run(self._store)
        raws = list(read.values("owners"))
        if not instance_id:
            return raws, [False] * len(chunk)
        rung = {kv.key for kv in read.kvs("bells")}
        return raws, [k.bell(instance_id, e.session_id) in rung for e in chunk]

    async def _read_bells(self, entries: list[_IndexEntry], instance_id: str) -> set[str]:
        """The sessions among `entries` whose bell rang: one keys-only range
        read over their span (none without an instance, or entries)."""
        if not instance_id or not entries:
            return set()
        span = _bell_span(self._keys, instance_id, entries)
        read = await Txn().read("bells", *span, keys_only=True).run(self._store)
        prefix = self._keys.bell_prefix(instance_id)
        return {kv.key[len(prefix) :].decode() for kv in read.kvs("bells")}


def _bell_span(keys: Keys, instance_id: str, entries: list[_IndexEntry]) -> tuple[bytes, bytes]:
    """The key range of the instance's bells from the first entry's session
    to the last's (entries come in session id order)."""
    first, last = entries[0].session_id, entries[-1].session_id
    return keys.bell(instance_id, first), keys.bell(instance_id, last) + b"\x00"


def _indexed(deployment_id: str, entry: _IndexEntry, rung: bool) -> OwnedSession:
    """An index entry as it names its session's owner (maybe stale)."""
    epoch, run = parse_fence(entry.fence)
    record = OwnerRecord(run, deployment_id, entry.holder, epoch)
    return OwnedSession(Fence(entry.session_id, run, epoch).proto(), record, input_waiting=rung)


def _owned_session(entry: _IndexEntry, raw: bytes | None, rung: bool) -> OwnedSession | None:
    """The listing's view of one index entry, or None when its owner record
    is gone or moved on (another fence or instance) since the listing."""
    if raw is None:
        return None
    record = OwnerRecord.decode(raw)
    if record.fence != entry.fence or record.instance_id != entry.holder:
        return None
    epoch, run = parse_fence(entry.fence)
    return OwnedSession(
        fence=Fence(entry.session_id, run, epoch).proto(),
        owner=record,
        input_waiting=record.parked and rung,
    )
