"""Compaction (docs/design.md §4), the I/O: the model's summary replaces the context.

One room with one model call: `summarize` asks the agent's model to
summarize what it sees and applies the answer (or the failure) to the
session through the turn rules (rules/turns.py: `compacted`,
`compaction_failed`); the shell commits the events. Whether compaction is
due is a rule (decisions.compaction_due)."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.rules import turns
from baton_runtime.owner.rules.held import SessionState
from baton_runtime.owner.rules.steps import safe_error


async def summarize(
    state: SessionState,
    events: list[s.Event],
    entry: s.InboxEntry | None,
    log: structlog.BoundLogger,
    clock: Callable[[], float],
) -> None:
    """Replace the context with the model's summary of it, appending the
    stream's events to `events`; `entry` is the compact command, or None
    when the owner compacts on its own. A failed model call fails the
    compaction, not the run: the context stays as it was. `clock`: the
    time the answer (or the failure) came, for the rules."""
    agent = state.agent
    before = state.context.size()
    try:
        reply = await agent.model.complete(
            agent.compaction_instructions, state.context.messages, ()
        )
    except Exception as exc:  # noqa: BLE001 - authored code
        log.warning("compaction failed", error=repr(exc), automatic=entry is None)
        turns.compaction_failed(state, events, entry, safe_error(exc), now=clock())
    else:
        turns.compacted(state, events, entry, reply, before, now=clock())


def log_over_budget(state: SessionState, log: structlog.BoundLogger) -> None:
    """Say why the owner compacts on its own: what the model sees outgrew
    the agent's context budget."""
    entries, size = state.context.size()
    log.info(
        "context over budget; compacting",
        entries=entries,
        bytes=size,
        budget_bytes=state.agent.context_budget_bytes,
        budget_entries=state.agent.context_budget_entries,
    )
