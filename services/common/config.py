"""Config from flags and environment: flags win, env is the fallback, missing
required settings fail fast with a message naming both."""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from baton_runtime.common.security.tls import DEFAULT_CHECK_SECONDS, Security


class ConfigError(ValueError):
    """A missing or invalid setting. The process exits with its message."""


@dataclass(frozen=True)
class Setting:
    flag: str
    env: str
    help: str
    default: str | None = None
    # A flag without a value (its presence means "1"); env takes 1/0.
    switch: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


LISTEN = "--listen"
TLS_SETTINGS = (
    Setting(
        "--tls-cert",
        "BATON_TLS_CERT",
        "PEM certificate of this process, naming its role in a spiffe://baton/ URI SAN",
        "",
    ),
    Setting("--tls-key", "BATON_TLS_KEY", "PEM private key of --tls-cert", ""),
    Setting("--tls-ca", "BATON_TLS_CA", "PEM CA bundle that peers' certificates must chain to", ""),
    Setting(
        "--plaintext",
        "BATON_PLAINTEXT",
        "no TLS: local development only; binds loopback addresses only",
        "0",
        switch=True,
    ),
    Setting(
        "--tls-ip-server-name",
        "BATON_TLS_IP_SERVER_NAME",
        "name that servers dialled by IP address (other deployments' owners, at the address "
        "they registered) are verified against; their certificates carry it (default: the IP)",
        "",
    ),
    Setting(
        "--tls-reload-seconds",
        "BATON_TLS_RELOAD_SECONDS",
        "how often clients check the certificate files for a rotation (SIGHUP: at once)",
        str(int(DEFAULT_CHECK_SECONDS)),
    ),
)
CAPACITY_SETTINGS = (
    Setting(
        "--max-concurrent-rpcs",
        "BATON_MAX_CONCURRENT_RPCS",
        "unary calls served at once; more get RESOURCE_EXHAUSTED with retry info",
        "2000",
    ),
    Setting(
        "--max-concurrent-streams",
        "BATON_MAX_CONCURRENT_STREAMS",
        "server streams open at once; more get RESOURCE_EXHAUSTED with retry info",
        "100000",
    ),
)
COMMON_SETTINGS = (
    Setting("--log-level", "BATON_LOG_LEVEL", "debug|info|warning|error", "info"),
    Setting(
        "--health-listen",
        "BATON_HEALTH_LISTEN",
        "host:port of a plaintext listener serving only grpc.health.v1, for probes that "
        "cannot speak TLS (Kubernetes' gRPC probes); empty: none",
        "",
    ),
    Setting(
        "--metrics-listen",
        "BATON_METRICS_LISTEN",
        "host:port of a plaintext HTTP listener serving Prometheus metrics at /metrics "
        "(e.g. 127.0.0.1:9102; 0.0.0.0:9102 where a scraper must reach it); empty: none",
        "",
    ),
    Setting("--grace", "BATON_SHUTDOWN_GRACE", "graceful shutdown period, seconds", "5"),
    *TLS_SETTINGS,
    *CAPACITY_SETTINGS,
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
    Setting(
        "--etcd-cert",
        "BATON_ETCD_CERT",
        "client certificate for etcd; its CN is the etcd user (default --tls-cert)",
        "",
    ),
    Setting("--etcd-key", "BATON_ETCD_KEY", "key of --etcd-cert (default --tls-key)", ""),
    Setting("--etcd-ca", "BATON_ETCD_CA", "CA bundle of etcd's certificate (default --tls-ca)", ""),
    Setting(
        "--etcd-plaintext",
        "BATON_ETCD_PLAINTEXT",
        "reach etcd without TLS (implied by --plaintext unless --etcd-ca is set)",
        "0",
        switch=True,
    ),
    Setting(
        "--etcd-group-commit",
        "BATON_ETCD_GROUP_COMMIT",
        "write requests to etcd in flight at once before the next writes wait and ride one "
        "request together as nested transactions (docs/design.md §10); 0: each its own request",
        "1",
    ),
    Setting(
        "--accept-etcd-risk",
        "BATON_ACCEPT_ETCD_RISK",
        "start even if an etcd member runs a known-bad release (docs/etcd.md); without it "
        "the service refuses to start, saying why and what to install",
        "0",
        switch=True,
    ),
)


