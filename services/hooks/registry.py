"""The hook registry on etcd: tokens, the durable inbox, ownership records.

Every transaction stays inside one session's keys plus the index entries
pointing at it (token index, ownership index, bell; DESIGN.md §10). Appends to
one session's inbox are group committed inside this process (one appender per
session, one txn per batch); the inbox-head compare-and-swap is the
cross-process fallback.

Parking: the append txn also compares the owner record against a cached copy
(learned from the failure branch), and while that record says parked it puts
the owner instance's bell in the same txn. So a bell is rung exactly for the
arrivals after a successful park, with no race against (un)parking, and an
unparked session still costs one round trip per batch.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aetcd import rpc
from google.protobuf.timestamp_pb2 import Timestamp

from baton.session.v1 import session_pb2 as s
from services.common import ids
from services.common.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Reason,
    Unavailable,
)
from services.common.etcd import (
    Store,
    cmp_absent,
    cmp_value,
    op_delete,
    op_get,
    op_put,
    single_value,
    watch_then_read,
)
from services.common.keys import (
    Keys,
    OwnerRecord,
    TokenRecord,
    canonical_json,
    fence_value,
    parse_fence,
    prefix_end,
    seq_of,
)

MAX_COMMAND_BYTES = 256 * 1024
MAX_BATCH_ENTRIES = 40
MAX_BATCH_BYTES = 1024 * 1024
MAX_APPEND_ATTEMPTS = 50
_INBOX_PAGE_MIN = 16
_INBOX_PAGE_MAX = 256
_INBOX_PAGE_BYTES = 2 * 1024 * 1024
_SESSION_CACHE_SIZE = 100_000
_TOKEN_CACHE_SIZE = 100_000
_LIST_CHUNK = 64


def _owner_record(owner: s.OwnerIdentity, epoch: int, parked: bool = False) -> OwnerRecord:
    return OwnerRecord(
        owner_run_id=owner.owner_run_id,
        deployment_id=owner.deployment_id,
        instance_id=owner.instance_id,
        epoch=epoch,
        parked=parked,
    )


@dataclass(slots=True)
class _SessionState:
    """What this hooks process last saw of a session's head and owner record."""

    head: int
    owner_raw: bytes
    owner: OwnerRecord


@dataclass(frozen=True)
class TakeOver:
    """The result of a takeover: the successor's fence, and whether the
    session stays parked (then `inbox_head` is its consumed position)."""

    fence: s.Fence
    parked: bool
    inbox_head: int


@dataclass(frozen=True)
class OwnedSession:
    """A session in an instance's ownership index."""

    fence: s.Fence
    owner: OwnerRecord


def check_tenant(namespace: str, record: TokenRecord, channel: str, token: str) -> None:
    """A channel may address only its own aliases and its own sessions.

    An empty channel addresses every tenant: the servicer lets only internal
    callers (owners, by certificate) leave it empty. Another channel's alias
    is refused as such (its namespace says so without a lookup), but another
    channel's session id answers exactly like an unknown one (Google
    AIP-211: no existence leak).
    """
    if not channel:
        return
    if namespace == ids.INBOX_NAMESPACE:
        if record.channel != channel:
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {record.session_id} not found")
        return
    if namespace != channel:
        raise PermissionDenied(
            Reason.CROSS_TENANT,
            f"token {ids.brief(token)} belongs to another channel",
            token=token,
        )


@dataclass
class _Append:
    token: str
    token_value: bytes
    command: s.Command
    future: asyncio.Future[s.Receipt]


@dataclass
class _SessionQueue:
    pending: list[_Append] = field(default_factory=list)
    running: bool = False


