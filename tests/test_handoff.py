"""Ingress-driven upgrades (docs/design.md §6): a send accepted by another
deployment moves an idle session there in one atomic step; everything else
stays put and leaves no upgrade state behind.

Two (or three) deployments run in this process: each an owner and an ingress
on its own loopback ports, sharing hooks, anchor and the real etcd. Process
crashes at each step of the protocol are in test_handoff_faults.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aetcd
import grpc
import pytest

from baton_runtime._proto.baton.owner.v1 import owner_pb2
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import failpoints, ids
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import BatonError, Reason, Unavailable
from baton_runtime.common.etcd.keys import Keys, OwnerRecord, parse_fence
from baton_runtime.common.rpc.status_map import from_rpc_error
from baton_runtime.common.security.permits import PermitSigner, grant_for
from baton_runtime.owner.handoff import attempt as handoff
from baton_runtime.owner.host.host import OwnerHost
from baton_runtime.owner.rules.held import RunIdentity, make_event
from baton_runtime.owner.run.commit import commit_step
from baton_runtime.owner.run.snapshots import initial_snapshot
from tests import certs
from tests.procs import eventually
from tests.stack import Stack, add_deployment, stop_deployment
from tests.test_turns import follow_until, of, read_all, respond, waits

K = s.EventKind
HANDED_OFF = K.EVENT_KIND_SESSION_HANDED_OFF
WAITING = K.EVENT_KIND_SESSION_WAITING
COMPLETED = K.EVENT_KIND_MESSAGE_COMPLETED
RECEIVED = K.EVENT_KIND_MESSAGE_RECEIVED
RESULT = K.EVENT_KIND_TOOL_CALL_RESULT


class Env:
    """Deployment A (the stack), B, and the means to look inside."""

    def __init__(self, a: Stack, b: Stack, etcd: aetcd.Client) -> None:
        self.a = a
        self.b = b
        self.etcd = etcd
        self.keys = Keys(a.etcd.prefix)
        self.hooks = a.hooks_client(timeout=5)
        self.anchor = a.anchor_client(timeout=5)

    def host(self, stack: Stack) -> OwnerHost:
        host = stack.owner.app
        assert isinstance(host, OwnerHost)
        return host

    async def close(self) -> None:
        await self.hooks.close()
        await self.anchor.close()

    async def owner(self, session_id: str) -> tuple[int, OwnerRecord]:
        fence = await self.etcd.get(self.keys.fence(session_id))
        record = await self.etcd.get(self.keys.owner(session_id))
        assert fence is not None and record is not None
        epoch, _ = parse_fence(fence.value)
        return epoch, OwnerRecord.decode(record.value)

    async def transfers(self, session_id: str) -> list[bytes]:
        prefix = self.keys.transfer(session_id, "")
        return [kv.key for kv in await self.etcd.get_prefix(prefix)]

    async def snapshot(self, session_id: str) -> s.SessionSnapshot:
        return await self.anchor.snapshot(session_id)

    async def wait_ready(self, *stacks: Stack) -> None:
        async def ready() -> bool:
            for stack in stacks:
                live = await self.hooks.list_instances(stack.deployment_id)
                if not live:
                    return False
            return True

        await eventually(ready, "owners registered", 15)

    async def no_upgrade_state(self, session_id: str, *targets: Stack) -> None:
        """A skipped or failed handoff leaves nothing: no transfer record, the
        epoch unchanged, no candidate on any target."""
        assert await self.transfers(session_id) == []
        epoch, record = await self.owner(session_id)
        assert epoch == 1 and record.deployment_id == self.a.deployment_id

        async def released() -> bool:
            return all(not self.host(t).acceptance.accepting for t in targets)

        await eventually(released, "no handoff in flight", 10)


@pytest.fixture
async def env(stack: Stack, etcd: aetcd.Client) -> AsyncIterator[Env]:
    b = await add_deployment(stack, "dep-b")
    running = Env(stack, b, etcd)
    try:
        await running.wait_ready(stack, b)
        yield running
    finally:
        failpoints.configure("")
        await running.close()
        await stop_deployment(b)


async def turn(stack: Stack, session_id: str, text: str, start: int, **kwargs: object) -> list:
    """Send `text` through `stack`'s ingress; return the events of its turn."""
    await stack.send(session_id, text, **kwargs)
    events = await follow_until(stack, session_id, waits(1), start_seq=start)
    return events


