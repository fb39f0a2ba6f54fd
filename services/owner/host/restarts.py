"""Restarts and takeovers: what an owner instance does when a run of a
session failed, and when it takes a session over from a dead instance of
its deployment (the fleet drives that; services/owner/host/fleet.py).

Which failures are deterministic (the one table: docs/failures.md):
- a commit that can never succeed (an entry, event, snapshot or commit over
  its limit; anything anchor refuses as INVALID_ARGUMENT) and a model
  request the endpoint rejects: the turn fails with the reason
  (`RunCommits.guarded` for a refused commit; MODEL_REJECTED from the
  model adapter); nothing restarts;
- a run that fails for any other non-retryable reason (authored code
  raising in Agent.on_load, owner code crashing, an unreadable snapshot or
  history): restarted with backoff, at most `restart_budget` times in a row,
  then the session stalls (`stall`);
- retryable errors (etcd unavailable, deadlines, CAS conflicts), a full
  etcd (STORE_FULL) and a call that gRPC or the network ended
  (TRANSPORT_FAILED: a status no Baton service gave, such as a message over
  the size limit) are not deterministic: restarted (or, for a commit,
  retried) with backoff, never counted.
"""

from __future__ import annotations

import asyncio

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids, retry
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.answers import OwnedSession, TakenOver
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError, FailedPrecondition, Fenced, Reason
from baton_runtime.common.observability import metrics
from baton_runtime.common.tasks import Background
from baton_runtime.owner.host.parking import Activator
from baton_runtime.owner.rules.held import RunIdentity, make_event
from baton_runtime.owner.rules.turns import safe_error
from baton_runtime.owner.run.commit import commit_step

DEFAULT_RESTART_BUDGET = 5
# Failures that are not retryable and still say nothing about the session.
_NOT_THE_SESSIONS = frozenset({Reason.STORE_FULL, Reason.TRANSPORT_FAILED})


def transient(failure: BaseException | None) -> bool:
    """A failure that is not the session's fault: restarted without limit."""
    return isinstance(failure, BatonError) and (
        failure.retryable or failure.reason in _NOT_THE_SESSIONS
    )


