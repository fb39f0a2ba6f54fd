"""Baton's protocol for one session, as steps on the model's state.

Each step is one atomic thing the real system does: an etcd transaction
(with what the process that sent it does with the answer), or a process
event (a crash, a lease expiring, a restart). `Model.successors` yields
every step enabled in a state, each with the state after it; where a real
call can lose its answer, the step yields that outcome too (while the
budget of lost replies lasts). Steps are `protocol` (the system's own
doing: at quiescence none is enabled) or `environment` (what the world may
do or not: a new send, a fault, an operator's drain).

The step names are the rows of docs/model.md, which maps each to the room
and function it mirrors (`ACTIONS` below says the same, and
tests/test_model.py checks that both name real code).

docs/model.md says what is coarser than the code, and why that is sound
(an RPC and its transaction are one step; a delivery is checked as a
trigger when it is taken; bells are level-triggered; ...).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from model.options import Bounds, Variant, deployment_of
from model.state import (
    BEGIN,
    FORCED,
    IDLE,
    NOT_PARKED,
    OFFERED,
    SETTLING,
    UNSURE,
    Acceptance,
    Activating,
    Budget,
    Claiming,
    Entry,
    Event,
    Gateway,
    Held,
    Host,
    Parked,
    Run,
    Snapshot,
    State,
    Store,
)

PROTOCOL = "protocol"
ENVIRONMENT = "environment"


class Step(NamedTuple):
    """One step: its name (a row of docs/model.md), the instance or gateway
    that took it, what its call came to (`OUTCOMES`), whether the system or
    the world took it, what it did (for a trace), and the state after."""

    action: str
    actor: str
    outcome: str
    kind: str
    label: str
    state: State


# What a step's call came to, as its caller saw it.
OUTCOMES = {
    "ok": "applied and answered",
    "lost": "applied; the answer was lost",
    "dropped": "lost before it was applied",
    "duplicate": "a repeated delivery id: the first receipt, nothing appended",
    "replayed": "a repeat of an applied request: its recorded answer",
    "fenced": "refused: FAILED_PRECONDITION/FENCED",
    "stale": "refused: ABORTED (the snapshot revision or the stream moved on)",
    "refused": "refused for good (a transfer's compare, a checkpoint not idle)",
    "local": "no call: a process event, or a decision in the owner's memory",
}


# Step name -> (what it is, where the code does it). Kept in step with
# docs/model.md by tests/test_model.py.
ACTIONS: dict[str, tuple[str, str]] = {
    "send": (
        "a gateway sends a message (a new delivery id) through an ingress",
        "services/hooks/inbox.py:Inbox._append_txn",
    ),
    "retry_send": (
        "the gateway sends again after a lost answer, same delivery id",
        "services/hooks/inbox.py:Inbox._after_refusal",
    ),
    "crash": (
        "kill -9 of an owner process: everything in memory is gone",
        "services/owner/host/sessions.py:HostedSessions.stop",
    ),
    "pause": (
        "an owner process paused past its lease (SIGSTOP, a partition)",
        "services/owner/host/fleet.py:FleetMembership._keep_alive",
    ),
    "notice_lease_lost": (
        "a keep-alive answers TTL 0: stop every run and exit",
        "services/owner/host/fleet.py:FleetMembership._lose_lease",
    ),
    "lease_expires": (
        "a dead process's lease expires: its registry key vanishes",
        "services/hooks/instances.py:InstanceRegistry.register",
    ),
    "restart": (
        "the supervisor restarts an owner process under its instance id",
        "services/owner/host/fleet.py:FleetMembership._join",
    ),
    "take_over": (
        "TakeOverSession: epoch + 1 by compare-and-swap, index moved",
        "services/hooks/ownership.py:Ownership.take_over",
    ),
    "take_over_retry": (
        "the takeover sent again after a lost answer (same successor run)",
        "services/owner/host/restarts.py:Restarts.take_over",
    ),
    "wake": (
        "a bell above the parked position (or a drain) wakes a parked session",
        "services/owner/host/parking.py:Parking.ring",
    ),
    "reconcile_wake": (
        "the reconciler wakes a parked session whose bell rang",
        "services/owner/host/reconcile.py:Reconciler.round",
    ),
    "activate": (
        "unpark (fenced), load the last snapshot, start a run",
        "services/owner/host/sessions.py:HostedSessions._activate",
    ),
    "begin": (
        "a run moved here without a trigger commits session.handed_off first",
        "services/owner/run/session.py:SessionRun._begin",
    ),
    "step": (
        "take the next inbox entry (or go on with the open turn), run a step, commit it",
        "services/owner/run/session.py:SessionRun._serve",
    ),
    "commit_retry": (
        "a commit whose answer was lost, sent again: replayed, fenced or stale",
        "services/owner/run/commit.py:_commit",
    ),
    "park": (
        "SetParked(true): fence, owner record and inbox head compared",
        "services/hooks/ownership.py:Ownership.set_parked",
    ),
    "offer": (
        "a trigger: the old owner offers the session to the accepting deployment",
        "services/owner/handoff/attempt.py:HandoffAttempts._move",
    ),
    "drain_offer": (
        "a drain: an idle run offers its session to the drain target",
        "services/owner/run/session.py:SessionRun._try_drain",
    ),
    "offer_timeout": (
        "AcceptHandoff's answer does not come: the outcome is uncertain",
        "services/owner/handoff/attempt.py:HandoffAttempts._offer",
    ),
    "transfer": (
        "the target validates, Transfers (one txn) and launches the successor",
        "services/hooks/transfer.py:_transfer_txn",
    ),
    "settle": (
        "an uncertain handoff decided by a fenced commit of the unchanged snapshot",
        "services/owner/run/session.py:SessionRun._settle_uncertain",
    ),
    "adopt": (
        "an owner of the accepting deployment adopts a session whose fleet is gone",
        "services/owner/host/adoption.py:Adoption.prepare",
    ),
    "drain_start": (
        "an operator drains deployment A to B",
        "services/owner/host/drains.py:Drains.start",
    ),
}


class Model:
    """The protocol under `bounds`, with the mistakes `variant` names."""

    def __init__(
        self,
        bounds: Bounds | None = None,
        variant: Variant | None = None,
        *,
        strict_step_once: bool = False,
    ) -> None:
        """`strict_step_once`: a committed step run again by any run is a
        violation, a stale one's too (a paused owner that resumes may run
        the step of an entry it read before its fence moved, which its
        successor committed: its commit is fenced, but its model and tool
        calls were made). Off, only the session's owner is held to it."""
        self.bounds = bounds or Bounds()
        self.variant = variant or Variant()
        self.strict_step_once = strict_step_once
        self.instances = self.bounds.instances
        self._index = {name: i for i, name in enumerate(self.instances)}
        self._deployment = {name: deployment_of(name) for name in self.instances}

    def initial(self) -> State:
        """The session created on the first instance, session.started
        committed (CreateSession, then the first commit)."""
        first = self.instances[0]
        snap = Snapshot(inbox_next=0, open_steps=0, next_event_seq=1, deployment="A", revision=1)
        store = Store(
            epoch=1,
            holder=first,
            parked_at=NOT_PARKED,
            inbox=(),
            bells=(),
            snapshot=snap,
            events=(Event(0, "started", -1, 0, 1, "A"),),
            handoffs=(),
        )
        hosts = tuple(
            Host(name, up=True, lease=True, held=Run(1, snap) if name == first else None)
            for name in self.instances
        )
        bounds = self.bounds
        return State(
            store=store,
            hosts=hosts,
            gateways=(Gateway(),) * bounds.messages,
            budget=Budget(bounds.crashes, bounds.lost, bounds.handoffs),
        )

    def successors(self, s: State) -> Iterator[Step]:
        """Every step enabled in `s`."""
        yield from self._gateways(s)
        yield from self._processes(s)
        yield from self._takeovers(s)
        yield from self._parking(s)
        yield from self._runs(s)
        yield from self._handoffs(s)

    # -- state helpers -------------------------------------------------------------

    def host(self, s: State, name: str) -> Host:
        return s.hosts[self._index[name]]

    def _put(self, s: State, name: str, host: Host, budget: Budget | None = None) -> State:
        """`s` with instance `name` as `host` (and the budget left as `budget`)."""
        i = self._index[name]
        hosts = (*s.hosts[:i], host, *s.hosts[i + 1 :])
        return State(s.store, hosts, s.gateways, budget or s.budget, s.draining)

    def _hold(self, s: State, name: str, held: Held | None, budget: Budget | None = None) -> State:
        """`s` with instance `name` holding `held` of the session."""
        h = self.host(s, name)
        host = Host(h.name, h.up, h.lease, held, h.accepting, h.rejoin)
        return self._put(s, name, host, budget)

    def _hosts_of(self, deployment: str) -> list[str]:
        return [name for name in self.instances if self._deployment[name] == deployment]

    def _spend_lost(self, s: State) -> Budget:
        return s.budget._replace(lost=s.budget.lost - 1)

    # -- gateways: appends to the inbox (hooks' ResumeHook) ---------------------------

    def _gateways(self, s: State) -> Iterator[Step]:
        unsent = [m for m, gateway in enumerate(s.gateways) if not gateway.via]
        if unsent:
            # Messages are interchangeable but for their ingress: sending the
            # lowest unsent one first loses no behaviour (a symmetry).
            m = unsent[0]
            for via in ("A", "B"):
                yield from self._append(s, m, via, "send", ENVIRONMENT)
        for m, gateway in enumerate(s.gateways):
            if gateway.retry:
                yield from self._append(s, m, gateway.via, "retry_send", PROTOCOL)

    def _append(self, s: State, m: int, via: str, action: str, kind: str) -> Iterator[Step]:
        """ResumeHook: one txn comparing the inbox head, the delivery id's
        absence and the owner record; writing the entry, the delivery id, the
        head and, while the owner record says parked, its instance's bell. A
        repeated delivery id answers the first receipt and appends nothing.
        (A delivery sent again after its answer arrived is the same as one
        whose answer was lost: both reach hooks twice.)"""
        st = s.store
        first = next((seq for seq, e in enumerate(st.inbox) if e.msg == m), None)
        if first is not None and not self.variant.dedupe_by_attempt:
            seq, store, outcome = first, st, "duplicate"
        else:
            seq = len(st.inbox)
            inbox = (*st.inbox, Entry(m, via, st.epoch))
            bells = st.bells
            if st.parked_at != NOT_PARKED:
                bells = _ring(bells, st.holder, len(inbox))
            store, outcome = st._replace(inbox=inbox, bells=bells), "ok"
        gateways = list(s.gateways)
        actor = f"m{m}"
        label = f"{action} m{m} via {via}: " + ("duplicate of " if outcome == "duplicate" else "")
        label += f"seq {seq}"
        gateways[m] = Gateway(via, retry=False, receipt=seq)
        answered = s._replace(store=store, gateways=tuple(gateways))
        yield Step(action, actor, outcome, kind, label, answered)
        if s.budget.lost:
            gateways[m] = Gateway(via, retry=True, receipt=s.gateways[m].receipt)
            lost = s._replace(store=store, gateways=tuple(gateways), budget=self._spend_lost(s))
            yield Step(action, actor, "lost", kind, label + ", answer lost", lost)

    # -- processes: crashes, pauses, leases, restarts ---------------------------------

    def _processes(self, s: State) -> Iterator[Step]:
        for name, h in zip(self.instances, s.hosts, strict=True):
            if h.up and s.budget.crashes:
                spent = s.budget._replace(crashes=s.budget.crashes - 1)
                crashed = self._stop(s._replace(budget=spent), name)
                yield Step("crash", name, "local", ENVIRONMENT, f"crash {name}", crashed)
                if h.lease:
                    paused = self._put(s, name, h._replace(lease=False), budget=spent)
                    label = f"pause {name} past its lease"
                    yield Step("pause", name, "local", ENVIRONMENT, label, paused)
            if h.up and not h.lease:
                stopped = self._stop(s, name)
                label = f"{name} learns its lease expired, stops"
                yield Step("notice_lease_lost", name, "local", PROTOCOL, label, stopped)
            if not h.up and h.lease:
                expired = self._put(s, name, h._replace(lease=False))
                label = f"{name}'s lease expires"
                yield Step("lease_expires", name, "local", PROTOCOL, label, expired)
            if not h.up:
                # A new process registers a new lease; sessions still indexed
                # under its id are its leftovers, taken over before it serves.
                listed = s.store.epoch if s.store.holder == name else 0
                fresh = Host(name, up=True, lease=True, held=None, rejoin=listed)
                restarted = self._put(s, name, fresh)
                yield Step("restart", name, "local", PROTOCOL, f"restart {name}", restarted)

    def _stop(self, s: State, name: str) -> State:
        """The process ends (kill -9, or its exit after losing its lease):
        its runs, parked sessions and acceptances are gone; an AcceptHandoff
        waiting on it fails (the old owner's attempt is then uncertain)."""
        h = self.host(s, name)
        s = self._put(s, name, Host(name, up=False, lease=h.lease, held=None))
        for other, oh in zip(self.instances, s.hosts, strict=True):
            run = oh.held
            if isinstance(run, Run) and run.pc == OFFERED and run.target == name:
                s = self._hold(s, other, run._replace(pc=SETTLING))
        return s

    # -- takeover (hooks' TakeOverSession; restarts.py, fleet.py) ---------------------

    def _takeovers(self, s: State) -> Iterator[Step]:
        st = s.store
        old = st.holder
        for name, h in zip(self.instances, s.hosts, strict=True):
            if isinstance(h.held, Claiming):
                yield self._take_over_retry(s, name, h.held)
                continue
            if not (h.up and h.lease and h.held is None and not h.accepting) or not old:
                continue  # (a transfer here in flight: held, in `HostedSessions.holds`)
            if self._deployment[old] != self._deployment[name]:
                continue  # WRONG_DEPLOYMENT: only the session's own fleet takes it over
            if old == name:
                # Its own leftovers, listed at its join (a listing of an older
                # fence is FENCED: a stutter); or, by the reconciler, indexed
                # here and held in no state.
                if h.rejoin != st.epoch and not self.variant.reconciler:
                    continue
            elif self.host(s, old).lease:
                continue  # INSTANCE_LIVE: the old instance still holds its lease
            yield from self._take_over(s, name)

    def _take_over(self, s: State, name: str) -> Iterator[Step]:
        """The compare-and-swap: fence and owner record as listed (the
        listing is fresh here: a stale one is FENCED, a stutter), epoch + 1,
        the index moved. A parked session stays parked if no bell rang (then
        nothing arrived since it parked); a rung bell is deleted. The answer:
        parked at the position its owner record keeps, or not parked."""
        st = s.store
        old = st.holder
        rang = _bell(st.bells, old) is not None
        stays_parked = st.parked_at != NOT_PARKED and not rang
        store = st._replace(
            epoch=st.epoch + 1,
            holder=name,
            parked_at=st.parked_at if stays_parked else NOT_PARKED,
            bells=_unring(st.bells, old),
        )
        held: Held = (
            Parked(store.epoch, st.parked_at) if stays_parked else Activating(store.epoch, False)
        )
        label = f"{name} takes over from {old} (epoch {store.epoch}"
        label += f", stays parked at {st.parked_at})" if stays_parked else ")"
        host = self.host(s, name)._replace(held=held, rejoin=0)
        taken = self._put(s._replace(store=store), name, host)
        yield Step("take_over", name, "ok", PROTOCOL, label, taken)
        if s.budget.lost:
            claiming = host._replace(held=Claiming(st.epoch, old))
            lost = self._put(s._replace(store=store, budget=self._spend_lost(s)), name, claiming)
            yield Step("take_over", name, "lost", PROTOCOL, label + ", answer lost", lost)

    def _take_over_retry(self, s: State, name: str, claim: Claiming) -> Step:
        """The same request again. A replay (the fence is the one it would
        write) answers from what the applied takeover wrote: the parked
        position its owner record keeps (issue 32's third defect, fixed:
        the inbox head of now, above arrivals whose bells rang since)."""
        st = s.store
        label = f"{name} takes over again"
        if (st.epoch, st.holder) != (claim.epoch + 1, name):
            # FENCED (another instance won) or the old instance is live again.
            return Step(
                "take_over_retry",
                name,
                "fenced",
                PROTOCOL,
                label + ": FENCED",
                self._hold(s, name, None),
            )
        if st.parked_at == NOT_PARKED:
            held: Held = Activating(st.epoch, False)
            label += ": replayed, not parked"
        else:
            at = len(st.inbox) if self.variant.takeover_replay_head_now else st.parked_at
            held = Parked(st.epoch, at)
            label += f": replayed, parked at {at}"
        return Step("take_over_retry", name, "replayed", PROTOCOL, label, self._hold(s, name, held))

    # -- parking and waking (parking.py, sessions.py) -----------------------------------

    def _parking(self, s: State) -> Iterator[Step]:
        st = s.store
        for name, h in zip(self.instances, s.hosts, strict=True):
            if not h.up:
                continue
            held = h.held
            if isinstance(held, Parked):
                bell = _bell(st.bells, name)
                woken = self._hold(s, name, Activating(held.epoch, True))
                if bell is not None and bell > held.inbox_next:
                    yield Step(
                        "wake", name, "local", PROTOCOL, f"{name} wakes (bell {bell})", woken
                    )
                elif self._drain_due(s, name):
                    yield Step(
                        "wake", name, "local", PROTOCOL, f"{name} wakes for the drain", woken
                    )
                elif bell is not None and self.variant.reconciler:
                    label = f"{name}'s reconciler wakes it (bell {bell})"
                    yield Step("reconcile_wake", name, "local", PROTOCOL, label, woken)
            elif isinstance(held, Activating):
                yield self._activate(s, name, held)

    def _activate(self, s: State, name: str, act: Activating) -> Step:
        """Unpark when asked (SetParked(false): fenced; deletes the bell), load
        the last snapshot, launch the run. A launch without unparking is not
        fenced here: the run's inbox stream and commits are."""
        st = s.store
        if act.unpark:
            if (st.epoch, st.holder) != (act.epoch, name):
                label = f"{name} unparks: FENCED, no longer its session"
                return Step("activate", name, "fenced", PROTOCOL, label, self._hold(s, name, None))
            st = st._replace(parked_at=NOT_PARKED, bells=_unring(st.bells, name))
        snap = st.snapshot
        pc = BEGIN if snap.deployment != self._deployment[name] else IDLE
        run = Run(act.epoch, snap, pc=pc)
        label = f"{name} {'unparks, ' if act.unpark else ''}loads rev {snap.revision}, runs"
        return Step(
            "activate", name, "ok", PROTOCOL, label, self._hold(s._replace(store=st), name, run)
        )

    # -- runs: steps, commits, parking, departures (session.py) -------------------------

    def _runs(self, s: State) -> Iterator[Step]:
        for name, h in zip(self.instances, s.hosts, strict=True):
            run = h.held
            if not h.up or not isinstance(run, Run):
                continue
            if run.pc == BEGIN:
                yield from self._commit(s, name, run, "begin", "commits handed_off", None)
            elif run.pc in (IDLE, FORCED):
                yield from self._step(s, name, run)
                if run.pc == IDLE and run.snap.open_steps == 0:
                    if self._drain_due(s, name):
                        yield from self._offer(s, name, run, -1)
                    else:
                        yield from self._park(s, name, run)
            elif run.pc == UNSURE:
                yield self._commit_retry(s, name, run)
            elif run.pc == SETTLING:
                yield self._settle(s, name, run)

    def _step(self, s: State, name: str, run: Run) -> Iterator[Step]:
        """The next step of the open turn, or the next inbox entry: a handoff
        trigger (a send another deployment accepted, taken while idle) is
        offered; anything else starts a turn. The step runs (model and tool
        calls: nothing durable) and is committed."""
        st = s.store
        entry_seq, step = self.next_step(run)
        if step == 1:
            if entry_seq >= len(st.inbox):
                return
            entry = st.inbox[entry_seq]
            if run.pc != FORCED and entry.epoch > run.epoch:
                return  # appended after this run's fence moved: never delivered to it
            if run.pc == IDLE and self._is_trigger(s, name, entry):
                yield from self._offer(s, name, run, entry_seq)
                return
        done = any(
            e.kind == "step" and (e.inbox_seq, e.step) == (entry_seq, step) for e in st.events
        )
        if done and (self.strict_step_once or (st.epoch, st.holder) == (run.epoch, name)):
            ran = f"{name} ran step {step} of inbox {entry_seq} again"
            s = s._replace(store=_audit(st, "steps_once", ran))
        what = f"step {step} of inbox {entry_seq}"
        yield from self._commit(s, name, run, "step", what, (entry_seq, step))

    def _is_trigger(self, s: State, name: str, entry: Entry) -> bool:
        """departure_rules.is_trigger: a send accepted by another deployment,
        taken while idle (no open turn); only while handoff ids last."""
        return entry.via != self._deployment[name] and s.budget.handoffs > 0

    def _commit(
        self,
        s: State,
        name: str,
        run: Run,
        action: str,
        what: str,
        step: tuple[int, int] | None,
        after: str = IDLE,
    ) -> Iterator[Step]:
        """CommitStep: one txn comparing the fence, the snapshot revision the
        run last committed or loaded, and that the stream continues at the
        run's next seq; writing the events and the snapshot. The first commit
        of a run on a new deployment carries session.handed_off. FENCED ends
        the run; any other refusal fails it (the host restarts it from the
        last snapshot); a lost answer leaves it retrying."""
        st = s.store
        base = run.snap
        events, snap = self.commit_plan(name, run, step)
        label = f"{name} {what}"
        fenced = (st.epoch, st.holder) != (run.epoch, name)
        if fenced and not self.variant.commit_without_fence:
            ended = self._hold(s, name, None)
            yield Step(action, name, "fenced", PROTOCOL, label + ": FENCED, run ends", ended)
            return
        if st.snapshot.revision != base.revision or len(st.events) != base.next_event_seq:
            failed = self._hold(s, name, Activating(run.epoch, True))
            yield Step(action, name, "stale", PROTOCOL, label + ": ABORTED, run fails", failed)
            return
        if fenced:
            accepted = f"a commit by {name} at epoch {run.epoch} accepted at epoch {st.epoch}"
            st = _audit(st, "fenced_commits", accepted)
        store = st._replace(snapshot=snap, events=st.events + tuple(events))
        committed = self._hold(s._replace(store=store), name, run._replace(snap=snap, pc=after))
        label += f" (rev {snap.revision})"
        yield Step(action, name, "ok", PROTOCOL, label, committed)
        if s.budget.lost:
            first = events[0] if events else None
            unsure = run._replace(pc=UNSURE, pending=(snap, first))
            lost = self._hold(s._replace(store=store, budget=self._spend_lost(s)), name, unsure)
            yield Step(action, name, "lost", PROTOCOL, label + ", answer lost", lost)

    def commit_plan(
        self, name: str, run: Run, step: tuple[int, int] | None
    ) -> tuple[list[Event], Snapshot]:
        """What `run` on instance `name` commits for `step` (inbox seq, step
        of its turn; None: no step): its events, session.handed_off first on
        a new deployment, and the snapshot after them."""
        dep = self._deployment[name]
        base = run.snap
        events: list[Event] = []
        seq = base.next_event_seq
        if base.deployment != dep:
            events.append(Event(seq, "handed_off", -1, 0, run.epoch, dep))
            seq += 1
        inbox_next, open_steps = base.inbox_next, base.open_steps
        if step is not None:
            entry_seq, k = step
            events.append(Event(seq, "step", entry_seq, k, run.epoch, dep))
            seq += 1
            inbox_next = entry_seq + 1
            open_steps = k if k < self.bounds.steps else 0
        return events, Snapshot(inbox_next, open_steps, seq, dep, base.revision + 1)

    @staticmethod
    def next_step(run: Run) -> tuple[int, int]:
        """The step `run` takes next: (inbox seq, step of its turn)."""
        snap = run.snap
        if snap.open_steps:
            return snap.inbox_next - 1, snap.open_steps + 1
        return snap.inbox_next, 1

    def _commit_retry(self, s: State, name: str, run: Run) -> Step:
        """The identical commit again: FENCED first, then `replayed` when the
        stored snapshot and first event are the ones it wrote, else stale."""
        assert run.pending is not None
        st = s.store
        snap, first = run.pending
        label = f"{name} commits again"
        fenced = (st.epoch, st.holder) != (run.epoch, name)
        if fenced and not self.variant.commit_without_fence:
            ended = self._hold(s, name, None)
            return Step(
                "commit_retry", name, "fenced", PROTOCOL, label + ": FENCED, run ends", ended
            )
        if st.snapshot == snap and (first is None or st.events[first.seq] == first):
            done = self._hold(s, name, run._replace(snap=snap, pc=IDLE, pending=None))
            return Step("commit_retry", name, "replayed", PROTOCOL, label + ": replayed", done)
        failed = self._hold(s, name, Activating(run.epoch, True))
        return Step("commit_retry", name, "stale", PROTOCOL, label + ": ABORTED, run fails", failed)

    def _park(self, s: State, name: str, run: Run) -> Iterator[Step]:
        """SetParked(true) when idle: compares the fence, the owner record and
        that the inbox head is the consumed position (else INBOX_NOT_DRAINED:
        the run goes on, a stutter); an owner record parked already answers
        at once. A lost answer fails the run; its restart unparks (the park
        may have taken effect)."""
        st = s.store
        if (st.epoch, st.holder) != (run.epoch, name):
            ended = self._hold(s, name, None)
            yield Step("park", name, "fenced", PROTOCOL, f"{name} parks: FENCED, run ends", ended)
            return
        pos = run.snap.inbox_next
        drained = len(st.inbox) == pos or self.variant.park_without_head_compare
        if st.parked_at == NOT_PARKED and not drained:
            return
        store = st._replace(parked_at=pos if st.parked_at == NOT_PARKED else st.parked_at)
        label = f"{name} parks at {pos}"
        parked = self._hold(s._replace(store=store), name, Parked(run.epoch, pos))
        yield Step("park", name, "ok", PROTOCOL, label, parked)
        if s.budget.lost:
            spent = self._spend_lost(s)
            restart = Activating(run.epoch, True)
            applied = self._hold(s._replace(store=store, budget=spent), name, restart)
            yield Step("park", name, "lost", PROTOCOL, label + ", answer lost, run fails", applied)
            dropped = self._hold(s._replace(budget=spent), name, restart)
            yield Step("park", name, "dropped", PROTOCOL, label + ": call lost, run fails", dropped)

    # -- handoffs: offer, transfer, settle, drain, adoption ------------------------------

    def _drain_due(self, s: State, name: str) -> bool:
        """A drain of deployment A is on and an attempt may still move the
        session (then its runs offer it rather than park, and its parked
        sessions are woken for it)."""
        return s.draining and self._deployment[name] == "A" and s.budget.handoffs > 0

    def _offer(self, s: State, name: str, run: Run, trigger: int) -> Iterator[Step]:
        """The old owner's attempt (`trigger` -1: a drain): the live instances
        of the target deployment from the registry (none: the trigger is
        processed here), then AcceptHandoff on one of them with the
        checkpoint (its last commit) and its permit. A target that is down
        fails the call: the outcome is uncertain."""
        target_dep = s.store.inbox[trigger].via if trigger >= 0 else "B"
        action = "offer" if trigger >= 0 else "drain_offer"
        what = f"inbox {trigger}" if trigger >= 0 else "the drain"
        live = [b for b in self._hosts_of(target_dep) if self.host(s, b).lease]
        if not live:
            if trigger >= 0:
                here = self._hold(s, name, run._replace(pc=FORCED))
                label = f"{name} offers {what}: no live {target_dep}, processes it here"
                yield Step(action, name, "local", PROTOCOL, label, here)
            return
        handoff = self.bounds.handoffs - s.budget.handoffs
        s = s._replace(budget=s.budget._replace(handoffs=s.budget.handoffs - 1))
        if self.variant.release_then_claim:
            st = s.store
            if (st.epoch, st.holder) != (run.epoch, name):
                ended = self._hold(s, name, None)
                yield Step(action, name, "fenced", PROTOCOL, f"{name} releases: FENCED", ended)
                return
            released = st._replace(
                epoch=st.epoch + 1, holder="", parked_at=NOT_PARKED, bells=_unring(st.bells, name)
            )
            s = s._replace(store=released)
        for b in live:
            offered = run._replace(pc=OFFERED, handoff=handoff, target=b, trigger=trigger)
            label = f"{name} offers {what} to {b} (handoff {handoff})"
            if self.variant.release_then_claim:
                label = f"{name} releases the session (epoch {s.store.epoch}), offers {what} to {b}"
            target = self.host(s, b)
            if not target.up:
                failed = self._hold(s, name, offered._replace(pc=SETTLING))
                label += f": {b} is down, the outcome is uncertain"
                yield Step(action, name, "dropped", PROTOCOL, label, failed)
                continue
            acceptance = Acceptance(handoff, run.epoch, name, trigger, run.snap)
            accepting = target._replace(accepting=(*target.accepting, acceptance))
            after = self._hold(self._put(s, b, accepting), name, offered)
            yield Step(action, name, "ok", PROTOCOL, label, after)

    def _handoffs(self, s: State) -> Iterator[Step]:
        for name, h in zip(self.instances, s.hosts, strict=True):
            run = h.held
            if h.up and isinstance(run, Run) and run.pc == OFFERED and s.budget.lost:
                timed_out = self._hold(
                    s, name, run._replace(pc=SETTLING), budget=self._spend_lost(s)
                )
                label = f"{name}'s AcceptHandoff to {run.target} times out"
                yield Step("offer_timeout", name, "local", ENVIRONMENT, label, timed_out)
            if h.up:
                for acceptance in h.accepting:
                    yield from self._transfer(s, name, acceptance)
            if h.up and h.lease and h.held is None:
                yield from self._adopt(s, name)
        if self.bounds.drain and not s.draining:
            label = "an operator drains A to B"
            yield Step(
                "drain_start", "operator", "local", ENVIRONMENT, label, s._replace(draining=True)
            )

    def _transfer(self, s: State, name: str, acc: Acceptance) -> Iterator[Step]:
        """The target's one call: prepare (the checkpoint is idle: no open
        turn, the trigger its next entry), Transfer on hooks, launch the
        successor with the trigger in hand, answer the old owner.

        Transfer is one txn comparing the fence, the snapshot revision, the
        inbox head (the trigger is the last arrival; a drain: nothing
        unprocessed) and the handoff id's absence, writing epoch + 1, the
        owner record, the index, the old bell's deletion and the outcome
        under the handoff id. A replay of the same id answers the recorded
        outcome. Every refusal is final; a lost answer is replayed."""
        st = s.store
        ckpt = acc.checkpoint
        label = f"{name} accepts handoff {acc.handoff}"
        h = self.host(s, name)
        rest = tuple(a for a in h.accepting if a != acc)
        s = self._put(s, name, h._replace(accepting=rest))
        idle = ckpt.open_steps == 0 and (acc.trigger < 0 or ckpt.inbox_next == acc.trigger)
        recorded = next((r for r in st.handoffs if r[0] == acc.handoff), None)
        if recorded is not None:
            why = "" if recorded[2] == name else "HANDOFF_ID_REUSED"
        elif not idle:
            why = "SESSION_NOT_IDLE"
        else:
            why = self._transfer_refusal(st, acc)
        if why:
            refused = self._answer(s, acc, moved=False)
            yield Step("transfer", name, "refused", PROTOCOL, f"{label}: refused ({why})", refused)
            return
        if recorded is None:
            epoch, outcome = st.epoch + 1, "ok"
            st = self._audit_move(st, acc.trigger)
            st = st._replace(
                epoch=epoch,
                holder=name,
                parked_at=NOT_PARKED,
                bells=_unring(st.bells, acc.from_instance),
                handoffs=(*st.handoffs, (acc.handoff, epoch, name)),
            )
            s = s._replace(store=st)
        else:
            epoch, outcome = recorded[1], "replayed"
        moved_label = f"{label}: moved (epoch {epoch}"
        moved_label += "), runs the successor" if outcome == "ok" else ", replayed), runs it"
        launched = self._hold(s, name, Run(epoch, ckpt, pc=FORCED if acc.trigger >= 0 else BEGIN))
        answered = self._answer(launched, acc, moved=True)
        yield Step("transfer", name, outcome, PROTOCOL, moved_label, answered)
        if s.budget.lost:
            spent = self._spend_lost(s)
            unanswered = self._answer(launched, acc, moved=False, lost=True)._replace(budget=spent)
            label_lost = moved_label + "; the old owner's answer is lost"
            yield Step("transfer", name, outcome, PROTOCOL, label_lost, unanswered)
            if outcome == "ok":
                again = h._replace(accepting=(*rest, acc._replace(replaying=True)))
                lost = self._put(s, name, again, budget=spent)
                label_lost = f"{label}: moved, Transfer's answer lost"
                yield Step("transfer", name, "lost", PROTOCOL, label_lost, lost)

    def _audit_move(self, st: Store, trigger: int) -> Store:
        """§6: a session moves idle, and a backlog never moves: a trigger is
        the last arrival, a drain leaves nothing unprocessed behind, and no
        turn is open (`trigger` -1: a drain)."""
        head = len(st.inbox)
        if st.snapshot.open_steps:
            return _audit(st, "idle_moves", "a session moved with a turn open")
        if trigger >= 0 and head != trigger + 1:
            moved = f"the trigger {trigger} moved with the inbox at {head}: a backlog"
            return _audit(st, "idle_moves", moved)
        if trigger < 0 and head != st.snapshot.inbox_next:
            moved = f"a drain moved with {head - st.snapshot.inbox_next} unprocessed"
            return _audit(st, "idle_moves", moved)
        return st

    def _transfer_refusal(self, st: Store, acc: Acceptance) -> str:
        """Why hooks' `_transfer_txn` refuses ("" when it applies; the
        release-then-claim variant compares only that the session was
        released)."""
        if self.variant.release_then_claim:
            if (st.epoch, st.holder) != (acc.from_epoch + 1, ""):
                return "not released"
        elif (st.epoch, st.holder) != (acc.from_epoch, acc.from_instance):
            return "FENCED"
        revised = st.snapshot.revision != acc.checkpoint.revision
        if revised and not self.variant.transfer_without_revision_compare:
            return "STALE_CHECKPOINT"
        head = acc.trigger + 1 if acc.trigger >= 0 else acc.checkpoint.inbox_next
        if len(st.inbox) != head and not self.variant.transfer_without_head_compare:
            return "LATER_ARRIVAL"
        return ""

    def _answer(self, s: State, acc: Acceptance, *, moved: bool, lost: bool = False) -> State:
        """AcceptHandoff's answer reaches the old owner's run, if it still
        waits for it: moved ends it; a refusal has it process the trigger
        (a drain: go on); a lost answer leaves it uncertain."""
        old = acc.from_instance
        h = self.host(s, old)
        run = h.held
        if not (h.up and isinstance(run, Run) and run.pc == OFFERED and run.handoff == acc.handoff):
            return s
        if lost:
            return self._hold(s, old, run._replace(pc=SETTLING))
        if moved:
            return self._hold(s, old, None)
        if self.variant.release_then_claim:
            return self._hold(s, old, run._replace(pc=SETTLING))  # it takes the session back
        return self._hold(s, old, run._replace(pc=FORCED if acc.trigger >= 0 else IDLE))

    def _settle(self, s: State, name: str, run: Run) -> Step:
        """An uncertain attempt: commit the unchanged snapshot, fenced and
        compared with the checkpoint's revision. Success: nothing moved and
        nothing can (the transfer compares that revision); the trigger is
        processed here. FENCED: the session moved; the run ends.
        (Release-then-claim: take the released session back, if nobody
        claimed it.)"""
        st = s.store
        after = FORCED if run.trigger >= 0 else IDLE
        if self.variant.release_then_claim:
            if (st.epoch, st.holder) == (run.epoch + 1, ""):
                store = st._replace(epoch=st.epoch + 1, holder=name)
                back = run._replace(epoch=store.epoch, pc=after, handoff=-1, target="")
                taken = self._hold(s._replace(store=store), name, back)
                return Step(
                    "settle", name, "ok", PROTOCOL, f"{name} claims the session back", taken
                )
            ended = self._hold(s, name, None)
            return Step(
                "settle", name, "fenced", PROTOCOL, f"{name} finds it claimed: run ends", ended
            )
        settled = run._replace(handoff=-1, target="")
        steps = list(
            self._commit(s, name, settled, "settle", "settles by a commit", None, after=after)
        )
        return steps[0]  # (the commit's answer is not lost here: a lost one is retried)

    def _adopt(self, s: State, name: str) -> Iterator[Step]:
        """Adoption: an arrival through this deployment's ingress for a
        session whose deployment has no live instance (ingress notices and
        asks an owner here). Settled sessions only (no open turn); Transfer
        with reason ADOPTION compares the fence, the snapshot revision and,
        in its txn, that the old fleet has no live instance; the backlog
        moves with it."""
        st = s.store
        old = st.holder
        mine = self._deployment[name]
        if not old or self._deployment[old] == mine or s.budget.handoffs == 0:
            return
        if any(self.host(s, i).lease for i in self._hosts_of(self._deployment[old])):
            return
        waiting = st.inbox[st.snapshot.inbox_next :]
        if not any(e.via == mine for e in waiting) or st.snapshot.open_steps:
            return
        handoff = self.bounds.handoffs - s.budget.handoffs
        epoch = st.epoch + 1
        store = st._replace(
            epoch=epoch,
            holder=name,
            parked_at=NOT_PARKED,
            bells=_unring(st.bells, old),
            handoffs=(*st.handoffs, (handoff, epoch, name)),
        )
        budget = s.budget._replace(handoffs=s.budget.handoffs - 1)
        run = Run(epoch, st.snapshot, pc=BEGIN)
        adopted = self._hold(s._replace(store=store, budget=budget), name, run)
        label = f"{name} adopts it from {old} (handoff {handoff}, epoch {epoch})"
        yield Step("adopt", name, "ok", PROTOCOL, label, adopted)


def _bell(bells: tuple[tuple[str, int], ...], name: str) -> int | None:
    return next((head for instance, head in bells if instance == name), None)


def _ring(bells: tuple[tuple[str, int], ...], name: str, head: int) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((*_unring(bells, name), (name, head))))


def _unring(bells: tuple[tuple[str, int], ...], name: str) -> tuple[tuple[str, int], ...]:
    return tuple(bell for bell in bells if bell[0] != name)


def _audit(st: Store, invariant: str, what: str) -> Store:
    """Note what `invariant` (invariants.py) must see of this transition."""
    return st._replace(audit=(*st.audit, (invariant, what)))
