"""The checker: every reachable state by breadth-first search, or random
walks for bounds too large for that, with design §9's invariants checked on
every state and the quiescence checks wherever no protocol step is
enabled. Breadth-first, the first violation found has a shortest trace."""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from model.invariants import QUIESCENT, SAFETY, STORED, Check
from model.protocol import PROTOCOL, Model, Step
from model.state import State, Store


@dataclass
class Violation:
    """An invariant that failed, why, and the steps from the initial state."""

    invariant: str
    message: str
    trace: list[Step]
    at_quiescence: bool

    def __str__(self) -> str:
        when = "at quiescence" if self.at_quiescence else "on a reachable state"
        lines = [
            f"{self.invariant} fails {when}: {self.message}",
            f"after {len(self.trace)} steps:",
        ]
        lines += [f"  {n:2}. {step.label}" for n, step in enumerate(self.trace, 1)]
        return "\n".join(lines)


@dataclass
class Result:
    """What an exploration saw."""

    states: int = 0
    transitions: int = 0
    depth: int = 0
    quiescent: int = 0  # states where no protocol step is enabled
    seconds: float = 0.0
    complete: bool = False  # every reachable state seen (no violation, no state limit)
    violation: Violation | None = None
    actions: dict[str, int] = field(default_factory=dict)  # transitions by step name

    def summary(self) -> str:
        done = "all reachable states"
        if not self.complete:
            done = "stopped at a violation" if self.violation else "stopped at the state limit"
        return (
            f"{self.states:,} states, {self.transitions:,} transitions, depth {self.depth}, "
            f"{self.quiescent:,} quiescent, {self.seconds:.1f} s ({done})"
        )


class Checker:
    """Design §9's checks of one state, those of what etcd holds run once
    per distinct store (states share stores: most steps change one
    process's memory, not etcd)."""

    def __init__(self) -> None:
        self._good_stores: set[Store] = set()

    def safety(self, s: State) -> tuple[str, str] | None:
        """The first failed invariant of `s` and why, or None."""
        if s.store not in self._good_stores:
            for name, stored in STORED.items():
                message = stored(s.store)
                if message is not None:
                    return name, message
            self._good_stores.add(s.store)
        return _first_failure(SAFETY, s)

    def quiescence(self, s: State) -> tuple[str, str] | None:
        return _first_failure(QUIESCENT, s)


def _first_failure(checks: dict[str, Check], s: State) -> tuple[str, str] | None:
    for name, check in checks.items():
        message = check(s)
        if message is not None:
            return name, message
    return None


def explore(model: Model, max_states: int | None = None) -> Result:
    """Breadth-first search of every state reachable from the initial one;
    stops at the first violation (a shortest trace to it)."""
    started = time.monotonic()
    result = Result()
    initial = model.initial()
    checker = Checker()
    actions: Counter[str] = Counter()
    # Each state -> the state and step it was first reached by.
    parents: dict[State, tuple[State, Step] | None] = {initial: None}
    frontier = deque([(initial, 0)])
    failure = checker.safety(initial)
    if failure is not None:
        result.violation = _violation(parents, initial, failure, at_quiescence=False)
    while frontier and failure is None:
        s, depth = frontier.popleft()
        result.depth = depth
        busy = False
        for step in model.successors(s):
            result.transitions += 1
            actions[step.action] += 1
            busy = busy or step.kind == PROTOCOL
            t = step.state
            known = len(parents)
            parents.setdefault(t, (s, step))
            if len(parents) == known:
                continue  # seen before (one hash: no `in` before the insert)
            failure = checker.safety(t)
            if failure is not None:
                result.violation = _violation(parents, t, failure, at_quiescence=False)
                break
            frontier.append((t, depth + 1))
        if failure is None and not busy:
            result.quiescent += 1
            failure = checker.quiescence(s)
            if failure is not None:
                result.violation = _violation(parents, s, failure, at_quiescence=True)
        if max_states is not None and len(parents) >= max_states:
            break
    result.complete = not frontier and failure is None
    result.actions = dict(actions)
    result.states = len(parents)
    result.seconds = time.monotonic() - started
    return result


