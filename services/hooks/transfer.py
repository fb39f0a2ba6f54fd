"""The Transfer call and the atomic handoff primitive (docs/design.md §6,
step 3).

A Transfer call (`Transfers.transfer`) is planned (`plan_transfer`: pure
validation), its permit checked (services/hooks/consent.py), the session
moved, this process's session cache told, and the outcome counted.

One etcd transaction inside one session's keys moves the whole session — its
fence, owner record and ownership index entry — to a successor on an exact
deployment. Tokens map to sessions, not runs, so no token-index entry changes;
the session's own record of its claim set is what the transaction compares.
The outcome is recorded under the handoff id in the same transaction, so a
replay returns the same result and an uncertain outcome can be looked up,
for the deduplication window: the record is put under the window lease
(`expiry.py`) and etcd deletes it after that. Later, GetTransfer answers
NOT_FOUND (TRANSFER_NOT_FOUND) and a replay of the request is refused by the
fence it names, which moved with the transfer. The same transaction writes
the handoff index (`hx/{handoff}` → the session, under the same lease), so an
operator finds a handoff by its id alone (`find`).

Why the session moves decides the one inbox compare: a trigger must be the
inbox head (the last arrival); a drain must find nothing unprocessed (the
head is the checkpoint's consumed position); an adoption of a session whose
deployment has no owner left compares no inbox position, so the backlog
moves with it (issue 12; docs/deploy.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.bounds import check_seq
from baton_runtime.common.errors import (
    Aborted,
    AlreadyExists,
    BatonError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
)
from baton_runtime.common.etcd.keys import Keys, OwnerRecord, canonical_json, prefix_end
from baton_runtime.common.etcd.ops import cmp_absent, cmp_mod, cmp_none, cmp_value
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.etcd.txn import Fence, Txn, TxnResult
from baton_runtime.common.observability import metrics
from baton_runtime.common.security.identity import Caller
from baton_runtime.hooks.expiry import ExpiryLeases
from baton_runtime.hooks.sessions import SessionCache

_T = TypeVar("_T")


@dataclass(frozen=True)
class TransferOutcome:
    """What a transfer recorded under its handoff id."""

    fence: s.Fence
    successor: s.OwnerIdentity
    trigger_seq: int
    reason: s.TransferReason.ValueType = s.TRANSFER_REASON_TRIGGER

    def encode(self) -> bytes:
        return canonical_json(
            {
                "deployment_id": self.successor.deployment_id,
                "epoch": self.fence.epoch,
                "instance_id": self.successor.instance_id,
                "owner_run_id": self.successor.owner_run_id,
                "reason": int(self.reason),
                "trigger_seq": self.trigger_seq,
            }
        )

    @classmethod
    def decode(cls, session_id: str, value: bytes) -> TransferOutcome:
        data = json.loads(value)
        successor = s.OwnerIdentity(
            owner_run_id=data["owner_run_id"],
            deployment_id=data["deployment_id"],
            instance_id=data["instance_id"],
        )
        fence = s.Fence(
            session_id=session_id, owner_run_id=successor.owner_run_id, epoch=data["epoch"]
        )
        return cls(
            fence=fence,
            successor=successor,
            trigger_seq=int(data["trigger_seq"]),
            # A stored int: the enum's ValueType is a NewType of int.
            reason=int(data.get("reason", s.TRANSFER_REASON_TRIGGER)),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class TransferRequest:
    """A Transfer call as the servicer read it (None: a message the call
    left out); `plan_transfer` validates it, the permit is checked after."""

    handoff_id: str
    expected: s.Fence | None
    expected_owner: s.OwnerIdentity | None
    successor: s.OwnerIdentity | None
    hooks: tuple[str, ...]
    trigger_seq: int
    snapshot_revision: int
    reason: s.TransferReason.ValueType = s.TRANSFER_REASON_TRIGGER
    inbox_head: int = 0
    permit: s.TransferPermit = field(default_factory=s.TransferPermit)


@dataclass(frozen=True)
class TransferPlan:
    """A transfer request known to be well-formed, nothing read yet
    (`plan_transfer`): what the transfer compares and writes.
    `reason` is never UNSPECIFIED (that means TRIGGER); `head` is the
    inbox head the transfer requires (None: any, an adoption)."""

    session_id: str
    handoff_id: str
    expected: s.Fence
    expected_owner: s.OwnerIdentity
    successor: s.OwnerIdentity
    hooks: tuple[str, ...]
    trigger_seq: int
    snapshot_revision: int
    reason: s.TransferReason.ValueType
    head: int | None


def plan_transfer(request: TransferRequest, caller: Caller) -> TransferPlan:
    """Validate a transfer request as `caller` makes it (InvalidArgument
    when it is not well-formed; PermissionDenied when an owner names a
    successor outside its own deployment); pure. The permit is checked
    for `plan.reason` after, before anything is written."""
    expected = _given(request.expected, "expected")
    expected_owner = _given(request.expected_owner, "expected_owner")
    successor = _given(request.successor, "successor")
    caller.require_deployment(successor.deployment_id, "the successor")
    check_seq(expected.epoch, "expected.epoch")
    check_seq(request.trigger_seq, "trigger_seq")
    check_seq(request.snapshot_revision, "snapshot_revision")
    sid = ids.validate_session_id(expected.session_id)
    reason, head = _check_request(
        request.handoff_id,
        expected_owner,
        successor,
        request.trigger_seq,
        request.snapshot_revision,
        request.reason,
        request.inbox_head,
    )
    return TransferPlan(
        sid,
        request.handoff_id,
        expected,
        expected_owner,
        successor,
        request.hooks,
        request.trigger_seq,
        request.snapshot_revision,
        reason,
        head,
    )


@dataclass(frozen=True)
class Transferred:
    """A transfer's answer: the outcome, and whether it was a replay of one
    already applied."""

    outcome: TransferOutcome
    replayed: bool


class PermitCheck(Protocol):
    """The consent a transfer needs before it writes (services/hooks/consent.py)."""

    async def check_transfer(self, plan: TransferPlan, permit: s.TransferPermit) -> None: ...


class Transfers:
    """Transfer and GetTransfer over one etcd store."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        leases: ExpiryLeases,
        sessions: SessionCache,
        consent: PermitCheck,
    ) -> None:
        self._store = store
        self._keys = keys
        self._leases = leases
        self._sessions = sessions
        self._consent = consent

    async def transfer(self, request: TransferRequest, caller: Caller) -> Transferred:
        """The Transfer call: the request planned, its permit checked, the
        session moved, and this process's session cache told. Counted in
        baton_transfers_total: moved, replayed (a repeat of a move already
        applied) or refused (any error, the checks included)."""
        try:
            done = await self._transfer(request, caller)
        except Exception:
            metrics.TRANSFERS.labels("refused").inc()
            raise
        metrics.TRANSFERS.labels("replayed" if done.replayed else "moved").inc()
        return done

    async def _transfer(self, request: TransferRequest, caller: Caller) -> Transferred:
        plan = plan_transfer(request, caller)
        await self._consent.check_transfer(plan, request.permit)  # once known well-formed
        return await self._move(plan)

    async def _move(self, plan: TransferPlan) -> Transferred:
        """Apply a planned transfer whose permit was checked. Nothing is
        written unless every compare holds; each refusal names its reason.

        Every refusal is final: the fence and the snapshot revision never come
        back, the inbox head only grows. So once a (replayed) request is
        refused, an earlier copy of it still in flight cannot commit either,
        and the old owner may process the trigger itself."""
        sid, successor = plan.session_id, plan.successor
        moved_to = Fence(sid, successor.owner_run_id, plan.expected.epoch + 1)
        outcome = TransferOutcome(
            fence=moved_to.proto(),
            successor=successor,
            trigger_seq=plan.trigger_seq if plan.reason == s.TRANSFER_REASON_TRIGGER else 0,
            reason=plan.reason,
        )
        record = OwnerRecord(
            owner_run_id=successor.owner_run_id,
            deployment_id=successor.deployment_id,
            instance_id=successor.instance_id,
            epoch=moved_to.epoch,
        )
        claimed = canonical_json(list(plan.hooks))
        result = await self._leases.run(
            lambda lease: _transfer_txn(self._keys, plan, claimed, moved_to, record, outcome, lease)
        )
        if result.succeeded:
            if plan.head is not None:  # (an adoption compares no inbox head: nothing to cache)
                # So the next append does not fail its compare first.
                self._sessions.owner_moved(sid, plan.head, record.encode())
            return Transferred(outcome, False)
        stored = result.value("transfer")
        if stored is not None:
            previous = TransferOutcome.decode(sid, stored)
            if previous.successor.owner_run_id != successor.owner_run_id:
                raise AlreadyExists(
                    Reason.HANDOFF_ID_REUSED,
                    f"handoff {plan.handoff_id} already moved session {sid} to run "
                    f"{previous.successor.owner_run_id}",
                )
            return Transferred(previous, True)
        Fence.of(plan.expected).check(result.value("fence"))
        raise _refusal(result, sid, plan.reason, plan.head, plan.snapshot_revision, claimed)

    async def owner(self, session_id: str) -> tuple[OwnerRecord, int]:
        """The session's owner record and inbox head."""
        ids.validate_session_id(session_id)
        k = self._keys
        result = await (
            Txn()
            .read("owner", k.owner(session_id))
            .read("head", k.inbox_head(session_id))
            .run(self._store)
        )
        owner, head = result.value("owner"), result.value("head")
        if owner is None or head is None:
            raise NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} not found")
        return OwnerRecord.decode(owner), int(head)

    async def get(self, session_id: str, handoff_id: str) -> TransferOutcome:
        ids.validate_session_id(session_id)
        ids.validate_id(handoff_id, "handoff_id")
        result = await (
            Txn().read("transfer", self._keys.transfer(session_id, handoff_id)).run(self._store)
        )
        value = result.value("transfer")
        if value is None:
            raise NotFound(
                Reason.TRANSFER_NOT_FOUND,
                f"no transfer {handoff_id} of session {session_id} (a handoff record is "
                f"kept for the deduplication window, {self._leases.window_seconds:g} s)",
            )
        return TransferOutcome.decode(session_id, value)

    async def find(self, handoff_id: str) -> TransferOutcome:
        """A transfer by its handoff id alone, through the handoff index
        (`hx/{handoff}`, written with the record under the same lease). A
        record written before the index existed, or one whose session was
        deleted by retention since, is NOT_FOUND: name the session then."""
        ids.validate_id(handoff_id, "handoff_id")
        result = await Txn().read("index", self._keys.handoff(handoff_id)).run(self._store)
        session_id = result.value("index")
        if session_id is not None:
            try:
                return await self.get(session_id.decode(), handoff_id)
            except NotFound:
                pass
        raise NotFound(
            Reason.TRANSFER_NOT_FOUND,
            f"no transfer {handoff_id} in the handoff index (a handoff record is kept for the "
            f"deduplication window, {self._leases.window_seconds:g} s; one recorded before "
            "the index existed is found with its session id)",
        )


