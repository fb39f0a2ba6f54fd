"""Child sessions, the I/O (docs/design.md §11; the rules are in rules/handles.py,
children.py and reports.py): where a child is created, how work and controls reach it, and how
its reports reach its parent. Every delivery is an inbox append through
hooks (`ResumeHook`) with a delivery id derived from what it carries, so a
repeat (a step run again, a run restarted) is appended once; no transaction
ever spans a parent and a child (docs/design.md §10).

Placement: a child is created on the parent's deployment, on another live
instance of it when there is one (chosen by a hash of the child's id), so one
crash does not take a parent and its running children down together; with
no other instance, on this one. It then stays where it was created (its own
fleet takes it over, like any session); a parent that moves to another
deployment keeps addressing it by its id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import structlog

from baton_runtime._proto.baton.owner.v1 import owner_pb2 as owner_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import failpoints, ids, retry
from baton_runtime.common.clients.answers import OwnerInstance, StartedSession
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError, FailedPrecondition, NotFound
from baton_runtime.owner.handoff.peers import Peers, place

log = structlog.get_logger("baton.owner.children")

START_CALL_SECONDS = 10.0


@dataclass(frozen=True)
class ChildStart:
    """A child session to start (StartSession with a parent link): where it
    runs, its parent link, and its first work (None: none given)."""

    session_id: str
    deployment_id: str
    channel: str
    parent: s.ParentLink
    first_command: s.Command | None
    aliases: tuple[str, ...] = ()  # refused: a child session takes none

    def request(self) -> owner_pb.StartSessionRequest:
        """The StartSession request that asks a peer instance for it."""
        return owner_pb.StartSessionRequest(
            session_id=self.session_id,
            deployment_id=self.deployment_id,
            channel=self.channel,
            aliases=self.aliases,
            parent=self.parent,
            first_command=self.first_command,
        )


class LocalOwner(Protocol):
    """What `Children` needs of the owner instance it works for (`OwnerHost`):
    the one callable interface left between them, because a child may be
    started on this very instance, and a delivery to a session that runs
    here is handed to its run at once. Both are downward for the host, which
    owns the runs; `Children` never holds a run."""

    async def start_child(self, start: ChildStart) -> StartedSession:
        """Create and run the child session on this instance."""
        ...

    def offer(self, session_id: str, entry: s.InboxEntry) -> None:
        """An entry just appended to `session_id`'s inbox by this process."""
        ...


class Children:
    """Creates child sessions and carries commands between parents and
    children, for the runs of one owner instance."""

    def __init__(
        self,
        deployment_id: str,
        instance_id: str,
        hooks: HooksClient,
        local: LocalOwner,
    ) -> None:
        self.deployment_id = deployment_id
        self.instance_id = instance_id
        self._hooks = hooks
        self._local = local
        self._peers = Peers(hooks, call_seconds=START_CALL_SECONDS)

    async def close(self) -> None:
        await self._peers.close()

    async def _live_peers(self) -> list[OwnerInstance]:
        """The other live instances of this deployment, in a stable order."""
        try:
            live = await self._peers.instances(self.deployment_id)
        except BatonError as exc:
            log.info("instance lookup failed; starting children here", reason=exc.reason)
            return []
        others = [i for i in live if i.instance_id != self.instance_id]
        return sorted(others, key=lambda i: (i.instance_id, i.address))

    async def start(
        self, child_session_id: str, channel: str, parent: s.ParentLink, work: s.Command
    ) -> bool:
        """Create the child session on this deployment with `work` as its
        first inbox entry. Idempotent: a child that exists already is left as
        it is; False then says the work still has to be sent."""
        start = ChildStart(child_session_id, self.deployment_id, channel, parent, work)
        peers = await self._live_peers()
        if peers:
            chosen = place(child_session_id, peers)
            try:
                started = await self._peers.client(chosen.address).start_session(start.request())
                return started.first_command_appended
            except BatonError as exc:
                if not exc.retryable:
                    raise
                # The peer may be gone: start it here (the registry catches up).
                self._peers.forget(self.deployment_id)
                log.info(
                    "peer could not start a child; starting it here",
                    peer_instance_id=chosen.instance_id,
                    child_session_id=child_session_id,
                    reason=exc.reason,
                )
        return (await self._local.start_child(start)).first_command_appended

    async def send(self, session_id: str, command: s.Command) -> s.Receipt:
        """Append `command` to the inbox of `session_id` (a child, or a
        parent), retrying transient failures with the same delivery id; a run
        of that session in this process gets it at once. Raises what cannot
        succeed (the session finalized or gone)."""
        backoff = retry.DELIVERY.backoff()
        while True:
            try:
                receipt = await self._hooks.append(ids.inbox_token(session_id), command)
                if not receipt.duplicate:
                    self._local.offer(session_id, s.InboxEntry(seq=receipt.seq, command=command))
                return receipt
            except BatonError as exc:
                if not exc.retryable:
                    raise
                log.warning(
                    "delivery retry",
                    to_session_id=session_id,
                    delivery_id=command.delivery.delivery_id,
                    reason=exc.reason,
                )
            await backoff.wait()

    async def send_control(self, session_id: str, command: s.Command) -> None:
        """A cancel or reset for a child: one that is finalized or gone needs none."""
        try:
            await self.send(session_id, command)
        except (FailedPrecondition, NotFound) as exc:
            log.info(
                "child needs no control",
                child_session_id=session_id,
                delivery_id=command.delivery.delivery_id,
                reason=exc.reason,
            )

    async def deliver_reports(self, link: s.ParentLink) -> None:
        """Deliver a child's outbox to its parent, in order; each delivered
        report leaves the outbox (the next commit persists that). A parent
        that finalized or is gone takes none: the report is dropped."""
        while link.outbox:
            report = s.TaskResultCommand()
            report.CopyFrom(link.outbox[0])
            command = s.Command(
                delivery=s.DeliveryMetadata(delivery_id=report.task_delivery_id),
                task_result=report,
            )
            await failpoints.hit("children.before_report")
            try:
                await self.send(report.parent_session_id, command)
                await failpoints.hit("children.after_report")
            except BatonError as exc:  # never retryable here: `send` retries those
                log.info(
                    "parent takes no report; dropped",
                    parent_session_id=report.parent_session_id,
                    delivery_id=report.task_delivery_id,
                    reason=exc.reason,
                )
            if link.outbox and link.outbox[0].task_delivery_id == report.task_delivery_id:
                del link.outbox[0]
