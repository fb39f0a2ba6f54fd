"""Config from flags and environment: flags win, env is the fallback, missing
required settings fail fast with a message naming both."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.channels import grpc_target


class ConfigError(ValueError):
    """A missing or invalid setting. The process exits with its message."""


@dataclass(frozen=True)
class Setting:
    flag: str
    env: str
    help: str
    default: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


LISTEN = "--listen"
COMMON_SETTINGS = (
    Setting("--log-level", "BATON_LOG_LEVEL", "debug|info|warning|error", "info"),
    Setting("--grace", "BATON_SHUTDOWN_GRACE", "graceful shutdown period, seconds", "5"),
)
ETCD_SETTINGS = (
    Setting(
        "--etcd",
        "BATON_ETCD_ENDPOINT",
        "etcd endpoint host:port, or every member's, comma-separated",
        "127.0.0.1:2379",
    ),
    Setting("--etcd-prefix", "BATON_ETCD_PREFIX", "root key prefix in etcd", "/baton/"),
    Setting("--etcd-timeout", "BATON_ETCD_TIMEOUT", "timeout of each etcd call, seconds", "5"),
)


def read_settings(
    prog: str,
    settings: Sequence[Setting],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Parse flags, fall back to env, then defaults; fail on what is missing."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog=prog)
    for s in settings:
        parser.add_argument(s.flag, dest=s.dest, help=f"{s.help} (env {s.env})")
    args = parser.parse_args(argv)
    values: dict[str, str] = {}
    for s in settings:
        value = getattr(args, s.dest)
        if value is None:
            value = environ.get(s.env, s.default)
        if value is None:
            raise ConfigError(f"{prog}: missing setting {s.flag} (or env {s.env}): {s.help}")
        values[s.dest] = value
    return values


def as_float(values: Mapping[str, str], key: str, *, minimum: float = 0.0) -> float:
    try:
        number = float(values[key])
    except ValueError as exc:
        raise ConfigError(f"{key} must be a number, got {values[key]!r}") from exc
    if number < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {number}")
    return number


def as_int(values: Mapping[str, str], key: str, *, minimum: int = 0) -> int:
    try:
        number = int(values[key])
    except ValueError as exc:
        raise ConfigError(f"{key} must be an integer, got {values[key]!r}") from exc
    if number < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {number}")
    return number


# The help of a setting that names the replicas of another service.
ADDRESSES_HELP = "host:port, several ip:port comma-separated, or dns:///name:port"


def as_addresses(values: Mapping[str, str], key: str) -> str:
    """An address setting (see `channels.grpc_target`), checked now so a
    bad one fails at startup."""
    try:
        grpc_target(values[key])
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from exc
    return values[key]


def as_prefix(value: str) -> str:
    if not value.startswith("/") or not value.endswith("/"):
        raise ConfigError(f"etcd prefix must start and end with '/', got {value!r}")
    return value


@dataclass(frozen=True)
class EtcdConfig:
    endpoint: str
    prefix: str
    timeout: float

    @classmethod
    def from_values(cls, values: Mapping[str, str]) -> EtcdConfig:
        # Not at the top: etcd.py imports aetcd, which ingress and owner never need.
        from services.common.etcd import etcd_target

        try:
            etcd_target(values["etcd"])
        except ValueError as exc:
            raise ConfigError(f"etcd: {exc}") from exc
        return cls(
            endpoint=values["etcd"],
            prefix=as_prefix(values["etcd_prefix"]),
            timeout=as_float(values, "etcd_timeout", minimum=0.1),
        )