# -- the happy path -----------------------------------------------------------------


async def test_same_deployment_turns_never_hand_off(env: Env) -> None:
    a = env.a
    sid = await a.create()
    seq = 1
    for text in ("hello", "what is 2+3", "whoami"):
        events = await turn(a, sid, text, seq)
        seq = events[-1].seq + 1
    events = await read_all(a, sid)
    assert not of(events, HANDED_OFF)
    assert {e.deployment_id for e in events} == {"dep-a"}
    assert await env.transfers(sid) == []
    epoch, record = await env.owner(sid)
    assert (epoch, record.deployment_id) == (1, "dep-a")
    assert of(events, RESULT)[-1].tool_result.output == "dep-a"


@pytest.mark.parametrize("inline", [True, False], ids=["checkpoint-sent", "checkpoint-loaded"])
async def test_an_idle_session_moves_to_the_deployment_that_accepted_the_send(
    env: Env, inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint (snapshot and context) is sent along by A, or, when
    larger than A sends, loaded by B from anchor: the same outcome."""
    if not inline:
        monkeypatch.setattr(handoff, "INLINE_CHECKPOINT_BYTES", 0)
    a, b = env.a, env.b
    sid = await a.create(aliases=["order-7"], timeout_seconds=3600, token_budget=100_000)
    first = await turn(a, sid, "what is 6*7", 1)
    before = await env.snapshot(sid)
    hooks_before = list(before.hooks)
    assert "slack:order-7" in hooks_before

    # A reader following from seq 0 since before the handoff.
    follower = asyncio.create_task(follow_until(a, sid, waits(2), timeout=20))
    await asyncio.sleep(0.1)
    receipt = await b.send(sid, "whoami")
    assert receipt.accepted_deployment_id == "dep-b"
    upgrade = await follow_until(b, sid, waits(1), start_seq=first[-1].seq + 1)
    followed = await follower

    # The stream: no gap, no duplicate, no disconnect; one handoff event.
    assert [e.seq for e in followed] == list(range(len(followed)))
    assert followed[len(followed) - len(upgrade) :] == upgrade
    handed = of(upgrade, HANDED_OFF)
    assert len(handed) == 1 and handed[0].text == "dep-a" and handed[0].deployment_id == "dep-b"
    assert upgrade[0].kind == HANDED_OFF
    # The event names the handoff; hooks looks its outcome up by that id.
    assert handed[0].handoff_id.startswith("ho_")
    found = await env.hooks.get_transfer(sid, handed[0].handoff_id)
    assert found.fence.epoch == 2 and found.successor.deployment_id == "dep-b"
    assert found.trigger_seq == receipt.receipt.seq
    assert {e.deployment_id for e in upgrade} == {"dep-b"}
    # The successor processed the trigger; its tool reports the new deployment.
    assert [e.inbox_seq for e in of(upgrade, RECEIVED)] == [receipt.receipt.seq]
    assert of(upgrade, RESULT)[-1].tool_result.output == "dep-b"
    assert of(upgrade, COMPLETED)[-1].text == "The result is dep-b."

    # Ownership: epoch + 1, on B, recorded under one handoff id.
    epoch, record = await env.owner(sid)
    assert (epoch, record.deployment_id, record.instance_id) == (2, "dep-b", "dep-b-i1")
    assert len(await env.transfers(sid)) == 1
    assert not env.host(b).acceptance.accepting
    assert sid not in env.host(a).runs and sid in env.host(b).runs

    # Identity, settled state, usage, limits, hooks and the timeout carried over.
    after = await env.snapshot(sid)
    assert after.session_id == sid and after.deployment_id == "dep-b"
    assert list(after.hooks) == hooks_before
    hooks_raw = await env.etcd.get(env.keys.hooks(sid))
    assert hooks_raw is not None and b"slack:order-7" in hooks_raw.value
    assert after.limits == before.limits
    assert after.usage.model_calls == before.usage.model_calls + 2
    # The history continued where A left it; B's model saw A's context (the
    # fixture counts one prompt token per earlier message).
    assert before.history_log.next_index == 4
    assert after.history_log.next_index == 8 and after.history_log.context_start == 0
    words = len("You are Baton's deterministic fixture agent.".split())
    first_step = of(upgrade, K.EVENT_KIND_STEP_COMPLETED)[0]
    assert first_step.usage.input_tokens == words + 1 + 4
    assert after.timeout.duration_seconds == 3600
    assert after.timeout.armed_by_owner_run_id == record.owner_run_id
    assert after.timeout.deadline.ToSeconds() >= before.timeout.deadline.ToSeconds()
    assert not after.HasField("open_turn")

    # The alias still names the same session; a send B accepts stays on B.
    alias_receipt = await b.send(alias="order-7", text="what is 1+1")
    assert alias_receipt.receipt.session_id == sid
    more = await follow_until(b, sid, waits(1), start_seq=upgrade[-1].seq + 1)
    assert {e.deployment_id for e in more} == {"dep-b"} and not of(more, HANDED_OFF)


async def test_the_successor_restarts_the_timeout_from_activation(env: Env) -> None:
    a, b = env.a, env.b
    sid = await a.create(timeout_seconds=600)
    await turn(a, sid, "hello", 1)
    before = await env.snapshot(sid)
    await asyncio.sleep(1.1)
    await b.send(sid, "hello again")
    await follow_until(b, sid, lambda ev: bool(of(ev, HANDED_OFF)) and bool(of(ev, WAITING)))
    after = await env.snapshot(sid)
    assert after.deployment_id == "dep-b"
    assert after.timeout.duration_seconds == 600
    assert after.timeout.deadline.ToSeconds() > before.timeout.deadline.ToSeconds()


async def test_chains_and_rollbacks(env: Env, stack: Stack) -> None:
    a, b = env.a, env.b
    c = await add_deployment(stack, "dep-c")
    try:
        await env.wait_ready(c)
        sid = await a.create(aliases=["chain"])
        seq = (await turn(a, sid, "hello", 1))[-1].seq + 1
        path = []
        for via in (b, c, a, a, b):
            events = await turn(via, sid, "whoami", seq)
            seq = events[-1].seq + 1
            path.append(of(events, RESULT)[-1].tool_result.output)
        assert path == ["dep-b", "dep-c", "dep-a", "dep-a", "dep-b"]
        events = await read_all(a, sid)
        assert [e.seq for e in events] == list(range(len(events)))
        assert [e.text for e in of(events, HANDED_OFF)] == ["dep-a", "dep-b", "dep-c", "dep-a"]
        epoch, record = await env.owner(sid)
        assert (epoch, record.deployment_id) == (5, "dep-b")
        assert len(await env.transfers(sid)) == 4
        lookup = await env.hooks.lookup("slack:chain")
        assert lookup.session_id == sid
    finally:
        await stop_deployment(c)


# -- skips: nothing moves, nothing is left ----------------------------------------


async def test_pending_human_input_skips(env: Env) -> None:
    a, b = env.a, env.b
    sid = await a.create()
    waiting = await turn(a, sid, "transfer 5", 1)
    request = of(waiting, K.EVENT_KIND_INPUT_REQUESTED)[-1].input_request
    # An input response accepted by B never triggers; a plain send while
    # input is pending is processed here (it abandons the wait).
    await respond(b, sid, s.InputResponse(request_id=request.request_id, approved=True))
    await follow_until(a, sid, waits(1), start_seq=waiting[-1].seq + 1)
    events = await turn(a, sid, "transfer 6", (await read_all(a, sid))[-1].seq + 1)
    await b.send(sid, "never mind")
    done = await follow_until(a, sid, waits(1), start_seq=events[-1].seq + 1)
    assert {e.deployment_id for e in done} == {"dep-a"}
    assert not of(await read_all(a, sid), HANDED_OFF)
    await env.no_upgrade_state(sid, b)


async def test_pending_authorization_skips(env: Env) -> None:
    a, b = env.a, env.b
    sid = await a.create()
    waiting = await turn(a, sid, "read calendar", 1)
    assert of(waiting, K.EVENT_KIND_AUTHORIZATION_REQUIRED)
    await b.send(sid, "hello from b")
    done = await follow_until(a, sid, waits(1), start_seq=waiting[-1].seq + 1)
    assert {e.deployment_id for e in done} == {"dep-a"}
    await env.no_upgrade_state(sid, b)


async def test_an_active_turn_and_queued_commands_skip(env: Env) -> None:
    a, b = env.a, env.b
    sid = await a.create()
    # Three 1.5 s tool steps, then the answer: once step 1's result is on the
    # stream, 3 s of the turn remain for the two sends below, even on a
    # loaded machine.
    await a.send(sid, "sleep 4 1500")
    await follow_until(a, sid, lambda ev: bool(of(ev, RESULT)), start_seq=1)
    # Arrives during the turn (steer: joins it) and queued behind it: both
    # were evaluated on arrival while busy, so neither moves the session,
    # not even once the turn settles.
    steer = await b.send(sid, "steered from b")
    queued = await b.send(sid, "queued from b", turn_policy=s.TURN_POLICY_QUEUE)
    events = await follow_until(a, sid, waits(2), start_seq=1, timeout=20)
    received = [e.inbox_seq for e in of(events, RECEIVED)]
    assert received == [0, steer.receipt.seq, queued.receipt.seq]
    assert {e.deployment_id for e in events} == {"dep-a"}
    await env.no_upgrade_state(sid, b)


async def test_a_burst_of_two_deliveries_skips_and_both_run_here_in_order(env: Env) -> None:
    a, b = env.a, env.b
    sid = await a.create()
    start = (await turn(a, sid, "hello", 1))[-1].seq + 1
    # Hold the handoff before it asks B so the second delivery is surely a
    # later arrival, whichever way the two land in the inbox stream.
    failpoints.configure("handoff.before_accept=sleep(300)")
    first, second = await asyncio.gather(
        b.send(sid, "one", caller="u1"), b.send(sid, "two", caller="u2")
    )
    events = await follow_until(
        a,
        sid,
        lambda ev: (
            sorted(e.inbox_seq for e in of(ev, RECEIVED))
            == sorted([first.receipt.seq, second.receipt.seq])
            and ev[-1].kind == WAITING
        ),
        start_seq=start,
    )
    assert [e.inbox_seq for e in of(events, RECEIVED)] == sorted(
        [first.receipt.seq, second.receipt.seq]
    )
    assert {e.deployment_id for e in events} == {"dep-a"}
    await env.no_upgrade_state(sid, b)


async def test_an_unreadable_checkpoint_is_refused_and_a_processes_once(
    env: Env, stack: Stack
) -> None:
    """Deployment C reads only snapshot format 3: it refuses A's checkpoint,
    and A processes the delivery itself, exactly once."""
    c = await add_deployment(stack, "dep-c", snapshot_formats=frozenset({3}))
    try:
        await env.wait_ready(c)
        a = env.a
        sid = await a.create(timeout_seconds=600)
        start = (await turn(a, sid, "hello", 1))[-1].seq + 1
        before = await env.snapshot(sid)
        receipt = await c.send(sid, "whoami")
        events = await follow_until(a, sid, waits(1), start_seq=start)
        assert [e.inbox_seq for e in of(events, RECEIVED)] == [receipt.receipt.seq]
        assert of(events, RESULT)[-1].tool_result.output == "dep-a"
        await env.no_upgrade_state(sid, c)
        after = await env.snapshot(sid)
        assert after.timeout.deadline == before.timeout.deadline, (
            "a failed handoff moved the deadline"
        )
        all_events = await read_all(a, sid)
        assert len([e for e in of(all_events, RECEIVED) if e.inbox_seq == receipt.receipt.seq]) == 1
    finally:
        await stop_deployment(c)


async def test_no_live_instance_of_the_target_skips(env: Env, stack: Stack) -> None:
    a = env.a
    c = await add_deployment(stack, "dep-c")
    await env.wait_ready(c)
    sid = await a.create()
    start = (await turn(a, sid, "hello", 1))[-1].seq + 1
    # C's ingress keeps accepting while C's owner fleet is gone.
    await c.owner.stop(grace=0.2)
    await eventually(lambda: _no_instances(env, "dep-c"), "dep-c deregistered", 15)
    try:
        await c.send(sid, "whoami")
        events = await follow_until(a, sid, waits(1), start_seq=start)
        assert of(events, RESULT)[-1].tool_result.output == "dep-a"
        await env.no_upgrade_state(sid)
    finally:
        await c.channel.close()
        await c.ingress.stop(grace=0.2)


async def _no_instances(env: Env, deployment_id: str) -> bool:
    return not await env.hooks.list_instances(deployment_id)


# -- races and lost answers ------------------------------------------------------


async def test_a_delivery_racing_the_transfer_fails_it_and_a_keeps_fifo(env: Env) -> None:
    a, b = env.a, env.b
    sid = await a.create(aliases=["race"])
    start = (await turn(a, sid, "hello", 1))[-1].seq + 1
    failpoints.configure("handoff.before_transfer=once:sleep(500)")
    trigger = await b.send(sid, "whoami")

    async def prepared() -> bool:
        return bool(env.host(b).acceptance.accepting)

    await eventually(prepared, "B validating the checkpoint", 10)
    # Ingress keeps accepting and resolving the alias during the handoff.
    later = await a.send(alias="race", text="what is 2+2")
    assert later.receipt.session_id == sid
    events = await follow_until(
        a, sid, lambda ev: len(of(ev, RECEIVED)) >= 2 and ev[-1].kind == WAITING, start_seq=start
    )
    assert [e.inbox_seq for e in of(events, RECEIVED)] == [trigger.receipt.seq, later.receipt.seq]
    assert {e.deployment_id for e in events} == {"dep-a"}
    await env.no_upgrade_state(sid, b)


async def test_a_lost_transfer_response_is_settled_by_a_replay(env: Env) -> None:
    a, b = env.a, env.b
    sid = await a.create()
    start = (await turn(a, sid, "hello", 1))[-1].seq + 1
    failpoints.configure("handoff.transfer_response=once:error")
    receipt = await b.send(sid, "whoami")
    events = await follow_until(b, sid, waits(1), start_seq=start)
    assert of(events, RESULT)[-1].tool_result.output == "dep-b"
    assert [e.inbox_seq for e in of(events, RECEIVED)] == [receipt.receipt.seq]
    assert len(await env.transfers(sid)) == 1
    epoch, record = await env.owner(sid)
    assert (epoch, record.deployment_id) == (2, "dep-b")


async def test_an_uncertain_outcome_is_settled_and_a_keeps_the_session(env: Env) -> None:
    """B fails before transferring; A cannot know, so it commits its
    checkpoint unchanged (fenced): that succeeds, so A processes the trigger."""
    a, b = env.a, env.b
    sid = await a.create()
    start = (await turn(a, sid, "hello", 1))[-1].seq + 1
    failpoints.configure("handoff.prepare=once:error")
    await b.send(sid, "whoami")
    events = await follow_until(a, sid, waits(1), start_seq=start)
    assert of(events, RESULT)[-1].tool_result.output == "dep-a"
    await env.no_upgrade_state(sid, b)
    # The signal is forgotten, not remembered: the next B send moves it.
    events = await turn(b, sid, "whoami", events[-1].seq + 1)
    assert of(events, RESULT)[-1].tool_result.output == "dep-b"


async def test_a_parked_session_wakes_and_moves(env: Env, stack: Stack) -> None:
    """An idle session parked on A (no run in memory) moves on its next B send."""
    a, b = env.a, env.b
    host = env.host(a)
    host.park_after = 0.2
    sid = await a.create()
    start = (await turn(a, sid, "hello", 1))[-1].seq + 1

    async def parked() -> bool:
        return sid in host.parked

    await eventually(parked, "session parked", 10)
    events = await turn(b, sid, "whoami", start)
    assert of(events, RESULT)[-1].tool_result.output == "dep-b"
    epoch, record = await env.owner(sid)
    assert (epoch, record.deployment_id) == (2, "dep-b")


async def test_accept_handoff_validates_and_replays(env: Env) -> None:
    """The test plays the old owner X (deployment dep-x, no process): it
    creates a session, commits session.started, and appends a trigger. Its
    good request carries no checkpoint bytes: B reads it from anchor."""

    b = env.b
    sid = ids.new_session_id()
    x = s.OwnerIdentity(owner_run_id="run_x1", deployment_id="dep-x", instance_id="x1")
    as_x = certs.owner("dep-x")
    hooks_x, anchor_x = env.a.hooks_client(as_x), env.a.anchor_client(as_x)
    try:
        created = await hooks_x.create_session(sid, x, "slack", ["slack:acc"])
        fence = created.fence
        snapshot = initial_snapshot(sid, "slack", "dep-x", list(created.hooks))
        identity = RunIdentity(fence, "dep-x", "x1")
        started = make_event(identity, K.EVENT_KIND_SESSION_STARTED)
        await commit_step(anchor_x, identity, snapshot, [started], False, 0)
    finally:
        await hooks_x.close()
        await anchor_x.close()
    command = s.Command(
        delivery=s.DeliveryMetadata(delivery_id="d-1", accepted_deployment_id="dep-b"),
        send=s.SendCommand(text="whoami"),
    )
    # The trigger arrives as dep-b's ingress delivers it, in the tenant's channel.
    gateway = env.b.hooks_client(certs.ingress("dep-b"))
    try:
        receipt = await gateway.append(ids.inbox_token(sid), command, "slack")
    finally:
        await gateway.close()
    trigger = s.InboxEntry(seq=receipt.seq, command=command)
    snapshot_kv = await env.etcd.get(env.keys.snapshot(sid))
    assert snapshot_kv is not None
    revision = snapshot_kv.mod_revision
    good = dict(
        handoff_id="h-1",
        fence=fence,
        deployment_id="dep-b",
        from_owner=x,
        snapshot_revision=revision,
        trigger=trigger,
    )
    x_signs = PermitSigner(as_x)

    def permit(signer: PermitSigner = x_signs, **change: Any) -> s.TransferPermit:
        fields: dict[str, Any] = {**good, **change}
        granted = signer.sign(
            grant_for(
                fields["fence"], fields["handoff_id"], "dep-b", fields["snapshot_revision"], 0
            )
        )
        assert granted is not None
        return granted

    good["permit"] = permit()
    b_signs = PermitSigner(certs.owner("dep-b"))
    on_b = s.OwnerIdentity(owner_run_id="run_x1", deployment_id="dep-b", instance_id="x1")
    on_latest = s.OwnerIdentity(owner_run_id="run_x1", deployment_id="latest", instance_id="x1")
    cancel = s.InboxEntry(seq=receipt.seq, command=s.Command(cancel=s.CancelCommand()))
    cases = [
        ({"deployment_id": "latest"}, "INVALID_DEPLOYMENT_ID"),
        ({"deployment_id": ""}, "INVALID_DEPLOYMENT_ID"),
        ({"deployment_id": "dep-a"}, "WRONG_DEPLOYMENT"),
        ({"from_owner": on_latest}, "INVALID_DEPLOYMENT_ID"),
        # Only the owner named as the current one may offer the session.
        ({"from_owner": on_b}, "DEPLOYMENT_NOT_ALLOWED"),
        ({"snapshot_revision": 0}, "MISSING_FIELD"),
        ({"snapshot_revision": revision - 1}, "STALE_CHECKPOINT"),
        ({"trigger": s.InboxEntry(seq=5, command=command)}, "SESSION_NOT_IDLE"),
        ({"trigger": cancel}, "INVALID_FIELD"),
        ({"handoff_id": ""}, "INVALID_FIELD"),
        ({"fence": s.Fence(session_id="ses_x", owner_run_id="r", epoch=1)}, "INVALID_SESSION_ID"),
        # Hooks moves the session only with X's own signed consent to exactly
        # this handoff (services/common/security/permits.py).
        ({"permit": None}, "TRANSFER_NOT_PERMITTED"),
        ({"permit": permit(b_signs)}, "TRANSFER_NOT_PERMITTED"),
        ({"permit": permit(handoff_id="h-other")}, "TRANSFER_NOT_PERMITTED"),
        ({"permit": permit(snapshot_revision=revision + 1)}, "TRANSFER_NOT_PERMITTED"),
        (
            {
                "permit": s.TransferPermit(
                    grant=good["permit"].grant, certificate=b"x", signature=b"x"
                )
            },
            "TRANSFER_NOT_PERMITTED",
        ),
    ]
    client = b.owner_client(security=as_x, timeout=5)
    try:
        for change, reason in cases:
            request = owner_pb2.AcceptHandoffRequest(**{**good, **change})  # type: ignore[arg-type]
            with pytest.raises(BatonError) as info:
                await client.accept_handoff(request)
            assert info.value.reason == reason, (change, info.value)
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await client.stub.AcceptHandoff(
                owner_pb2.AcceptHandoffRequest(handoff_id="h-2"), timeout=5
            )
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert from_rpc_error(raw.value).reason == "MISSING_FIELD"
        # B loads the checkpoint from anchor at A's revision: a stored snapshot
        # it cannot parse, or in a format it does not read, is refused.
        original = snapshot_kv.value
        old_format = s.SessionSnapshot.FromString(original)
        old_format.format_version = 1
        for raw_snapshot, reason in (
            (b"\xff\xff\xff", "CHECKPOINT_UNREADABLE"),
            (old_format.SerializeToString(), "CHECKPOINT_INCOMPATIBLE"),
        ):
            await env.etcd.put(env.keys.snapshot(sid), raw_snapshot)
            stored = await env.etcd.get(env.keys.snapshot(sid))
            assert stored is not None
            request = owner_pb2.AcceptHandoffRequest(
                **{**good, "snapshot_revision": stored.mod_revision}  # type: ignore[arg-type]
            )
            with pytest.raises(BatonError) as info:
                await client.accept_handoff(request)
            assert info.value.reason == reason
        # A checkpoint sent along is checked the same way, and its context
        # must be the one the snapshot names.
        mismatched = s.ChatMessage(role=s.ROLE_USER, content="not in the checkpoint")
        for sent, reason in (
            ({"checkpoint": b"\xff\xff\xff"}, "CHECKPOINT_UNREADABLE"),
            ({"checkpoint": old_format.SerializeToString()}, "CHECKPOINT_INCOMPATIBLE"),
            ({"checkpoint": original, "context": [mismatched]}, "CHECKPOINT_UNREADABLE"),
        ):
            request = owner_pb2.AcceptHandoffRequest(**{**good, **sent})  # type: ignore[arg-type]
            with pytest.raises(BatonError) as info:
                await client.accept_handoff(request)
            assert info.value.reason == reason, sent
        await env.etcd.put(env.keys.snapshot(sid), original)
        restored = await env.etcd.get(env.keys.snapshot(sid))
        assert restored is not None
        good["snapshot_revision"] = restored.mod_revision
        good["permit"] = permit()
        assert await env.transfers(sid) == [], "a refused handoff wrote something"
        epoch, record = await env.owner(sid)
        assert (epoch, record.deployment_id) == (1, "dep-x")

        # The good one moves the session to B, which processes the trigger.
        request = owner_pb2.AcceptHandoffRequest(**good)  # type: ignore[arg-type]
        first = await client.accept_handoff(request)
        assert first.fence.epoch == 2 and first.successor.deployment_id == "dep-b"
        assert not first.replayed
        events = await follow_until(b, sid, waits(1))
        assert [e.kind for e in events[:2]] == [K.EVENT_KIND_SESSION_STARTED, HANDED_OFF]
        assert events[1].text == "dep-x" and events[1].handoff_id == "h-1"
        assert of(events, RESULT)[-1].tool_result.output == "dep-b"
        # A repeat returns the same outcome and starts nothing twice.
        again = await client.accept_handoff(request)
        assert again.replayed and again.fence == first.fence
        assert again.successor == first.successor
        assert env.host(b).runs[sid].run_id == first.fence.owner_run_id
        assert len(await env.transfers(sid)) == 1
        assert len(of(await read_all(b, sid), RECEIVED)) == 1
    finally:
        await client.close()


class _FlakyHooks:
    """B's hooks client, losing the first Transfer answer and every one for
    `lose_for` seconds after the first call (each call does reach hooks), and
    failing every lookup."""

    def __init__(self, real: HooksClient, lose_for: float) -> None:
        self._real = real
        self._lose_until = 0.0
        self._lose_for = lose_for
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    async def transfer(self, request: object, deadline_s: float | None = None) -> object:
        loop = asyncio.get_running_loop()
        if not self.calls:
            self._lose_until = loop.time() + self._lose_for
        self.calls += 1
        response = await self._real.transfer(request, deadline_s)  # type: ignore[arg-type]
        # The first answer is always lost (however long the call took), then
        # every answer until `lose_for` has passed.
        if self.calls == 1 or loop.time() < self._lose_until:
            raise Unavailable(Reason.UPSTREAM_UNAVAILABLE, "answer lost")
        return response

    async def get_transfer(self, *args: object) -> object:
        raise Unavailable(Reason.UPSTREAM_UNAVAILABLE, "hooks still flaky")


@pytest.mark.parametrize(
    "lose_for", [0.01, 4.0], ids=["one answer lost", "answers lost past A's wait"]
)
async def test_lost_transfer_answers_never_strand_the_session(env: Env, lose_for: float) -> None:
    """The first Transfer commits but its answer (and every lookup) is lost.
    Briefly: B's replay settles it and B runs the trigger. For longer than B
    makes A wait: A gets UNAVAILABLE, settles with a fenced commit (FENCED:
    it moved) and ends; B keeps replaying in the background and starts the
    successor when the replay answers. Either way the trigger runs once, on B."""
    a, b = env.a, env.b
    sid = await a.create()
    start = (await turn(a, sid, "hello", 1))[-1].seq + 1
    acceptance = env.host(b).acceptance
    flaky = _FlakyHooks(acceptance.hooks, lose_for)
    acceptance.hooks = flaky  # type: ignore[assignment]
    receipt = await b.send(sid, "whoami")
    events = await follow_until(b, sid, waits(1), start_seq=start, timeout=20)
    assert flaky.calls >= 2, "the transfer was never replayed"
    assert [e.inbox_seq for e in of(events, RECEIVED)] == [receipt.receipt.seq]
    assert of(events, RESULT)[-1].tool_result.output == "dep-b"
    epoch, record = await env.owner(sid)
    assert (epoch, record.deployment_id) == (2, "dep-b")
    assert sid not in env.host(a).runs
    all_events = await read_all(a, sid)
    assert len([e for e in of(all_events, RECEIVED) if e.inbox_seq == receipt.receipt.seq]) == 1