class HookRegistry:
    """Domain operations of the hooks service over one etcd store."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self._store = store
        self._keys = keys
        self._queues: dict[str, _SessionQueue] = {}
        self._sessions: OrderedDict[str, _SessionState] = OrderedDict()
        self._tokens: OrderedDict[str, bytes] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- sessions and claims -------------------------------------------------

    async def create_session(
        self,
        session_id: str,
        owner: s.OwnerIdentity,
        channel: str,
        aliases: list[str],
        parent: s.ParentLink | None = None,
        first_command: s.Command | None = None,
    ) -> tuple[s.Fence, list[str], s.InboxEntry | None]:
        """Create the session; with `first_command`, appended as inbox entry
        0 by the same transaction. Returns (fence, claimed tokens, that entry)."""
        ids.validate_session_id(session_id)
        ids.validate_channel(channel)
        ids.validate_deployment_id(owner.deployment_id)
        ids.validate_id(owner.owner_run_id, "owner_run_id")
        ids.validate_id(owner.instance_id, "instance_id")
        k = self._keys
        tokens = [ids.inbox_token(session_id)]
        for alias in aliases:
            ids.split_token(alias)
            if alias not in tokens:
                tokens.append(alias)
        _check_hook_count(len(tokens))
        fence = fence_value(1, owner.owner_run_id)
        link = b""
        if parent is not None and parent.parent_session_id:
            ids.validate_session_id(parent.parent_session_id)
            kept = s.ParentLink()
            kept.CopyFrom(parent)
            del kept.outbox[:]
            link = kept.SerializeToString()
        record = TokenRecord(session_id=session_id, channel=channel, parent=link).encode()
        owner_record = _owner_record(owner, 1)
        owner_raw = owner_record.encode()
        first: s.InboxEntry | None = None
        head = 0
        inbox: list[rpc.RequestOp] = []
        if first_command is not None and first_command.WhichOneof("kind"):
            _check_command(first_command)
            now = Timestamp()
            now.GetCurrentTime()
            first = s.InboxEntry(seq=0, command=first_command, accepted_at=now)
            head = 1
            inbox.append(op_put(k.inbox_entry(session_id, 0), first.SerializeToString()))
            if first_command.delivery.delivery_id:
                delivery = k.delivery(session_id, first_command.delivery.delivery_id)
                inbox.append(op_put(delivery, b"0"))
        compare = [cmp_absent(k.fence(session_id))] + [cmp_absent(k.token(t)) for t in tokens]
        success = [
            op_put(k.fence(session_id), fence),
            op_put(k.owner(session_id), owner_raw),
            op_put(k.owned(owner.deployment_id, owner.instance_id, session_id), fence),
            op_put(k.hooks(session_id), canonical_json(tokens)),
            op_put(k.inbox_head(session_id), str(head).encode()),
            *inbox,
        ] + [op_put(k.token(t), record) for t in tokens]
        failure = [
            op_get(k.fence(session_id)),
            op_get(k.hooks(session_id)),
            op_get(k.inbox_entry(session_id, 0)),
        ] + [op_get(k.token(t)) for t in tokens]
        response = await self._store.txn(compare, success, failure)
        result = s.Fence(session_id=session_id, owner_run_id=owner.owner_run_id, epoch=1)
        if response.succeeded:
            self._remember(session_id, _SessionState(head, owner_raw, owner_record))
            return result, tokens, first
        existing = single_value(response.responses[0])
        if existing == fence:  # a retry of the create that already succeeded
            raw = single_value(response.responses[2])
            entry = s.InboxEntry.FromString(raw) if raw is not None and first else None
            return result, json.loads(single_value(response.responses[1]) or b"[]"), entry
        if existing is not None:
            _, run = existing.decode().partition("/")[::2]
            raise AlreadyExists(
                Reason.SESSION_EXISTS,
                f"session {session_id} already exists",
                session_id=session_id,
                owner_run_id=run,
            )
        for token, got in zip(tokens, response.responses[3:], strict=True):
            holder = single_value(got)
            if holder is not None:
                held_by = TokenRecord.decode(holder).session_id
                raise AlreadyExists(
                    Reason.TOKEN_CLAIMED,
                    f"token {token!r} is held by session {held_by}",
                    token=token,
                    session_id=held_by,
                )
        raise Unavailable(Reason.CONFLICT, "create raced a concurrent change; retry")

    async def claim(self, fence: s.Fence, tokens: list[str], channel: str = "") -> list[str]:
        """Claim tokens for the fenced session, all or nothing."""
        for token in tokens:
            ids.split_token(token)
        k = self._keys
        sid = fence.session_id
        for _ in range(MAX_APPEND_ATTEMPTS):
            current_raw, current = await self._read_hooks(fence)
            new = [t for t in dict.fromkeys(tokens) if t not in current]
            if not new:
                return current
            updated = current + new
            _check_hook_count(len(updated))
            record = await self._session_record(sid, channel)
            compare = [
                cmp_value(k.fence(sid), fence_value(fence.epoch, fence.owner_run_id)),
                cmp_value(k.hooks(sid), current_raw),
            ] + [cmp_absent(k.token(t)) for t in new]
            success = [op_put(k.hooks(sid), canonical_json(updated))] + [
                op_put(k.token(t), record) for t in new
            ]
            failure = [op_get(k.fence(sid)), op_get(k.hooks(sid))] + [
                op_get(k.token(t)) for t in new
            ]
            response = await self._store.txn(compare, success, failure)
            if response.succeeded:
                return updated
            self._check_fence(fence, single_value(response.responses[0]))
            for token, got in zip(new, response.responses[2:], strict=True):
                holder = single_value(got)
                if holder is not None:
                    held_by = TokenRecord.decode(holder).session_id
                    raise AlreadyExists(
                        Reason.TOKEN_CLAIMED,
                        f"token {token!r} is held by session {held_by}",
                        token=token,
                        session_id=held_by,
                    )
        raise Unavailable(Reason.CONFLICT, "claim kept racing concurrent changes; retry")

    async def dispose(self, fence: s.Fence, tokens: list[str]) -> list[str]:
        """Release tokens (all when `tokens` is empty) held by the fenced session."""
        k = self._keys
        sid = fence.session_id
        for _ in range(MAX_APPEND_ATTEMPTS):
            current_raw, current = await self._read_hooks(fence)
            drop = [t for t in current if not tokens or t in tokens]
            remaining = [t for t in current if t not in drop]
            compare = [
                cmp_value(k.fence(sid), fence_value(fence.epoch, fence.owner_run_id)),
                cmp_value(k.hooks(sid), current_raw),
            ]
            success = [op_put(k.hooks(sid), canonical_json(remaining))] + [
                op_delete(k.token(t)) for t in drop
            ]
            response = await self._store.txn(compare, success, [op_get(k.fence(sid))])
            if response.succeeded:
                for t in drop:
                    self._tokens.pop(t, None)
                return remaining
            self._check_fence(fence, single_value(response.responses[0]))
        raise Unavailable(Reason.CONFLICT, "dispose kept racing concurrent changes; retry")

    async def _read_hooks(self, fence: s.Fence) -> tuple[bytes, list[str]]:
        k = self._keys
        sid = fence.session_id
        response = await self._store.txn([], [op_get(k.fence(sid)), op_get(k.hooks(sid))], [])
        self._check_fence(fence, single_value(response.responses[0]))
        raw = single_value(response.responses[1]) or b"[]"
        current: list[str] = json.loads(raw)
        return raw, current

    async def _session_record(self, session_id: str, channel: str) -> bytes:
        token = ids.inbox_token(session_id)
        raw = await self._token_value(token)
        if raw is None:
            return TokenRecord(session_id=session_id, channel=channel).encode()
        return raw

    def _check_fence(self, fence: s.Fence, current: bytes | None) -> None:
        expected = fence_value(fence.epoch, fence.owner_run_id)
        if current is None:
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {fence.session_id} not found")
        if current != expected:
            raise Fenced(
                f"owner run {fence.owner_run_id} epoch {fence.epoch} no longer owns "
                f"session {fence.session_id}",
                session_id=fence.session_id,
            )

    # -- ownership: takeover and parking ---------------------------------------

    async def take_over(
        self, expected: s.Fence, expected_instance_id: str, successor: s.OwnerIdentity
    ) -> TakeOver:
        """Move a session from a dead instance to `successor` with epoch + 1.

        A compare-and-swap of the fence and the owner record: the first caller
        wins; the others get ABORTED/FENCED. A replay by the winner (same
        successor run) returns the same result. The ownership index moves in
        the same txn. A parked session stays parked when nothing arrived since
        it parked (no bell rang); then the successor need not load it.
        """
        sid = ids.validate_session_id(expected.session_id)
        ids.validate_id(expected_instance_id, "expected_instance_id")
        ids.validate_deployment_id(successor.deployment_id)
        ids.validate_id(successor.owner_run_id, "owner_run_id")
        ids.validate_id(successor.instance_id, "instance_id")
        k = self._keys
        expected_fence = fence_value(expected.epoch, expected.owner_run_id)
        epoch = expected.epoch + 1
        new_fence = fence_value(epoch, successor.owner_run_id)
        result = s.Fence(session_id=sid, owner_run_id=successor.owner_run_id, epoch=epoch)
        for _ in range(MAX_APPEND_ATTEMPTS):
            read = await self._store.txn(
                [],
                [
                    op_get(k.fence(sid)),
                    op_get(k.owner(sid)),
                    op_get(k.inbox_head(sid)),
                    op_get(k.closed(sid)),
                    op_get(k.bell(expected_instance_id, sid)),
                    op_get(k.instance(successor.deployment_id, expected_instance_id)),
                ],
                [],
            )
            fence_now, owner_raw, head_raw, closed, bell, live = (
                single_value(r) for r in read.responses
            )
            if fence_now is None or owner_raw is None or head_raw is None:
                raise NotFound(Reason.SESSION_NOT_FOUND, f"session {sid} not found")
            record = OwnerRecord.decode(owner_raw)
            if fence_now == new_fence:  # a replay of our own takeover
                self._learn(sid, head_raw, owner_raw)
                return TakeOver(result, record.parked, int(head_raw))
            if fence_now != expected_fence or record.instance_id != expected_instance_id:
                raise Aborted(
                    Reason.FENCED,
                    f"session {sid} is no longer owned by run {expected.owner_run_id} "
                    f"on instance {expected_instance_id}",
                    session_id=sid,
                )
            if record.deployment_id != successor.deployment_id:
                raise FailedPrecondition(
                    Reason.WRONG_DEPLOYMENT,
                    f"session {sid} runs deployment {record.deployment_id}, "
                    f"not {successor.deployment_id}",
                )
            old_index = k.owned(record.deployment_id, expected_instance_id, sid)
            if closed is not None:
                # Finalized: nothing to run. Drop its index entry, fenced.
                await self._store.txn(
                    [cmp_value(k.fence(sid), expected_fence)], [op_delete(old_index)], []
                )
                raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {sid} is finalized")
            if live is not None and expected_instance_id != successor.instance_id:
                raise FailedPrecondition(
                    Reason.INSTANCE_LIVE,
                    f"instance {expected_instance_id} still holds its lease",
                    instance_id=expected_instance_id,
                )
            parked = record.parked and bell is None
            new_record = _owner_record(successor, epoch, parked)
            new_raw = new_record.encode()
            success = [
                op_put(k.fence(sid), new_fence),
                op_put(k.owner(sid), new_raw),
                op_put(k.owned(successor.deployment_id, successor.instance_id, sid), new_fence),
            ]
            if expected_instance_id != successor.instance_id:
                success.append(op_delete(old_index))
            if bell is not None:
                success.append(op_delete(k.bell(expected_instance_id, sid)))
            response = await self._store.txn(
                [
                    cmp_value(k.fence(sid), expected_fence),
                    cmp_value(k.owner(sid), owner_raw),
                    cmp_value(k.inbox_head(sid), head_raw),
                ],
                success,
                [],
            )
            if response.succeeded:
                self._remember(sid, _SessionState(int(head_raw), new_raw, new_record))
                return TakeOver(result, parked, int(head_raw))
            # Something moved (an arrival, a park) between the read and the txn: again.
        raise Unavailable(Reason.CONFLICT, "takeover kept racing concurrent changes; retry")

    async def set_parked(self, fence: s.Fence, parked: bool, inbox_next_seq: int) -> int:
        """Park (only when every inbox entry is consumed) or unpark a session.

        One txn comparing the fence, the owner record and, when parking, that
        the inbox head equals `inbox_next_seq`. Unparking deletes the bell.
        Returns the inbox head. Repeating a request that took effect succeeds.
        """
        sid = ids.validate_session_id(fence.session_id)
        k = self._keys
        expected = fence_value(fence.epoch, fence.owner_run_id)
        for _ in range(MAX_APPEND_ATTEMPTS):
            state = await self._state(sid)
            if state.owner.fence != expected or state.owner.parked == parked:
                # Our cache may be stale: verify against etcd before refusing or
                # answering "already done".
                state = await self._refresh(sid)
                self._check_fence(fence, state.owner.fence)
                if state.owner.parked == parked:
                    return state.head
            record = state.owner
            new_record = OwnerRecord(
                owner_run_id=record.owner_run_id,
                deployment_id=record.deployment_id,
                instance_id=record.instance_id,
                epoch=record.epoch,
                parked=parked,
            )
            new_raw = new_record.encode()
            compare = [cmp_value(k.fence(sid), expected), cmp_value(k.owner(sid), state.owner_raw)]
            success = [op_put(k.owner(sid), new_raw)]
            if parked:
                compare.append(cmp_value(k.inbox_head(sid), str(inbox_next_seq).encode()))
            else:
                success.append(op_delete(k.bell(record.instance_id, sid)))
            success.append(op_get(k.inbox_head(sid)))
            failure = [op_get(k.fence(sid)), op_get(k.owner(sid)), op_get(k.inbox_head(sid))]
            response = await self._store.txn(compare, success, failure)
            if response.succeeded:
                head_raw = single_value(response.responses[-1])
                head = int(head_raw or b"0")
                self._remember(sid, _SessionState(head, new_raw, new_record))
                return head
            used_raw = state.owner_raw
            fence_now, owner_raw, head_raw = (single_value(r) for r in response.responses)
            self._check_fence(fence, fence_now)
            state = self._learn(sid, head_raw, owner_raw)
            if parked and state.owner_raw == used_raw and state.head != inbox_next_seq:
                raise Aborted(
                    Reason.INBOX_NOT_DRAINED,
                    f"session {sid} has inbox entries up to {state.head}; "
                    f"consumed up to {inbox_next_seq}",
                    session_id=sid,
                    inbox_head=str(state.head),
                )
            # The owner record changed under our cache: again with the fresh one.
        raise Unavailable(Reason.CONFLICT, "park kept racing concurrent changes; retry")

    async def _refresh(self, session_id: str) -> _SessionState:
        self._sessions.pop(session_id, None)
        return await self._state(session_id)

    async def list_owned(self, deployment_id: str, instance_id: str) -> list[OwnedSession]:
        """The sessions an instance owns (its ownership index), with their
        current owner records (read in chunks, one read txn each)."""
        ids.validate_deployment_id(deployment_id)
        ids.validate_id(instance_id, "instance_id")
        k = self._keys
        prefix = k.owned_prefix(deployment_id, instance_id)
        response = await self._store.txn([], [op_get(prefix, prefix_end(prefix))], [])
        entries = [
            (kv.key[len(prefix) :].decode(), kv.value)
            for kv in response.responses[0].response_range.kvs
        ]
        owned: list[OwnedSession] = []
        for start in range(0, len(entries), _LIST_CHUNK):
            chunk = entries[start : start + _LIST_CHUNK]
            read = await self._store.txn([], [op_get(k.owner(sid)) for sid, _ in chunk], [])
            for (sid, indexed), got in zip(chunk, read.responses, strict=True):
                raw = single_value(got)
                if raw is None:
                    continue
                record = OwnerRecord.decode(raw)
                if record.fence != indexed or record.instance_id != instance_id:
                    continue  # moved on since the listing
                epoch, run = parse_fence(indexed)
                owned.append(
                    OwnedSession(
                        fence=s.Fence(session_id=sid, owner_run_id=run, epoch=epoch),
                        owner=record,
                    )
                )
        return owned

    # -- token resolution ----------------------------------------------------

    async def _token_value(self, token: str, *, cached: bool = True) -> bytes | None:
        """The token's index entry: from the cache when `cached` (only for
        callers whose txn compares the value, see `resume`), else from etcd
        (refreshing the cache)."""
        hit = self._tokens.get(token) if cached else None
        if hit is not None:
            self._tokens.move_to_end(token)
            return hit
        response = await self._store.txn([], [op_get(self._keys.token(token))], [])
        value = single_value(response.responses[0])
        if value is not None:
            self._tokens[token] = value
            self._tokens.move_to_end(token)
            if len(self._tokens) > _TOKEN_CACHE_SIZE:
                self._tokens.popitem(last=False)
        else:
            self._tokens.pop(token, None)
        return value

    async def lookup(self, token: str, channel: str, *, cached: bool = False) -> TokenRecord:
        """The session `token` names, checked against the caller's tenancy.

        Read from etcd: another hooks replica may have disposed the token (or
        it may name another session since), and this process's cache would
        not know. Only `resume` reads the cache (`cached=True`): its append
        txn compares the token's entry, so a stale one costs a retry, never a
        wrong append."""
        namespace, _ = ids.split_token(token)
        if channel and namespace not in (channel, ids.INBOX_NAMESPACE):
            raise PermissionDenied(
                Reason.CROSS_TENANT, f"token {token!r} belongs to another channel", token=token
            )
        raw = await self._token_value(token, cached=cached)
        if raw is None:
            if namespace == ids.INBOX_NAMESPACE:
                raise NotFound(Reason.SESSION_NOT_FOUND, f"session {token[8:]} not found")
            raise NotFound(Reason.TOKEN_NOT_FOUND, f"no session holds token {token!r}", token=token)
        record = TokenRecord.decode(raw)
        check_tenant(namespace, record, channel, token)
        return record

    # -- the inbox -----------------------------------------------------------

    async def resume(self, token: str, command: s.Command, channel: str) -> s.Receipt:
        """Durably append `command` to the inbox of the session `token` names."""
        _check_command(command)
        record = await self.lookup(token, channel, cached=True)
        raw = self._tokens.get(token)
        assert raw is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[s.Receipt] = loop.create_future()
        queue = self._queues.get(record.session_id)
        if queue is None:
            queue = self._queues[record.session_id] = _SessionQueue()
        queue.pending.append(_Append(token, raw, command, future))
        if not queue.running:
            queue.running = True
            task = loop.create_task(self._drain(record.session_id, queue))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(future)

    async def _drain(self, session_id: str, queue: _SessionQueue) -> None:
        try:
            while queue.pending:
                batch: list[_Append] = []
                size = 0
                while queue.pending and len(batch) < MAX_BATCH_ENTRIES:
                    item_size = queue.pending[0].command.ByteSize()
                    if batch and size + item_size > MAX_BATCH_BYTES:
                        break
                    batch.append(queue.pending.pop(0))
                    size += item_size
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

    async def _state(self, session_id: str) -> _SessionState:
        """The cached head and owner record; read both in one go when unknown."""
        state = self._sessions.get(session_id)
        if state is not None:
            self._sessions.move_to_end(session_id)
            return state
        k = self._keys
        response = await self._store.txn(
            [], [op_get(k.inbox_head(session_id)), op_get(k.owner(session_id))], []
        )
        return self._learn(
            session_id, single_value(response.responses[0]), single_value(response.responses[1])
        )

    def owner_moved(self, session_id: str, head: int, owner_raw: bytes) -> None:
        """Another component of this process (a transfer) wrote a new owner
        record: cache it, so the next append does not fail its compare first."""
        self._learn(session_id, str(head).encode(), owner_raw)

    def _learn(self, session_id: str, head: bytes | None, owner: bytes | None) -> _SessionState:
        """Cache what a read (or a failure branch) returned."""
        if head is None or owner is None:
            self._sessions.pop(session_id, None)
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} not found")
        state = self._sessions.get(session_id)
        if state is None or state.owner_raw != owner:
            state = _SessionState(int(head), owner, OwnerRecord.decode(owner))
        else:
            state.head = int(head)
        return self._remember(session_id, state)

    def _remember(self, session_id: str, state: _SessionState) -> _SessionState:
        self._sessions[session_id] = state
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > _SESSION_CACHE_SIZE:
            self._sessions.popitem(last=False)
        return state

    async def _commit_batch(self, session_id: str, batch: list[_Append]) -> None:
        k = self._keys
        for _ in range(MAX_APPEND_ATTEMPTS):
            if not batch:
                return
            state = await self._state(session_id)
            head = state.head
            # A delivery id repeated inside the batch is appended once.
            first_by_delivery: dict[str, _Append] = {}
            appended: list[_Append] = []
            followers: list[tuple[_Append, _Append]] = []
            for item in batch:
                delivery_id = item.command.delivery.delivery_id
                if delivery_id and delivery_id in first_by_delivery:
                    followers.append((item, first_by_delivery[delivery_id]))
                    continue
                if delivery_id:
                    first_by_delivery[delivery_id] = item
                appended.append(item)
            tokens = {item.token: item.token_value for item in appended}
            delivery_ids = list(first_by_delivery)
            now = Timestamp()
            now.GetCurrentTime()
            compare = [
                cmp_value(k.inbox_head(session_id), str(head).encode()),
                cmp_absent(k.closed(session_id)),
                cmp_value(k.owner(session_id), state.owner_raw),
            ]
            compare += [cmp_value(k.token(t), v) for t, v in tokens.items()]
            compare += [cmp_absent(k.delivery(session_id, d)) for d in delivery_ids]
            success: list[rpc.RequestOp] = []
            seqs: dict[int, int] = {}
            for offset, item in enumerate(appended):
                seq = head + offset
                seqs[id(item)] = seq
                entry = s.InboxEntry(seq=seq, command=item.command, accepted_at=now)
                success.append(op_put(k.inbox_entry(session_id, seq), entry.SerializeToString()))
                delivery_id = item.command.delivery.delivery_id
                if delivery_id:
                    success.append(op_put(k.delivery(session_id, delivery_id), str(seq).encode()))
            new_head = head + len(appended)
            success.append(op_put(k.inbox_head(session_id), str(new_head).encode()))
            if state.owner.parked:
                bell = k.bell(state.owner.instance_id, session_id)
                success.append(op_put(bell, str(new_head).encode()))
            failure = [
                op_get(k.inbox_head(session_id)),
                op_get(k.closed(session_id)),
                op_get(k.owner(session_id)),
            ]
            failure += [op_get(k.token(t)) for t in tokens]
            failure += [op_get(k.delivery(session_id, d)) for d in delivery_ids]
            response = await self._store.txn(compare, success, failure)
            if response.succeeded:
                state.head = new_head
                run = state.owner.owner_run_id
                owner_deployment = state.owner.deployment_id
                for item in appended:
                    _settle(
                        item,
                        s.Receipt(
                            session_id=session_id,
                            owner_run_id=run,
                            seq=seqs[id(item)],
                            owner_deployment_id=owner_deployment,
                        ),
                    )
                for item, first in followers:
                    _settle(
                        item,
                        s.Receipt(
                            session_id=session_id,
                            owner_run_id=run,
                            seq=seqs[id(first)],
                            duplicate=True,
                            owner_deployment_id=owner_deployment,
                        ),
                    )
                return
            # Failure branch: learn why from the same round trip, then retry the rest.
            responses = list(response.responses)
            state = self._learn(session_id, single_value(responses[0]), single_value(responses[2]))
            if single_value(responses[1]) is not None:
                raise FailedPrecondition(
                    Reason.SESSION_FINALIZED, f"session {session_id} is finalized"
                )
            run = state.owner.owner_run_id
            token_values = responses[3 : 3 + len(tokens)]
            moved = {
                t
                for (t, v), got in zip(tokens.items(), token_values, strict=True)
                if single_value(got) != v
            }
            delivered: dict[str, int] = {}
            for d, got in zip(delivery_ids, responses[3 + len(tokens) :], strict=True):
                value = single_value(got)
                if value is not None:
                    delivered[d] = int(value)
            remaining: list[_Append] = []
            for item in batch:
                delivery_id = item.command.delivery.delivery_id
                if delivery_id in delivered:
                    _settle(
                        item,
                        s.Receipt(
                            session_id=session_id,
                            owner_run_id=run,
                            seq=delivered[delivery_id],
                            duplicate=True,
                            owner_deployment_id=state.owner.deployment_id,
                        ),
                    )
                elif item.token in moved:
                    self._tokens.pop(item.token, None)
                    self._resubmit(item)
                else:
                    remaining.append(item)
            batch = remaining
        raise Unavailable(Reason.CONFLICT, "inbox append kept racing other appenders; retry")

    def _resubmit(self, item: _Append) -> None:
        """The token changed under us: resolve it again and append there."""

        async def again() -> None:
            try:
                receipt = await self.resume(item.token, item.command, "")
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                if not item.future.done():
                    item.future.set_exception(exc)
                return
            _settle(item, receipt)

        task = asyncio.get_running_loop().create_task(again())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stream_inbox(
        self, fence: s.Fence, from_seq: int
    ) -> AsyncIterator[list[s.InboxEntry]]:
        """The inbox from `from_seq`, then live, until the fence moves."""
        k = self._keys
        sid = fence.session_id
        expected = fence_value(fence.epoch, fence.owner_run_id)
        async with watch_then_read(self._store.client, k.control_prefix(sid)) as follower:
            # The backlog in pages (a long one after an outage must not become
            # one message): small commands in pages of up to 256, large ones
            # in pages of 16 (16 x MAX_COMMAND_BYTES = 4 MiB).
            next_seq = from_seq
            limit = _INBOX_PAGE_MIN
            first_revision = 0
            while True:
                response = await self._store.txn(
                    [],
                    [
                        op_get(k.fence(sid)),
                        op_get(
                            k.inbox_entry(sid, next_seq),
                            prefix_end(k.inbox_prefix(sid)),
                            limit=limit,
                        ),
                    ],
                    [],
                )
                self._check_fence(fence, single_value(response.responses[0]))
                first_revision = first_revision or response.header.revision
                page = response.responses[1].response_range
                entries = [s.InboxEntry.FromString(kv.value) for kv in page.kvs]
                if entries:
                    next_seq = entries[-1].seq + 1
                    yield entries
                if not page.more:
                    break
                size = sum(len(kv.value) for kv in page.kvs)
                if size < _INBOX_PAGE_BYTES // 2:
                    limit = min(limit * 2, _INBOX_PAGE_MAX)
            fence_key = k.fence(sid)
            async for event in follower.events(first_revision + 1):
                key = event.kv.key
                if key == fence_key:
                    if event.kv.value != expected:
                        raise Fenced(
                            f"owner run {fence.owner_run_id} lost session {sid}", session_id=sid
                        )
                    continue
                if not event.kv.value:
                    continue
                seq = seq_of(key)
                if seq >= next_seq:
                    next_seq = seq + 1
                    yield [s.InboxEntry.FromString(event.kv.value)]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


def _settle(item: _Append, receipt: s.Receipt) -> None:
    if not item.future.done():
        item.future.set_result(receipt)


def _check_command(command: s.Command) -> None:
    size = command.ByteSize()
    if size > MAX_COMMAND_BYTES:
        raise InvalidArgument(
            Reason.MESSAGE_TOO_LARGE,
            f"command is {size} bytes; the limit is {MAX_COMMAND_BYTES}",
        )
    if command.delivery.delivery_id:
        ids.validate_id(command.delivery.delivery_id, "delivery_id")


def _check_hook_count(count: int) -> None:
    if count > ids.MAX_HOOKS_PER_SESSION:
        raise InvalidArgument(
            Reason.TOO_MANY_HOOKS,
            f"a session may hold at most {ids.MAX_HOOKS_PER_SESSION} addresses; "
            f"this would make {count}",
        )
