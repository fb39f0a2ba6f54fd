"""Ownership (docs/design.md §5): takeover of a dead instance's sessions, parking,
and the ownership index an instance lists its sessions from.

A takeover is a compare-and-swap of the fence and the owner record with epoch
+ 1; the ownership index entry moves in the same txn. Parking flips the owner
record's `parked` flag; the inbox append (services/hooks/inbox.py) rings the
owner instance's bell while it is set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import (
    Aborted,
    FailedPrecondition,
    Fenced,
    NotFound,
    Reason,
    Unavailable,
)
from baton_runtime.common.etcd.keys import Keys, OwnerRecord
from baton_runtime.common.etcd.ops import cmp_value
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Fence, Txn, TxnResult
from baton_runtime.hooks.inbox import MAX_APPEND_ATTEMPTS
from baton_runtime.hooks.sessions import CachedSession, SessionCache, owner_record


@dataclass(frozen=True)
class TakeOver:
    """The result of a takeover: the successor's fence, and whether the
    session stays parked (then `inbox_head` is its consumed position, and
    `timeout_deadline` its lifetime deadline as its park recorded it, unix
    seconds, 0 = none)."""

    fence: s.Fence
    parked: bool
    inbox_head: int
    timeout_deadline: int = 0

    @classmethod
    def of(cls, fence: s.Fence, record: OwnerRecord, head: int) -> TakeOver:
        """What a takeover that wrote `record` answers: a parked session's
        position is the one recorded with it, so a replay answers what the
        applied takeover decided, whatever arrived since."""
        if record.parked:
            return cls(fence, True, record.parked_inbox_next_seq, record.timeout_deadline)
        return cls(fence, False, head)


@dataclass(frozen=True)
class OwnedSession:
    """A session in an instance's ownership index."""

    fence: s.Fence
    owner: OwnerRecord
    input_waiting: bool = False  # parked, and its bell rang since


def _successor_record(
    record: OwnerRecord, successor: s.OwnerIdentity, epoch: int, rang: bool, head: int
) -> OwnerRecord:
    """The owner record a takeover writes. A parked session stays parked
    when nothing arrived since it parked (no bell rang): then the inbox head
    is still its consumed position. Its lifetime deadline goes with it
    (a takeover stays inside the deployment, whose deadline it keeps)."""
    parked = record.parked and not rang
    return dataclasses.replace(
        owner_record(successor, epoch, parked),
        parked_inbox_next_seq=head if parked else 0,
        timeout_deadline=record.timeout_deadline,
    )


def _check_takeover(
    expected: s.Fence, expected_instance_id: str, successor: s.OwnerIdentity
) -> str:
    """The takeover request's ids (InvalidArgument); the session id."""
    sid = ids.validate_session_id(expected.session_id)
    ids.validate_id(expected_instance_id, "expected_instance_id")
    ids.validate_deployment_id(successor.deployment_id)
    ids.validate_id(successor.owner_run_id, "owner_run_id")
    ids.validate_id(successor.instance_id, "instance_id")
    return sid


