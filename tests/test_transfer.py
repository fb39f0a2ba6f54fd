"""The atomic handoff primitive on hooks (docs/design.md §6 step 3): one etcd txn
moves a session to a successor on an exact deployment, or writes nothing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aetcd
import grpc
import pytest

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.hooks.v1 import hooks_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.channels import open_channel
from baton_runtime.common.errors import Fenced
from baton_runtime.common.etcd.keys import Keys, OwnerRecord, parse_fence
from baton_runtime.common.rpc.status_map import from_rpc_error
from baton_runtime.common.security.permits import PermitSigner, grant_for
from tests import certs
from tests.stack import Stack


@dataclass
class Env:
    stack: Stack
    etcd: aetcd.Client
    keys: Keys
    hooks: hooks_pb2_grpc.HookRegistryServiceStub


@pytest.fixture
async def env(stack: Stack) -> AsyncIterator[Env]:
    client = await certs.etcd_client(stack.etcd.endpoint)
    # Transfer is called by the successor: an owner of dep-b (SUCCESSOR).
    channel = open_channel(stack.addr(stack.hooks), certs.owner("dep-b"))
    try:
        yield Env(
            stack, client, Keys(stack.etcd.prefix), hooks_pb2_grpc.HookRegistryServiceStub(channel)
        )
    finally:
        await channel.close()
        await client.close()


async def dump(env: Env, session_id: str) -> dict[bytes, tuple[bytes, int]]:
    """Every key of the session, its index entries and tokens, with mod revisions."""
    out: dict[bytes, tuple[bytes, int]] = {}
    for prefix in (f"{env.keys.root}s/{session_id}/", f"{env.keys.root}i/", f"{env.keys.root}t/"):
        for kv in await env.etcd.get_prefix(prefix.encode()):
            out[kv.key] = (kv.value, kv.mod_revision)
    return out


async def current(env: Env, session_id: str) -> tuple[s.Fence, s.OwnerIdentity, list[str], int]:
    fence_raw = await env.etcd.get(env.keys.fence(session_id))
    owner_raw = await env.etcd.get(env.keys.owner(session_id))
    hooks_raw = await env.etcd.get(env.keys.hooks(session_id))
    head_raw = await env.etcd.get(env.keys.inbox_head(session_id))
    snapshot_raw = await env.etcd.get(env.keys.snapshot(session_id))
    assert fence_raw and owner_raw and hooks_raw and head_raw and snapshot_raw
    REVISIONS[session_id] = snapshot_raw.mod_revision
    epoch, run = parse_fence(fence_raw.value)
    record = OwnerRecord.decode(owner_raw.value)
    owner = s.OwnerIdentity(
        owner_run_id=run, deployment_id=record.deployment_id, instance_id=record.instance_id
    )
    return (
        s.Fence(session_id=session_id, owner_run_id=run, epoch=epoch),
        owner,
        json.loads(hooks_raw.value),
        int(head_raw.value),
    )


SUCCESSOR = s.OwnerIdentity(owner_run_id="run_b1", deployment_id="dep-b", instance_id="dep-b-i1")


REVISIONS: dict[str, int] = {}  # session -> its snapshot's mod revision, read by `current`


def request(
    fence: s.Fence,
    owner: s.OwnerIdentity,
    hooks: list[str],
    trigger: int,
    handoff: str = "h1",
    *,
    revision: int | None = None,
    signer: str | None = None,
) -> hooks_pb.TransferRequest:
    """A trigger's transfer, with the permit the current owner signs (an
    owner of `signer`, by default of the session's deployment)."""
    if revision is None:
        revision = REVISIONS[fence.session_id]
    grant = grant_for(fence, handoff, SUCCESSOR.deployment_id, revision, s.TRANSFER_REASON_TRIGGER)
    permit = PermitSigner(certs.owner(signer or owner.deployment_id)).sign(grant)
    return hooks_pb.TransferRequest(
        handoff_id=handoff,
        expected=fence,
        expected_owner=owner,
        successor=SUCCESSOR,
        hooks=hooks,
        trigger_seq=trigger,
        snapshot_revision=revision,
        permit=permit,
    )


