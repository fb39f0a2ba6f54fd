"""Ingress-driven upgrade (DESIGN.md §6): both sides of a handoff.

The old owner (A): a run that finds an eligible trigger (see
`SessionRun._is_trigger`) calls `HandoffBroker.hand_off`, which
1. names a handoff id; the checkpoint is the run's last committed snapshot
   (its mod revision) plus the trigger's inbox seq;
2. resolves the live instances of the exact target deployment through the
   registry (none: skip) and asks one to prepare a candidate;
3. calls Transfer on hooks. An uncertain outcome (timeout, unavailable, a lost
   response) is settled by replaying the same request: the transfer records
   its result under the handoff id, and every refusal is final (the fence and
   the snapshot revision never come back, the inbox head only grows), so a
   refused replay means no copy of the request can commit later;
4. on success asks the successor to activate and the run ends; on a refusal
   releases the candidate, and the run processes the trigger itself.

The new owner (B): `prepare` validates the checkpoint (readable, a snapshot
format this build reads, idle, the trigger is the next inbox entry, still the
latest commit) and keeps a candidate in memory — nothing durable is written.
`activate` runs it with the fence the transfer wrote. A candidate also asks
hooks for its transfer's outcome now and then (GetTransfer), so a session
transferred by an owner that died before activating it still starts; an
unclaimed candidate is dropped after `CANDIDATE_TTL_SECONDS`.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import zlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton.owner.v1 import owner_pb2 as owner_pb
from baton.session.v1 import session_pb2 as s
from services.common import failpoints, ids
from services.common.clients import AnchorClient, HooksClient, OwnerClient
from services.common.errors import (
    Aborted,
    AlreadyExists,
    BatonError,
    DeadlineExceeded,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    NotFound,
    Reason,
    Unavailable,
)

if TYPE_CHECKING:
    from services.owner.session import SessionRun

log = structlog.get_logger("baton.owner.handoff")

PEER_CALL_SECONDS = 5.0
TRANSFER_SETTLE_SECONDS = 30.0
ACTIVATE_ATTEMPTS = 3
CANDIDATE_TTL_SECONDS = 30.0
CANDIDATE_POLL_FIRST_SECONDS = 1.0
CANDIDATE_POLL_MAX_SECONDS = 4.0


@dataclass
class Candidate:
    """A prepared successor, waiting for its transfer."""

    handoff_id: str
    successor: s.OwnerIdentity
    snapshot: s.SessionSnapshot
    revision: int
    poll: asyncio.Task[None] | None = field(default=None, repr=False)


Launch = Callable[[s.Fence, s.SessionSnapshot, int | None], None]


class HandoffBroker:
    """Hands sessions off to other deployments and takes them over from them."""

    def __init__(
        self,
        deployment_id: str,
        instance_id: str,
        hooks: HooksClient,
        anchor: AnchorClient,
        launch: Launch,
        *,
        readable_formats: frozenset[int],
    ) -> None:
        self.deployment_id = deployment_id
        self.instance_id = instance_id
        self.hooks = hooks
        self.anchor = anchor
        self.readable_formats = readable_formats
        self.candidates: dict[str, Candidate] = {}
        self._launch = launch
        self._peers: dict[str, OwnerClient] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._log = log.bind(deployment_id=deployment_id, instance_id=instance_id)

    async def close(self) -> None:
        for candidate in self.candidates.values():
            if candidate.poll is not None:
                candidate.poll.cancel()
        self.candidates.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _peer(self, address: str) -> OwnerClient:
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = OwnerClient(address, timeout=PEER_CALL_SECONDS)
        return peer

    # -- the old owner ------------------------------------------------------

    async def hand_off(self, run: SessionRun, entry: s.InboxEntry) -> bool:
        """Try to move `run`'s session to the deployment that accepted
        `entry`. True: the session moved and the run must end. False: it did
        not, nothing of the attempt is left, and the run processes `entry`.
        Raises Fenced when the run turns out not to own the session."""
        target = entry.command.delivery.accepted_deployment_id
        fence = run.identity.fence
        revision = run.snapshot_revision
        handoff_id = ids.new_handoff_id()
        bound = self._log.bind(
            session_id=fence.session_id,
            run_id=fence.owner_run_id,
            handoff_id=handoff_id,
            to_deployment_id=target,
            inbox_seq=entry.seq,
        )
        if revision is None:
            bound.info("handoff skipped: checkpoint revision unknown")
            return False
        started = time.monotonic()
        try:
            instances = await self.hooks.list_instances(target)
        except BatonError as exc:
            bound.info("handoff skipped: registry lookup failed", reason=exc.reason)
            return False
        if not instances:
            bound.info("handoff skipped: no live instance of the target deployment")
            return False
        chosen = instances[zlib.crc32(fence.session_id.encode()) % len(instances)]
        peer = self._peer(chosen.address)
        await failpoints.hit("handoff.before_prepare")
        try:
            prepared = await peer.prepare_handoff(
                owner_pb.PrepareHandoffRequest(
                    handoff_id=handoff_id,
                    fence=fence,
                    deployment_id=target,
                    from_deployment_id=self.deployment_id,
                    snapshot_revision=revision,
                    trigger_seq=entry.seq,
                )
            )
        except BatonError as exc:
            bound.info(
                "handoff skipped: the target refused or failed to prepare",
                reason=exc.reason,
                error=exc.message,
                target_instance_id=chosen.instance_id,
            )
            self._release(peer, handoff_id, fence.session_id)
            return False
        successor = prepared.successor
        bound = bound.bind(successor_run_id=successor.owner_run_id)
        await failpoints.hit("handoff.after_prepare")
        request = hooks_pb.TransferRequest(
            handoff_id=handoff_id,
            expected=fence,
            expected_owner=s.OwnerIdentity(
                owner_run_id=fence.owner_run_id,
                deployment_id=self.deployment_id,
                instance_id=self.instance_id,
            ),
            successor=successor,
            hooks=list(run.snapshot.hooks),
            trigger_seq=entry.seq,
            snapshot_revision=revision,
        )
        try:
            moved = await self._transfer(request, bound)
        except Fenced:
            self._release(peer, handoff_id, fence.session_id)
            raise
        except (Aborted, AlreadyExists, FailedPrecondition, NotFound, InvalidArgument) as exc:
            bound.info("handoff failed: transfer refused", reason=exc.reason, error=exc.message)
            self._release(peer, handoff_id, fence.session_id)
            return False
        await failpoints.hit("handoff.after_transfer")
        bound.info(
            "session handed off",
            epoch=moved.epoch,
            successor_instance_id=successor.instance_id,
            took_ms=round((time.monotonic() - started) * 1000, 2),
        )
        await self._activate_successor(peer, handoff_id, moved, bound)
        return True

    async def _transfer(
        self, request: hooks_pb.TransferRequest, bound: structlog.BoundLogger
    ) -> s.Fence:
        """Transfer, replaying the identical request until it is settled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TRANSFER_SETTLE_SECONDS
        backoff = 0.05
        while True:
            try:
                response = await self.hooks.transfer(request)
                await failpoints.hit("handoff.transfer_response")
                if response.replayed:
                    bound.info("transfer outcome settled by a replay")
                return response.fence
            except (Unavailable, DeadlineExceeded) as exc:
                # Refusals are final; only these leave the outcome unknown.
                if loop.time() > deadline:
                    raise
                bound.warning("transfer outcome uncertain; replaying", reason=exc.reason)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _activate_successor(
        self, peer: OwnerClient, handoff_id: str, fence: s.Fence, bound: structlog.BoundLogger
    ) -> None:
        for attempt in range(ACTIVATE_ATTEMPTS):
            try:
                await peer.activate_handoff(handoff_id, fence)
                return
            except BatonError as exc:
                bound.warning("activation failed", reason=exc.reason, attempt=attempt + 1)
                if not exc.retryable:
                    break
            await asyncio.sleep(0.1 * 2**attempt)
        # The candidate polls GetTransfer; if its instance died, its
        # deployment's fleet takes the session over after the lease expires.
        bound.warning("successor not activated directly; it picks the transfer up itself")

    def _release(self, peer: OwnerClient, handoff_id: str, session_id: str) -> None:
        async def release() -> None:
            try:
                await peer.release_handoff(handoff_id, session_id)
            except BatonError as exc:  # the candidate expires on its own
                self._log.info("candidate release failed", handoff_id=handoff_id, reason=exc.reason)

        self._spawn(release())

    # -- the new owner --------------------------------------------------------

    async def prepare(self, request: owner_pb.PrepareHandoffRequest) -> s.OwnerIdentity:
        """Validate the checkpoint and keep a candidate; see the module doc."""
        handoff_id = ids.validate_id(request.handoff_id, "handoff_id")
        if not request.HasField("fence"):
            raise InvalidArgument(Reason.MISSING_FIELD, "fence is required")
        sid = ids.validate_session_id(request.fence.session_id)
        target = ids.validate_deployment_id(request.deployment_id)
        source = ids.validate_deployment_id(request.from_deployment_id)
        if target != self.deployment_id:
            raise FailedPrecondition(
                Reason.WRONG_DEPLOYMENT,
                f"this owner runs deployment {self.deployment_id}, not {target}",
            )
        if source == self.deployment_id:
            raise InvalidArgument(
                Reason.INVALID_FIELD, f"session {sid} already runs on deployment {source}"
            )
        if request.snapshot_revision <= 0:
            raise InvalidArgument(Reason.MISSING_FIELD, "snapshot_revision is required")
        existing = self.candidates.get(handoff_id)
        if existing is not None:
            return existing.successor
        await failpoints.hit("handoff.prepare")
        snapshot, revision = await self._load_checkpoint(sid)
        self._validate(snapshot, revision, request)
        successor = s.OwnerIdentity(
            owner_run_id=ids.new_run_id(),
            deployment_id=self.deployment_id,
            instance_id=self.instance_id,
        )
        candidate = Candidate(handoff_id, successor, snapshot, revision)
        self.candidates[handoff_id] = candidate
        candidate.poll = self._spawn(self._await_transfer(candidate, sid))
        self._log.info(
            "handoff candidate prepared",
            session_id=sid,
            handoff_id=handoff_id,
            from_deployment_id=source,
            successor_run_id=successor.owner_run_id,
        )
        return successor

    async def _load_checkpoint(self, session_id: str) -> tuple[s.SessionSnapshot, int]:
        try:
            return await self.anchor.snapshot_with_revision(session_id)
        except BatonError as exc:
            if exc.retryable:
                raise
            raise FailedPrecondition(
                Reason.CHECKPOINT_UNREADABLE,
                f"the checkpoint of session {session_id} cannot be read: {exc.message}",
            ) from exc

    def _validate(
        self, snapshot: s.SessionSnapshot, revision: int, request: owner_pb.PrepareHandoffRequest
    ) -> None:
        sid = request.fence.session_id
        if snapshot.session_id != sid:
            raise FailedPrecondition(
                Reason.CHECKPOINT_UNREADABLE,
                f"the checkpoint names session {snapshot.session_id!r}",
            )
        if snapshot.format_version not in self.readable_formats:
            raise FailedPrecondition(
                Reason.CHECKPOINT_INCOMPATIBLE,
                f"snapshot format {snapshot.format_version} is not one deployment "
                f"{self.deployment_id} reads ({sorted(self.readable_formats)})",
            )
        if revision != request.snapshot_revision:
            raise Aborted(
                Reason.STALE_CHECKPOINT,
                f"the session committed since the checkpoint (revision {revision}, "
                f"not {request.snapshot_revision})",
            )
        if snapshot.status != s.SESSION_STATUS_ACTIVE:
            raise FailedPrecondition(Reason.SESSION_FINALIZED, f"session {sid} is finalized")
        if snapshot.HasField("open_turn") or snapshot.inbox_next_seq != request.trigger_seq:
            raise FailedPrecondition(
                Reason.SESSION_NOT_IDLE,
                f"session {sid} is not idle at the checkpoint (open turn or backlog)",
            )

    async def activate(self, handoff_id: str, fence: s.Fence) -> None:
        """Run the candidate of `handoff_id` with the transferred fence."""
        ids.validate_id(handoff_id, "handoff_id")
        sid = ids.validate_session_id(fence.session_id)
        candidate = self.candidates.get(handoff_id)
        if candidate is not None and (
            fence.owner_run_id != candidate.successor.owner_run_id
            or candidate.snapshot.session_id != sid
        ):
            raise InvalidArgument(
                Reason.INVALID_FIELD, f"handoff {handoff_id} prepared another run or session"
            )
        await failpoints.hit("handoff.activate")
        if candidate is None:
            # Already activated (by its poll), or dropped: the general path
            # loads the checkpoint; a wrong fence is refused by hooks.
            self._launch(fence, s.SessionSnapshot(), None)
            return
        self._start(candidate, fence)

    def _start(self, candidate: Candidate, fence: s.Fence) -> None:
        if self.candidates.pop(candidate.handoff_id, None) is None:
            return
        if candidate.poll is not None and candidate.poll is not asyncio.current_task():
            candidate.poll.cancel()
        self._log.info(
            "handoff candidate activated",
            session_id=fence.session_id,
            handoff_id=candidate.handoff_id,
            run_id=fence.owner_run_id,
            epoch=fence.epoch,
        )
        self._launch(fence, candidate.snapshot, candidate.revision)

    def release(self, handoff_id: str) -> None:
        candidate = self.candidates.pop(handoff_id, None)
        if candidate is None:
            return
        if candidate.poll is not None:
            candidate.poll.cancel()
        self._log.info(
            "handoff candidate released",
            session_id=candidate.snapshot.session_id,
            handoff_id=handoff_id,
        )

    async def _await_transfer(self, candidate: Candidate, session_id: str) -> None:
        """The safety net when the old owner dies between Transfer and
        ActivateHandoff: look the outcome up until the candidate expires."""
        loop = asyncio.get_running_loop()
        expires = loop.time() + CANDIDATE_TTL_SECONDS
        delay = CANDIDATE_POLL_FIRST_SECONDS
        while True:
            last = loop.time() >= expires
            if not last:
                await asyncio.sleep(min(delay, max(0.0, expires - loop.time())))
                delay = min(delay * 2, CANDIDATE_POLL_MAX_SECONDS)
            if candidate.handoff_id not in self.candidates:
                return
            try:
                found = await self.hooks.get_transfer(session_id, candidate.handoff_id)
            except NotFound:
                found = None
            except BatonError as exc:
                self._log.warning("transfer lookup failed", reason=exc.reason)
                found = None
            if found is not None and found.successor.owner_run_id == (
                candidate.successor.owner_run_id
            ):
                self._start(candidate, found.fence)
                return
            if last:
                self.candidates.pop(candidate.handoff_id, None)
                self._log.info(
                    "handoff candidate expired",
                    session_id=session_id,
                    handoff_id=candidate.handoff_id,
                )
                return
