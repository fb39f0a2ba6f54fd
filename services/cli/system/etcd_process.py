"""etcd on loopback as real processes: one member (`EtcdProcess`) or a
cluster (`EtcdCluster`), each with its own data dir, over TLS with client
certificates when asked, and etcd's corruption checks on. Every etcd started
here is one `find_etcd` (services/cli/system/etcd_binary.py) accepts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

from baton_runtime.cli.system.etcd_binary import EtcdBinary, find_etcd
from baton_runtime.cli.system.processes import free_port, guarded, sync_channel, terminate
from baton_runtime.common.etcd.releases import corruption_check_flags
from baton_runtime.common.security.tls import Security, TlsFiles


@dataclass(frozen=True)
class EtcdTls:
    """etcd over TLS: its server certificate and the CA that signs client
    certificates (`--client-cert-auth`), plus a `root` client certificate for
    health checks and setting up auth. Peers stay on loopback plaintext (one
    member)."""

    server: TlsFiles
    root: TlsFiles


@dataclass
class EtcdProcess:
    """An etcd member on loopback with its own data dir: a single-member
    cluster, or one member of an `EtcdCluster` (`name`, `initial_cluster`)."""

    client_port: int = 0
    peer_port: int = 0
    data_dir: str = ""
    log_path: str = ""
    tls: EtcdTls | None = None
    proc: subprocess.Popen[bytes] | None = None
    # Every etcd Baton starts compacts its history (periodic: keeps this
    # window of revisions, compacting as often); see docs/storage.md "etcd space".
    compaction_retention: str = "1m"
    # The backend quota (NOSPACE alarm above it); 0 = etcd's default, 2 GiB.
    quota_bytes: int = 0
    _own_dir: bool = False
    name: str = "baton"
    # The peer port other members dial ("" = `peer_port`): another one when a
    # proxy stands in front of it (the chaos test's fault layer, tests/netfaults.py).
    advertised_peer_port: int = 0
    # Every member as `name=http://127.0.0.1:peer,...`; "" = this one alone.
    # Read only on the first start (a restart finds the cluster in its data dir).
    initial_cluster: str = ""
    # The etcd executable ("" = `find_etcd`'s choice) and whether a known-bad
    # release may run (None = $BATON_ACCEPT_ETCD_RISK).
    binary: str = ""
    accept_risk: bool | None = None
    # What was started (set by `start`).
    etcd: EtcdBinary | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> EtcdProcess:
        """Spawn etcd; with `wait` (default), block until it reports healthy.
        Raises EtcdRefused for a known-bad release (see `find_etcd`)."""
        self.etcd = find_etcd(self.binary, accept_risk=self.accept_risk)
        self.client_port = self.client_port or free_port()
        self.peer_port = self.peer_port or free_port()
        if not self.data_dir:
            self.data_dir = tempfile.mkdtemp(prefix="baton-etcd-")
            self._own_dir = True
        self.log_path = self.log_path or os.path.join(self.data_dir, "etcd.log")
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            guarded(self._command(self.etcd)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        if wait:
            self.wait_healthy(timeout)
        return self

    def _command(self, etcd: EtcdBinary) -> list[str]:
        """The etcd command line: this member's name, dirs and URLs, then
        the limits, compaction, corruption checks and TLS every member gets."""
        client = f"{self.scheme}://127.0.0.1:{self.client_port}"
        listen_peer = f"http://127.0.0.1:{self.peer_port}"
        peer = f"http://127.0.0.1:{self.advertised_peer_port or self.peer_port}"
        return [
            etcd.path,
            "--name",
            self.name,
            "--data-dir",
            os.path.join(self.data_dir, "data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            listen_peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.initial_cluster or f"{self.name}={peer}",
            "--log-level",
            "warn",
            # A session may hold 256 addresses; claiming or releasing all of
            # them is one transaction (etcd's default cap is 128 ops).
            "--max-txn-ops",
            "1024",
            # A member cut off from the others campaigns only once a
            # pre-vote says it could win: back from a partition, it does not
            # unseat the leader with the term it inflated meanwhile (the
            # default from etcd 3.5 on; 3.4 needs the flag).
            "--pre-vote=true",
            "--auto-compaction-mode",
            "periodic",
            "--auto-compaction-retention",
            self.compaction_retention,
            *(["--quota-backend-bytes", str(self.quota_bytes)] if self.quota_bytes else []),
            # Corruption is detected, not served: the checks as this release
            # spells them (an unreadable version, run at the operator's risk,
            # gets none: their names differ between release lines).
            *(corruption_check_flags(etcd.version) if etcd.version else []),
            *self._tls_flags(),
        ]

    def _tls_flags(self) -> list[str]:
        """Clients over TLS with certificates from the CA (none: plaintext)."""
        if self.tls is None:
            return []
        return [
            "--cert-file",
            self.tls.server.cert,
            "--key-file",
            self.tls.server.key,
            "--trusted-ca-file",
            self.tls.server.ca,
            "--client-cert-auth",
        ]

    def healthy(self) -> bool:
        return etcd_healthy(self.endpoint, self.tls.root if self.tls else None)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise TimeoutError(f"etcd not healthy after {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            terminate(self.proc, timeout)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """kill -9 (the data dir stays: `start` again to restart the member)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def status(self) -> dict[str, str]:
        """The member's maintenance status as strings (its id, the leader's
        id, the raft term); raises OSError when it does not answer.
        Plaintext members answer through
        etcd's HTTP gateway; TLS members over gRPC as `root` (with auth on,
        the gateway refuses client certificates that carry a common name)."""
        if self.tls is None:
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.client_port}/v3/maintenance/status", data=b"{}"
            )
            with urllib.request.urlopen(request, timeout=2) as response:  # noqa: S310
                body = json.loads(response.read())
            return {
                "member_id": body["header"]["member_id"],
                "leader": body.get("leader", ""),
                "raft_term": body.get("raftTerm", ""),
            }
        channel = sync_channel(f"127.0.0.1:{self.client_port}", Security(files=self.tls.root))
        stub = rpc_pb2_grpc.MaintenanceStub(channel)
        try:
            status = stub.Status(rpc_pb2.StatusRequest(), timeout=2)
        except grpc.RpcError as exc:
            raise OSError(f"etcd status: {exc}") from exc
        finally:
            channel.close()
        return {
            "member_id": str(status.header.member_id),
            "leader": str(status.leader),
            "raft_term": str(status.raftTerm),
        }