def _transfer_txn(
    k: Keys,
    plan: TransferPlan,
    claimed: bytes,
    moved_to: Fence,
    record: OwnerRecord,
    outcome: TransferOutcome,
    lease: int,
) -> Txn:
    """The one transaction that moves the session (`lease`: the
    deduplication window's, for the handoff record)."""
    sid, handoff_id = plan.session_id, plan.handoff_id
    expected_owner, successor = plan.expected_owner, plan.successor
    txn = Txn().require(
        Fence.of(plan.expected).compare(k),
        cmp_value(k.hooks(sid), claimed),
        cmp_mod(k.snapshot(sid), plan.snapshot_revision),
        cmp_absent(k.closed(sid)),
        cmp_absent(k.transfer(sid, handoff_id)),
    )
    if plan.head is not None:
        txn.require(cmp_value(k.inbox_head(sid), str(plan.head).encode()))
    old_fleet = k.deployment_prefix(expected_owner.deployment_id)
    if plan.reason == s.TRANSFER_REASON_ADOPTION:
        # No permit can come from a fleet that is gone: what allows an
        # adoption is that the session's deployment has no live instance.
        txn.require(cmp_none(old_fleet, prefix_end(old_fleet)))
        txn.read_on_failure("live", old_fleet, prefix_end(old_fleet), keys_only=True, limit=1)
    txn.put(k.fence(sid), moved_to.value).put(k.owner(sid), record.encode())
    old_index = k.owned(expected_owner.deployment_id, expected_owner.instance_id, sid)
    new_index = k.owned(successor.deployment_id, successor.instance_id, sid)
    if old_index != new_index:  # (one txn may not name a key twice)
        txn.delete(old_index)
    txn.put(new_index, moved_to.value)
    txn.delete(k.bell(expected_owner.instance_id, sid))
    txn.put(k.transfer(sid, handoff_id), outcome.encode(), lease)
    # The handoff index points at this one session and expires with the
    # record (same lease), so GetTransfer needs only the id (§10).
    txn.put(k.handoff(handoff_id), sid.encode(), lease)
    txn.read_on_failure("transfer", k.transfer(sid, handoff_id))
    txn.read_on_failure("fence", k.fence(sid))
    txn.read_on_failure("hooks", k.hooks(sid))
    txn.read_on_failure("head", k.inbox_head(sid))
    txn.read_on_failure("closed", k.closed(sid))
    txn.read_on_failure("snapshot", k.snapshot(sid), keys_only=True)
    return txn


