"""Reaching etcd: endpoints and targets, the channel's options (TLS,
keepalive, round-robin over members) and `EtcdClient`, aetcd's client with
the channel and watcher made here (docs/etcd.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import grpc
from aetcd import rpc

from baton_runtime.common.config import grpc_target
from baton_runtime.common.etcd.watch_stream import EtcdWatcher
from baton_runtime.common.security.tls import (
    Security,
    channel_credentials,
    load_material,
    tls_options,
)

_CHANNEL_OPTIONS = {
    "grpc.keepalive_time_ms": 5000,
    "grpc.keepalive_timeout_ms": 2000,
    "grpc.http2.ping_timeout_ms": 2000,
    "grpc.max_receive_message_length": 48 * 1024 * 1024,
    # A member back from a restart is dialled again within seconds.
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 5000,
}


# Every call and every watch stream asks for a member that has a leader
# (etcd's `hasleader` metadata, clientv3's WithRequireLeader). A member cut
# off from the quorum still takes its clients' connections: asked this way,
# it refuses calls at once ("etcdserver: no leader", UNAVAILABLE) and ends
# the watch streams it serves once it has had no leader for a few election
# timeouts, so the caller retries, and `follow_range` resumes, on another
# member. Without it, a watch it serves sees no new event and no error for
# as long as the partition lasts, and every watch of a process rides one
# stream (tests/test_etcd_partition.py; the chaos run's network faults).
REQUIRE_LEADER = (("hasleader", "true"),)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port` (an optional http:// is ignored)."""
    endpoint = endpoint.removeprefix("http://")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} must be host:port")
    return host or "127.0.0.1", int(port)


def etcd_target(endpoints: str) -> str:
    """The gRPC target of one etcd endpoint or of every member's, comma-
    separated (`http://` and `https://` are ignored; see `channels.grpc_target`)."""
    parts = [
        part.strip().removeprefix("http://").removeprefix("https://")
        for part in endpoints.split(",")
    ]
    if len(parts) == 1:  # the name as given; `localhost` may resolve to [::1] first
        host, port = parse_endpoint(parts[0])
        parts = [f"{'127.0.0.1' if host == 'localhost' else host}:{port}"]
    return grpc_target(",".join(parts))


def make_client(endpoint: str, timeout: float, security: Security | None = None) -> EtcdClient:
    """A client of one etcd member or of several (`endpoint` comma-separated);
    over TLS with this process's certificate when `security` says so (etcd
    then takes the certificate's CN as its user).

    With several members the channel balances round-robin over them, as
    etcd's own Go client does: a member that dies fails the calls in flight
    on it (UNAVAILABLE, the outcome of a write unknown) and the next calls go
    to the others; watches on it end and `follow_range` resumes them on
    another member from the last revision delivered."""
    target = etcd_target(endpoint)
    options = dict(_CHANNEL_OPTIONS, **{"grpc.lb_policy_name": "round_robin"})
    # aetcd dials f"{host}:{port}"; handing it the target split at its last
    # colon makes that any gRPC target, a multi-address one included.
    host, _, port = target.rpartition(":")
    credentials = None
    if security is not None and security.files is not None:
        credentials = channel_credentials(load_material(security.files))
        options.update(tls_options(target, []))
    return EtcdClient(credentials, host=host, port=int(port), timeout=timeout, options=options)


class EtcdClient(aetcd.Client):  # type: ignore[misc]  # (aetcd ships no type hints)
    """aetcd's client, with the channel and the watcher made here.

    - **TLS.** aetcd 1.0 only opens plaintext channels; this opens a TLS one
      when given credentials and uses aetcd's own stubs and watcher on it, so
      the rest of aetcd (and `Store`, which calls the KV stub directly) is
      unchanged. Auth is by client certificate: with etcd's
      `--client-cert-auth` and auth enabled, etcd maps the certificate's
      common name to its user, so there is no token to attach to (or
      refresh on) the raw txn path, and no password to keep.
    - **Watch creations never give up inside aetcd.** aetcd's watcher binds a
      `created` answer to whichever creation is pending when it arrives. One
      that gave up on aetcd's own timeout (etcd electing a leader after a
      restart, under load) left its late answer to the next creation, which
      then got the first one's events (another prefix: an inbox stream fed
      another session's keys, or nothing at all) and lost its own. Here the
      watcher has no timeout; `create_watch` bounds a creation, and when it
      gives up it first ends the watch stream (`reset_watches`) while the
      creation is still pending, so its answer can never reach a later one.
    """

    def __init__(self, credentials: grpc.ChannelCredentials | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # aetcd passes it on every call of its own; `Store` and the watcher
        # on theirs.
        self.metadata = REQUIRE_LEADER
        self._credentials = credentials
        self.watch_create_timeout: float = kwargs.get("timeout") or 5.0
        self.watch_creation = asyncio.Lock()

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]  # set by aetcd's untyped __init__
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            if self._credentials is not None:
                self.channel = grpc.aio.secure_channel(target, self._credentials, options=options)
            else:
                self.channel = grpc.aio.insecure_channel(target, options=options)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = EtcdWatcher(
                rpc.WatchStub(self.channel), timeout=None, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False

    async def reset_watches(self, why: str) -> None:
        """End the watch stream: the pending creation and every watch on the
        stream fail with ConnectionFailedError (their loops resume on a new
        stream, from their own cursors)."""
        if self._watcher is not None:
            # aetcd 1.0's own way of ending a broken stream (pinned in pyproject).
            await self._watcher._terminate_stream(aetcd.ConnectionFailedError(why))
