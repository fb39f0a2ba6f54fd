"""Keys with work in flight, counted: the same key may be in flight twice
(two creations racing, a transfer replayed), and it stays in flight until
the last of them ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class InFlight:
    """`key in inflight` while some `with inflight.hold(key):` runs."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        return len(self._counts)

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        self._counts[key] = self._counts.get(key, 0) + 1
        try:
            yield
        finally:
            self._counts[key] -= 1
            if not self._counts[key]:
                del self._counts[key]
