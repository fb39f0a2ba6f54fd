"""Client channels between Baton services: TLS with this process's identity
(services/common/security/tls.py), keepalive, bounded calls, and round-robin over
every replica of the callee with retries of idempotent calls.

An address setting names one or more replicas (`grpc_target`): `host:port`;
several `ip:port` separated by commas; or any gRPC target with a scheme, such
as `dns:///hooks.baton.svc:50052` (every A record of a headless Service). The
channel balances calls round-robin over the resolved addresses that accept
connections; a replica shutting down sends GOAWAY and takes no new calls.
Methods the caller declares idempotent are retried on UNAVAILABLE by gRPC
itself (on the next replica, with backoff, inside the call's deadline).

No client-side health checking: hooks and anchor report NOT_SERVING while
etcd is unreachable or full (services/common/etcd/health.py), which is true
of every replica at once, and a client that skipped them all would answer
"no healthy backend" instead of the replica's own reason (STORE_FULL). A
replica whose etcd alone is unreachable answers UNAVAILABLE, and the
idempotent call is retried on another one; readiness probes take it out of
a Kubernetes Service.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable

import grpc

from baton_runtime.common.security.tls import Security, open_secure_channel

DEFAULT_CALL_TIMEOUT = 10.0

_OPTIONS = [
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    # A replica that went away is tried again soon (the default backoff
    # starts at 1 s and grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
]

# gRPC retries a call only while no response has reached the caller, and
# only on these codes. UNAVAILABLE: the call reached no replica (no
# connection, a replica shutting down), or the replica could not finish it
# (baton_runtime.common.errors.Unavailable, e.g. its etcd unreachable) — then a
# write's outcome may be unknown, which is why only idempotent methods retry.
_RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
# No retryThrottling: gRPC's token bucket (measured with grpcio 1.85) ran dry
# with one failing replica among healthy ones even though every retry
# succeeded, and then let half the calls fail. Four attempts with backoff,
# inside the call's deadline, bound the extra load instead.

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


def service_config(service: str, idempotent: Iterable[str] = ()) -> str:
    """Round-robin, and a retry policy for the `idempotent` methods of
    `service` (its full proto name)."""
    config: dict[str, object] = {"loadBalancingConfig": [{"round_robin": {}}]}
    methods = [{"service": service, "method": m} for m in sorted(idempotent)]
    if methods:
        config["methodConfig"] = [{"name": methods, "retryPolicy": _RETRY_POLICY}]
    return json.dumps(config)


def open_channel(
    addresses: str, security: Security, service: str = "", idempotent: Iterable[str] = ()
) -> grpc.aio.Channel:
    """A channel to every replica `addresses` names (see `grpc_target`) with
    this process's identity (TLS, following certificate rotations; plaintext
    when so configured); with `service`, balanced and retried as
    `service_config` says. With TLS, each replica's certificate must name the
    host the target names (for `ip:port` lists, their IP; for `dns:///name`,
    the name)."""
    options: list[tuple[str, int | str]] = list(_OPTIONS)
    if service:
        options.append(("grpc.service_config", service_config(service, idempotent)))
    return open_secure_channel(grpc_target(addresses), security, options)
