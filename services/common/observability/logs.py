"""structlog, configured once: JSON off a terminal, console on one; the trace
and span ids on every line written inside a span while tracing is on."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from baton_runtime.common.observability.tracing import log_trace_ids

MAX_LOGGED_CHARS = 512


def clip_values(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """No log line carries an oversize value a caller sent (a 20,000
    character id is logged as its prefix and length)."""
    for key, value in event.items():
        if isinstance(value, str) and len(value) > MAX_LOGGED_CHARS and key != "exception":
            event[key] = f"{value[:MAX_LOGGED_CHARS]}... ({len(value)} characters)"
    return event


def configure_logging(level: str = "info") -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer: Any
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer()
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            log_trace_ids,
            clip_values,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