class Ownership:
    """TakeOverSession, SetParked and ListInstanceSessions over one etcd store."""

    def __init__(self, store: Store, keys: Keys, sessions: SessionCache) -> None:
        self._store = store
        self._keys = keys
        self._sessions = sessions

    async def take_over(
        self, expected: s.Fence, expected_instance_id: str, successor: s.OwnerIdentity
    ) -> TakeOver:
        """Move a session from a dead instance to `successor` with epoch + 1.

        A compare-and-swap of the fence and the owner record: the first caller
        wins; the others get FENCED (FAILED_PRECONDITION, as every fenced
        refusal, docs/design.md §2). A replay by the winner (same successor run)
        returns the same result, read from the owner record the takeover
        wrote (never from the inbox head of now: commands that arrived since
        rang the successor's bell, and a parked position above them would
        make the successor ignore it). The ownership index moves in the same
        txn. A parked session stays parked when nothing arrived since it
        parked (no bell rang); then the successor need not load it, and the
        record passes on its parked position and lifetime deadline.
        """
        sid = _check_takeover(expected, expected_instance_id, successor)
        old = Fence.of(expected)
        new = Fence(sid, successor.owner_run_id, expected.epoch + 1)
        for _ in range(MAX_APPEND_ATTEMPTS):
            read = await self._read_for_takeover(sid, expected_instance_id, successor)
            fence_now = read.value("fence")
            owner_raw = read.value("owner")
            head_raw = read.value("head")
            if fence_now is None or owner_raw is None or head_raw is None:
                raise NotFound(Reason.SESSION_NOT_FOUND, f"session {sid} not found")
            record = OwnerRecord.decode(owner_raw)
            if fence_now == new.value:  # a replay of our own takeover
                self._sessions.learn(sid, head_raw, owner_raw)
                return TakeOver.of(new.proto(), record, int(head_raw))
            if not old.holds(fence_now) or record.instance_id != expected_instance_id:
                raise Fenced(
                    f"session {sid} is no longer owned by run {expected.owner_run_id} "
                    f"on instance {expected_instance_id}",
                    session_id=sid,
                )
            await self._check_movable(old, record, expected_instance_id, successor, read)
            rang = read.value("bell") is not None
            new_record = _successor_record(record, successor, new.epoch, rang, int(head_raw))
            new_raw = new_record.encode()
            txn = self._takeover_txn(old, new, record, expected_instance_id, successor, new_raw)
            txn.require(cmp_value(self._keys.owner(sid), owner_raw))
            txn.require(cmp_value(self._keys.inbox_head(sid), head_raw))
            if rang:
                txn.delete(self._keys.bell(expected_instance_id, sid))
            if (await txn.run(self._store)).succeeded:
                self._sessions.remember(sid, CachedSession(int(head_raw), new_raw, new_record))
                return TakeOver.of(new.proto(), new_record, int(head_raw))
            # Something moved (an arrival, a park) between the read and the txn: again.
        raise Unavailable(Reason.CONFLICT, "takeover kept racing concurrent changes; retry")

    async def _read_for_takeover(
        self, sid: str, expected_instance_id: str, successor: s.OwnerIdentity
    ) -> TxnResult:
        """Fence, owner record, inbox head, closed marker, the old instance's
        bell for the session and its liveness, in one read."""
        k = self._keys
        return await (
            Txn()
            .read("fence", k.fence(sid))
            .read("owner", k.owner(sid))
            .read("head", k.inbox_head(sid))
            .read("closed", k.closed(sid))
            .read("bell", k.bell(expected_instance_id, sid))
            .read("live", k.instance(successor.deployment_id, expected_instance_id))
            .run(self._store)
        )

    def _takeover_txn(
        self,
        old: Fence,
        new: Fence,
        record: OwnerRecord,
        expected_instance_id: str,
        successor: s.OwnerIdentity,
        new_raw: bytes,
    ) -> Txn:
        """The swap: the new fence and owner record, the ownership index
        entry moved to the successor's instance."""
        k, sid = self._keys, old.session_id
        txn = (
            Txn()
            .require(old.compare(k))
            .put(k.fence(sid), new.value)
            .put(k.owner(sid), new_raw)
            .put(k.owned(successor.deployment_id, successor.instance_id, sid), new.value)
        )
        if expected_instance_id != successor.instance_id:
            txn.delete(k.owned(record.deployment_id, expected_instance_id, sid))
        return txn

    async def _check_movable(
        self,
        old: Fence,
        record: OwnerRecord,
        expected_instance_id: str,
        successor: s.OwnerIdentity,
        read: TxnResult,
    ) -> None:
        """Refuse a takeover to another deployment, of a finalized session
        (dropping its index entry, fenced), or from an instance still live."""
        k, sid = self._keys, old.session_id
        if record.deployment_id != successor.deployment_id:
            raise FailedPrecondition(
                Reason.WRONG_DEPLOYMENT,
                f"session {sid} runs deployment {record.deployment_id}, "
                f"not {successor.deployment_id}",
            )
        if read.value("closed") is not None:
            # Finalized: nothing to run. Drop its index entry, fenced.
            old_index = k.owned(record.deployment_id, expected_instance_id, sid)
            await Txn().require(old.compare(k)).delete(old_index).run(self._store)
            raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {sid} is finalized")
        if read.value("live") is not None and expected_instance_id != successor.instance_id:
            raise FailedPrecondition(
                Reason.INSTANCE_LIVE,
                f"instance {expected_instance_id} still holds its lease",
                instance_id=expected_instance_id,
            )

    async def set_parked(
        self, fence: s.Fence, parked: bool, inbox_next_seq: int, timeout_deadline: int = 0
    ) -> int:
        """Park (only when every inbox entry is consumed) or unpark a session.

        One txn comparing the fence, the owner record and, when parking, that
        the inbox head equals `inbox_next_seq`. Parking records that position
        and the session's lifetime deadline (`timeout_deadline`, unix
        seconds, 0 = none) in the owner record; unparking deletes the bell
        and keeps the deadline. Returns the inbox head. Repeating a request
        that took effect succeeds.
        """
        sid = ids.validate_session_id(fence.session_id)
        owner = Fence.of(fence)
        for _ in range(MAX_APPEND_ATTEMPTS):
            state = await self._sessions.state(sid)
            if not owner.holds(state.owner.fence) or state.owner.parked == parked:
                # Our cache may be stale: verify against etcd before refusing or
                # answering "already done".
                state = await self._sessions.refresh(sid)
                owner.check(state.owner.fence)
                if state.owner.parked == parked:
                    return state.head
            new_record = _parked_record(state.owner, parked, inbox_next_seq, timeout_deadline)
            new_raw = new_record.encode()
            result = await self._park_txn(owner, state, new_raw, parked, inbox_next_seq).run(
                self._store
            )
            if result.succeeded:
                head = int(result.value("head") or b"0")
                self._sessions.remember(sid, CachedSession(head, new_raw, new_record))
                return head
            owner.check(result.value("fence"))
            seen = self._sessions.learn(sid, result.value("head"), result.value("owner"))
            if parked and seen.owner_raw == state.owner_raw and seen.head != inbox_next_seq:
                raise Aborted(
                    Reason.INBOX_NOT_DRAINED,
                    f"session {sid} has inbox entries up to {seen.head}; "
                    f"consumed up to {inbox_next_seq}",
                    session_id=sid,
                    inbox_head=str(seen.head),
                )
            # The owner record changed under our cache: again with the fresh one.
        raise Unavailable(Reason.CONFLICT, "park kept racing concurrent changes; retry")

    def _park_txn(
        self, owner: Fence, state: CachedSession, new_raw: bytes, parked: bool, inbox_next_seq: int
    ) -> Txn:
        """Compare the fence and the owner record as cached (and, to park,
        the inbox head at `inbox_next_seq`); write the flipped record (and,
        to unpark, delete the bell); read the head back either way."""
        k, sid = self._keys, owner.session_id
        txn = (
            Txn()
            .require(owner.compare(k), cmp_value(k.owner(sid), state.owner_raw))
            .put(k.owner(sid), new_raw)
        )
        if parked:
            txn.require(cmp_value(k.inbox_head(sid), str(inbox_next_seq).encode()))
        else:
            txn.delete(k.bell(state.owner.instance_id, sid))
        txn.read("head", k.inbox_head(sid))
        txn.read_on_failure("fence", k.fence(sid))
        txn.read_on_failure("owner", k.owner(sid))
        txn.read_on_failure("head", k.inbox_head(sid))
        return txn


def _parked_record(
    record: OwnerRecord, parked: bool, inbox_next_seq: int, timeout_deadline: int
) -> OwnerRecord:
    """The owner record a park (or an unpark) writes."""
    if parked:
        return dataclasses.replace(
            record,
            parked=True,
            parked_inbox_next_seq=inbox_next_seq,
            timeout_deadline=timeout_deadline,
        )
    return dataclasses.replace(record, parked=False, parked_inbox_next_seq=0)
