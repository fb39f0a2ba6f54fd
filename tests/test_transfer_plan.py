"""The pure part of a transfer (services/hooks/transfer.py `plan_transfer`):
a request is validated, and its reason and required inbox head decided,
before its permit is checked and anything is read. No etcd, no gRPC."""

from __future__ import annotations

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import InvalidArgument, PermissionDenied, Reason
from baton_runtime.common.security.identity import Caller, Role
from baton_runtime.hooks.transfer import TransferPlan, TransferRequest, plan_transfer

SID = "ses_" + "a" * 26
FENCE = s.Fence(session_id=SID, owner_run_id="run_1", epoch=3)
OLD = s.OwnerIdentity(owner_run_id="run_1", deployment_id="dep-a", instance_id="i1")
NEW = s.OwnerIdentity(owner_run_id="run_2", deployment_id="dep-b", instance_id="i2")


def plan(caller: Caller = Caller.UNVERIFIED, **overrides: object) -> TransferPlan:
    fields: dict[str, object] = {
        "handoff_id": "h1",
        "expected": FENCE,
        "expected_owner": OLD,
        "successor": NEW,
        "hooks": ("tok_1",),
        "trigger_seq": 7,
        "snapshot_revision": 42,
    }
    fields.update(overrides)
    return plan_transfer(TransferRequest(**fields), caller)  # type: ignore[arg-type]


def test_a_trigger_requires_the_inbox_head_just_past_it() -> None:
    planned = plan()
    assert planned.session_id == SID and planned.reason == s.TRANSFER_REASON_TRIGGER
    assert planned.head == 8 and planned.hooks == ("tok_1",)
    assert plan(reason=s.TRANSFER_REASON_UNSPECIFIED).reason == s.TRANSFER_REASON_TRIGGER


def test_a_drain_requires_the_checkpoints_head_and_an_adoption_none() -> None:
    assert plan(reason=s.TRANSFER_REASON_DRAIN, inbox_head=5).head == 5
    adoption = plan(reason=s.TRANSFER_REASON_ADOPTION)
    assert adoption.reason == s.TRANSFER_REASON_ADOPTION and adoption.head is None


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"snapshot_revision": 0}, Reason.MISSING_FIELD),
        ({"expected": None}, Reason.MISSING_FIELD),
        ({"successor": None}, Reason.MISSING_FIELD),
        ({"trigger_seq": -1}, None),
        ({"reason": 99}, Reason.INVALID_FIELD),
        ({"expected": s.Fence(session_id="nope")}, None),
        ({"handoff_id": ""}, None),
        ({"successor": s.OwnerIdentity(deployment_id="dep-b", instance_id="i2")}, None),
    ],
)
def test_a_malformed_request_is_refused_before_anything_is_read(
    overrides: dict[str, object], reason: str | None
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        plan(**overrides)
    if reason is not None:
        assert refused.value.reason == reason


def test_an_owner_hands_over_to_its_own_deployment_only() -> None:
    """(The successor's deployment is the caller's; an unverified caller, in
    plaintext mode, may name any.)"""
    assert plan(Caller(Role.OWNER, "dep-b")).successor == NEW
    with pytest.raises(PermissionDenied):
        plan(Caller(Role.OWNER, "dep-a"))
