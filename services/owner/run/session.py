"""A session program: one owner run of one session, as an imperative shell.

The run reads the session's inbox continuously (a server stream from hooks),
takes the commands the rules say it takes (admission.take), asks the
decisions (decisions.py) what each means and hands the effect it gets back
to its one small `_apply_<kind>` — a commit, the open turn's steps, a
finalization, a compaction, tool calls for answered waits — then loops (the
shape of Temporal's workflow activation: the rules return effects and take
their time from the shell's clock, the shell carries the effects out).
Every step is committed through anchor as one fenced transaction: the
step's events, the history entries it appended and the new snapshot, whose
inbox position says which commands the step consumed.

Calls go one way: the shell holds the rooms it drives and asks the rules;
no room holds another room or the shell, and none decides what the shell
does next. The rooms: the inbox buffer (inbox_buffer.py: reports what
arrives), the abortable step (step.py: model, tools, child work; the shell
aborts it when a command pushed meanwhile may), departures (departures.py:
handoff, drain and park attempts; when each is due is the departure rules'),
commits (commit.py: the last commit and the checkpoint; the shell calls the
upkeep before and after each and fails the turn of a refused one), upkeep
(upkeep.py: timer, history retirement, controls to children, reports and
aliases) and compaction.py (the model's summary); the shell holds no client
of its own. The rules are in rules/: one state (held.py) and functions over
it by concern, decisions.py and departure_rules.py; none of them does I/O
or reads a clock. What a run starts from and how it ends (`RunStart`,
`RunServices`, `RunExit`) is terms.py's.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Awaitable
from typing import assert_never

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import failpoints, retry
from baton_runtime.common.errors import BatonError, Fenced
from baton_runtime.common.tasks import Background
from baton_runtime.owner.agents.api import Agent
from baton_runtime.owner.handoff.attempt import Attempt
from baton_runtime.owner.rules import admission, decisions, departure_rules, reports, turns
from baton_runtime.owner.rules.decisions import (
    AnswerAuthorization,
    AnswerInputs,
    Commit,
    Effect,
    Finalize,
    NextStep,
    Rejected,
    RunTurn,
    Summarize,
)
from baton_runtime.owner.rules.held import RunIdentity, SessionState, make_event
from baton_runtime.owner.rules.steps import StepProgress
from baton_runtime.owner.run import compaction
from baton_runtime.owner.run.commit import CommitRefused, RunCommits
from baton_runtime.owner.run.departures import Departures
from baton_runtime.owner.run.inbox_buffer import InboxBuffer, InboxClosed
from baton_runtime.owner.run.metering import accepted_time, waited
from baton_runtime.owner.run.spans import RunSpans  # tracing
from baton_runtime.owner.run.step import StepRunner
from baton_runtime.owner.run.terms import RunExit, RunServices, RunStart
from baton_runtime.owner.run.upkeep import Upkeep

log = structlog.get_logger("baton.owner.session")


class Idle(enum.Enum):
    """Why the run stopped waiting with nothing to take."""

    DRAIN = "drain"  # a drain attempt is due
    PARK = "park"  # nothing came for `park_after`: the run may park


def _run_log(identity: RunIdentity) -> structlog.BoundLogger:
    fence = identity.fence
    return log.bind(  # type: ignore[no-any-return]
        session_id=fence.session_id,
        run_id=fence.owner_run_id,
        epoch=fence.epoch,
        deployment_id=identity.deployment_id,
    )


class SessionRun:
    """Executes one session for one owner run until fenced, finalized, parked
    or handed off."""

    def __init__(
        self,
        identity: RunIdentity,
        agent: Agent,
        start: RunStart,
        services: RunServices,
        *,
        drain_to: str = "",
    ) -> None:
        """`drain_to`: the deployment this one drains to when the run starts
        ("" when it does not)."""
        fence = identity.fence
        hooks, anchor, children = services.hooks, services.anchor, services.children
        self.identity = identity
        self._clock = services.clock
        self.state = SessionState.hold(
            identity, start.snapshot, agent, start.context, now=self._clock()
        )
        self.agent = agent
        self._park_after = services.park_after
        self.failure: BaseException | None = None  # why the run failed, when it did
        self.drained = False  # the run ended because a drain moved the session
        self._unstarted = start.unstarted  # session.started goes with the first commit
        self._handoff_id = start.handoff_id  # the handoff that started this run, if one did
        self._log = _run_log(identity)
        # Every task of the run (inbox reader, step, timer, retirement,
        # reports): cancelled together when the run ends.
        self._background = Background()
        tasks, state, run_log = self._background, self.state, self._log
        catalog = services.catalog
        self._step = StepRunner(
            identity,
            state,
            hooks,
            children,
            catalog,
            tasks,
            run_log,
            lease=services.lease,
            live=anchor.live,
        )
        self._upkeep = Upkeep(identity, state, hooks, anchor, children, tasks, run_log)
        self._departures = Departures(
            state, hooks, run_log, attempts=services.attempts, drain_to=drain_to
        )
        self._spans = RunSpans(fence.session_id, fence.owner_run_id)  # tracing
        self._inbox = InboxBuffer(
            hooks,
            fence,
            state.inbox,
            run_log,
            from_seq=start.snapshot.inbox_next_seq,
            seed=start.seed,
            spans=self._spans,  # tracing
        )
        self._pending = self._inbox.pending
        self._revision_known = start.revision is not None  # handoff eligibility needs it
        self._commits = RunCommits(anchor, identity, state, revision=start.revision)

    @property
    def snapshot(self) -> s.SessionSnapshot:
        return self.state.snapshot

    @property
    def session_id(self) -> str:
        return self.identity.fence.session_id

    @property
    def run_id(self) -> str:
        return self.identity.fence.owner_run_id

    @property
    def snapshot_revision(self) -> int | None:
        """The mod revision of the last committed snapshot, when known."""
        return self._commits.revision

    @property
    def progressed(self) -> bool:
        """A commit of this run succeeded."""
        return self._commits.progressed

    @property
    def pending(self) -> int:
        """Inbox entries read and not processed yet."""
        return len(self._pending)

    @property
    def drain_to(self) -> str:
        return self._departures.drain_to

    def busy_with(self) -> str:
        """Why the session cannot move yet (departure_rules.busy_with)."""
        return departure_rules.busy_with(self.state)

    def oldest_pending_accepted(self) -> float | None:
        """When the oldest entry read and not processed yet was accepted
        (epoch seconds), or None. Entries set aside while the turn waits for
        the user or a child (a queued message: admission.next_to_take) wait
        for that, not for the run: they do not count."""
        index = admission.next_to_take(self.state, self._pending)
        return None if index is None else accepted_time(self._pending[index])

    def offer(self, entry: s.InboxEntry) -> None:
        """An entry appended to this session's inbox by this process (a
        child's work or report): taken now when it is the next one."""
        self._inbox.offer(entry)

    # -- the program ------------------------------------------------------

    async def run(self) -> RunExit:
        self._background.spawn(self._inbox.read())
        try:
            await self._begin()
            return await self._serve()
        except InboxClosed as closed:
            self.failure = closed.failure
            return RunExit.FENCED if closed.fenced else RunExit.FAILED
        except Fenced:
            self._log.info("fenced; run ends")
            return RunExit.FENCED
        except BatonError as exc:
            self._log.error("run failed", reason=exc.reason, error=exc.message)
            self.failure = exc
            return RunExit.FAILED
        except Exception as exc:  # noqa: BLE001 - authored or owner code: the host restarts
            self._log.exception("run crashed")
            self.failure = exc
            return RunExit.FAILED
        finally:
            await self._background.cancel_all()

    async def _begin(self) -> None:
        """Before the first command: authored code's look, what the stream
        must say first (started, handed off), the timer, a predecessor's
        leftovers (reports, the step in flight at its crash)."""
        state = self.state
        if self.agent.on_load is not None:
            # Authored code sees the session first; if it raises, the run
            # fails and counts against the host's restart budget.
            self.agent.on_load(self.snapshot)
        self._upkeep.start_retire()
        if self._unstarted:
            self._commits.carry.append(self._event(s.EVENT_KIND_SESSION_STARTED))
        arrived_from = self.snapshot.deployment_id
        handed_off = bool(arrived_from) and arrived_from != self.identity.deployment_id
        if handed_off:
            # First run on this deployment after a handoff: say so on the
            # stream (with the first commit here) and restart the timeout.
            self._commits.carry.append(
                self._event(
                    s.EVENT_KIND_SESSION_HANDED_OFF, text=arrived_from, handoff_id=self._handoff_id
                )
            )
        delay = turns.arm_timeout(state, now=self._clock(), restart=handed_off)
        if delay is not None:
            self._upkeep.start_timer(delay)
        if handed_off and not self._pending:
            # Moved by a drain or an adoption (no trigger in hand): say so
            # on the stream now, not with whatever comes next.
            await self._guarded(self._commit([]))
        self._upkeep.deliver_reports()  # a predecessor's, if it could not
        if decisions.recovery(state):
            turn = self.snapshot.open_turn
            self._log.info("continuing open turn", turn_id=turn.turn_id, steps=turn.steps)
            with self._spans.process(state, None):  # tracing
                await self._guarded(self._apply_run_turn(RunTurn([])))

    def _event(self, kind: s.EventKind.ValueType, text: str = "", handoff_id: str = "") -> s.Event:
        """An event the run itself says (started, handed off), at the clock's time."""
        state, now = self.state, self._clock()
        return make_event(
            state.identity, kind, state.turn_id, now=now, text=text, handoff_id=handoff_id
        )

    async def _serve(self) -> RunExit:
        """Take commands until the session finalizes or the run departs."""
        while self.snapshot.status != s.SESSION_STATUS_FINALIZED:
            entry = await self._take()
            if entry is Idle.DRAIN:
                if await self._moved(await self._try_drain()):
                    self.drained = True
                    return RunExit.HANDED_OFF
                continue
            if entry is Idle.PARK:
                if await self._try_park():
                    return RunExit.PARKED
                continue
            if (
                self._triggers_handoff(entry)
                and not self._pending
                and await self._moved(await self._try_hand_off(entry))
            ):
                return RunExit.HANDED_OFF
            waited(entry)  # (a trigger handed off is dispatched, and counted, there)
            with self._spans.process(self.state, entry):  # tracing
                await self._guarded(self._process(entry))
            if self.snapshot.status != s.SESSION_STATUS_FINALIZED:
                await self._guarded(self._compact_if_over_budget())
        await self._upkeep.retired()
        return RunExit.FINALIZED

    async def _take(self) -> s.InboxEntry | Idle:
        """The next command the rules take (admission.take: the first,
        unless the turn waits and a queued message waits for it to end);
        else, once it is due, a drain attempt, or a park attempt after
        `park_after` with nothing to take. Raises InboxClosed."""
        with self._inbox.idle_while(not self.state.turn_open):
            while (entry := admission.take(self.state, self._pending)) is None:
                self._inbox.raise_if_closed()
                drain_in = self._drain_wait()
                if drain_in == 0.0:
                    return Idle.DRAIN
                park_in = self._park_after
                parks_first = park_in is not None and (drain_in is None or park_in < drain_in)
                wait = park_in if parks_first else drain_in
                if not await self._inbox.arrival(wait) and parks_first:
                    return Idle.PARK
            return entry

    # -- departures (docs/design.md §6, issue 12) ---------------------------------------

    def request_drain(self, target: str) -> None:
        """An operator drains this deployment to `target`: the session moves
        there through the ordinary handoff the next time it is idle."""
        self._departures.request_drain(target)
        self._inbox.wake()

    def _drain_wait(self) -> float | None:
        """Seconds until a drain attempt is due (0: now); None while none can
        be. The one place the run asks (departure_rules.drain_wait)."""
        return departure_rules.drain_wait(
            self.state,
            draining=self._departures.draining,
            pending=len(self._pending),
            due_at=self._departures.drain_due_at,
            now=time.monotonic(),
        )

    def _triggers_handoff(self, entry: s.InboxEntry) -> bool:
        """`entry` triggers a handoff: it arrived while the run was idle with
        nothing pending (the buffer noted it), and the departure rules say
        so. Nothing can change their answer between its arrival and now:
        the run was waiting for commands, or committing what left it idle."""
        return (
            self._departures.can_move
            and entry.seq == self._inbox.idle_arrival
            and departure_rules.is_trigger(self.state, entry, revision_known=self._revision_known)
        )

    async def _try_drain(self) -> Attempt:
        with self._spans.handoff(None, self.drain_to):  # tracing
            return await self._departures.try_drain(self._commits.checkpoint())

    async def _try_hand_off(self, entry: s.InboxEntry) -> Attempt:
        target = entry.command.delivery.accepted_deployment_id
        with self._spans.handoff(entry, target):  # tracing
            return await self._departures.try_hand_off(self._commits.checkpoint(), entry)

    async def _try_park(self) -> bool:
        if not departure_rules.may_park(
            park_after=self._park_after,
            pending=len(self._pending),
            reports_pending=self._upkeep.reports_pending(),
        ):
            return False
        if reports.delivered_uncommitted(self.state):
            # The emptied outbox durable first (a snapshot-only commit): a
            # woken run must not deliver them again (docs/design.md §16).
            await self._guarded(self._commit([]))
            return False  # parks at the next idle timeout, if still idle
        # Still idle while parking: an arrival that fails the park is
        # evaluated as a handoff trigger like any other.
        with self._inbox.idle_while(not self.state.turn_open):
            return await self._departures.park(self.identity.fence)

    async def _moved(self, attempt: Attempt) -> bool:
        """Whether an attempt to move the session moved it; an uncertain one
        is decided here first."""
        if attempt is Attempt.UNCERTAIN:
            return await self._settle_uncertain()
        return attempt is Attempt.MOVED

    async def _settle_uncertain(self) -> bool:
        """Commit the unchanged snapshot, fenced (compared with the last
        revision): success means the session did not move and cannot move
        on this attempt (the checkpoint revision is gone); FENCED means it
        moved. Anything else decides nothing (the transfer may still land),
        so keep trying: the trigger waits."""
        backoff = retry.HANDOFF_CHECKPOINT.backoff()
        while True:
            try:
                await self._commit([], idle_after=False)
            except Fenced:
                self._log.info("handoff settled: the session moved")
                return True
            except BatonError as exc:
                self._log.warning("deciding commit failed; again", reason=exc.reason)
                await backoff.wait()
                continue
            self._log.info("handoff settled: the session stays; processing here")
            return False

    # -- commits: the upkeep around each, a refused one failing the turn ----------------

    async def _commit(
        self, events: list[s.Event], close: bool = False, *, idle_after: bool = True
    ) -> None:
        """Commit `events` with the state (fenced), the upkeep before and
        after it. Raises CommitRefused for a commit that can never succeed."""
        await self._upkeep.before_commit(closes=close)
        # A commit that settles the session: a delivery arriving while it is in
        # flight arrives at an idle session (a reader may see the commit, and
        # send, before this run has the answer), so it may trigger a handoff.
        with self._inbox.idle_while(idle_after and not close and not self.state.turn_open):
            await self._commits.commit(events, close)
        self._upkeep.after_commit()

    async def _guarded(self, work: Awaitable[None]) -> None:
        """Run `work`; a commit it makes that can never succeed (too large,
        invalid) fails the turn instead (docs/failures.md)."""
        try:
            await work
        except CommitRefused as refused:
            self._log.warning(
                "commit refused; the turn fails", reason=refused.reason, error=refused.message
            )
            self._commits.carry = refused.carry
            error = s.ErrorDetail(reason=refused.reason, message=refused.message[:500])
            events = turns.refused(
                self.state, refused.events, refused.close, error, now=self._clock()
            )
            await self._commit(events, close=refused.close)

    # -- commands: ask the decisions, apply the effect they return ---------------------

    async def _process(self, entry: s.InboxEntry) -> None:
        """One command from the inbox: what it means is the decisions'
        answer; the effect it returns is applied here."""
        effect = decisions.decide(self.state, entry, self._pending, now=self._clock())
        if entry.command.WhichOneof("kind") == "task_result" and not isinstance(effect, Rejected):
            await failpoints.hit("children.apply_result")
        if isinstance(effect, Commit) and effect.note:
            self._log.info(effect.note, inbox_seq=entry.seq)
        await self._apply(effect)

    async def _apply(self, effect: Effect) -> None:
        """Hand `effect` to its one `_apply_<kind>` (an effect may lead to
        another: the decisions' answer to what the first one did)."""
        match effect:
            case Commit():
                await self._apply_commit(effect)
            case Rejected():
                await self._apply_rejected(effect)
            case RunTurn():
                await self._apply_run_turn(effect)
            case Finalize():
                await self._apply_finalize(effect)
            case Summarize():
                await self._apply_summarize(effect)
            case AnswerInputs():
                await self._apply_answer_inputs(effect)
            case AnswerAuthorization():
                await self._apply_answer_authorization(effect)
            case _:
                assert_never(effect)

    async def _apply_commit(self, effect: Commit) -> None:
        await self._commit(effect.events)

    async def _apply_rejected(self, effect: Rejected) -> None:
        reason = effect.event.error.reason
        self._log.info("command rejected", reason=reason, inbox_seq=effect.entry.seq)
        await self._commit([effect.event])

    async def _apply_run_turn(self, effect: RunTurn) -> None:
        """The open turn's steps until the decisions end it (one exit)."""
        events = effect.events
        while True:
            ends = decisions.before_step(self.state, self._pending, events, now=self._clock())
            if ends is None:
                progress = await self._run_step()
                after = decisions.after_step(
                    self.state, progress, self._pending, events, now=self._clock()
                )
                if after is NextStep.NOW:
                    continue  # the boundary finds the pushed command
                if after is NextStep.AFTER_COMMIT:
                    await self._commit(events)
                    events = []
                    continue
                ends = after
            await self._apply(ends)
            return

    async def _run_step(self) -> StepProgress:
        """One step of the open turn, while `_abort_on_push` watches what
        arrives meanwhile."""
        watch = self._background.spawn(self._abort_on_push(self._inbox.next_seq))
        try:
            return await self._step.run()
        finally:
            watch.cancel()

    async def _abort_on_push(self, since: int) -> None:
        """A command arriving while the step runs (seq `since` and on) aborts
        it at once when the rules say so (admission.aborts_step: a cancel,
        reset or own timeout with everything ahead of it able to join the
        turn); the turn's next boundary then finds it."""
        with contextlib.suppress(InboxClosed):  # the run learns it at its next commit
            while True:
                pending = list(self._pending)
                for index, entry in enumerate(pending):
                    ahead = pending[:index]
                    if entry.seq >= since and admission.aborts_step(self.state, entry, ahead):
                        self._step.abort()
                        return
                since = self._inbox.next_seq
                await self._inbox.arrival()

    async def _apply_finalize(self, effect: Finalize) -> None:
        """Terminal: close the stream once, then release every token."""
        error = effect.error
        turns.finalize(self.state, effect.events, effect.entry, error, now=self._clock())
        await self._commit(effect.events, close=True)
        await self._upkeep.release_aliases()
        self._log.info("session finalized", reason=error.reason if error else "RESET")

    async def _apply_summarize(self, effect: Summarize) -> None:
        """The compact command, or the owner's own (`effect.entry` None)."""
        await compaction.summarize(self.state, effect.events, effect.entry, self._log, self._clock)
        await self._commit(effect.events)

    async def _apply_answer_inputs(self, effect: AnswerInputs) -> None:
        """Run the approved calls in order, then ask what their results mean."""
        results = [await self._step.call_tool(call) for call in effect.to_run]
        answered = decisions.apply_input_answers(self.state, effect, results, now=self._clock())
        await self._apply(answered)

    async def _apply_answer_authorization(self, effect: AnswerAuthorization) -> None:
        """Run the call signed in for (none: refused), then ask what it means."""
        call = effect.to_run
        result = await self._step.call_tool(call) if call is not None else None
        answered = decisions.apply_authorization(self.state, effect, result, now=self._clock())
        await self._apply(answered)

    # -- compaction ------------------------------------------------------------------

    async def _compact_if_over_budget(self) -> None:
        """At a turn boundary: compact when what the model sees outgrew the
        agent's context budget (docs/design.md §4)."""
        if decisions.compaction_due(self.state):
            compaction.log_over_budget(self.state, self._log)
            await self._apply_summarize(Summarize([], None))