async def expect(call: object, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code
    assert from_rpc_error(info.value).reason == reason


async def session_with_trigger(env: Env) -> tuple[str, s.Fence, s.OwnerIdentity, list[str], int]:
    sid = await env.stack.create(aliases=["shop-1"])
    await env.stack.send(sid, "hello")
    await env.stack.events(sid, until=1)
    fence, owner, hooks, head = await current(env, sid)
    return sid, fence, owner, hooks, head - 1


async def test_transfer_moves_the_session_in_one_step_and_replays(env: Env) -> None:
    sid, fence, owner, hooks, trigger = await session_with_trigger(env)
    response = await env.hooks.Transfer(request(fence, owner, hooks, trigger), timeout=10)
    assert response.fence == s.Fence(session_id=sid, owner_run_id="run_b1", epoch=fence.epoch + 1)
    assert not response.replayed
    moved, successor, hooks_after, _ = await current(env, sid)
    assert moved == response.fence
    assert successor == SUCCESSOR
    assert hooks_after == hooks  # the claim set travels unchanged
    index = env.keys.owned(owner.deployment_id, owner.instance_id, sid)
    assert await env.etcd.get(index) is None
    assert await env.etcd.get(env.keys.owned("dep-b", "dep-b-i1", sid)) is not None
    # Tokens map to the session, not the run: the alias still resolves.
    lookup = await env.hooks.LookupHook(
        hooks_pb.LookupHookRequest(token="slack:shop-1"), timeout=10
    )
    assert lookup.session_id == sid

    before = await dump(env, sid)
    again = await env.hooks.Transfer(request(fence, owner, hooks, trigger), timeout=10)
    assert again.replayed and again.fence == response.fence
    assert await dump(env, sid) == before, "a replay wrote to etcd"
    found = await env.hooks.GetTransfer(
        hooks_pb.GetTransferRequest(session_id=sid, handoff_id="h1"), timeout=10
    )
    assert found.fence == response.fence and found.successor == SUCCESSOR
    assert found.trigger_seq == trigger
    # The old owner's run is fenced: its next commit would be refused.
    old_owner = env.stack.hooks_client()
    try:
        with pytest.raises(Fenced):
            await old_owner.claim(fence, ["slack:x"])
    finally:
        await old_owner.close()
    # And the new owner's deployment cannot use the old fence either.
    await expect(
        env.hooks.ClaimHooks(
            hooks_pb.ClaimHooksRequest(fence=fence, tokens=["slack:x"]), timeout=10
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "DEPLOYMENT_NOT_ALLOWED",
    )


async def test_a_later_arrival_fails_the_transfer_and_writes_nothing(env: Env) -> None:
    sid, fence, owner, hooks, trigger = await session_with_trigger(env)
    await env.stack.send(sid, "arrived later")
    await env.stack.events(sid, until=2)
    fence, owner, hooks, _ = await current(env, sid)
    before = await dump(env, sid)
    await expect(
        env.hooks.Transfer(request(fence, owner, hooks, trigger), timeout=10),
        grpc.StatusCode.ABORTED,
        "LATER_ARRIVAL",
    )
    assert await dump(env, sid) == before
    await expect(
        env.hooks.GetTransfer(
            hooks_pb.GetTransferRequest(session_id=sid, handoff_id="h1"), timeout=10
        ),
        grpc.StatusCode.NOT_FOUND,
        "TRANSFER_NOT_FOUND",
    )


async def test_a_changed_claim_set_or_stale_fence_fails_and_writes_nothing(env: Env) -> None:
    sid, fence, owner, hooks, trigger = await session_with_trigger(env)
    before = await dump(env, sid)
    await expect(
        env.hooks.Transfer(request(fence, owner, hooks[:1], trigger), timeout=10),
        grpc.StatusCode.ABORTED,
        "HOOKS_CHANGED",
    )
    stale = s.Fence(session_id=sid, owner_run_id=fence.owner_run_id, epoch=fence.epoch + 5)
    await expect(
        env.hooks.Transfer(request(stale, owner, hooks, trigger), timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        "FENCED",
    )
    assert await dump(env, sid) == before


async def test_transfers_name_exact_deployments(env: Env) -> None:
    sid, fence, owner, hooks, trigger = await session_with_trigger(env)
    before = await dump(env, sid)
    for bad in ("", "latest", "LATEST"):
        req = request(fence, owner, hooks, trigger)
        req.successor.deployment_id = bad
        await expect(
            env.hooks.Transfer(req, timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_DEPLOYMENT_ID",
        )
    assert await dump(env, sid) == before


async def test_a_reused_handoff_id_for_another_successor_is_refused(env: Env) -> None:
    sid, fence, owner, hooks, trigger = await session_with_trigger(env)
    await env.hooks.Transfer(request(fence, owner, hooks, trigger), timeout=10)
    before = await dump(env, sid)
    other = request(fence, owner, hooks, trigger)
    other.successor.owner_run_id = "run_b2"
    await expect(
        env.hooks.Transfer(other, timeout=10), grpc.StatusCode.ALREADY_EXISTS, "HANDOFF_ID_REUSED"
    )
    assert await dump(env, sid) == before
    assert ids.inbox_token(sid) in hooks


async def test_a_commit_since_the_checkpoint_fails_the_transfer(env: Env) -> None:
    """The old owner committed after the checkpoint (e.g. it processed the
    trigger after a refused replay): a late copy of the transfer cannot land."""
    sid, fence, owner, hooks, trigger = await session_with_trigger(env)
    stale = request(fence, owner, hooks, trigger, revision=REVISIONS[sid] - 1)
    before = await dump(env, sid)
    await expect(env.hooks.Transfer(stale, timeout=10), grpc.StatusCode.ABORTED, "STALE_CHECKPOINT")
    missing = request(fence, owner, hooks, trigger, revision=0)
    await expect(
        env.hooks.Transfer(missing, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, "MISSING_FIELD"
    )
    assert await dump(env, sid) == before


async def test_only_the_sessions_own_deployment_can_consent_to_moving_it(env: Env) -> None:
    """The issue's attack: an owner of another deployment (the caller, dep-b)
    knows the session's fence, claim set, inbox head and snapshot revision
    (all of them readable with an owner certificate) and asks hooks to move
    the idle session to itself. Without a permit signed by an owner of the
    session's deployment, hooks refuses, whatever the request claims, and
    writes nothing; an adoption is refused while that deployment has a live
    instance."""
    sid, fence, owner, hooks, trigger = await session_with_trigger(env)
    before = await dump(env, sid)
    denied = grpc.StatusCode.PERMISSION_DENIED
    no_permit = request(fence, owner, hooks, trigger)
    no_permit.ClearField("permit")
    await expect(env.hooks.Transfer(no_permit, timeout=10), denied, "TRANSFER_NOT_PERMITTED")
    # Its own signature (an owner of dep-b) is no consent.
    own = request(fence, owner, hooks, trigger, signer="dep-b")
    await expect(env.hooks.Transfer(own, timeout=10), denied, "TRANSFER_NOT_PERMITTED")
    # Nor does naming itself as the current owner's deployment help: hooks
    # reads whose the session is.
    claimed = s.OwnerIdentity(
        owner_run_id=owner.owner_run_id, deployment_id="dep-b", instance_id=owner.instance_id
    )
    lie = request(fence, claimed, hooks, trigger, signer="dep-b")
    await expect(env.hooks.Transfer(lie, timeout=10), denied, "TRANSFER_NOT_PERMITTED")
    # A real permit for another handoff is not this one's.
    reused = request(fence, owner, hooks, trigger, handoff="h-elsewhere")
    reused.handoff_id = "h1"
    await expect(env.hooks.Transfer(reused, timeout=10), denied, "TRANSFER_NOT_PERMITTED")
    # A permit field over its bound is bad input, refused as such.
    oversized = request(fence, owner, hooks, trigger)
    oversized.permit.certificate = b"x" * 20_000
    await expect(
        env.hooks.Transfer(oversized, timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
    # An adoption needs no permit, but the session's deployment must have
    # no live instance: the stack's owner is live.
    adoption = request(fence, owner, hooks, trigger)
    adoption.ClearField("permit")
    adoption.reason = s.TRANSFER_REASON_ADOPTION
    await expect(
        env.hooks.Transfer(adoption, timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        "INSTANCE_LIVE",
    )
    assert await dump(env, sid) == before, "a refused transfer wrote something"
    # The same request with the owner's own permit goes through.
    response = await env.hooks.Transfer(request(fence, owner, hooks, trigger), timeout=10)
    assert response.fence.epoch == fence.epoch + 1
