"""A run's upkeep around its commits (docs/design.md §4, §11), all under the
run's one `Background`; the shell (session.py) calls it before and after
each commit (`before_commit`, `after_commit`):

- the durable lifetime timer: armed with the run's id (turns.arm_timeout);
  when it fires, a timeout command is appended to the session's inbox (a
  successor ignores a predecessor's);
- history retirement: committed entries the model no longer sees are
  deleted in the background, never blocking a turn (the mark is persisted
  by the next commit; until then a successor retires again);
- controls to children before a commit: the cancels and resets the rules
  decided (`SessionState.outgoing`) reach the children before the commit
  that decides them (a repeat after a crash is deduplicated);
- reports after a commit: a child's committed reports reach its parent in
  the background; a finalizing child's before the commit that closes it;
- tokens after the commit that finalizes: the aliases are released (the
  inbox token stays, so late sends learn the session is finalized).
"""

from __future__ import annotations

import asyncio

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids, retry
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError
from baton_runtime.common.tasks import Background
from baton_runtime.owner.rules.held import RunIdentity, SessionState
from baton_runtime.owner.run.children import Children


class Upkeep:
    """The timer, retirement, child controls and reports of one run."""

    def __init__(
        self,
        identity: RunIdentity,
        state: SessionState,
        hooks: HooksClient,
        anchor: AnchorClient,
        children: Children | None,
        background: Background,
        log: structlog.BoundLogger,
    ) -> None:
        self._identity = identity
        self._state = state
        self._hooks = hooks
        self._anchor = anchor
        self._children = children
        self._background = background
        self._log = log
        self._retiring: asyncio.Task[None] | None = None
        self._delivering: asyncio.Task[None] | None = None

    async def release_aliases(self) -> None:
        """After the commit that finalized the session: release every alias
        (the inbox token stays: late sends learn the session is finalized)."""
        fence = self._identity.fence
        inbox = ids.inbox_token(fence.session_id)
        aliases = [t for t in self._state.snapshot.hooks if t != inbox]
        if aliases:
            await self._hooks.dispose(fence, aliases)

    # -- around a commit ------------------------------------------------------------

    async def before_commit(self, *, closes: bool) -> None:
        """Before a commit: the controls the rules decided for children reach
        them; a finalizing child's reports reach its parent before the
        commit that closes its stream (no run follows it)."""
        await self.send_controls()
        if closes and self._state.is_child:
            await self.deliver_reports_now()  # a repeat is deduplicated

    def after_commit(self) -> None:
        """After a commit: retire what the model no longer sees, and deliver
        a child's committed reports, in the background."""
        self.start_retire()
        self.deliver_reports()

    # -- the session timeout --------------------------------------------------------

    def start_timer(self, delay: float) -> None:
        """The lifetime timer the rules armed (turns.arm_timeout) fires in
        `delay` seconds: a timeout command in the session's inbox."""
        self._background.spawn(self._fire_timeout(delay))

    async def _fire_timeout(self, delay: float) -> None:
        await asyncio.sleep(delay)
        fence = self._identity.fence
        command = s.Command(
            delivery=s.DeliveryMetadata(delivery_id=f"timeout-{fence.owner_run_id}"),
            timeout=s.TimeoutCommand(armed_by_owner_run_id=fence.owner_run_id),
        )
        backoff = retry.TIMEOUT_DELIVERY.backoff()
        while True:
            try:
                await self._hooks.append(ids.inbox_token(fence.session_id), command)
                return
            except BatonError as exc:
                if not exc.retryable:
                    self._log.warning("timeout not delivered", reason=exc.reason)
                    return
            await backoff.wait()

    # -- history retirement ------------------------------------------------------------

    def start_retire(self) -> None:
        """Retire what the model no longer sees, unless a retirement runs."""
        if self._retiring is not None and not self._retiring.done():
            return
        retirable = self._state.context.retirable()
        if retirable is not None:
            self._retiring = self._background.spawn(self._retire(*retirable))

    async def _retire(self, start: int, below: int) -> None:
        try:
            deleted = await self._anchor.retire_history(self._identity.fence, below, start)
        except BatonError as exc:
            # Fenced: the run learns it from its next commit. Anything else:
            # retried after the next commit or by a successor.
            self._log.info("history not retired yet", reason=exc.reason, below=below)
            return
        self._state.context.retired(below)
        self._log.debug("history retired", below=below, deleted=deleted)

    async def retired(self) -> None:
        """Wait for the retirement in progress (a finalized session's)."""
        if self._retiring is not None:
            await self._retiring

    # -- child sessions: controls out, reports up ------------------------------------

    async def send_controls(self) -> None:
        """Cancels and resets the state decided for children, before the
        commit that decides them (a repeat after a crash is deduplicated)."""
        outgoing = self._state.outgoing
        while outgoing:
            child, command = outgoing[0]
            if self._children is not None:
                await self._children.send_control(child, command)
            outgoing.pop(0)

    def reports_pending(self) -> bool:
        busy = self._delivering is not None and not self._delivering.done()
        return busy or bool(self._state.snapshot.parent.outbox)

    def deliver_reports(self) -> None:
        """Deliver this child's committed reports in the background."""
        if self._children is None or not self._state.snapshot.parent.outbox:
            return
        if self._delivering is not None and not self._delivering.done():
            return
        self._delivering = self._background.spawn(self._deliver_loop())

    async def _deliver_loop(self) -> None:
        assert self._children is not None
        link = self._state.snapshot.parent
        count = len(link.outbox)
        try:
            await self._children.deliver_reports(link)
        except BatonError as exc:
            self._log.error("reports not delivered", reason=exc.reason, error=exc.message)
            return
        self._log.info("reports delivered", reports=count, parent_session_id=link.parent_session_id)

    async def deliver_reports_now(self) -> None:
        """A finalizing child: its reports, before the commit that closes it."""
        if self._delivering is not None and not self._delivering.done():
            await asyncio.shield(self._delivering)
        if self._children is not None:
            await self._children.deliver_reports(self._state.snapshot.parent)
