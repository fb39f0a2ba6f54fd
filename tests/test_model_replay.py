"""The protocol's model replayed against the real services (docs/model.md):
for every (step, outcome) the replay bounds reach, a shortest model trace
that ends with it, played against a real hooks and anchor on a real etcd.

The test plays the gateways and the owner instances: each step makes the
calls the real step makes (ResumeHook, TakeOverSession, SetParked,
CommitStep, Transfer; RegisterInstance and DeregisterInstance for the
leases), its answer must be the one the model's step got (applied,
duplicate, replayed, FENCED, ABORTED, refused; a takeover's parked
position), and after every step what etcd holds — fence, owner record,
inbox head, delivery ids, bells, stream, snapshot, transfer records — must
be what the model's state says. So neither can change a transaction without
the other: the model's proofs stand on the code's transactions as they are.

What the owner decides in its memory (when to park, what to offer, how to
settle) is the model's here; the process tests with failpoints
(tests/test_handoff_faults.py, tests/test_recovery.py) run the owner's own.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aetcd
import pytest

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import Aborted, Fenced
from baton_runtime.common.etcd.keys import Keys, OwnerRecord, parse_fence, prefix_end
from baton_runtime.common.security.permits import PermitSigner, grant_for
from baton_runtime.hooks.transfer import TransferOutcome
from baton_runtime.owner.handoff.attempt import REFUSALS
from model.explore import Checker, explore, shortest_traces
from model.options import Bounds, Variant, deployment_of
from model.protocol import PROTOCOL, Model, Step
from model.state import NOT_PARKED, Activating, Claiming, Parked, Run, Snapshot, State
from model.state import Event as ModelEvent
from tests import certs
from tests.stack import Stack
from tests.test_handoff_faults import check, settle, start, stop, transfers, trigger_ran_on

# The model's deployments, as real deployment ids (no owner process runs
# them: the test is their owners).
DEPLOYMENTS = {"A": "model-a", "B": "model-b"}
CHANNEL = "slack"

# Every (step, outcome) of these bounds within 8 steps: 41 traces of up to
# 8 steps (the second bound adds the drain's).
REPLAY_BOUNDS = (
    Bounds(messages=2, crashes=2, lost=1),
    Bounds(messages=1, crashes=1, lost=1, drain=True),
)
MAX_DEPTH = 8

pytestmark = pytest.mark.timeout(600)

T = TypeVar("T")


@functools.cache
def traces() -> dict[tuple[str, str], tuple[Model, list[Step]]]:
    """(step, outcome) -> a shortest trace ending with it, and its model."""
    found: dict[tuple[str, str], tuple[Model, list[Step]]] = {}
    for bounds in REPLAY_BOUNDS:
        model = Model(bounds)
        for key, trace in shortest_traces(model, MAX_DEPTH).items():
            found.setdefault(key, (model, trace))
    return found


@dataclass
class Clients:
    """The test as each deployment's owners and ingresses, and etcd."""

    owner_hooks: dict[str, HooksClient]
    owner_anchor: dict[str, AnchorClient]
    ingress_hooks: dict[str, HooksClient]
    etcd: aetcd.Client
    keys: Keys


@pytest.fixture
async def clients(stack: Stack) -> AsyncIterator[Clients]:
    owners = {d: certs.owner(real) for d, real in DEPLOYMENTS.items()}
    made = Clients(
        owner_hooks={d: stack.hooks_client(sec) for d, sec in owners.items()},
        owner_anchor={d: stack.anchor_client(sec) for d, sec in owners.items()},
        ingress_hooks={
            d: stack.hooks_client(certs.ingress(real)) for d, real in DEPLOYMENTS.items()
        },
        etcd=await certs.etcd_client(stack.etcd.endpoint),
        keys=Keys(stack.etcd.prefix),
    )
    try:
        yield made
    finally:
        for group in (made.owner_hooks, made.owner_anchor, made.ingress_hooks):
            for client in group.values():
                await client.close()
        await made.etcd.close()


