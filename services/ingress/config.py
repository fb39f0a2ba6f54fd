"""ingress configuration. Refuses to start without an exact deployment id or
without API keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import (
    ADDRESSES_HELP,
    COMMON_SETTINGS,
    ConfigError,
    Setting,
    as_addresses,
    as_float,
    as_int,
    read_settings,
)
from services.common.errors import BatonError
from services.common.ids import validate_channel, validate_deployment_id


def parse_api_keys(spec: str) -> dict[str, str]:
    """`channel=key,channel=key` -> {key: channel}."""
    keys: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        channel, sep, key = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"API key entry {item!r} must be channel=key")
        try:
            validate_channel(channel)
        except BatonError as exc:
            raise ConfigError(exc.message) from exc
        if len(key) < 8:
            raise ConfigError(f"API key of channel {channel!r} is shorter than 8 characters")
        if key in keys:
            raise ConfigError(f"API key of channel {channel!r} is used by another channel")
        keys[key] = channel
    if not keys:
        raise ConfigError("at least one API key is required (BATON_API_KEYS=channel=key,...)")
    return keys


@dataclass(frozen=True)
class IngressConfig:
    listen: str
    deployment_id: str
    api_keys: dict[str, str]
    hooks: str
    anchor: str
    owner: str
    max_message_bytes: int = 32 * 1024
    log_level: str = "info"
    grace: float = 5.0

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> IngressConfig:
        values = read_settings(
            "services.ingress",
            (
                Setting(
                    "--listen", "BATON_INGRESS_LISTEN", "host:port to serve on", "127.0.0.1:50051"
                ),
                Setting(
                    "--deployment-id", "BATON_DEPLOYMENT_ID", "exact deployment id of this build"
                ),
                Setting("--api-keys", "BATON_API_KEYS", "channel=key[,channel=key...]"),
                Setting(
                    "--hooks", "BATON_HOOKS_ADDR", f"hooks: {ADDRESSES_HELP}", "127.0.0.1:50052"
                ),
                Setting(
                    "--anchor", "BATON_ANCHOR_ADDR", f"anchor: {ADDRESSES_HELP}", "127.0.0.1:50053"
                ),
                Setting(
                    "--owner",
                    "BATON_OWNER_ADDR",
                    f"owners of this deployment: {ADDRESSES_HELP}",
                    "127.0.0.1:50054",
                ),
                Setting(
                    "--max-message-bytes",
                    "BATON_MAX_MESSAGE_BYTES",
                    "largest message text",
                    "32768",
                ),
                *COMMON_SETTINGS,
            ),
            argv,
            environ,
        )
        try:
            deployment_id = validate_deployment_id(values["deployment_id"])
        except BatonError as exc:
            raise ConfigError(f"services.ingress: {exc.message}") from exc
        return cls(
            listen=values["listen"],
            deployment_id=deployment_id,
            api_keys=parse_api_keys(values["api_keys"]),
            hooks=as_addresses(values, "hooks"),
            anchor=as_addresses(values, "anchor"),
            owner=as_addresses(values, "owner"),
            max_message_bytes=as_int(values, "max_message_bytes", minimum=1),
            log_level=values["log_level"],
            grace=as_float(values, "grace"),
        )