def _violation(
    parents: dict[State, tuple[State, Step] | None],
    s: State,
    failure: tuple[str, str],
    *,
    at_quiescence: bool,
) -> Violation:
    return Violation(failure[0], failure[1], _path(parents, s), at_quiescence)


@dataclass
class Walks:
    """What random walks saw."""

    walks: int = 0
    steps: int = 0
    quiescent: int = 0  # walks that reached quiescence (all did, unless one is stuck)
    seconds: float = 0.0
    violation: Violation | None = None

    def summary(self) -> str:
        return (
            f"{self.walks:,} walks, {self.steps:,} steps, "
            f"{self.quiescent:,} ended quiescent, {self.seconds:.1f} s"
        )


def random_walks(
    model: Model, *, walks: int, length: int, seed: int, settle_limit: int = 10_000
) -> Walks:
    """`walks` random walks of up to `length` steps of any kind, each then
    settled with protocol steps only until none is enabled (quiescence),
    checking the invariants on every state and the quiescence checks at the
    end. Stops at the first violation."""
    started = time.monotonic()
    rng = random.Random(seed)
    checker = Checker()
    result = Walks()
    for _ in range(walks):
        result.walks += 1
        violation = _walk(model, checker, rng, length, settle_limit, result)
        if violation is not None:
            result.violation = violation
            break
    result.seconds = time.monotonic() - started
    return result


def _walk(
    model: Model,
    checker: Checker,
    rng: random.Random,
    length: int,
    settle_limit: int,
    result: Walks,
) -> Violation | None:
    s = model.initial()
    trace: list[Step] = []
    for settling in (False, True):
        budget = settle_limit if settling else length
        for _ in range(budget):
            steps = _choices(model.successors(s), protocol_only=settling)
            if not steps:
                break
            step = rng.choice(steps)
            trace.append(step)
            result.steps += 1
            s = step.state
            failure = checker.safety(s)
            if failure is not None:
                return Violation(failure[0], failure[1], trace, at_quiescence=False)
        else:
            if settling:
                message = f"no quiescence after {settle_limit} protocol steps (a livelock?)"
                return Violation("quiescence_reached", message, trace, at_quiescence=False)
    result.quiescent += 1
    failure = checker.quiescence(s)
    if failure is not None:
        return Violation(failure[0], failure[1], trace, at_quiescence=True)
    return None


def _choices(steps: Iterable[Step], *, protocol_only: bool) -> list[Step]:
    return [step for step in steps if step.kind == PROTOCOL or not protocol_only]


def shortest_traces(model: Model, max_depth: int) -> dict[tuple[str, str], list[Step]]:
    """For every (step name, outcome) reached within `max_depth` steps, a
    shortest trace that ends with such a step (breadth-first: the first one
    met). For replaying against the real services
    (tests/test_model_replay.py)."""
    initial = model.initial()
    parents: dict[State, tuple[State, Step] | None] = {initial: None}
    found: dict[tuple[str, str], list[Step]] = {}
    frontier = deque([(initial, 0)])
    while frontier:
        s, depth = frontier.popleft()
        for step in model.successors(s):
            key = (step.action, step.outcome)
            if key not in found:
                found[key] = [*_path(parents, s), step]
            known = len(parents)
            parents.setdefault(step.state, (s, step))
            if len(parents) > known and depth + 1 < max_depth:
                frontier.append((step.state, depth + 1))
    return found


def _path(parents: dict[State, tuple[State, Step] | None], s: State) -> list[Step]:
    trace: list[Step] = []
    link = parents[s]
    while link is not None:
        previous, step = link
        trace.append(step)
        link = parents[previous]
    trace.reverse()
    return trace
