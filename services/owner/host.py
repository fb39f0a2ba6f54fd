"""The owner host: the session runs of one owner instance."""

from __future__ import annotations

import asyncio

import structlog

from baton.session.v1 import session_pb2 as s
from services.common import ids
from services.common.clients import AnchorClient, HooksClient
from services.common.errors import AlreadyExists, FailedPrecondition, Reason
from services.owner.agent import Agent
from services.owner.session import (
    RunExit,
    RunIdentity,
    SessionRun,
    commit_step,
    initial_snapshot,
    make_event,
)

log = structlog.get_logger("baton.owner")


class OwnerHost:
    """Starts sessions on this deployment and keeps their runs."""

    def __init__(
        self,
        deployment_id: str,
        instance_id: str,
        agent: Agent,
        hooks: HooksClient,
        anchor: AnchorClient,
    ) -> None:
        self.deployment_id = ids.validate_deployment_id(deployment_id)
        self.instance_id = instance_id
        self.agent = agent
        self.hooks = hooks
        self.anchor = anchor
        self.runs: dict[str, SessionRun] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start_session(
        self,
        session_id: str,
        deployment_id: str,
        channel: str,
        aliases: list[str],
        *,
        timeout_seconds: int = 0,
        token_budget: int = 0,
    ) -> tuple[str, bool, str]:
        """Create the session (epoch 1), commit session.started, run it.

        Returns (owner_run_id, created, inbox_token)."""
        ids.validate_session_id(session_id)
        ids.validate_deployment_id(deployment_id)
        ids.validate_channel(channel)
        if deployment_id != self.deployment_id:
            raise FailedPrecondition(
                Reason.WRONG_DEPLOYMENT,
                f"this owner runs deployment {self.deployment_id}, not {deployment_id}",
            )
        inbox = ids.inbox_token(session_id)
        running = self.runs.get(session_id)
        if running is not None:
            return running.identity.fence.owner_run_id, False, inbox
        run_id = ids.new_run_id()
        owner = s.OwnerIdentity(
            owner_run_id=run_id, deployment_id=self.deployment_id, instance_id=self.instance_id
        )
        try:
            created = await self.hooks.create_session(session_id, owner, channel, aliases)
        except AlreadyExists as exc:
            if exc.reason == Reason.SESSION_EXISTS:
                return exc.metadata.get("owner_run_id", ""), False, inbox
            raise
        identity = RunIdentity(created.fence, self.deployment_id, self.instance_id)
        snapshot = initial_snapshot(
            session_id,
            channel,
            self.deployment_id,
            list(created.hooks),
            timeout_seconds=timeout_seconds,
            token_budget=token_budget,
        )
        await commit_step(
            self.anchor, identity, snapshot, [make_event(identity, s.EVENT_KIND_SESSION_STARTED)]
        )
        run = SessionRun(identity, snapshot, self.agent, self.hooks, self.anchor, self._forget)
        self._launch(run)
        log.info("session started", session_id=session_id, run_id=run_id, channel=channel)
        return run_id, True, inbox

    def _launch(self, run: SessionRun) -> None:
        self.runs[run.session_id] = run
        task = asyncio.get_running_loop().create_task(run.run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget(self, run: SessionRun, exit: RunExit) -> None:
        if self.runs.get(run.session_id) is run:
            del self.runs[run.session_id]

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