@dataclass(frozen=True)
class Capacity:
    """Calls a server runs at once; more are refused with RESOURCE_EXHAUSTED
    and RetryInfo (nothing is accepted). Unary calls and server streams are
    counted apart: a hooks server holds one inbox stream per live session.

    Methods in `unmetered` (full paths) are never refused for capacity:
    hooks serves an owner's lease keep-alive however busy it is, so an
    overload of hooks (a gateway burst through every ingress) never costs
    an owner its lease.

    (Not grpc.aio's `maximum_concurrent_rpcs`: its limiter lets every call
    through after the first refusals, grpc/grpc#41531, and its refusal has
    no reason or retry info.)"""

    max_unary: int = 2000
    max_streams: int = 100_000
    retry_after: float = 0.1
    unmetered: frozenset[str] = frozenset()

    @classmethod
    def from_values(cls, values: Mapping[str, str]) -> Capacity:
        return cls(
            max_unary=as_int(values, "max_concurrent_rpcs", minimum=1),
            max_streams=as_int(values, "max_concurrent_streams", minimum=1),
        )


def as_switch(values: Mapping[str, str], key: str) -> bool:
    value = values[key].strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{key} must be 1 or 0, got {values[key]!r}")


def security_from_values(values: Mapping[str, str]) -> Security:
    """TLS from the three files, or plaintext when explicitly asked for;
    anything else fails fast."""
    files = (values["tls_cert"], values["tls_key"], values["tls_ca"])
    check = as_float(values, "tls_reload_seconds", minimum=0.1)
    if as_switch(values, "plaintext"):
        if any(files) or values["tls_ip_server_name"]:
            raise ConfigError(
                "--plaintext and --tls-cert/--tls-key/--tls-ca/--tls-ip-server-name exclude "
                "each other"
            )
        return Security.plaintext()
    if not all(files):
        raise ConfigError(
            "TLS needs --tls-cert, --tls-key and --tls-ca (env BATON_TLS_CERT, BATON_TLS_KEY, "
            "BATON_TLS_CA); for local development without TLS pass --plaintext "
            "(BATON_PLAINTEXT=1)"
        )
    return Security.tls(*files, check_every=check, ip_server_name=values["tls_ip_server_name"])


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
        if s.switch:
            parser.add_argument(
                s.flag, dest=s.dest, action="store_const", const="1", help=f"{s.help} (env {s.env})"
            )
        else:
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


def as_int(
    values: Mapping[str, str], key: str, *, minimum: int = 0, maximum: int | None = None
) -> int:
    try:
        number = int(values[key])
    except ValueError as exc:
        raise ConfigError(f"{key} must be an integer, got {values[key]!r}") from exc
    if number < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{key} must be <= {maximum}, got {number}")
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


def as_listen(values: Mapping[str, str], key: str) -> str:
    """An optional `host:port` to listen on ("" = none), checked at startup."""
    value = values[key].strip()
    if not value:
        return ""
    host, colon, port = value.rpartition(":")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{key} must be host:port (or empty), got {value!r}")
    return value


def as_prefix(value: str) -> str:
    if not value.startswith("/") or not value.endswith("/"):
        raise ConfigError(f"etcd prefix must start and end with '/', got {value!r}")
    return value


