"""The retry policy (services/common/retry.py): pure, no etcd, no gRPC."""

from __future__ import annotations

import pytest

from baton_runtime.common import retry
from baton_runtime.common.retry import Backoff, RetryPolicy


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_waits_double_up_to_the_cap() -> None:
    policy = RetryPolicy("t", first=0.05, cap=1.0)
    assert [policy.delay(n) for n in range(1, 8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_a_huge_retry_count_stays_at_the_cap() -> None:
    assert RetryPolicy("t", first=0.1, cap=2.0).delay(10_000) == 2.0


def test_a_longer_first_wait_is_taken_then_capped() -> None:
    # A restart that waited 30 s retries its activation after 30 s, then at the cap.
    policy = RetryPolicy("t", first=0.2, cap=5.0)
    assert [policy.delay(n, first=30.0) for n in (1, 2, 3)] == [30.0, 5.0, 5.0]
    assert [policy.delay(n, first=1.0) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]


def test_jitter_only_shortens_and_by_at_most_its_fraction() -> None:
    policy = RetryPolicy("t", first=1.0, cap=8.0, jitter=0.25)
    assert policy.jittered(4.0, rng=lambda: 0.0) == 4.0
    assert policy.jittered(4.0, rng=lambda: 1.0) == 3.0
    assert policy.jittered(4.0, rng=lambda: 0.5) == 3.5


def test_no_jitter_is_exact() -> None:
    backoff = RetryPolicy("t", first=0.5, cap=2.0, jitter=0.0).backoff(rng=lambda: 0.9)
    assert [backoff.next_delay() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
    assert backoff.retries == 4


def test_reset_starts_over() -> None:
    clock = FakeClock()
    backoff = RetryPolicy("t", first=0.1, cap=2.0, jitter=0.0).backoff(clock=clock)
    backoff.next_delay()
    backoff.next_delay()
    backoff.reset()
    assert backoff.retries == 0
    assert backoff.next_delay() == 0.1


def test_budget_is_spent_after_its_seconds() -> None:
    clock = FakeClock()
    backoff = RetryPolicy("t", first=0.1, cap=1.0, budget_seconds=30.0).backoff(clock=clock)
    clock.now += 30.0
    assert not backoff.spent()
    clock.now += 0.001
    assert backoff.spent()
    backoff.reset()
    assert not backoff.spent()


def test_without_a_budget_it_is_never_spent() -> None:
    clock = FakeClock()
    backoff = Backoff(RetryPolicy("t", first=0.1, cap=1.0), clock=clock)
    clock.now += 1e9
    assert not backoff.spent()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"first": 0.0, "cap": 1.0},
        {"first": 2.0, "cap": 1.0},
        {"first": 0.1, "cap": 1.0, "multiplier": 0.5},
        {"first": 0.1, "cap": 1.0, "jitter": 1.0},
        {"first": 0.1, "cap": 1.0, "budget_seconds": 0.0},
    ],
)
def test_nonsense_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy("bad", **kwargs)


def test_retry_counts_from_one() -> None:
    with pytest.raises(ValueError):
        retry.COMMIT.delay(0)


def test_the_table_names_every_policy_once() -> None:
    assert len(retry.POLICIES) == 14
    for name, policy in retry.POLICIES.items():
        assert policy.name == name
        assert policy.jittered(policy.delay(100), rng=lambda: 0.0) <= policy.cap
    # The commit is the one retry with a time budget (a step's work is never
    # lost to a short outage; past it the run restarts from its snapshot).
    assert [p.name for p in retry.POLICIES.values() if p.budget_seconds] == ["commit"]


async def test_wait_sleeps_the_next_delay() -> None:
    backoff = RetryPolicy("t", first=0.001, cap=0.001, jitter=0.0).backoff()
    await backoff.wait()
    assert backoff.retries == 1
