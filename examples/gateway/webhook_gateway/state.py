"""What the gateway keeps across restarts, in one JSON file written
atomically (a temporary file renamed over it): each conversation's callback
URL, and each session's cursor (the seq after the last event delivered to
the callback), so a restarted gateway neither re-posts nor skips."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class GatewayState:
    path: Path
    callbacks: dict[str, str] = field(default_factory=dict)  # session id -> callback URL
    cursors: dict[str, int] = field(default_factory=dict)  # session id -> next seq

    @classmethod
    def load(cls, path: Path) -> GatewayState:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return cls(path)
        return cls(path, dict(data.get("callbacks", {})), dict(data.get("cursors", {})))

    def save(self) -> None:
        data = {"callbacks": self.callbacks, "cursors": self.cursors}
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".gateway-state-")
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.path)