@dataclass
class Replay:
    """One trace played against the real services: its session, the real
    ids of the model's instances and runs, and what the replay learned."""

    clients: Clients
    model: Model
    number: int  # instance ids are unique per trace (the registry is global)
    sid: str = field(default_factory=ids.new_session_id)
    leases: dict[str, int] = field(default_factory=dict)
    revisions: dict[int, int] = field(default_factory=dict)  # model rev -> etcd mod revision
    unanswered: dict[str, anchor_pb.CommitStepRequest] = field(default_factory=dict)

    # -- names ---------------------------------------------------------------------

    def instance(self, name: str) -> str:
        return f"{name}-{self.number}"

    def run_id(self, name: str, epoch: int) -> str:
        return f"run.{self.instance(name)}.{epoch}"

    def fence(self, epoch: int, name: str) -> s.Fence:
        return s.Fence(session_id=self.sid, owner_run_id=self.run_id(name, epoch), epoch=epoch)

    def identity(self, name: str, epoch: int) -> s.OwnerIdentity:
        return s.OwnerIdentity(
            owner_run_id=self.run_id(name, epoch),
            deployment_id=DEPLOYMENTS[deployment_of(name)],
            instance_id=self.instance(name),
        )

    def hooks(self, name: str) -> HooksClient:
        return self.clients.owner_hooks[deployment_of(name)]

    def anchor(self, name: str) -> AnchorClient:
        return self.clients.owner_anchor[deployment_of(name)]

    @property
    def token(self) -> str:
        return ids.inbox_token(self.sid)

    # -- the trace -----------------------------------------------------------------

    async def play(self, trace: list[Step]) -> None:
        state = self.model.initial()
        await self.begin(state)
        try:
            await self.compare(state, "the initial state")
            for n, step in enumerate(trace, 1):
                where = f"step {n} ({step.label}) of\n" + "\n".join(
                    f"  {i:2}. {t.label}" for i, t in enumerate(trace, 1)
                )
                handler = getattr(self, f"_{step.action}")
                try:
                    await handler(state, step)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}\nat {where}") from None
                await self.compare(step.state, where)
                state = step.state
        finally:
            for lease in self.leases.values():
                await self.clients.owner_hooks["A"].deregister_instance(lease)

    async def begin(self, state: State) -> None:
        """The model's initial state: every instance registered, the session
        created on the first, session.started committed."""
        for name in self.model.instances:
            await self._register(name)
        first = self.model.instances[0]
        await self.hooks(first).create_session(self.sid, self.identity(first, 1), CHANNEL, [])
        run = state.hosts[0].held
        assert isinstance(run, Run)
        started = s.Event(
            session_id=self.sid,
            seq=0,
            kind=s.EVENT_KIND_SESSION_STARTED,
            deployment_id=DEPLOYMENTS["A"],
            owner_run_id=self.run_id(first, 1),
        )
        request = anchor_pb.CommitStepRequest(
            fence=self.fence(1, first),
            events=[started],
            snapshot=self.snapshot(run.snap),
            expected_snapshot_revision=0,
        )
        committed = await self.anchor(first).commit(request)
        self.revisions[run.snap.revision] = committed.revision

    async def _register(self, name: str) -> None:
        lease = await self.hooks(name).register_instance(
            DEPLOYMENTS[deployment_of(name)], self.instance(name), 300, "127.0.0.1:1"
        )
        self.leases[name] = lease.lease_id

    async def _revoke(self, name: str) -> None:
        await self.hooks(name).deregister_instance(self.leases.pop(name))

    # -- what the model holds, in the real services' terms ------------------------------

    def snapshot(self, snap: Snapshot) -> s.SessionSnapshot:
        real = s.SessionSnapshot(
            format_version=1,
            session_id=self.sid,
            channel=CHANNEL,
            deployment_id=DEPLOYMENTS[snap.deployment],
            hooks=[self.token],
            status=s.SESSION_STATUS_ACTIVE,
            inbox_next_seq=snap.inbox_next,
            next_event_seq=snap.next_event_seq,
        )
        if snap.open_steps:
            real.open_turn.turn_id = f"turn-{snap.inbox_next - 1}"
            real.open_turn.steps = snap.open_steps
        return real

    def event(self, name: str, event: ModelEvent) -> s.Event:
        kind = {
            "started": s.EVENT_KIND_SESSION_STARTED,
            "handed_off": s.EVENT_KIND_SESSION_HANDED_OFF,
            "step": s.EVENT_KIND_STEP_COMPLETED,
        }[event.kind]
        return s.Event(
            session_id=self.sid,
            seq=event.seq,
            kind=kind,
            deployment_id=DEPLOYMENTS[event.deployment],
            owner_run_id=self.run_id(name, event.epoch),
            inbox_seq=max(event.inbox_seq, 0),
            step=event.step,
        )

    # -- the steps -----------------------------------------------------------------

    async def _send(self, before: State, step: Step) -> None:
        m = int(step.actor.removeprefix("m"))
        gateway = step.state.gateways[m]
        command = s.Command(
            send=s.SendCommand(text=f"message {m}"),
            delivery=s.DeliveryMetadata(
                delivery_id=f"d{m}", accepted_deployment_id=DEPLOYMENTS[gateway.via]
            ),
        )
        ingress = self.clients.ingress_hooks[gateway.via]
        receipt = await ingress.append(self.token, command, CHANNEL)
        if step.outcome != "lost":
            assert receipt.duplicate == (step.outcome == "duplicate"), receipt
            assert receipt.seq == gateway.receipt, (receipt.seq, gateway.receipt)

    _retry_send = _send

    async def _crash(self, before: State, step: Step) -> None:
        """Nothing at hooks: the lease stays until it expires."""

    async def _pause(self, before: State, step: Step) -> None:
        await self._revoke(step.actor)  # its lease expires while it runs

    async def _notice_lease_lost(self, before: State, step: Step) -> None:
        """Nothing at hooks: the process stops."""

    async def _lease_expires(self, before: State, step: Step) -> None:
        await self._revoke(step.actor)

    async def _restart(self, before: State, step: Step) -> None:
        await self._register(step.actor)

    async def _take_over(self, before: State, step: Step) -> None:
        name, st = step.actor, before.store
        await self._claim(step, name, st.epoch, st.holder)

    async def _take_over_retry(self, before: State, step: Step) -> None:
        claim = self.model.host(before, step.actor).held
        assert isinstance(claim, Claiming)
        await self._claim(step, step.actor, claim.epoch, claim.from_instance)

    async def _claim(self, step: Step, name: str, epoch: int, old: str) -> None:
        """TakeOverSession from (epoch, old); its answer is the model's."""
        call = self.hooks(name).take_over_session(
            self.fence(epoch, old), self.instance(old), self.identity(name, epoch + 1)
        )
        taken = await _answer(step.outcome, call)
        if taken is None or step.outcome == "lost":
            return
        held = self.model.host(step.state, step.actor).held
        if isinstance(held, Parked):
            assert taken.parked and taken.inbox_head == held.inbox_next, (taken, held)
        else:
            assert isinstance(held, Activating) and not taken.parked, (taken, held)

    async def _wake(self, before: State, step: Step) -> None:
        """The host's decision on a bell: no call."""

    _reconcile_wake = _wake

    async def _activate(self, before: State, step: Step) -> None:
        act = self.model.host(before, step.actor).held
        assert isinstance(act, Activating)
        if act.unpark:
            call = self.hooks(step.actor).set_parked(self.fence(act.epoch, step.actor), False)
            await _answer(step.outcome, call)
        if step.outcome == "ok":
            snapshot, revision = await self.anchor(step.actor).snapshot_with_revision(self.sid)
            run = self.model.host(step.state, step.actor).held
            assert isinstance(run, Run)
            assert snapshot == self.snapshot(run.snap), snapshot
            assert self.revisions[run.snap.revision] == revision

    async def _step(self, before: State, step: Step) -> None:
        run = self.model.host(before, step.actor).held
        assert isinstance(run, Run)
        await self._commit(step, run, self.model.next_step(run))

    async def _begin(self, before: State, step: Step) -> None:
        run = self.model.host(before, step.actor).held
        assert isinstance(run, Run)
        await self._commit(step, run, None)

    _settle = _begin

    async def _commit(self, step: Step, run: Run, planned: tuple[int, int] | None) -> None:
        name = step.actor
        events, snap = self.model.commit_plan(name, run, planned)
        request = anchor_pb.CommitStepRequest(
            fence=self.fence(run.epoch, name),
            events=[self.event(name, e) for e in events],
            snapshot=self.snapshot(snap),
            expected_snapshot_revision=self.revisions[run.snap.revision],
        )
        committed = await _answer(step.outcome, self.anchor(name).commit(request))
        if step.outcome == "lost":
            self.unanswered[name] = request
        elif committed is not None:
            assert not committed.replayed

    async def _commit_retry(self, before: State, step: Step) -> None:
        request = self.unanswered.pop(step.actor)
        committed = await _answer(step.outcome, self.anchor(step.actor).commit(request))
        if committed is not None:
            assert committed.replayed

    async def _park(self, before: State, step: Step) -> None:
        if step.outcome == "dropped":
            return  # lost before it reached hooks
        run = self.model.host(before, step.actor).held
        assert isinstance(run, Run)
        fence = self.fence(run.epoch, step.actor)
        call = self.hooks(step.actor).set_parked(fence, True, run.snap.inbox_next)
        await _answer(step.outcome, call)

    async def _offer(self, before: State, step: Step) -> None:
        """Owner to owner: AcceptHandoff carries the checkpoint and the
        permit (signed at the transfer, below); nothing at hooks."""

    _drain_offer = _offer
    _offer_timeout = _offer

    async def _drain_start(self, before: State, step: Step) -> None:
        """An operator's call to the owners: nothing at hooks."""

    async def _transfer(self, before: State, step: Step) -> None:
        name = step.actor
        after = self.model.host(step.state, name).accepting
        (acc,) = set(self.model.host(before, name).accepting) - set(after)
        ckpt = acc.checkpoint
        if ckpt.open_steps or (acc.trigger >= 0 and ckpt.inbox_next != acc.trigger):
            assert step.outcome == "refused"
            return  # the target refuses the checkpoint itself (SESSION_NOT_IDLE)
        reason = s.TRANSFER_REASON_TRIGGER if acc.trigger >= 0 else s.TRANSFER_REASON_DRAIN
        handoff_id = f"h{acc.handoff}"
        expected = self.fence(acc.from_epoch, acc.from_instance)
        target = DEPLOYMENTS[deployment_of(name)]
        revision = self.revisions[ckpt.revision]
        grant = grant_for(expected, handoff_id, target, revision, reason)
        signer = PermitSigner(certs.owner(DEPLOYMENTS[deployment_of(acc.from_instance)]))
        request = hooks_pb.TransferRequest(
            handoff_id=handoff_id,
            expected=expected,
            expected_owner=self.identity(acc.from_instance, acc.from_epoch),
            successor=self.identity(name, acc.from_epoch + 1),
            hooks=[self.token],
            trigger_seq=max(acc.trigger, 0),
            snapshot_revision=revision,
            reason=reason,
            inbox_head=ckpt.inbox_next,
            permit=signer.sign(grant),
        )
        moved = await _answer(step.outcome, self.hooks(name).transfer(request))
        if moved is not None and step.outcome != "lost":
            assert moved.replayed == (step.outcome == "replayed"), moved
            assert moved.fence == self.fence(acc.from_epoch + 1, name), moved

    async def _adopt(self, before: State, step: Step) -> None:
        name, st = step.actor, before.store
        (handoff,) = set(step.state.store.handoffs) - set(st.handoffs)
        request = hooks_pb.TransferRequest(
            handoff_id=f"h{handoff[0]}",
            expected=self.fence(st.epoch, st.holder),
            expected_owner=self.identity(st.holder, st.epoch),
            successor=self.identity(name, st.epoch + 1),
            hooks=[self.token],
            snapshot_revision=self.revisions[st.snapshot.revision],
            reason=s.TRANSFER_REASON_ADOPTION,
        )
        moved = await _answer(step.outcome, self.hooks(name).transfer(request))
        assert moved is not None and moved.fence == self.fence(st.epoch + 1, name), moved

    # -- what etcd holds -----------------------------------------------------------------

    async def compare(self, state: State, where: str) -> None:
        st = state.store
        got = await self._read()
        want = {
            "fence": (st.epoch, self.run_id(st.holder, st.epoch)),
            "owner": (
                self.instance(st.holder),
                DEPLOYMENTS[deployment_of(st.holder)],
                st.epoch,
                st.parked_at != NOT_PARKED,
            ),
            "head": len(st.inbox),
            "deliveries": {
                f"d{e.msg}": seq
                for seq, e in reversed(list(enumerate(st.inbox)))  # (the first of each)
            },
            "bells": {self.instance(name): head for name, head in st.bells},
            "events": [
                (e.seq, e.kind, e.inbox_seq if e.kind == "step" else -1, e.step, e.epoch)
                for e in st.events
            ],
            "snapshot": self.snapshot(st.snapshot),
            "handoffs": {f"h{h}": (epoch, self.instance(name)) for h, epoch, name in st.handoffs},
        }
        for part, value in want.items():
            assert got[part] == value, f"{part}: etcd holds {got[part]}, the model {value}\n{where}"
        revision = got["revision"]
        known = self.revisions.setdefault(st.snapshot.revision, revision)
        assert known == revision, f"snapshot revision {revision}, model's maps to {known}\n{where}"

    async def _read(self) -> dict[str, object]:
        k, sid, etcd = self.clients.keys, self.sid, self.clients.etcd

        async def value(key: bytes) -> bytes | None:
            kv = await etcd.get(key)
            return None if kv is None else bytes(kv.value)

        fence = await value(k.fence(sid))
        owner = await value(k.owner(sid))
        head = await value(k.inbox_head(sid))
        snapshot = await etcd.get(k.snapshot(sid))
        assert fence and owner and head and snapshot
        record = OwnerRecord.decode(owner)
        deliveries = {}
        for kv in await etcd.get_prefix(k.delivery(sid, "")):
            deliveries[bytes(kv.key).rsplit(b"/", 1)[1].decode()] = int(kv.value)
        bells = {}
        for name in self.model.instances:
            bell = await value(k.bell(self.instance(name), sid))
            if bell is not None:
                bells[self.instance(name)] = int(bell)
        events = []
        start = k.events_prefix(sid)
        for kv in await etcd.get_range(start, prefix_end(start)):
            e = s.Event.FromString(kv.value)
            kind = {
                s.EVENT_KIND_SESSION_STARTED: "started",
                s.EVENT_KIND_SESSION_HANDED_OFF: "handed_off",
                s.EVENT_KIND_STEP_COMPLETED: "step",
            }[e.kind]
            epoch = int(e.owner_run_id.rsplit(".", 1)[1])
            inbox_seq = e.inbox_seq if kind == "step" else -1
            events.append((e.seq, kind, inbox_seq, e.step, epoch))
        handoffs = {}
        for kv in await etcd.get_prefix(k.transfer(sid, "")):
            handoff = bytes(kv.key).rsplit(b"/", 1)[1].decode()
            outcome = TransferOutcome.decode(sid, bytes(kv.value))
            handoffs[handoff] = (outcome.fence.epoch, outcome.successor.instance_id)
        return {
            "fence": parse_fence(fence),
            "owner": (record.instance_id, record.deployment_id, record.epoch, record.parked),
            "head": int(head),
            "deliveries": deliveries,
            "bells": bells,
            "events": events,
            "snapshot": s.SessionSnapshot.FromString(snapshot.value),
            "revision": snapshot.mod_revision,
            "handoffs": handoffs,
        }