def _given(value: _T | None, name: str) -> _T:
    """A message the request must carry."""
    if value is None:
        raise InvalidArgument(Reason.MISSING_FIELD, f"{name} is required")
    return value


def _check_request(
    handoff_id: str,
    expected_owner: s.OwnerIdentity,
    successor: s.OwnerIdentity,
    trigger_seq: int,
    snapshot_revision: int,
    reason: s.TransferReason.ValueType,
    inbox_head: int,
) -> tuple[s.TransferReason.ValueType, int | None]:
    """Validate a transfer request: its reason (UNSPECIFIED means TRIGGER)
    and the inbox head it requires (None: any, an adoption)."""
    if snapshot_revision <= 0:
        raise InvalidArgument(
            Reason.MISSING_FIELD, "snapshot_revision (the checkpoint) is required"
        )
    ids.validate_id(handoff_id, "handoff_id")
    ids.validate_deployment_id(expected_owner.deployment_id)
    ids.validate_deployment_id(successor.deployment_id)
    ids.validate_id(successor.owner_run_id, "successor.owner_run_id")
    ids.validate_id(successor.instance_id, "successor.instance_id")
    ids.validate_id(expected_owner.instance_id, "expected_owner.instance_id")
    if reason == s.TRANSFER_REASON_UNSPECIFIED:
        reason = s.TRANSFER_REASON_TRIGGER
    if reason not in (
        s.TRANSFER_REASON_TRIGGER,
        s.TRANSFER_REASON_DRAIN,
        s.TRANSFER_REASON_ADOPTION,
    ):
        raise InvalidArgument(Reason.INVALID_FIELD, f"unknown transfer reason {int(reason)}")
    head = {
        s.TRANSFER_REASON_TRIGGER: trigger_seq + 1,
        s.TRANSFER_REASON_DRAIN: inbox_head,
    }.get(reason)
    return reason, head


