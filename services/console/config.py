"""The console's settings (`python -m baton_runtime.console`): where it
listens, where hooks, anchor and each deployment's ingress are, and the
operator identity it calls them with.

Secrets never come from argv: the console token (BATON_CONSOLE_TOKEN) and
the API key its cancel and reset use (BATON_API_KEY) are read from the
environment only, as the CLI reads its key.

Listening on anything but a loopback address needs both `--allow-remote`
and a console token: a caller that is not on loopback must then present
the token (docs/console.md, security).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from baton_runtime.common.config import (
    ADDRESSES_HELP,
    TLS_SETTINGS,
    ConfigError,
    Setting,
    as_addresses,
    as_switch,
    read_settings,
    security_from_values,
)
from baton_runtime.common.errors import BatonError
from baton_runtime.common.ids import validate_deployment_id
from baton_runtime.common.security.tls import Security

PROG = "baton_runtime.console"
MIN_TOKEN_LENGTH = 16

_SETTINGS = (
    Setting("--listen", "BATON_CONSOLE_LISTEN", "host:port to serve HTTP on", "127.0.0.1:50150"),
    Setting(
        "--allow-remote",
        "BATON_CONSOLE_ALLOW_REMOTE",
        "listen on a non-loopback address (needs BATON_CONSOLE_TOKEN; callers that are not "
        "on loopback must present it)",
        "0",
        switch=True,
    ),
    Setting("--hooks", "BATON_HOOKS_ADDR", f"hooks: {ADDRESSES_HELP}", "127.0.0.1:50052"),
    Setting("--anchor", "BATON_ANCHOR_ADDR", f"anchor: {ADDRESSES_HELP}", "127.0.0.1:50053"),
    Setting(
        "--ingresses",
        "BATON_CONSOLE_INGRESSES",
        "each deployment's public ingress, DEP=host:port comma-separated (cancel and reset "
        "go through the session's deployment's ingress with BATON_API_KEY); empty: none",
        "",
    ),
    Setting("--log-level", "BATON_LOG_LEVEL", "debug|info|warning|error", "info"),
    *TLS_SETTINGS,
)


def _ingresses(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        deployment_id, equals, address = part.partition("=")
        if not equals or not address:
            raise ConfigError(f"--ingresses: {part!r} is not DEP=host:port")
        try:
            found[validate_deployment_id(deployment_id)] = address
        except BatonError as exc:
            raise ConfigError(f"--ingresses: {exc.message}") from exc
    return found


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_listen(listen: str) -> tuple[str, int]:
    host, colon, port = listen.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--listen must be host:port, got {listen!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ConsoleConfig:
    listen: str = "127.0.0.1:50150"
    hooks: str = "127.0.0.1:50052"
    anchor: str = "127.0.0.1:50053"
    # The operator identity every call to hooks, anchor and owners presents.
    security: Security = field(default_factory=Security.plaintext)
    # Each deployment's public ingress (cancel and reset), and the API key
    # they are sent with ("": those two actions are refused).
    ingresses: Mapping[str, str] = field(default_factory=dict)
    api_key: str = ""
    # The CA the ingresses' certificates chain to ("" with plaintext).
    ca_cert: str = ""
    # Callers that are not on loopback present it ("": only loopback callers).
    token: str = ""
    allow_remote: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        host, _ = split_listen(self.listen)
        if not is_loopback_host(host):
            if not self.allow_remote:
                raise ConfigError(
                    f"{PROG}: {self.listen} is not a loopback address: pass --allow-remote "
                    "(BATON_CONSOLE_ALLOW_REMOTE=1) and a console token (BATON_CONSOLE_TOKEN)"
                )
            if len(self.token) < MIN_TOKEN_LENGTH:
                raise ConfigError(
                    f"{PROG}: listening on {self.listen} needs a console token of at least "
                    f"{MIN_TOKEN_LENGTH} characters in BATON_CONSOLE_TOKEN"
                )

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> ConsoleConfig:
        env = os.environ if environ is None else environ
        values = read_settings(PROG, _SETTINGS, argv, env)
        security = security_from_values(values)
        return cls(
            listen=values["listen"],
            hooks=as_addresses(values, "hooks"),
            anchor=as_addresses(values, "anchor"),
            security=security,
            ingresses=_ingresses(values["ingresses"]),
            api_key=env.get("BATON_API_KEY", ""),
            ca_cert=security.files.ca if security.files is not None else "",
            token=env.get("BATON_CONSOLE_TOKEN", ""),
            allow_remote=as_switch(values, "allow_remote"),
            log_level=values["log_level"],
        )
