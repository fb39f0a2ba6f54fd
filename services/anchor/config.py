"""anchor configuration: flags, then env, then defaults."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import Setting, StoreServiceConfig, as_float

WEEK = 7 * 24 * 3600


@dataclass(frozen=True)
class AnchorConfig(StoreServiceConfig):
    retention_seconds: float = float(WEEK)
    retention_sweep_seconds: float = 30.0

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> AnchorConfig:
        listen = Setting(
            "--listen", "BATON_ANCHOR_LISTEN", "host:port to serve on", "127.0.0.1:50053"
        )
        retention = (
            Setting(
                "--finalized-retention",
                "BATON_FINALIZED_RETENTION",
                "seconds a finalized session's keys are kept before they are deleted",
                str(WEEK),
            ),
            Setting(
                "--retention-sweep",
                "BATON_RETENTION_SWEEP",
                "seconds between sweeps of the retention index",
                "30",
            ),
        )
        shared, values = cls.read("services.anchor", listen, retention, argv, environ)
        return cls(
            **shared,
            retention_seconds=as_float(values, "finalized_retention"),
            retention_sweep_seconds=as_float(values, "retention_sweep", minimum=0.05),
        )
