"""anchor configuration: flags, then env, then defaults."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import (
    COMMON_SETTINGS,
    ETCD_SETTINGS,
    Capacity,
    EtcdConfig,
    Setting,
    as_float,
    read_settings,
    security_from_values,
)
from services.common.tls import Security


@dataclass(frozen=True)
class AnchorConfig:
    listen: str
    etcd: EtcdConfig
    tls: Security
    log_level: str = "info"
    grace: float = 5.0
    retention_seconds: float = 7 * 24 * 3600.0
    retention_sweep_seconds: float = 30.0
    capacity: Capacity = Capacity()
    # A plaintext listener serving only health (probes without TLS); empty: none.
    health_listen: str = ""

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> AnchorConfig:
        values = read_settings(
            "services.anchor",
            (
                Setting(
                    "--listen", "BATON_ANCHOR_LISTEN", "host:port to serve on", "127.0.0.1:50053"
                ),
                Setting(
                    "--finalized-retention",
                    "BATON_FINALIZED_RETENTION",
                    "seconds a finalized session's keys are kept before they are deleted",
                    str(7 * 24 * 3600),
                ),
                Setting(
                    "--retention-sweep",
                    "BATON_RETENTION_SWEEP",
                    "seconds between sweeps of the retention index",
                    "30",
                ),
                *ETCD_SETTINGS,
                *COMMON_SETTINGS,
            ),
            argv,
            environ,
        )
        tls = security_from_values(values)
        return cls(
            listen=values["listen"],
            etcd=EtcdConfig.from_values(values, tls),
            tls=tls,
            log_level=values["log_level"],
            grace=as_float(values, "grace"),
            retention_seconds=as_float(values, "finalized_retention"),
            retention_sweep_seconds=as_float(values, "retention_sweep", minimum=0.05),
            capacity=Capacity.from_values(values),
            health_listen=values["health_listen"],
        )
