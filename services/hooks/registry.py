"""The hook registry on etcd: tokens, the durable inbox, ownership records.

Every transaction stays inside one session's keys plus the token-index entries
pointing at it (DESIGN.md §10). Appends to one session's inbox are group
committed inside this process (one appender per session, one txn per batch);
the inbox-head compare-and-swap is the cross-process fallback.
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
    AlreadyExists,
    Fenced,
    FailedPrecondition,
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
    follow_range,
    op_delete,
    op_get,
    op_put,
    single_value,
)
from services.common.keys import Keys, TokenRecord, canonical_json, fence_value, prefix_end, seq_of

MAX_COMMAND_BYTES = 256 * 1024
MAX_BATCH_ENTRIES = 40
MAX_BATCH_BYTES = 1024 * 1024
MAX_APPEND_ATTEMPTS = 50
_HEAD_CACHE_SIZE = 100_000
_TOKEN_CACHE_SIZE = 100_000


def _owner_record(owner: s.OwnerIdentity, epoch: int) -> bytes:
    return canonical_json(
        {
            "deployment_id": owner.deployment_id,
            "epoch": epoch,
            "instance_id": owner.instance_id,
            "owner_run_id": owner.owner_run_id,
        }
    )


def _owner_run_of(value: bytes | None) -> str:
    if not value:
        return ""
    run: str = json.loads(value).get("owner_run_id", "")
    return run


def check_tenant(namespace: str, record: TokenRecord, channel: str, token: str) -> None:
    """A channel may address only its own aliases and its own sessions.

    An empty channel is an internal caller (an owner) and may address anything.
    """
    if not channel:
        return
    owner_channel = record.channel if namespace == ids.INBOX_NAMESPACE else namespace
    if owner_channel != channel:
        raise PermissionDenied(
            Reason.CROSS_TENANT,
            f"token {token!r} belongs to another channel",
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
        self._heads: OrderedDict[str, int] = OrderedDict()
        self._tokens: OrderedDict[str, bytes] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- sessions and claims -------------------------------------------------

    async def create_session(
        self, session_id: str, owner: s.OwnerIdentity, channel: str, aliases: list[str]
    ) -> tuple[s.Fence, list[str]]:
        ids.validate_session_id(session_id)
        ids.validate_channel(channel)
        ids.validate_deployment_id(owner.deployment_id)
        ids.validate_id(owner.owner_run_id, "owner_run_id")
        k = self._keys
        tokens = [ids.inbox_token(session_id)]
        for alias in aliases:
            ids.split_token(alias)
            if alias not in tokens:
                tokens.append(alias)
        _check_hook_count(len(tokens))
        fence = fence_value(1, owner.owner_run_id)
        record = TokenRecord(session_id=session_id, channel=channel).encode()
        compare = [cmp_absent(k.fence(session_id))] + [cmp_absent(k.token(t)) for t in tokens]
        success = [
            op_put(k.fence(session_id), fence),
            op_put(k.owner(session_id), _owner_record(owner, 1)),
            op_put(k.hooks(session_id), canonical_json(tokens)),
            op_put(k.inbox_head(session_id), b"0"),
        ] + [op_put(k.token(t), record) for t in tokens]
        failure = [op_get(k.fence(session_id)), op_get(k.hooks(session_id))] + [
            op_get(k.token(t)) for t in tokens
        ]
        response = await self._store.txn(compare, success, failure)
        result = s.Fence(session_id=session_id, owner_run_id=owner.owner_run_id, epoch=1)
        if response.succeeded:
            self._heads[session_id] = 0
            return result, tokens
        existing = single_value(response.responses[0])
        if existing == fence:  # a retry of the create that already succeeded
            return result, json.loads(single_value(response.responses[1]) or b"[]")
        if existing is not None:
            _, run = existing.decode().partition("/")[::2]
            raise AlreadyExists(
                Reason.SESSION_EXISTS,
                f"session {session_id} already exists",
                session_id=session_id,
                owner_run_id=run,
            )
        for token, got in zip(tokens, response.responses[2:], strict=True):
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
        response = await self._store.txn(
            [], [op_get(k.fence(sid)), op_get(k.hooks(sid))], []
        )
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

    # -- token resolution ----------------------------------------------------

    async def _token_value(self, token: str) -> bytes | None:
        cached = self._tokens.get(token)
        if cached is not None:
            self._tokens.move_to_end(token)
            return cached
        response = await self._store.txn([], [op_get(self._keys.token(token))], [])
        value = single_value(response.responses[0])
        if value is not None:
            self._tokens[token] = value
            if len(self._tokens) > _TOKEN_CACHE_SIZE:
                self._tokens.popitem(last=False)
        return value

    async def lookup(self, token: str, channel: str) -> TokenRecord:
        namespace, _ = ids.split_token(token)
        if channel and namespace not in (channel, ids.INBOX_NAMESPACE):
            raise PermissionDenied(
                Reason.CROSS_TENANT, f"token {token!r} belongs to another channel", token=token
            )
        raw = await self._token_value(token)
        if raw is None:
            raise NotFound(Reason.TOKEN_NOT_FOUND, f"no session holds token {token!r}", token=token)
        record = TokenRecord.decode(raw)
        check_tenant(namespace, record, channel, token)
        return record

    # -- the inbox -----------------------------------------------------------

    async def resume(self, token: str, command: s.Command, channel: str) -> s.Receipt:
        """Durably append `command` to the inbox of the session `token` names."""
        size = command.ByteSize()
        if size > MAX_COMMAND_BYTES:
            raise InvalidArgument(
                Reason.MESSAGE_TOO_LARGE,
                f"command is {size} bytes; the limit is {MAX_COMMAND_BYTES}",
            )
        if command.delivery.delivery_id:
            ids.validate_id(command.delivery.delivery_id, "delivery_id")
        record = await self.lookup(token, channel)
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

    async def _head(self, session_id: str) -> int:
        head = self._heads.get(session_id)
        if head is not None:
            return head
        response = await self._store.txn([], [op_get(self._keys.inbox_head(session_id))], [])
        value = single_value(response.responses[0])
        if value is None:
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} not found")
        return int(value)

    def _remember_head(self, session_id: str, head: int) -> None:
        self._heads[session_id] = head
        self._heads.move_to_end(session_id)
        if len(self._heads) > _HEAD_CACHE_SIZE:
            self._heads.popitem(last=False)

    async def _commit_batch(self, session_id: str, batch: list[_Append]) -> None:
        k = self._keys
        for _ in range(MAX_APPEND_ATTEMPTS):
            if not batch:
                return
            head = await self._head(session_id)
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
            success.append(op_get(k.owner(session_id)))
            failure = [
                op_get(k.inbox_head(session_id)),
                op_get(k.closed(session_id)),
                op_get(k.owner(session_id)),
            ]
            failure += [op_get(k.token(t)) for t in tokens]
            failure += [op_get(k.delivery(session_id, d)) for d in delivery_ids]
            response = await self._store.txn(compare, success, failure)
            if response.succeeded:
                self._remember_head(session_id, new_head)
                run = _owner_run_of(single_value(response.responses[-1]))
                for item in appended:
                    _settle(item, s.Receipt(session_id=session_id, owner_run_id=run, seq=seqs[id(item)]))
                for item, first in followers:
                    _settle(
                        item,
                        s.Receipt(
                            session_id=session_id, owner_run_id=run, seq=seqs[id(first)], duplicate=True
                        ),
                    )
                return
            # Failure branch: learn why from the same round trip, then retry the rest.
            responses = list(response.responses)
            head_value = single_value(responses[0])
            if head_value is None:
                raise NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} not found")
            self._remember_head(session_id, int(head_value))
            if single_value(responses[1]) is not None:
                raise FailedPrecondition(
                    Reason.SESSION_FINALIZED, f"session {session_id} is finalized"
                )
            run = _owner_run_of(single_value(responses[2]))
            token_values = responses[3 : 3 + len(tokens)]
            moved = {
                t for (t, v), got in zip(tokens.items(), token_values, strict=True)
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

    async def stream_inbox(self, fence: s.Fence, from_seq: int) -> AsyncIterator[list[s.InboxEntry]]:
        """The inbox from `from_seq`, then live, until the fence moves."""
        k = self._keys
        sid = fence.session_id
        expected = fence_value(fence.epoch, fence.owner_run_id)
        response = await self._store.txn(
            [],
            [
                op_get(k.fence(sid)),
                op_get(k.inbox_entry(sid, from_seq), prefix_end(k.inbox_prefix(sid))),
            ],
            [],
        )
        self._check_fence(fence, single_value(response.responses[0]))
        next_seq = from_seq
        initial = [s.InboxEntry.FromString(kv.value) for kv in response.responses[1].response_range.kvs]
        if initial:
            next_seq = initial[-1].seq + 1
            yield initial
        fence_key = k.fence(sid)
        async for event in follow_range(
            self._store.client, k.control_prefix(sid), response.header.revision + 1
        ):
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


def _check_hook_count(count: int) -> None:
    if count > ids.MAX_HOOKS_PER_SESSION:
        raise InvalidArgument(
            Reason.TOO_MANY_HOOKS,
            f"a session may hold at most {ids.MAX_HOOKS_PER_SESSION} addresses; "
            f"this would make {count}",
        )