async def _answer(outcome: str, call: Awaitable[T]) -> T | None:
    """The call's answer when the model's step was applied (its answer lost
    or not); the refusal the model's step got otherwise."""
    if outcome in ("ok", "lost", "duplicate", "replayed"):
        return await call
    # A refused transfer: one of the answers its caller takes as final.
    refusals = {"fenced": (Fenced,), "stale": (Aborted,)}.get(outcome, REFUSALS)
    with pytest.raises(refusals):
        await call
    return None


# -- the tests ---------------------------------------------------------------------------


def test_the_replay_bounds_reach_every_outcome_worth_replaying() -> None:
    """The traces replayed take every step with each of its outcomes that
    the bounds reach (the protocol has no ABORTED commit: its fences keep
    every stale commit out first)."""
    reached = set(traces())
    assert {("transfer", "replayed"), ("take_over_retry", "replayed"), ("adopt", "ok")} <= reached
    assert {("settle", "fenced"), ("settle", "ok"), ("commit_retry", "replayed")} <= reached
    assert {("drain_offer", "ok"), ("begin", "ok"), ("transfer", "refused")} <= reached
    assert len(reached) >= 40, sorted(reached)


async def test_model_traces_replay_on_the_real_services(clients: Clients) -> None:
    for number, (key, (model, trace)) in enumerate(sorted(traces().items()), 1):
        replay = Replay(clients, model, number)
        try:
            await replay.play(trace)
        except AssertionError as exc:
            raise AssertionError(f"the trace of {key}: {exc}") from None


