"""The durable inbox (docs/design.md §3): appends, and the fenced inbox stream.

Appends to one session's inbox are group committed inside this process (one
appender task per session, one txn per batch); the inbox-head compare-and-swap
is the cross-process fallback. A delivery id repeated inside a batch is
appended once; one already in the inbox answers with its first receipt.

Delivery ids are remembered for the deduplication window: each `dlv/` key
is put under this replica's current window lease (`expiry.ExpiryLeases`),
and etcd deletes it when the lease expires. Inside the window a repeat finds
the key (compared absent by every append), whichever replica it reaches.

Parking: the append txn also compares the owner record against the cached copy
(`sessions`, corrected from the failure branch), and while that record says
parked it puts the owner instance's bell in the same txn. So a bell is rung
exactly for the arrivals after a successful park, with no race against
(un)parking, and an unparked session still costs one round trip per batch.

The lifetime deadline: the owner record keeps it from the session's park on
(services/hooks/ownership.py), and once it passed every append but the
owner's own timeout is refused as for a finalized session: a parked session
is finalized only once its owner wakes it at the deadline, and nothing sent
in between may start a turn.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from google.protobuf.timestamp_pb2 import Timestamp

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import FailedPrecondition, InvalidArgument, Reason, Unavailable
from baton_runtime.common.etcd.keys import Keys, OwnerRecord, prefix_end, seq_of
from baton_runtime.common.etcd.ops import cmp_absent, cmp_value
from baton_runtime.common.etcd.scope import ScopeCheck
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Fence, Txn, TxnResult
from baton_runtime.common.etcd.watch import watch_then_read
from baton_runtime.common.limits import MAX_COMMAND_BYTES
from baton_runtime.common.observability import metrics
from baton_runtime.common.observability.tracing import check_traceparent
from baton_runtime.common.streams.pages import byte_pages
from baton_runtime.common.tasks import Background
from baton_runtime.hooks.expiry import ExpiryLeases
from baton_runtime.hooks.sessions import CachedSession, SessionCache
from baton_runtime.hooks.tokens import TokenIndex

MAX_BATCH_ENTRIES = 40
MAX_BATCH_BYTES = 1024 * 1024
MAX_APPEND_ATTEMPTS = 50
_INBOX_READ_MIN = 16
_INBOX_READ_MAX = 160  # x MAX_COMMAND_BYTES = 40 MiB: under the etcd client's 48 MiB
_INBOX_READ_BYTES = 2 * 1024 * 1024


def check_command(command: s.Command) -> None:
    size = command.ByteSize()
    if size > MAX_COMMAND_BYTES:
        raise InvalidArgument(
            Reason.MESSAGE_TOO_LARGE,
            f"command is {size} bytes; the limit is {MAX_COMMAND_BYTES}",
        )
    if command.delivery.delivery_id:
        ids.validate_id(command.delivery.delivery_id, "delivery_id")
    check_traceparent(command.delivery.traceparent)


@dataclass
class _Append:
    """One accepted command waiting for its receipt."""

    token: str
    token_entry: bytes  # the index entry it was resolved with (compared)
    command: s.Command
    future: asyncio.Future[s.Receipt]

    @property
    def delivery_id(self) -> str:
        return self.command.delivery.delivery_id


@dataclass
class _SessionQueue:
    pending: list[_Append] = field(default_factory=list)
    running: bool = False


@dataclass
class _Attempt:
    """One try at appending a batch at inbox head `head`: the commands it
    writes (the first of each delivery id, in order) and the repeats that
    share their seq."""

    head: int
    appended: list[_Append]
    repeats: list[tuple[_Append, _Append]]  # (repeat, the first of its delivery id)
    tokens: dict[str, bytes]  # token -> index entry, each compared
    delivery_ids: list[str]  # each compared absent

    @classmethod
    def of(cls, head: int, batch: list[_Append]) -> _Attempt:
        first_by_delivery: dict[str, _Append] = {}
        appended: list[_Append] = []
        repeats: list[tuple[_Append, _Append]] = []
        for item in batch:
            if item.delivery_id and item.delivery_id in first_by_delivery:
                repeats.append((item, first_by_delivery[item.delivery_id]))
                continue
            if item.delivery_id:
                first_by_delivery[item.delivery_id] = item
            appended.append(item)
        tokens = {item.token: item.token_entry for item in appended}
        return cls(head, appended, repeats, tokens, list(first_by_delivery))

    @property
    def new_head(self) -> int:
        return self.head + len(self.appended)

    def seqs(self) -> dict[int, int]:
        """id(item) -> the seq it is appended at."""
        return {id(item): self.head + offset for offset, item in enumerate(self.appended)}


class Inbox:
    """ResumeHook and StreamInbox over one etcd store."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        tokens: TokenIndex,
        sessions: SessionCache,
        leases: ExpiryLeases,
    ) -> None:
        self._store = store
        self._keys = keys
        self._tokens = tokens
        self._sessions = sessions
        self._leases = leases
        self._queues: dict[str, _SessionQueue] = {}
        self._background = Background()

    async def append(self, token: str, command: s.Command, channel: str) -> s.Receipt:
        """Durably append `command` to the inbox of the session `token` names
        (counted once in baton_inbox_appends_total by its outcome)."""
        try:
            receipt = await self._queue_append(token, command, channel)
        except Exception:
            _REFUSED.inc()
            raise
        (_DUPLICATE if receipt.duplicate else _ACCEPTED).inc()
        return receipt

    async def _queue_append(self, token: str, command: s.Command, channel: str) -> s.Receipt:
        check_command(command)
        record, entry = await self._tokens.resolve(token, channel, cached=True)
        future: asyncio.Future[s.Receipt] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(record.session_id)
        if queue is None:
            queue = self._queues[record.session_id] = _SessionQueue()
        queue.pending.append(_Append(token, entry, command, future))
        if not queue.running:
            queue.running = True
            self._background.spawn(self._drain(record.session_id, queue))
        return await asyncio.shield(future)

    async def close(self) -> None:
        await self._background.cancel_all()

    # -- the appender: one task per session with pending commands ---------------

    async def _drain(self, session_id: str, queue: _SessionQueue) -> None:
        try:
            while queue.pending:
                batch = _take_batch(queue)
                metrics.INBOX_APPEND_BATCH.observe(len(batch))
                try:
                    await self._commit_batch(session_id, batch)
                except Exception as exc:  # noqa: BLE001 - handed to every waiter
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(exc)
        finally:
            queue.running = False
            if not queue.pending and self._queues.get(session_id) is queue:
                del self._queues[session_id]

    async def _commit_batch(self, session_id: str, batch: list[_Append]) -> None:
        """Append `batch` in one txn, retried (after learning why from its
        failure branch) until every command has its receipt."""
        for _ in range(MAX_APPEND_ATTEMPTS):
            state = await self._sessions.state(session_id)
            state, batch = await self._refuse_late(session_id, state, batch)
            if not batch:
                return
            attempt = _Attempt.of(state.head, batch)
            result = await self._leases.run(
                functools.partial(self._append_txn, session_id, state, attempt),
                leased=bool(attempt.delivery_ids),
            )
            if result.succeeded:
                state.head = attempt.new_head
                _answer_appended(session_id, state.owner, attempt)
                return
            batch = self._after_refusal(session_id, batch, attempt, result)
        raise Unavailable(Reason.CONFLICT, "inbox append kept racing other appenders; retry")

    async def _refuse_late(
        self, session_id: str, state: CachedSession, batch: list[_Append]
    ) -> tuple[CachedSession, list[_Append]]:
        """Past the session's lifetime deadline (as its owner record keeps it
        from the park on) it is as good as finalized: every command but the
        timeout that finalizes it is refused as for a finalized session. The
        cached record says so without a read; it is read again before
        refusing, as a handoff to another deployment writes a record without
        the old deadline (one read, only for a session past its deadline)."""
        now = time.time()
        if not state.owner.past_deadline(now):
            return state, batch
        timeouts = [item for item in batch if item.command.WhichOneof("kind") == "timeout"]
        if len(timeouts) == len(batch):
            return state, batch
        state = await self._sessions.refresh(session_id)
        if not state.owner.past_deadline(now):
            return state, batch
        refusal = FailedPrecondition(
            Reason.SESSION_FINALIZED,
            f"session {session_id} is finalized: its lifetime timeout passed",
        )
        for item in batch:
            if item.command.WhichOneof("kind") != "timeout" and not item.future.done():
                item.future.set_exception(refusal)
        return state, timeouts

    def _append_txn(
        self, session_id: str, state: CachedSession, attempt: _Attempt, lease: int
    ) -> Txn:
        """Compares: the head, not finalized, the owner record as cached, each
        token's entry, each delivery id absent. Writes: the entries, their
        delivery ids (under the window lease), the new head, and the bell
        while parked. Reads on failure: all that was compared."""
        k, sid = self._keys, session_id
        txn = Txn().require(
            cmp_value(k.inbox_head(sid), str(attempt.head).encode()),
            cmp_absent(k.closed(sid)),
            cmp_value(k.owner(sid), state.owner_raw),
            *(cmp_value(k.token(t), v) for t, v in attempt.tokens.items()),
            *(cmp_absent(k.delivery(sid, d)) for d in attempt.delivery_ids),
        )
        now = Timestamp()
        now.FromNanoseconds(time.time_ns())  # (GetCurrentTime goes through datetime)
        for offset, item in enumerate(attempt.appended):
            seq = attempt.head + offset
            entry = s.InboxEntry(seq=seq, command=item.command, accepted_at=now)
            txn.put(k.inbox_entry(sid, seq), entry.SerializeToString())
            if item.delivery_id:
                txn.put(k.delivery(sid, item.delivery_id), str(seq).encode(), lease)
        new_head = str(attempt.new_head).encode()
        txn.put(k.inbox_head(sid), new_head)
        if state.owner.parked:
            txn.put(k.bell(state.owner.instance_id, sid), new_head)
        txn.read_on_failure("head", k.inbox_head(sid))
        txn.read_on_failure("closed", k.closed(sid))
        txn.read_on_failure("owner", k.owner(sid))
        txn.read_each("tokens", [k.token(t) for t in attempt.tokens], on="failure")
        txn.read_each(
            "deliveries", [k.delivery(sid, d) for d in attempt.delivery_ids], on="failure"
        )
        return txn

    def _after_refusal(
        self, session_id: str, batch: list[_Append], attempt: _Attempt, result: TxnResult
    ) -> list[_Append]:
        """Learn why the append was refused; answer the commands already
        delivered, resubmit those whose token moved, and return the rest to
        try again. Raises when the session is gone or finalized."""
        state = self._sessions.learn(session_id, result.value("head"), result.value("owner"))
        if result.value("closed") is not None:
            raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {session_id} is finalized")
        moved = {
            token
            for (token, entry), now in zip(
                attempt.tokens.items(), result.values("tokens"), strict=True
            )
            if now != entry
        }
        delivered = {
            delivery_id: int(seq)
            for delivery_id, seq in zip(
                attempt.delivery_ids, result.values("deliveries"), strict=True
            )
            if seq is not None
        }
        remaining: list[_Append] = []
        for item in batch:
            if item.delivery_id in delivered:
                seq = delivered[item.delivery_id]
                _answer(item, _receipt(session_id, state.owner, seq, duplicate=True))
            elif item.token in moved:
                self._tokens.forget(item.token)
                self._resubmit(item)
            else:
                remaining.append(item)
        return remaining

    def _resubmit(self, item: _Append) -> None:
        """The token changed under us: resolve it again and append there."""

        async def again() -> None:
            try:
                receipt = await self._queue_append(item.token, item.command, "")
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                if not item.future.done():
                    item.future.set_exception(exc)
                return
            _answer(item, receipt)

        self._background.spawn(again())

    # -- the stream ---------------------------------------------------------------

    async def stream(
        self, fence: s.Fence, from_seq: int, scope: ScopeCheck | None = None
    ) -> AsyncIterator[list[s.InboxEntry]]:
        """The inbox from `from_seq`, then live, until the fence moves. With
        `scope` the first read also reads the owner record and refuses a
        session of another deployment (services/common/etcd/scope.py)."""
        k = self._keys
        sid = fence.session_id
        owner = Fence.of(fence)
        # Deletions are left out of the watch (each commit deletes the entries
        # it consumed; the fence goes only with a finalized session's keys,
        # after its retention, when no run follows it any more).
        watching = watch_then_read(self._store.client, k.control_prefix(sid), puts_only=True)
        async with watching as follower:
            # The backlog (a long one after an outage must not become one
            # message, nor one read): reads of 16 entries, doubled while a
            # read stays under 1 MiB, each sent in pages of MAX_PAGE_BYTES.
            next_seq = from_seq
            limit = _INBOX_READ_MIN
            first_revision = 0
            while True:
                scoped = None if first_revision else scope
                result = await self._backlog_page(owner, scoped, next_seq, limit)
                first_revision = first_revision or result.revision
                read = result.kvs("page")
                sized = ((len(kv.value), s.InboxEntry.FromString(kv.value)) for kv in read)
                for entries in byte_pages(sized):
                    next_seq = entries[-1].seq + 1
                    yield entries
                if not result.more("page"):
                    break
                if sum(len(kv.value) for kv in read) < _INBOX_READ_BYTES // 2:
                    limit = min(limit * 2, _INBOX_READ_MAX)
            fence_key = k.fence(sid)
            async for event in follower.events(first_revision + 1):
                key = event.kv.key
                if key == fence_key:
                    owner.check(event.kv.value)
                    continue
                seq = seq_of(key)
                if seq >= next_seq:
                    next_seq = seq + 1
                    yield [s.InboxEntry.FromString(event.kv.value)]

    async def _backlog_page(
        self, fence: Fence, scope: ScopeCheck | None, next_seq: int, limit: int
    ) -> TxnResult:
        """One page of the inbox from `next_seq`, read with the fence (checked)
        and, with `scope`, the owner record (checked against that deployment)."""
        k = self._keys
        sid = fence.session_id
        read = Txn().read("fence", k.fence(sid))
        if scope is not None:
            read.read("owner", k.owner(sid))
        page_end = prefix_end(k.inbox_prefix(sid))
        read.read("page", k.inbox_entry(sid, next_seq), page_end, limit=limit)
        result = await read.run(self._store)
        fence.check(result.value("fence"))
        if scope is not None:
            scope.confirm(sid, fence.epoch, fence.owner_run_id, result.value("owner"))
        return result


