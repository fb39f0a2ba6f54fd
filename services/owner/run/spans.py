"""The owner's spans of one run (services/common/observability/tracing.py has the rest).

Processing inbox commands follows OpenTelemetry's messaging conventions: a
CONSUMER span `process inbox` per command the run takes from its inbox,
linked to the producer context stored with every command it consumes while
the span lasts — the one taken, and the steer messages, reports and
controls admitted at the turn's boundaries. The links come from the inbox
entries themselves, so they hold however the run got the session: after a
crash on another instance (the successor reads the same entries) or after a
handoff (the successor on the new deployment processes the trigger). Model
calls and tool calls (`model_call`, `tool_call`), commits (commit.py) and a
handoff attempt are child spans.

A step re-run after a crash in the middle of a turn links only the commands
it consumes itself: those the open turn consumed before were committed (and
their inbox entries deleted) with the predecessor's steps.

While tracing is off every method here is a plain block: no span, no
bookkeeping."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Protocol

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.observability.tracing import OFF, TRACING, link_to, span

if TYPE_CHECKING:
    from opentelemetry.trace import Span

# More would be dropped by the SDK's default link limit (128) anyway.
MAX_LINKS = 100


class _Held(Protocol):
    """What the spans read of the run's session (baton_runtime.owner.rules.held.SessionState)."""

    @property
    def snapshot(self) -> s.SessionSnapshot: ...

    @property
    def turn_id(self) -> str: ...


class RunSpans:
    """Spans of one run of `session_id`: remembers the producer context of
    every entry that arrived and was not consumed yet (as many as the run
    buffers), to link the span that consumes it."""

    def __init__(self, session_id: str, owner_run_id: str) -> None:
        self._session_id = session_id
        self._owner_run_id = owner_run_id
        self._producers: dict[int, str] = {}  # inbox seq -> traceparent

    def arrived(self, entry: s.InboxEntry) -> None:
        """An entry reached the run (buffered, not consumed yet)."""
        if TRACING.enabled and entry.command.delivery.traceparent:
            self._producers[entry.seq] = entry.command.delivery.traceparent

    def process(self, held: _Held, entry: s.InboxEntry | None) -> AbstractContextManager[None]:
        """Processing `entry` (None: continuing an open turn after a crash)
        and whatever it leads the run to consume."""
        if not TRACING.enabled:
            return OFF
        return self._process(held, entry)

    @contextmanager
    def _process(self, held: _Held, entry: s.InboxEntry | None) -> Iterator[None]:
        from opentelemetry.trace import SpanKind

        attributes: dict[str, str | int] = {
            "messaging.system": "baton",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": "inbox",
            "baton.session_id": self._session_id,
            "baton.owner_run_id": self._owner_run_id,
        }
        if entry is not None:
            attributes["baton.inbox_seq"] = entry.seq
            attributes["baton.command"] = entry.command.WhichOneof("kind") or ""
            if entry.command.delivery.delivery_id:
                attributes["messaging.message.id"] = entry.command.delivery.delivery_id
        with TRACING.tracer.start_as_current_span(
            "process inbox", kind=SpanKind.CONSUMER, attributes=attributes
        ) as current:
            try:
                yield
            finally:
                self._link_consumed(current, held)
                if held.turn_id:
                    current.set_attribute("baton.turn_id", held.turn_id)

    def _link_consumed(self, current: Span, held: _Held) -> None:
        """Link every remembered entry below the consumed position (the last
        MAX_LINKS of them), and forget them."""
        consumed = held.snapshot.inbox_next_seq
        done = sorted(seq for seq in self._producers if seq < consumed)
        for seq in done[-MAX_LINKS:]:
            link = link_to(self._producers[seq], **{"baton.inbox_seq": seq})
            if link is not None:
                current.add_link(link.context, link.attributes)
        for seq in done:
            del self._producers[seq]
        current.set_attribute("messaging.batch.message_count", len(done))

    def handoff(
        self, entry: s.InboxEntry | None, to_deployment_id: str
    ) -> AbstractContextManager[object]:
        """An attempt to move the session (for the trigger `entry`, or a drain)."""
        if not TRACING.enabled:
            return OFF
        links = []
        if entry is not None:
            link = link_to(entry.command.delivery.traceparent)
            if link is not None:
                links.append(link)
        return TRACING.tracer.start_as_current_span(
            "handoff",
            links=links,
            attributes={
                "baton.session_id": self._session_id,
                "baton.owner_run_id": self._owner_run_id,
                "baton.to_deployment_id": to_deployment_id,
            },
        )


def model_call() -> AbstractContextManager[object]:
    """A model call (GenAI conventions: `chat`); the adapter may add the
    model and usage to it (`tracing.annotate`)."""
    if not TRACING.enabled:
        return OFF
    return span("chat", **{"gen_ai.operation.name": "chat"})


def tool_call(call: s.ToolCall) -> AbstractContextManager[object]:
    """An inline tool call (GenAI conventions: `execute_tool <name>`)."""
    if not TRACING.enabled:
        return OFF
    return span(
        f"execute_tool {call.name}",
        **{
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id,
        },
    )
