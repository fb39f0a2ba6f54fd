"""Where and how the SDK reaches an ingress: `Settings`.

TLS by default: the CA bundle the ingress's certificate chains to (or the
system roots), optionally a client certificate and key (for an ingress
behind a proxy that wants one), and the channel's API key, sent as
`authorization: Bearer <key>` on every call. Plaintext must be asked for.

`Settings.from_profile()` reads what a running `baton up` wrote (its ingress
and CA) with the environment taking precedence, as the `baton` CLI does:
BATON_INGRESS_ADDR, BATON_TLS_CA, BATON_PLAINTEXT, BATON_API_KEY; the
profile is $BATON_PROFILE, else $XDG_CONFIG_HOME/baton/profile.json (default
~/.config/baton/profile.json). Without an API key it uses `baton up`'s
public loopback demo key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from baton_client.retry import RetryPolicy

DEFAULT_TARGET = "127.0.0.1:50051"
# `baton up`'s key: public, and granted only on loopback.
DEMO_API_KEY = "demo-key-0001-loopback-only"
DEFAULT_TIMEOUT = 10.0
# Bounds of one message: Baton's servers accept 4 MiB.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class SettingsError(ValueError):
    """Settings that cannot work (the message says which and why)."""


@dataclass(frozen=True)
class Settings:
    """Connection settings of a client."""

    #: host:port of an ingress, or any gRPC target (e.g. `dns:///ingress:443`,
    #: `ipv4:10.0.0.1:443,10.0.0.2:443` with `round_robin`).
    target: str = DEFAULT_TARGET
    #: The channel's API key.
    api_key: str = ""
    #: PEM file of the CA bundle to trust; empty: the system roots.
    ca_cert: str = ""
    #: PEM files of a client certificate and its key (both or neither).
    client_cert: str = ""
    client_key: str = ""
    #: The name to verify the server certificate as (default: the target's host).
    server_name: str = ""
    #: Talk without TLS (local development only).
    plaintext: bool = False
    #: Default deadline of every call, in seconds (a call's `timeout=` overrides it).
    timeout: float = DEFAULT_TIMEOUT
    #: Retries of unary calls.
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    #: Reconnects of a follower (its budget counts from its last progress).
    follow_retry: RetryPolicy = field(
        default_factory=lambda: RetryPolicy(max_attempts=10_000, max_backoff=2.0, budget=120.0)
    )
    #: Spread calls over every address of the target (`round_robin`).
    round_robin: bool = False

    def __post_init__(self) -> None:
        if not self.target:
            raise SettingsError("target is empty")
        if not self.api_key:
            raise SettingsError("api_key is empty (a channel's API key)")
        if bool(self.client_cert) != bool(self.client_key):
            raise SettingsError("give client_cert and client_key together")
        if self.plaintext and (self.ca_cert or self.client_cert):
            raise SettingsError("plaintext takes no certificates")
        if self.timeout <= 0:
            raise SettingsError("timeout must be positive")

    @classmethod
    def from_profile(
        cls,
        path: str | Path | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> Settings:
        """Settings from the environment, then `baton up`'s profile, then the
        defaults; keyword arguments override all three."""
        env = os.environ if environ is None else environ
        found = _read_profile(Path(path) if path else profile_path(env))
        explicit_tls = bool(env.get("BATON_TLS_CA")) or env.get("BATON_PLAINTEXT") in ("1", "true")
        values: dict[str, Any] = {
            "target": env.get("BATON_INGRESS_ADDR") or str(found.get("ingress") or DEFAULT_TARGET),
            "api_key": env.get("BATON_API_KEY") or DEMO_API_KEY,
            "ca_cert": env.get("BATON_TLS_CA")
            or ("" if explicit_tls else found.get("ca_cert", "")),
            "plaintext": env.get("BATON_PLAINTEXT") in ("1", "true")
            or (not explicit_tls and bool(found.get("plaintext"))),
        }
        values.update(overrides)
        return cls(**values)

    def channel_options(self) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Find a dead connection under an idle follow stream (Baton's
            # servers allow a ping every 5 s).
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # Reconnect quickly after an ingress restart.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2_000),
        ]
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        if self.round_robin:
            options.append(("grpc.lb_policy_name", "round_robin"))
        return options

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The channel credentials for TLS; None in plaintext."""
        if self.plaintext:
            return None
        root = _read(self.ca_cert, "CA certificate") if self.ca_cert else None
        cert = _read(self.client_cert, "client certificate") if self.client_cert else None
        key = _read(self.client_key, "client key") if self.client_key else None
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=cert
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),)

    def __repr__(self) -> str:  # never print the key
        return f"Settings(target={self.target!r}, plaintext={self.plaintext}, api_key=<hidden>)"


def profile_path(environ: Mapping[str, str]) -> Path:
    if environ.get("BATON_PROFILE"):
        return Path(environ["BATON_PROFILE"])
    config = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "baton" / "profile.json"


def _read_profile(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise SettingsError(f"cannot read the profile {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"the profile {path} is not a JSON object")
    return data


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SettingsError(f"cannot read the {what} {path}: {exc}") from exc