_ACCEPTED = metrics.INBOX_APPENDS.labels("accepted")
_DUPLICATE = metrics.INBOX_APPENDS.labels("duplicate")
_REFUSED = metrics.INBOX_APPENDS.labels("refused")


def _take_batch(queue: _SessionQueue) -> list[_Append]:
    """The next batch off the queue: up to MAX_BATCH_ENTRIES commands and
    MAX_BATCH_BYTES (at least one command)."""
    batch: list[_Append] = []
    size = 0
    while queue.pending and len(batch) < MAX_BATCH_ENTRIES:
        item_size = queue.pending[0].command.ByteSize()
        if batch and size + item_size > MAX_BATCH_BYTES:
            break
        batch.append(queue.pending.pop(0))
        size += item_size
    return batch


def _receipt(
    session_id: str, owner: OwnerRecord, seq: int, *, duplicate: bool = False
) -> s.Receipt:
    return s.Receipt(
        session_id=session_id,
        owner_run_id=owner.owner_run_id,
        seq=seq,
        duplicate=duplicate,
        owner_deployment_id=owner.deployment_id,
    )


def _answer_appended(session_id: str, owner: OwnerRecord, attempt: _Attempt) -> None:
    """Receipts for an append that committed: each command its seq, each
    repeat of a delivery id the seq of its first."""
    seqs = attempt.seqs()
    for item in attempt.appended:
        _answer(item, _receipt(session_id, owner, seqs[id(item)]))
    for item, first in attempt.repeats:
        _answer(item, _receipt(session_id, owner, seqs[id(first)], duplicate=True))


def _answer(item: _Append, receipt: s.Receipt) -> None:
    if not item.future.done():
        item.future.set_result(receipt)