@dataclass(frozen=True)
class EtcdConfig:
    endpoint: str
    prefix: str
    timeout: float
    # TLS to etcd with a client certificate (its CN is the etcd user), or
    # plaintext.
    security: Security
    # Run on members whose release is known-bad (services/common/etcd/releases.py).
    accept_risk: bool = False
    # Write requests in flight before the next writes are grouped; 0: never.
    group_commit: int = 1

    @classmethod
    def from_values(cls, values: Mapping[str, str], service: Security) -> EtcdConfig:
        """etcd's TLS defaults to the service's own identity; plaintext only
        with --etcd-plaintext, or with --plaintext and no --etcd-ca."""
        # Not at the top: etcd_client.py imports aetcd, which ingress and owner never need.
        from baton_runtime.common.etcd.client import etcd_target

        try:
            etcd_target(values["etcd"])
        except ValueError as exc:
            raise ConfigError(f"etcd: {exc}") from exc
        ca = values["etcd_ca"] or (service.files.ca if service.files else "")
        if as_switch(values, "etcd_plaintext") or not ca:
            security = Security.plaintext()
        else:
            cert = values["etcd_cert"] or (service.files.cert if service.files else "")
            key = values["etcd_key"] or (service.files.key if service.files else "")
            if not cert or not key:
                raise ConfigError("etcd TLS needs --etcd-cert and --etcd-key (or --tls-cert/key)")
            security = Security.tls(cert, key, ca)
        return cls(
            endpoint=values["etcd"],
            prefix=as_prefix(values["etcd_prefix"]),
            timeout=as_float(values, "etcd_timeout", minimum=0.1),
            security=security,
            accept_risk=as_switch(values, "accept_etcd_risk"),
            group_commit=as_int(values, "etcd_group_commit", minimum=0, maximum=64),
        )


@dataclass(frozen=True)
class StoreServiceConfig:
    """What hooks and anchor, etcd's two front doors, are configured with
    alike: a listen address, etcd, TLS, logging, shutdown grace, capacity and
    the plaintext health listener. Each adds its own settings on top."""

    listen: str
    etcd: EtcdConfig
    tls: Security
    log_level: str = "info"
    grace: float = 5.0
    capacity: Capacity = Capacity()
    # A plaintext listener serving only health (probes without TLS); empty: none.
    health_listen: str = ""
    # A plaintext HTTP listener serving Prometheus metrics; empty: none.
    metrics_listen: str = ""

    @staticmethod
    def read(
        module: str,
        listen: Setting,
        extra: Sequence[Setting],
        argv: Sequence[str] | None,
        environ: Mapping[str, str] | None,
    ) -> tuple[dict[str, Any], Mapping[str, str]]:
        """The shared fields (as keyword arguments) and every value read."""
        values = read_settings(
            module, (listen, *extra, *ETCD_SETTINGS, *COMMON_SETTINGS), argv, environ
        )
        tls = security_from_values(values)
        shared: dict[str, Any] = {
            "listen": values["listen"],
            "etcd": EtcdConfig.from_values(values, tls),
            "tls": tls,
            "log_level": values["log_level"],
            "grace": as_float(values, "grace"),
            "capacity": Capacity.from_values(values),
            "health_listen": values["health_listen"],
            "metrics_listen": as_listen(values, "metrics_listen"),
        }
        return shared, values


_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")


def grpc_target(addresses: str) -> str:
    """The gRPC target for an address setting.

    `host:port` is used as is (gRPC resolves a name through DNS). Several
    addresses separated by commas must be IP literals (`127.0.0.1:50052`,
    `[::1]:50052`; `localhost` means 127.0.0.1): they become one `ipv4:` or
    `ipv6:` target. A target with a scheme (`dns:///name:port`) is used as
    is. Raises ValueError for anything else.
    """
    parts = [part.strip() for part in addresses.split(",") if part.strip()]
    if not parts:
        raise ValueError("no address given")
    if len(parts) == 1 and (parts[0].startswith(_SCHEMES) or "://" in parts[0]):
        return parts[0]
    families = set()
    hosts_ports = []
    for part in parts:
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address {part!r} must be host:port")
        if len(parts) == 1:
            return part
        if host == "localhost":
            host = "127.0.0.1"
        try:
            ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        except ValueError as exc:
            raise ValueError(
                f"address {part!r}: several addresses must be IP literals; "
                "for a name with several replicas use dns:///name:port"
            ) from exc
        families.add(ip.version)
        hosts_ports.append(f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")
    if len(families) > 1:
        raise ValueError(f"addresses {addresses!r} mix IPv4 and IPv6")
    scheme = "ipv6" if families == {6} else "ipv4"
    return f"{scheme}:{','.join(hosts_ports)}"
