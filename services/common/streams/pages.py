"""Pages of a stream bounded in bytes (docs/design.md §16).

An inbox page (StreamInbox, FollowInboxes) and an event page (ReadEvents,
FollowEvents, StreamEvents) each travel in one gRPC message, and a feed's
message may carry the pages of several follows. gRPC refuses to send a
message over its limit (4 MiB) and fails the whole call with it: on a feed,
every follow of every session riding it. So a page holds entries while
their bytes stay within `limits.MAX_PAGE_BYTES`; an entry over it goes
alone (none is: entries are bounded far below, `limits.MAX_EVENT_BYTES`
and `limits.MAX_COMMAND_BYTES`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from baton_runtime.common.limits import MAX_PAGE_BYTES

_T = TypeVar("_T")

# What an entry costs in its message beyond its own bytes: the repeated
# field's tag and the length (1 + at most 5 bytes).
ENTRY_FRAMING = 6


def byte_pages(sized: Iterable[tuple[int, _T]], limit: int = MAX_PAGE_BYTES) -> Iterator[list[_T]]:
    """The entries of `sized` ((serialized bytes, entry) pairs, in order) in
    pages of at most `limit` bytes with their framing; a single entry over
    `limit` is a page of its own."""
    page: list[_T] = []
    used = 0
    for size, entry in sized:
        cost = size + ENTRY_FRAMING
        if page and used + cost > limit:
            yield page
            page, used = [], 0
        page.append(entry)
        used += cost
    if page:
        yield page
