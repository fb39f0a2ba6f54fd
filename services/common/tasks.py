"""Background tasks a component owns: referenced until they end, cancelled
together when it closes."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


class Background:
    """The set of tasks one component started."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(
        self,
        coro: Coroutine[Any, Any, _T],
        *,
        fresh_context: bool = False,
        outcome_optional: bool = False,
    ) -> asyncio.Task[_T]:
        """Start `coro`. `fresh_context`: do not inherit the caller's
        contextvars (a task outliving the RPC that started it must not log
        under its request id). `outcome_optional`: nobody may await the
        result (its caller went away), so an exception is not reported as
        never retrieved."""
        context = contextvars.Context() if fresh_context else None
        task = asyncio.get_running_loop().create_task(coro, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if outcome_optional:
            task.add_done_callback(mark_retrieved)
        return task

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def mark_retrieved(future: asyncio.Future[Any]) -> None:
    """A done callback: the outcome was seen (by the caller, or by nobody on
    purpose)."""
    if not future.cancelled():
        future.exception()
