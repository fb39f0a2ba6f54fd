"""The SDK's pure parts: settings and their sources, the retry rules and a
follower's cursor (no I/O; clocks and randomness injected)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from baton_client import Settings, SettingsError
from baton_client._proto.baton.session.v1 import session_pb2 as s
from baton_client.errors import (
    Aborted,
    InvalidArgument,
    ResourceExhausted,
    StreamGap,
    Unavailable,
)
from baton_client.requests import Cursor, Target
from baton_client.retry import Attempts, RetryBudget, RetryPolicy
from baton_client.settings import DEMO_API_KEY


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_settings_come_from_the_environment_then_the_profile_then_defaults(
    tmp_path: Path,
) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"ingress": "127.0.0.1:7001", "ca_cert": "/run/ca.pem"}))
    found = Settings.from_profile(profile, environ={})
    assert (found.target, found.ca_cert, found.plaintext) == (
        "127.0.0.1:7001",
        "/run/ca.pem",
        False,
    )
    assert found.api_key == DEMO_API_KEY
    env = {"BATON_PROFILE": str(profile), "BATON_API_KEY": "k1", "BATON_PLAINTEXT": "1"}
    overridden = Settings.from_profile(environ=env)
    assert (overridden.target, overridden.ca_cert, overridden.plaintext) == (
        "127.0.0.1:7001",
        "",
        True,
    )
    assert overridden.api_key == "k1" and "k1" not in repr(overridden)
    env = {"BATON_PROFILE": str(tmp_path / "none.json"), "BATON_INGRESS_ADDR": "h:1"}
    assert Settings.from_profile(environ=env, timeout=3.0).target == "h:1"
    profile.write_text("[1]")
    with pytest.raises(SettingsError, match="not a JSON object"):
        Settings.from_profile(profile, environ={})


@pytest.mark.parametrize(
    "fields",
    [
        {"api_key": ""},
        {"target": ""},
        {"client_cert": "c.pem"},
        {"plaintext": True, "ca_cert": "ca.pem"},
        {"timeout": 0},
    ],
)
def test_settings_that_cannot_work_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(SettingsError):
        Settings(**{"target": "h:1", "api_key": "k", **fields})  # type: ignore[arg-type]


def test_a_missing_certificate_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="missing.pem"):
        Settings(target="h:1", api_key="k", ca_cert=str(tmp_path / "missing.pem")).credentials()


def test_backoff_grows_to_its_cap_with_full_jitter() -> None:
    policy = RetryPolicy(initial_backoff=0.2, max_backoff=1.0, multiplier=2.0)
    assert [policy.backoff(n, lambda: 1.0) for n in (1, 2, 3, 4, 10)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert policy.backoff(3, lambda: 0.0) == 0.0
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_attempts_retry_only_what_may_succeed_within_the_limits() -> None:
    clock = Clock()
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.1, budget=10.0)
    attempts = Attempts(policy, RetryBudget(clock=clock), clock, rng=lambda: 1.0)
    assert attempts.next_wait(InvalidArgument("EMPTY_MESSAGE", "x")) is None
    attempts = Attempts(policy, RetryBudget(clock=clock), clock, rng=lambda: 1.0)
    assert attempts.next_wait(Unavailable("UPSTREAM_UNAVAILABLE", "x")) == 0.1
    assert attempts.next_wait(Aborted("CONFLICT", "x")) == 0.2
    assert attempts.next_wait(Unavailable("UPSTREAM_UNAVAILABLE", "x")) is None  # 3 attempts
    # The server's retry_after is a floor; a wait past the time budget is not taken.
    attempts = Attempts(policy, RetryBudget(clock=clock), clock, rng=lambda: 1.0)
    assert attempts.next_wait(ResourceExhausted("RATE_LIMITED", "x", retry_after=2.5)) == 2.5
    clock.now += 9.9  # 0.1 s of the budget left: too little for the next wait
    assert attempts.next_wait(Unavailable("UPSTREAM_UNAVAILABLE", "x")) is None
    # Without retry info a limit is final.
    assert not ResourceExhausted("MESSAGE_TOO_LARGE", "x").retryable


def test_progress_renews_a_followers_attempts() -> None:
    clock = Clock()
    policy = RetryPolicy(max_attempts=2, budget=5.0)
    attempts = Attempts(policy, None, clock, rng=lambda: 0.5)
    assert attempts.next_wait(Unavailable("UPSTREAM_UNAVAILABLE", "x")) is not None
    clock.now += 4.0
    attempts.progressed()
    assert attempts.next_wait(Unavailable("UPSTREAM_UNAVAILABLE", "x")) is not None


def test_the_retry_budget_bounds_the_rate_of_retries() -> None:
    clock = Clock()
    budget = RetryBudget(capacity=3, per_second=1.0, ratio=0.5, clock=clock)
    assert [budget.spend() for _ in range(4)] == [True, True, True, False]
    clock.now += 1.0  # one token back per second
    assert [budget.spend(), budget.spend()] == [True, False]
    budget.earn()
    budget.earn()  # two successes: one token
    assert [budget.spend(), budget.spend()] == [True, False]
    clock.now += 100.0  # never more than the capacity
    assert sum(budget.spend() for _ in range(10)) == 3


def event(seq: int, kind: int = s.EVENT_KIND_STEP_COMPLETED) -> s.Event:
    return s.Event(session_id="ses_x", seq=seq, kind=kind)  # type: ignore[arg-type]


def test_a_cursor_drops_overlap_refuses_gaps_and_stops_at_the_terminal_event() -> None:
    cursor = Cursor("ses_x", 3)
    assert cursor.request(True).start_seq == 3
    assert [e.seq for e in cursor.accept([event(1), event(2), event(3), event(4)])] == [3, 4]
    assert cursor.request(True).start_seq == 5
    with pytest.raises(StreamGap):
        cursor.accept([event(7)])
    done = cursor.accept([event(5, s.EVENT_KIND_SESSION_COMPLETED), event(6)])
    assert [e.seq for e in done] == [5] and cursor.closed


def test_a_target_names_a_session_one_way() -> None:
    assert Target.of("ses_x", "").fields() == {"session_id": "ses_x"}
    assert Target.of("", "thread").fields() == {"alias": "thread"}
    for both in (("", ""), ("ses_x", "thread")):
        with pytest.raises(InvalidArgument):
            Target.of(*both)
