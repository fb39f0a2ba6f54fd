"""hooks configuration: flags, then env, then defaults."""

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
class HooksConfig:
    listen: str
    etcd: EtcdConfig
    tls: Security
    log_level: str = "info"
    grace: float = 5.0
    capacity: Capacity = Capacity()
    # A plaintext listener serving only health (probes without TLS); empty: none.
    health_listen: str = ""

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> HooksConfig:
        values = read_settings(
            "services.hooks",
            (
                Setting(
                    "--listen", "BATON_HOOKS_LISTEN", "host:port to serve on", "127.0.0.1:50052"
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
            capacity=Capacity.from_values(values),
            health_listen=values["health_listen"],
        )