@dataclass
class EtcdCluster:
    """`size` etcd members on loopback forming one cluster, each with its own
    data dir under `base_dir`, started and stopped (or killed) one by one."""

    size: int = 3
    base_dir: str = ""
    members: list[EtcdProcess] = field(default_factory=list)
    # Client and peer ports of each member; empty = free ports.
    ports: list[tuple[int, int]] = field(default_factory=list)
    # The peer port each member is dialled at, when a proxy stands in front
    # of its own (see `EtcdProcess.advertised_peer_port`); empty = its own.
    advertised_peer_ports: list[int] = field(default_factory=list)
    log_dir: str = ""
    # Clients talk TLS to every member (peers stay loopback plaintext).
    tls: EtcdTls | None = None
    # As EtcdProcess's: the executable ("" = `find_etcd`'s) and the risk.
    binary: str = ""
    accept_risk: bool | None = None
    _own_dir: bool = False

    @property
    def endpoint(self) -> str:
        """Every member's client address, comma-separated (what `--etcd` takes)."""
        return ",".join(member.endpoint for member in self.members)

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> EtcdCluster:
        if not self.base_dir:
            self.base_dir = tempfile.mkdtemp(prefix="baton-etcd-cluster-")
            self._own_dir = True
        ports = self.ports or [(free_port(), free_port()) for _ in range(self.size)]
        if len(ports) != self.size:
            raise ValueError(f"{len(ports)} port pairs for {self.size} members")
        # Chosen (and checked) once: every member runs the same release.
        etcd = find_etcd(self.binary, accept_risk=self.accept_risk)
        names = [f"baton{i}" for i in range(self.size)]
        advertised = self.advertised_peer_ports or [peer for _, peer in ports]
        if len(advertised) != self.size:
            raise ValueError(f"{len(advertised)} advertised peer ports for {self.size} members")
        cluster = ",".join(
            f"{name}=http://127.0.0.1:{peer}" for name, peer in zip(names, advertised, strict=True)
        )
        for index, (name, (client, peer)) in enumerate(zip(names, ports, strict=True)):
            data_dir = os.path.join(self.base_dir, name)
            os.makedirs(data_dir, exist_ok=True)
            # etcd.log, etcd-2.log, ...: named as `baton up` labels the members.
            log_name = "etcd.log" if index == 0 else f"etcd-{index + 1}.log"
            member = EtcdProcess(
                client_port=client,
                peer_port=peer,
                advertised_peer_port=advertised[index],
                data_dir=data_dir,
                log_path=os.path.join(self.log_dir or data_dir, log_name),
                name=name,
                initial_cluster=cluster,
                tls=self.tls,
                binary=etcd.path,
                accept_risk=self.accept_risk,
            )
            self.members.append(member)
            member.start(wait=False)
        if wait:
            self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Every member reports healthy (a cluster has a leader only once a
        majority of members is up, so they are started first and awaited here)."""
        for member in self.members:
            member.wait_healthy(timeout)

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the current leader, as the live members report it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            statuses = {}
            for index, member in enumerate(self.members):
                if member.proc is None or member.proc.poll() is not None:
                    continue
                with contextlib.suppress(OSError, KeyError, ValueError):
                    statuses[index] = member.status()
            leaders = {status["leader"] for status in statuses.values()}
            for index, status in statuses.items():
                if leaders == {status["member_id"]}:
                    return index
            time.sleep(0.05)
        raise TimeoutError(f"no etcd leader agreed on after {timeout}s")

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start member `index` again (after `kill` or `stop`) on its data dir."""
        member = self.members[index]
        member.start(wait=False)
        member.wait_healthy(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        for member in self.members:
            member.stop(timeout)
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)


def _client_context(client: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=client.ca)
    context.load_cert_chain(client.cert, client.key)
    return context


def etcd_healthy(endpoint: str, client: TlsFiles | None = None) -> bool:
    """etcd's /health says true (over https with a client certificate when
    `client` is given, as `--client-cert-auth` demands)."""
    if client is None:
        url, context = f"http://{endpoint}/health", None
    else:
        url, context = f"https://{endpoint}/health", _client_context(client)
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url, timeout=1, context=context) as response:  # noqa: S310
            return b'"health":"true"' in response.read()
    return False
