"""The session status function (services/common/status.py): pure, one
case per status and the precedence between them."""

from __future__ import annotations

import dataclasses

import pytest

from baton_runtime.common.status import SessionFacts, Status, StatusView, session_status

IDLE = SessionFacts(
    committed=True,
    finalized=False,
    owner_run_id="run_a",
    owner_deployment_id="dep-a",
    snapshot_deployment_id="dep-a",
    parked=False,
    inbox_depth=0,
    turn_open=False,
    pending_inputs=0,
    pending_authorizations=0,
    children_running=0,
    children_waiting=0,
)


def facts(**changes: object) -> SessionFacts:
    return dataclasses.replace(IDLE, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "status"),
    [
        ({}, Status.IDLE),
        ({"inbox_depth": 1}, Status.RUNNING),
        ({"turn_open": True}, Status.RUNNING),
        ({"children_running": 1}, Status.RUNNING),
        ({"turn_open": True, "pending_inputs": 1}, Status.WAITING_FOR_INPUT),
        ({"turn_open": True, "children_waiting": 1}, Status.WAITING_FOR_INPUT),
        ({"turn_open": True, "pending_authorizations": 2}, Status.WAITING_FOR_AUTHORIZATION),
        ({"parked": True}, Status.PARKED),
        ({"finalized": True}, Status.FINALIZED),
        ({"owner_deployment_id": "dep-b"}, Status.HANDING_OFF),
        # Not committed yet (a child before its first commit): no snapshot
        # deployment to differ from.
        ({"committed": False, "snapshot_deployment_id": ""}, Status.IDLE),
        ({"committed": False, "snapshot_deployment_id": "", "inbox_depth": 1}, Status.RUNNING),
    ],
)
def test_each_status(changes: dict[str, object], status: Status) -> None:
    assert session_status(facts(**changes)).status is status


def test_a_stall_counts_while_its_run_owns_the_session_and_says_why() -> None:
    stalled = facts(
        stalled_by_run="run_a",
        stalled_reason="RESTART_BUDGET_SPENT",
        stalled_message="4 runs in a row failed",
        inbox_depth=3,
    )
    assert session_status(stalled) == StatusView(
        Status.STALLED, "RESTART_BUDGET_SPENT", "4 runs in a row failed"
    )
    # Taken over (or restarted): a new run runs it again.
    assert session_status(dataclasses.replace(stalled, owner_run_id="run_b")).status is (
        Status.RUNNING
    )


def test_precedence() -> None:
    everything = facts(
        finalized=True,
        owner_deployment_id="dep-b",
        stalled_by_run="run_a",
        pending_authorizations=1,
        pending_inputs=1,
        turn_open=True,
        inbox_depth=1,
        parked=True,
    )
    order = [
        ("finalized", False, Status.FINALIZED),
        ("owner_deployment_id", "dep-a", Status.HANDING_OFF),
        ("stalled_by_run", "", Status.STALLED),
        ("pending_authorizations", 0, Status.WAITING_FOR_AUTHORIZATION),
        ("pending_inputs", 0, Status.WAITING_FOR_INPUT),
        ("turn_open", False, Status.RUNNING),
        ("inbox_depth", 0, Status.RUNNING),
        ("parked", False, Status.PARKED),
    ]
    current = everything
    for field, cleared, expected in order:
        assert session_status(current).status is expected, field
        current = dataclasses.replace(current, **{field: cleared})  # type: ignore[arg-type]
    assert session_status(current).status is Status.IDLE


def test_status_names_are_what_the_cli_prints() -> None:
    assert [s.value for s in Status] == [
        "idle",
        "running",
        "waiting_for_input",
        "waiting_for_authorization",
        "parked",
        "stalled",
        "handing_off",
        "finalized",
    ]