def follow(model: Model, trace: list[Step]) -> list[Step]:
    """`trace`'s steps as `model` takes them (same step, actor and outcome,
    a send through the same ingress): another variant's trace, with the
    states this model reaches."""
    state, followed = model.initial(), []
    for step in trace:
        same = [
            t
            for t in model.successors(state)
            if (t.action, t.actor, t.outcome) == (step.action, step.actor, step.outcome)
            and t.state.gateways == step.state.gateways
        ]
        assert same, f"the model cannot take {step.label}"
        followed.append(same[0])
        state = same[0].state
    return followed


async def test_the_replayed_takeover_answers_what_the_takeover_decided(clients: Clients) -> None:
    """The model's shortest trace to issue 32's lost wake-up (its third
    defect), with the answers the protocol must give: the replay of a
    takeover whose answer was lost says parked at the position the takeover
    decided, under the bell that rang since. (Before that fix, hooks
    answered parked at the inbox head of now, 1, and this failed there.)"""
    broken = Model(Bounds(messages=1, crashes=1, lost=1), Variant(takeover_replay_head_now=True))
    violation = explore(broken).violation
    assert violation is not None and violation.invariant == "all_processed"
    model = Model(Bounds(messages=1, crashes=1, lost=1))
    await Replay(clients, model, 0).play(follow(model, violation.trace))


