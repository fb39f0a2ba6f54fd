"""One etcd transaction, written as a sentence: compares, writes, and reads
with names (`result.value("fence")`, never `responses[3]`); and the fence
value every owner write compares (docs/design.md §2).

    txn = Txn().require(fence.compare(keys), cmp_absent(keys.closed(sid)))
    txn.put(keys.snapshot(sid), raw)
    txn.read_on_failure("fence", keys.fence(sid))
    result = await txn.run(store)
    if not result.succeeded:
        fence.check(result.value("fence"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aetcd import rpc

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import Fenced, NotFound, Reason
from baton_runtime.common.etcd.keys import Keys, fence_value
from baton_runtime.common.etcd.ops import cmp_value, op_delete, op_get, op_put, single_value
from baton_runtime.common.etcd.store import Store

Branch = Literal["success", "failure"]


@dataclass(frozen=True)
class Fence:
    """An owner run's authority over a session: compared inside the same
    transaction as every write it causes; one check, one error."""

    session_id: str
    owner_run_id: str
    epoch: int

    @classmethod
    def of(cls, fence: s.Fence) -> Fence:
        return cls(fence.session_id, fence.owner_run_id, fence.epoch)

    @property
    def value(self) -> bytes:
        return fence_value(self.epoch, self.owner_run_id)

    def proto(self) -> s.Fence:
        return s.Fence(session_id=self.session_id, owner_run_id=self.owner_run_id, epoch=self.epoch)

    def compare(self, keys: Keys) -> rpc.Compare:
        return cmp_value(keys.fence(self.session_id), self.value)

    def holds(self, current: bytes | None) -> bool:
        return current == self.value

    def check(self, current: bytes | None) -> None:
        """Raise NotFound (no session) or Fenced (another run owns it) unless
        `current`, the stored fence, is this one."""
        if current is None:
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {self.session_id} not found")
        if current != self.value:
            raise Fenced(
                f"owner run {self.owner_run_id} epoch {self.epoch} no longer owns "
                f"session {self.session_id}",
                session_id=self.session_id,
            )


class TxnResult:
    """What a transaction answered: which branch ran, its revision, and the
    named reads of that branch."""

    def __init__(
        self, response: rpc.TxnResponse, names: dict[str, int], groups: dict[str, range]
    ) -> None:
        self.succeeded: bool = response.succeeded
        self.revision: int = response.header.revision
        self._response = response
        self._names = names
        self._groups = groups

    def kvs(self, name: str) -> Sequence[Any]:
        kvs: Sequence[Any] = self._response.responses[self._names[name]].response_range.kvs
        return kvs

    def kv(self, name: str) -> Any | None:
        found = self.kvs(name)
        return found[0] if found else None

    def value(self, name: str) -> bytes | None:
        kv = self.kv(name)
        return kv.value if kv is not None else None

    def deleted(self, name: str) -> int:
        """How many keys a named delete removed."""
        return int(self._response.responses[self._names[name]].response_delete_range.deleted)

    def more(self, name: str) -> bool:
        """True when a limited range read left keys out."""
        return bool(self._response.responses[self._names[name]].response_range.more)

    def count(self, name: str) -> int:
        """How many keys a range read's range holds (a limited read too)."""
        return int(self._response.responses[self._names[name]].response_range.count)

    def values(self, name: str) -> list[bytes | None]:
        """The values of a `read_each`, in the order of its keys (None: absent)."""
        responses = self._response.responses
        return [single_value(responses[i]) for i in self._groups[name]]


class Txn:
    """Builds one transaction: `require` compares, `put`/`delete` on success,
    named reads (one key, a range, or `read_each` of several keys) on
    either branch."""

    def __init__(self) -> None:
        self.compare: list[rpc.Compare] = []
        self.success: list[rpc.RequestOp] = []
        self.failure: list[rpc.RequestOp] = []
        self._names: dict[Branch, dict[str, int]] = {"success": {}, "failure": {}}
        self._groups: dict[Branch, dict[str, range]] = {"success": {}, "failure": {}}

    def require(self, *compares: rpc.Compare) -> Txn:
        self.compare.extend(compares)
        return self

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Txn:
        self.success.append(op_put(key, value, lease))
        return self

    def delete(self, key: bytes, range_end: bytes = b"", *, name: str = "") -> Txn:
        """Delete on success; a `name` makes its count readable (`deleted`)."""
        if name:
            self._names["success"][name] = len(self.success)
        self.success.append(op_delete(key, range_end))
        return self

    def read(
        self,
        name: str,
        key: bytes,
        range_end: bytes = b"",
        *,
        on: Branch = "success",
        keys_only: bool = False,
        limit: int = 0,
        revision: int = 0,
        newest_first: bool = False,
    ) -> Txn:
        ops = self.success if on == "success" else self.failure
        self._names[on][name] = len(ops)
        ops.append(
            op_get(
                key,
                range_end,
                keys_only=keys_only,
                limit=limit,
                revision=revision,
                newest_first=newest_first,
            )
        )
        return self

    def read_each(self, name: str, keys: Sequence[bytes], *, on: Branch = "success") -> Txn:
        """One-key reads of every key in `keys`, named together (see
        `TxnResult.values`)."""
        ops = self.success if on == "success" else self.failure
        self._groups[on][name] = range(len(ops), len(ops) + len(keys))
        ops.extend(op_get(key) for key in keys)
        return self

    def read_on_failure(
        self,
        name: str,
        key: bytes,
        range_end: bytes = b"",
        *,
        keys_only: bool = False,
        limit: int = 0,
    ) -> Txn:
        return self.read(name, key, range_end, on="failure", keys_only=keys_only, limit=limit)

    @property
    def ops(self) -> int:
        return len(self.compare) + max(len(self.success), len(self.failure))

    async def run(self, store: Store) -> TxnResult:
        response = await store.txn(self.compare, self.success, self.failure)
        branch: Branch = "success" if response.succeeded else "failure"
        return TxnResult(response, self._names[branch], self._groups[branch])
