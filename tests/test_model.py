"""The protocol's model (model/, docs/model.md): every reachable state of
small bounds keeps design §9's invariants, the known-bad variants fail with
a short trace, random walks of larger bounds hold, and the model's steps
name real code. Pure Python, no I/O: no etcd, no processes."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest

from model.explore import Result, explore, random_walks
from model.options import EXHAUSTIVE, SLOW_EXHAUSTIVE, WALKS, Bounds, Variant
from model.protocol import ACTIONS, Model

ROOT = Path(__file__).resolve().parent.parent

# The exhaustive bounds take about 12 s of CPU each (docs/testing.md); a
# machine shared with other work may stretch that well past the default.
pytestmark = pytest.mark.timeout(900)


@functools.cache
def explored(name: str) -> Result:
    """Every state of one of the suite's bounds (explored once per run)."""
    return explore(Model(EXHAUSTIVE[name]))


@pytest.mark.parametrize("name", list(EXHAUSTIVE))
def test_every_reachable_state_keeps_the_invariants(name: str) -> None:
    result = explored(name)
    assert result.violation is None, str(result.violation)
    assert result.complete
    # Not vacuous: the system keeps reaching quiescence, with work done.
    assert result.quiescent > 100 and result.states > 10_000, result.summary()


def test_the_exhaustive_bounds_take_every_step() -> None:
    """Together the bounds explored exhaustively take every step the model
    has: none is dead code. (The reconciler's wake is taken only where a
    bell never wakes its session: with the lost wake-up of issue 32.)"""
    taken: set[str] = set()
    for name in EXHAUSTIVE:
        taken |= explored(name).actions.keys()
    netted = Variant(takeover_replay_head_now=True, reconciler=True)
    taken |= explore(Model(Bounds(messages=1, crashes=1), netted)).actions.keys()
    assert taken == set(ACTIONS)


# Each known-bad variant, the invariant it must break, and the most steps
# its shortest trace may take (breadth-first: the first trace is shortest).
BAD = {
    # A stale owner's commit lands after its successor took over.
    "commit_without_fence": ("fenced_commits", 4),
    # A gateway's retry after a lost answer is appended a second time.
    "dedupe_by_attempt": ("deliveries_once", 2),
    # The seed's handoff: A releases, then B claims. A crashes after its
    # release and B refuses (a later arrival): nobody owns the session in
    # the interval, and nobody ever will; the commands are never processed.
    "release_then_claim": ("all_processed", 6),
    # Issue 32 defect 3: the replay answers the head of now as the parked
    # position, above the bell that rang since: a lost wake-up.
    "takeover_replay_head_now": ("all_processed", 6),
    # More mistakes of the same kind: a compare left out of a transaction.
    "park_without_head_compare": ("bells_cover_arrivals", 2),
    "transfer_without_head_compare": ("idle_moves", 4),
    "transfer_without_revision_compare": ("steps_once", 7),
}


@pytest.mark.parametrize("variant", list(BAD))
def test_a_known_bad_variant_fails_with_a_short_trace(variant: str) -> None:
    invariant, longest = BAD[variant]
    # The larger bound: breadth-first, the search stops at the violation's depth.
    result = explore(Model(SLOW_EXHAUSTIVE, Variant(**{variant: True})))
    violation = result.violation
    assert violation is not None, f"{variant} passed: {result.summary()}"
    assert violation.invariant == invariant, str(violation)
    assert len(violation.trace) <= longest, str(violation)


def test_every_variant_is_tried() -> None:
    variants = {f.name for f in dataclasses.fields(Variant)}
    assert variants - set(BAD) == {"reconciler"}


def test_the_reconciler_repairs_the_lost_wake_up() -> None:
    """The safety net (services/owner/host/reconcile.py) wakes a parked
    session whose bell rang, whatever position it was parked at: the
    replay defect's session is answered late, not never."""
    bounds = Bounds(messages=1, crashes=1)
    broken = Variant(takeover_replay_head_now=True)
    assert explore(Model(bounds, broken)).violation is not None
    netted = explore(Model(bounds, dataclasses.replace(broken, reconciler=True)))
    assert netted.violation is None, str(netted.violation)


def test_a_paused_owner_may_run_a_step_its_successor_committed() -> None:
    """A finding, not a defect of the protocol's safety: held to §9.3
    strictly, a stale run breaks it. An owner paused past its lease still
    has in its buffer the entry it read before its fence moved; resumed, it
    runs that entry's step (model and tool calls) before its commit is
    fenced, though its successor committed the same step. docs/model.md."""
    result = explore(Model(Bounds(messages=1, crashes=1, lost=0), strict_step_once=True))
    violation = result.violation
    assert violation is not None and violation.invariant == "steps_once", result.summary()
    assert [step.action for step in violation.trace] == [
        "send",
        "pause",
        "take_over",
        "activate",
        "step",
        "step",
    ]


def test_random_walks_of_larger_bounds_keep_the_invariants() -> None:
    walked = random_walks(Model(WALKS), walks=300, length=80, seed=38)
    assert walked.violation is None, str(walked.violation)
    assert walked.quiescent == walked.walks


@pytest.mark.slow
def test_every_reachable_state_of_the_larger_bound_keeps_the_invariants() -> None:
    result: Result = explore(Model(SLOW_EXHAUSTIVE))
    assert result.violation is None, str(result.violation)
    assert result.complete and result.states > 1_000_000, result.summary()


@pytest.mark.slow
def test_many_random_walks_of_larger_bounds_keep_the_invariants() -> None:
    walked = random_walks(Model(WALKS), walks=20_000, length=120, seed=3838)
    assert walked.violation is None, str(walked.violation)


# -- tied to the code ----------------------------------------------------------------


def test_every_step_names_real_code() -> None:
    """Each step's `path:Class.function` exists: renaming the code it
    mirrors fails here, so the table gets looked at again."""
    for action, (_, where) in ACTIONS.items():
        path, _, qualified = where.partition(":")
        source = (ROOT / path).read_text()
        for name in qualified.split("."):
            assert re.search(rf"\b(def|class) {re.escape(name)}\b", source), (action, where)


def test_docs_map_every_step_to_its_code() -> None:
    """docs/model.md has a row per step naming the same code."""
    page = (ROOT / "docs" / "model.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \|.*\| `([^`]+)` \|$", page, re.MULTILINE))
    assert rows == {action: where for action, (_, where) in ACTIONS.items()}