def _refusal(
    result: TxnResult,
    sid: str,
    reason: s.TransferReason.ValueType,
    head: int | None,
    snapshot_revision: int,
    claimed: bytes,
) -> BatonError:
    """Why a transfer by the session's owner was refused, from its failure
    branch: finalized, a later arrival, a newer commit, or other hooks."""
    if result.value("closed") is not None:
        return FailedPrecondition(Reason.SESSION_FINALIZED, f"session {sid} is finalized")
    if reason == s.TRANSFER_REASON_ADOPTION and result.kvs("live"):
        return FailedPrecondition(
            Reason.INSTANCE_LIVE,
            f"session {sid}'s deployment has a live owner instance: it is not adopted",
        )
    head_now = result.value("head")
    if head is not None and head_now != str(head).encode():
        return Aborted(
            Reason.LATER_ARRIVAL,
            f"the inbox head is {head_now.decode() if head_now else '?'}, not {head}: "
            + (
                "the trigger is not the last arrival"
                if reason == s.TRANSFER_REASON_TRIGGER
                else "a command arrived since the checkpoint"
            ),
        )
    snapshot = result.kv("snapshot")
    snapshot_now = snapshot.mod_revision if snapshot is not None else 0
    if snapshot_now != snapshot_revision:
        return Aborted(
            Reason.STALE_CHECKPOINT,
            f"the session committed since the checkpoint (snapshot revision "
            f"{snapshot_now}, not {snapshot_revision})",
        )
    return Aborted(
        Reason.HOOKS_CHANGED,
        f"the claimed hook set is {(result.value('hooks') or b'').decode()}, "
        f"not {claimed.decode()}",
    )
