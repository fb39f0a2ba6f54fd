"""owner configuration: flags, then env, then defaults. The deployment id is
required and exact (`latest` is refused)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import COMMON_SETTINGS, ConfigError, Setting, as_float, read_settings
from services.common.errors import BatonError
from services.common.ids import validate_deployment_id

DEFAULT_AGENT = "services.owner.fixture:build_agent"


@dataclass(frozen=True)
class OwnerConfig:
    listen: str
    deployment_id: str
    instance_id: str
    hooks: str
    anchor: str
    agent: str = DEFAULT_AGENT
    log_level: str = "info"
    grace: float = 5.0

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> OwnerConfig:
        values = read_settings(
            "services.owner",
            (
                Setting(
                    "--listen", "BATON_OWNER_LISTEN", "host:port to serve on", "127.0.0.1:50054"
                ),
                Setting(
                    "--deployment-id", "BATON_DEPLOYMENT_ID", "exact deployment id of this build"
                ),
                Setting("--instance-id", "BATON_INSTANCE_ID", "this instance's id", ""),
                Setting("--hooks", "BATON_HOOKS_ADDR", "hooks host:port", "127.0.0.1:50052"),
                Setting("--anchor", "BATON_ANCHOR_ADDR", "anchor host:port", "127.0.0.1:50053"),
                Setting("--agent", "BATON_AGENT", "agent factory module:function", DEFAULT_AGENT),
                *COMMON_SETTINGS,
            ),
            argv,
            environ,
        )
        try:
            deployment_id = validate_deployment_id(values["deployment_id"])
        except BatonError as exc:
            raise ConfigError(f"services.owner: {exc.message}") from exc
        return cls(
            listen=values["listen"],
            deployment_id=deployment_id,
            instance_id=values["instance_id"] or f"{socket.gethostname()}-{os.getpid()}",
            hooks=values["hooks"],
            anchor=values["anchor"],
            agent=values["agent"],
            log_level=values["log_level"],
            grace=as_float(values, "grace"),
        )
