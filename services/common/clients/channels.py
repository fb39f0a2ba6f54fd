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

import json
from collections.abc import Iterable

import grpc

from baton_runtime.common.config import grpc_target
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