# -- a model trace on real processes, its faults made by failpoints ---------------------

# The model's steps that the process world makes with a failpoint: (step,
# outcome, what its label says) -> the owner instances armed ("b": both of
# B's), the failpoint, and what an owner logs once the fault has happened.
FAILPOINTS = {
    ("transfer", "ok", "the old owner's answer is lost"): (
        "a1",
        "handoff.accept_response=once:error",
        (("a1",), "handoff settled: the session moved"),
    ),
    ("transfer", "lost", "Transfer's answer lost"): (
        "b",
        "handoff.transfer_response=once:error",
        (("b1", "b2"), "transfer outcome settled by a replay"),
    ),
}


def quiesce(model: Model, state: State) -> State:
    """The model's system left alone from `state`: protocol steps until none
    is enabled (the first each time), checked at the end as the checker
    checks a quiescent state."""
    for _ in range(1_000):
        protocol = [t for t in model.successors(state) if t.kind == PROTOCOL]
        if not protocol:
            break
        state = protocol[0].state
    checker = Checker()
    assert checker.safety(state) is None and checker.quiescence(state) is None
    return state


@pytest.mark.parametrize(
    "key", [("settle", "fenced"), ("transfer", "replayed")], ids=["settled", "replayed"]
)
async def test_a_model_trace_runs_on_real_processes(
    key: tuple[str, str], etcd_endpoint: str, tmp_path: Path
) -> None:
    """The model's shortest trace to a handoff settled by a fenced commit
    (the old owner's AcceptHandoff answer lost) or to a transfer replayed
    (its answer to the target lost), made by real owner processes with the
    failpoint that loses that answer; the session then ends where the model
    says, the trigger processed once, on the deployment the model names."""
    model, trace = traces()[key]
    armed: dict[str, str] = {"a1": "", "b": ""}
    logged: list[tuple[tuple[str, ...], str]] = []
    sends: list[str] = []
    for step in trace:
        if step.action == "send":
            sends.append(step.state.gateways[len(sends)].via)
            continue
        assert step.kind == PROTOCOL, f"the processes do not take {step.label} by themselves"
        for (action, outcome, says), (where, point, log) in FAILPOINTS.items():
            if (step.action, step.outcome) == (action, outcome) and says in step.label:
                armed[where] = point
                logged.append(log)
    assert logged, f"no failpoint makes {key}'s trace"
    final = quiesce(model, trace[-1].state)
    ran_on = {e.inbox_seq: e.deployment for e in final.store.events if e.kind == "step"}
    run = await start(etcd_endpoint, tmp_path, a1=armed["a1"], b=armed["b"])
    try:
        receipts = [
            await run.send(run.b if via == "B" else run.a, f"message {n}")
            for n, via in enumerate(sends)
        ]
        events = await settle(run, receipts)
        check(events, receipts)
        for seq, deployment in ran_on.items():
            assert trigger_ran_on(events, receipts[seq]) == f"dep-{deployment.lower()}"
        assert await transfers(run) == len(final.store.handoffs)
        for instances, text in logged:  # the fault happened where the model's trace has it
            assert any(run.log_has(i, text) for i in instances), f"no {text!r} in {instances}"
    finally:
        await stop(run)
