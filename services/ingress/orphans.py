"""Retiring a deployment strands nothing (docs/design.md §13, issue 12).

Only a live owner of a session's own deployment reads its inbox. When this
ingress accepts a command for a session whose deployment has no live owner
instance left, it asks this deployment's owner to adopt the session (the
owner checks everything again: no live instance, the last commit settled,
the checkpoint readable; then one fenced Transfer). This runs after the
receipt is returned and never delays it; a session that cannot be adopted
(a step was in flight when its fleet vanished) is logged and waits for an
owner of its own deployment.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.errors import BatonError, Reason
from baton_runtime.common.tasks import Background

log = structlog.get_logger("baton.ingress.orphans")

LIVENESS_CACHE_SECONDS = 2.0
# When the owner's deployment still looks live, look again after these pauses
# (together about three default lease TTLs).
RECHECK_SECONDS = (0.0, 3.0, 7.0, 20.0)


class OrphanWatch:
    """Watches receipts for sessions whose deployment has no owner left."""

    def __init__(self, deployment_id: str, hooks: HooksClient, owner: OwnerClient) -> None:
        self.deployment_id = deployment_id
        self._hooks = hooks
        self._owner = owner
        self._live: dict[str, tuple[float, bool]] = {}
        self._inflight: set[str] = set()
        self._background = Background()

    def accepted(self, receipt: s.Receipt) -> None:
        """A command was accepted for `receipt.session_id`."""
        deployment = receipt.owner_deployment_id
        if not deployment or deployment == self.deployment_id:
            return
        if receipt.session_id in self._inflight:
            return
        self._inflight.add(receipt.session_id)
        self._background.spawn(self._check(receipt.session_id, deployment), fresh_context=True)

    async def _check(self, session_id: str, deployment: str) -> None:
        """Now, and again a few times while the owner's deployment still looks
        live: an instance killed without a goodbye stays registered until its
        lease expires, and the command accepted meanwhile must not wait for
        the next one to be noticed."""
        bound = log.bind(session_id=session_id, owner_deployment_id=deployment)
        try:
            for delay in RECHECK_SECONDS:
                await asyncio.sleep(delay)
                try:
                    if await self._deployment_live(deployment):
                        continue
                    adopted = await self._owner.adopt_session(session_id)
                except BatonError as exc:
                    if exc.reason == Reason.SESSION_NOT_SETTLED:
                        bound.warning(
                            "orphaned session waits for its own deployment", error=exc.message
                        )
                        return
                    bound.info("orphaned session not adopted", reason=exc.reason, error=exc.message)
                    continue
                self._live.pop(deployment, None)
                bound.info("orphaned session adopted", epoch=adopted.fence.epoch)
                return
        finally:
            self._inflight.discard(session_id)

    async def _deployment_live(self, deployment: str) -> bool:
        now = time.monotonic()
        cached = self._live.get(deployment)
        if cached is not None and cached[0] > now:
            return cached[1]
        live = bool(await self._hooks.list_instances(deployment))
        self._live[deployment] = (now + LIVENESS_CACHE_SECONDS, live)
        return live

    async def close(self) -> None:
        await self._background.cancel_all()
