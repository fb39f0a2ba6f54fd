"""hooks configuration: flags, then env, then defaults."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import Setting, StoreServiceConfig


@dataclass(frozen=True)
class HooksConfig(StoreServiceConfig):
    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> HooksConfig:
        listen = Setting(
            "--listen", "BATON_HOOKS_LISTEN", "host:port to serve on", "127.0.0.1:50052"
        )
        shared, _ = cls.read("services.hooks", listen, (), argv, environ)
        return cls(**shared)
