"""The test suite's throwaway PKI and TLS-with-auth etcd.

One CA per test process (created on first use, removed at exit); every
in-process server, every service process and every client of the suite talks
TLS with a certificate of its role from it (`security(role, deployment)`),
and etcd runs with TLS, client-certificate auth and user/role auth limited
to the `/t/` prefix that every test's keys live under.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile

import aetcd

from baton_runtime.cli.system.etcd_auth import enable_auth
from baton_runtime.cli.system.etcd_process import EtcdCluster, EtcdProcess, EtcdTls
from baton_runtime.cli.system.processes import free_port
from baton_runtime.cli.system.service_launcher import ETCD_USERS
from baton_runtime.cli.system.service_launcher import etcd_tls as launched_etcd_tls
from baton_runtime.cli.system.service_launcher import start_etcd as launch_etcd
from baton_runtime.cli.system.service_launcher import start_etcd_cluster as launch_etcd_cluster
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security, TlsFiles
from tests.netfaults import Network

# Every test keeps its etcd keys under this prefix (a unique root each); the
# etcd role of the services' certificates may touch nothing else.
TEST_PREFIX = "/t/"

_pki: LocalPki | None = None


def pki() -> LocalPki:
    global _pki
    if _pki is None:
        directory = tempfile.mkdtemp(prefix="baton-test-pki-")
        atexit.register(shutil.rmtree, directory, True)
        _pki = LocalPki(directory, check_every=0.2)
    return _pki


def security(role: Role, deployment_id: str = "") -> Security:
    return pki().security(role, deployment_id)


def files(role: Role, deployment_id: str = "") -> TlsFiles:
    return pki().files(role, deployment_id)


OPERATOR = Role.OPERATOR


def operator() -> Security:
    return security(Role.OPERATOR)


def owner(deployment_id: str) -> Security:
    return security(Role.OWNER, deployment_id)


def ingress(deployment_id: str) -> Security:
    return security(Role.INGRESS, deployment_id)


def etcd_tls() -> EtcdTls:
    return launched_etcd_tls(pki())


def start_etcd(**kwargs: object) -> EtcdProcess:
    """A TLS etcd with auth on: hooks' and anchor's certificates are users
    whose role reads and writes `/t/` only (the launcher's `start_etcd`)."""
    return launch_etcd(pki(), TEST_PREFIX, **kwargs)


def start_etcd_cluster(size: int = 3, **kwargs: object) -> EtcdCluster:
    """`size` members, every one with TLS and the same auth as `start_etcd`
    (auth is enabled once, through the first member: it is cluster state)."""
    return launch_etcd_cluster(pki(), TEST_PREFIX, size, **kwargs)


async def start_etcd_cluster_behind(
    network: Network, size: int = 3, **kwargs: object
) -> EtcdCluster:
    """As `start_etcd_cluster`, with the members dialling each other through
    the fault layer's proxies (tests/netfaults.py): a route per ordered pair
    of members, named by member (baton0, baton1, ...). Clients are not
    proxied here: dial `network.link(...)` for that."""
    ports = [(free_port(), free_port()) for _ in range(size)]
    members: list[EtcdProcess] = []

    def callers() -> dict[int, str]:
        return {m.proc.pid: m.name for m in members if m.proc is not None}

    advertised = [
        await network.peer_link(f"baton{i}", peer, callers) for i, (_, peer) in enumerate(ports)
    ]
    cluster = EtcdCluster(
        size=size,
        tls=etcd_tls(),
        ports=ports,
        advertised_peer_ports=advertised,
        members=members,  # filled by `start`, read by `callers` meanwhile
        **kwargs,  # type: ignore[arg-type]
    )
    await asyncio.to_thread(cluster.start)
    await asyncio.to_thread(
        enable_auth, cluster.members[0].endpoint, etcd_tls().root, ETCD_USERS, TEST_PREFIX
    )
    return cluster


def etcd_security() -> Security:
    """How tests read etcd directly: as the `hooks` etcd user."""
    return security(Role.HOOKS)


async def etcd_client(endpoint: str, timeout: float = 5) -> aetcd.Client:
    """A connected raw etcd client (TLS, as the hooks user) for inspection."""
    client = make_client(endpoint, timeout, etcd_security())
    await client.connect()
    return client


async def etcd_root_client(
    endpoint: str, timeout: float = 5, max_receive_bytes: int = 0
) -> aetcd.Client:
    """A connected etcd client as `root` (the operator: every key, alarms,
    compaction, defragmentation)."""
    client = make_client(endpoint, timeout, Security(files=pki().etcd_user("root")))
    if max_receive_bytes:
        client._options["grpc.max_receive_message_length"] = max_receive_bytes
    await client.connect()
    return client
