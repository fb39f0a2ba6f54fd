"""Ranges of the numbers Baton accepts, checked before anything is written.

Every number a caller may send has a range: timeouts and budgets are
bounded so that derived values (a deadline timestamp, a budget extended by
what was used) stay representable; sequence numbers and revisions are
bounded by what a session can reach (etcd revisions are int64).
"""

from __future__ import annotations

from baton_runtime.common.errors import InvalidArgument, Reason

# Ten years: a deadline computed from it is a valid timestamp for centuries.
MAX_TIMEOUT_SECONDS = 10 * 366 * 24 * 3600
# A quadrillion tokens: far beyond any budget, far below uint64 overflow
# when a used count is added on top.
MAX_TOKEN_BUDGET = 10**15
# Stream/inbox seqs and etcd revisions (int64 in etcd; JSON-safe here).
MAX_SEQ = 2**53
# 9999-12-31T23:59:59Z: the last second a google.protobuf.Timestamp holds.
MAX_TIMESTAMP_SECONDS = 253_402_300_799
# Entries one hooks listing page holds at most (ListInstanceSessions,
# ListChannelSessions): a page answer stays far below the 4 MiB limit.
MAX_LISTING_PAGE = 1000


def check_range(value: int, field: str, maximum: int, minimum: int = 0) -> int:
    if not minimum <= value <= maximum:
        raise InvalidArgument(
            Reason.INVALID_FIELD,
            f"{field} must be between {minimum} and {maximum}",
            field=field,
        )
    return value


def check_session_settings(timeout_seconds: int, token_budget: int) -> None:
    check_range(timeout_seconds, "timeout_seconds", MAX_TIMEOUT_SECONDS)
    check_range(token_budget, "token_budget", MAX_TOKEN_BUDGET)


def check_seq(value: int, field: str) -> int:
    return check_range(value, field, MAX_SEQ)
