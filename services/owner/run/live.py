"""A running step's live items (docs/design.md "Live items"): what the
owner sends anchor while the step runs, beside the commit that will
supersede it.

The turn's and the step's start go out at once; model deltas (text, a tool
call's arguments) are coalesced, sent every LIVE_COALESCE_SECONDS or at
LIVE_MAX_TEXT_BYTES, whichever comes first; a tool's progress reports are
cut to LIVE_PROGRESS_BYTES and limited to LIVE_PROGRESS_PER_SECOND per
call (more are dropped). Sending never waits (`publish` queues: services/
common/clients/live.py), so a slow follower or anchor never slows the step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits
from baton_runtime.owner.agents.api import ModelDelta, TextDelta
from baton_runtime.owner.rules.held import timestamp

Publish = Callable[[s.LiveBatch], None]


def utf8_prefix(text: str, limit: int) -> tuple[str, str]:
    """`text` split after at most `limit` bytes of UTF-8, on a character
    boundary (at least one character when there is one)."""
    raw = text.encode()
    if len(raw) <= limit:
        return text, ""
    cut = limit
    while cut > 0 and (raw[cut] & 0xC0) == 0x80:
        cut -= 1
    head = raw[:cut].decode() or text[:1]
    return head, text[len(head) :]


class StepLive:
    """One step run's live items, in offset order, to `publish`."""

    def __init__(
        self, step: s.LiveStep, publish: Publish, clock: Callable[[], float] = time.time
    ) -> None:
        self.step = step
        self._publish = publish
        self._clock = clock
        self._offset = 0
        self._items: list[s.LiveItem] = []
        # The delta being coalesced: its kind and call, and its text so far.
        self._open: s.LiveItem | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reports: dict[str, list[float]] = {}  # a call's recent progress times
        self._closed = False

    def started(self, turn_started: bool) -> None:
        """The step (and, with `turn_started`, its turn) started: sent at once."""
        if turn_started:
            self._add(s.LiveItem(kind=s.LIVE_KIND_TURN_STARTED))
        self._add(s.LiveItem(kind=s.LIVE_KIND_STEP_STARTED))
        self.flush()

    def delta(self, delta: ModelDelta) -> None:
        """A model delta, coalesced with those before it of the same kind and call."""
        if self._closed:
            return
        if isinstance(delta, TextDelta):
            kind, index, name, text = s.LIVE_KIND_TEXT, 0, "", delta.text
        else:
            kind, index, name, text = (
                s.LIVE_KIND_TOOL_CALL,
                delta.index,
                delta.name,
                delta.arguments,
            )
        current = self._open
        if current is None or current.kind != kind or current.tool_call_index != index:
            self._close_open()
            current = self._open = s.LiveItem(kind=kind, tool_call_index=index)
        if name and not current.tool_name:
            current.tool_name = name[:128]
        current.text += text
        while len(current.text.encode()) >= limits.LIVE_MAX_TEXT_BYTES:
            head, rest = utf8_prefix(current.text, limits.LIVE_MAX_TEXT_BYTES)
            current.text = head
            self._close_open()
            current = self._open = s.LiveItem(
                kind=kind, tool_call_index=index, tool_name=current.tool_name, text=rest
            )
        if len(self._items) >= limits.LIVE_MAX_ITEMS_PER_BATCH:
            self.flush()
        self._arm()

    def progress(self, tool_call_id: str, tool_name: str, text: str) -> None:
        """A tool's progress report (bounded; over the rate: dropped)."""
        if self._closed:
            return
        now = time.monotonic()
        recent = [t for t in self._reports.get(tool_call_id, []) if now - t < 1.0]
        if len(recent) >= limits.LIVE_PROGRESS_PER_SECOND:
            return
        recent.append(now)
        self._reports[tool_call_id] = recent
        self._close_open()
        head, _ = utf8_prefix(str(text), limits.LIVE_PROGRESS_BYTES)
        self._add(
            s.LiveItem(
                kind=s.LIVE_KIND_TOOL_PROGRESS,
                tool_call_id=tool_call_id[:128],
                tool_name=tool_name[:128],
                text=head,
            )
        )
        self._arm()

    def flush(self) -> None:
        """Send what is pending (the delta being coalesced too)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._close_open()
        items, self._items = self._items, []
        for start in range(0, len(items), limits.LIVE_MAX_ITEMS_PER_BATCH):
            chunk = items[start : start + limits.LIVE_MAX_ITEMS_PER_BATCH]
            self._publish(s.LiveBatch(step=self.step, items=chunk))

    def close(self) -> None:
        """The step ended: send what is left; nothing after."""
        if not self._closed:
            self.flush()
            self._closed = True

    def _add(self, item: s.LiveItem) -> None:
        item.offset = self._offset
        item.time.CopyFrom(timestamp(self._clock()))
        self._offset += 1
        self._items.append(item)

    def _close_open(self) -> None:
        if self._open is not None:
            if self._open.text or self._open.tool_name:
                self._add(self._open)
            self._open = None

    def _arm(self) -> None:
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(limits.LIVE_COALESCE_SECONDS, self.flush)