class Restarts:
    """The restart budget of one owner instance's sessions, their stalls,
    and takeovers."""

    def __init__(
        self,
        identity: tuple[str, str],
        hooks: HooksClient,
        anchor: AnchorClient,
        activator: Activator,
        log: structlog.BoundLogger,
        restart_budget: int = DEFAULT_RESTART_BUDGET,
    ) -> None:
        self.deployment_id, self.instance_id = identity
        self._hooks = hooks
        self._anchor = anchor
        self._activator = activator
        self._log = log
        self.restart_budget = restart_budget
        self._failures: dict[str, int] = {}  # consecutive failed runs per session
        self._transient: dict[str, int] = {}  # consecutive transient failures per session
        self.stalled: dict[str, s.Fence] = {}  # restart budget spent: held, not run
        self._resuming: set[str] = set()  # stalled sessions an operator is resuming
        self.adopting: set[str] = set()  # sessions being taken over
        self._background = Background()
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True
        self._failures.clear()
        self._transient.clear()
        self.stalled.clear()
        await self._background.cancel_all()

    # -- failed runs: backoff, restart budget, stall ----------------------------------

    def forget_failures(self, session_id: str) -> None:
        """Its deterministic failures no longer count in a row: a run of it
        committed, or the session is no longer this instance's."""
        self._failures.pop(session_id, None)

    def ended(self, session_id: str) -> None:
        """A run ended without failing: both counts start over."""
        self._failures.pop(session_id, None)
        self._transient.pop(session_id, None)

    def run_failed(self, fence: s.Fence, failure: BaseException | None) -> None:
        """Restart a failed run with backoff. Transient failures (the store,
        the network) restart without limit; a session whose runs keep failing
        deterministically (the table at the top of this module) gets
        `restart_budget` restarts, then stalls. The waits are the
        `retry.RESTART_TRANSIENT` and `retry.RESTART_FAILED` policies."""
        sid = fence.session_id
        is_transient = transient(failure)
        if is_transient:
            count = self._transient[sid] = self._transient.get(sid, 0) + 1
            policy = retry.RESTART_TRANSIENT
        else:
            count = self._failures[sid] = self._failures.get(sid, 0) + 1
            if count > self.restart_budget:
                self._background.spawn(self._stall(fence, failure, count), fresh_context=True)
                return
            policy = retry.RESTART_FAILED
        delay = policy.jittered(policy.delay(count))
        metrics.RESTARTS.inc()
        self._log.warning(
            "run failed; restarting it",
            session_id=sid,
            delay_s=delay,
            transient=is_transient,
            failures=count,
            error=repr(failure)[:300],
        )
        self._activator.start_activation(fence, unpark=True, delay=delay)

    async def _stall(self, fence: s.Fence, failure: BaseException | None, count: int) -> None:
        """The restart budget is spent: hold the session without running it
        (its inbox keeps every accepted command) and say so on its stream.
        An operator's resume (`resume`), a restart of this instance, or
        another instance taking the session over runs it again with a fresh
        budget."""
        sid = fence.session_id
        self.stalled[sid] = fence
        if isinstance(failure, BatonError):
            cause = f"{failure.reason}: {failure.message}"
        else:
            cause = safe_error(failure) if failure is not None else "unknown"
        message = f"{count} runs in a row failed; the last: {cause}"[:500]
        self._log.error("session stalled: restart budget spent", session_id=sid, error=message)
        identity = RunIdentity(fence, self.deployment_id, self.instance_id)
        event = make_event(
            identity,
            s.EVENT_KIND_SESSION_STALLED,
            error=s.ErrorDetail(reason=Reason.RESTART_BUDGET_SPENT, message=message),
        )
        try:
            snapshot, revision = await self._anchor.snapshot_with_revision(sid)
            await commit_step(self._anchor, identity, snapshot, [event], False, revision)
        except Fenced:
            self.stalled.pop(sid, None)  # someone else runs it now
        except BatonError as exc:
            self._log.error("stall not reported on the stream", session_id=sid, reason=exc.reason)

    async def resume(self, session_id: str) -> s.Fence | None:
        """An operator's resume (docs/failures.md): run a session stalled here
        again, its restart budget renewed and its inbox kept. Commits
        `session.resumed` first (so introspection stops reporting the stall),
        then activates the run; the session stays held as stalled until then.
        None when it is not stalled here (a repeated or concurrent resume:
        the caller tells "held" from "not held"); Fenced when another run
        owns it now."""
        fence = self.stalled.get(session_id)
        if fence is None or session_id in self._resuming:
            return None
        identity = RunIdentity(fence, self.deployment_id, self.instance_id)
        self._resuming.add(session_id)
        try:
            snapshot, revision = await self._anchor.snapshot_with_revision(session_id)
            event = make_event(identity, s.EVENT_KIND_SESSION_RESUMED)
            await commit_step(self._anchor, identity, snapshot, [event], False, revision)
        except Fenced:
            self.stalled.pop(session_id, None)  # someone else runs it now
            raise
        finally:
            self._resuming.discard(session_id)
        if self.stalled.pop(session_id, None) is None:
            return None  # the instance stopped meanwhile
        self.ended(session_id)
        metrics.RESUMES.inc()
        self._log.info("stalled session resumed by an operator", session_id=session_id)
        self._activator.start_activation(fence, unpark=True)
        return fence

    # -- takeover ------------------------------------------------------------------------

    async def take_over(self, owned: OwnedSession) -> TakenOver | None:
        """Take over a session of a dead instance of this deployment.

        None when another instance won the race or the session is finalized.
        Raises FailedPrecondition/INSTANCE_LIVE when the instance is not dead
        after all. Transient failures are retried with the same successor run
        id, so a takeover whose answer was lost is recognised as ours."""
        sid = owned.fence.session_id
        successor = s.OwnerIdentity(
            owner_run_id=ids.new_run_id(),
            deployment_id=self.deployment_id,
            instance_id=self.instance_id,
        )
        bound = self._log.bind(session_id=sid, run_id=successor.owner_run_id)
        self.adopting.add(sid)
        backoff = retry.TAKEOVER.backoff()
        try:
            while True:
                if self.stopped:
                    return None
                try:
                    taken = await self._hooks.take_over_session(
                        owned.fence, owned.owner.instance_id, successor
                    )
                    break
                except Fenced:
                    return None  # another instance won
                except FailedPrecondition as exc:
                    if exc.reason == Reason.SESSION_FINALIZED:
                        return None
                    raise
                except BatonError as exc:
                    if not exc.retryable:
                        raise
                    pause = backoff.next_delay()
                    bound.warning("takeover retry", reason=exc.reason, backoff_s=pause)
                    await asyncio.sleep(pause)
            metrics.TAKEOVERS.inc()
            bound.info(
                "session taken over",
                from_instance=owned.owner.instance_id,
                epoch=taken.fence.epoch,
                parked=taken.parked,
            )
            return taken
        finally:
            self.adopting.discard(sid)
