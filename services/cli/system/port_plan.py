"""The ports of one `baton up`: where each replica of each service, each
etcd member and each metrics endpoint listens, checked to be distinct, in
range and free before anything starts.

Port plan, from `--port-base P` (default 50051): the first deployment's
ingress P, hooks P+1, anchor P+2, the first deployment's owner P+3; the N-th
deployment (N >= 2, in the order given) has its ingress at P+2N and its owner
at P+2N+1 (dep 2: P+4, P+5; dep 3: P+6, P+7). With `--replicas R`, replica k
(k >= 2) of each of them listens 100 (k - 1) above the first (hooks P+1,
P+101, P+201, ...). etcd clients use `--etcd-port E` (default 23790) and etcd
peers E+1; with `--etcd-members M`, member m (m >= 2) uses E+2(m-1) and the
port after it. Port 0 means "pick free ports". Each service process also
serves Prometheus metrics (`--metrics-listen`) on loopback, METRICS_OFFSET
above its gRPC port (free ports too with a port base of 0); `baton up`
prints every process's `http://127.0.0.1:PORT/metrics`. The web console
listens at P+99 (`CONSOLE_OFFSET`; a free port with a port base of 0).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from baton_runtime.cli.system.launch_settings import DEFAULT_DEPLOYMENT_ID, LaunchError

# Offsets from --port-base of the shared services; per-deployment offsets are
# `deployment_offsets`. Start order after etcd: the shared services, then
# every deployment's owner and ingress together.
SHARED_OFFSETS = {"hooks": 1, "anchor": 2}
PER_DEPLOYMENT = ("owner", "ingress")
# With --replicas N, replica k (k >= 2) of each service listens at the first
# replica's port + REPLICA_STRIDE * (k - 1); with --etcd-members M, member m
# (m >= 2) at the first member's client and peer ports + ETCD_MEMBER_STRIDE * (m - 1).
REPLICA_STRIDE = 100
ETCD_MEMBER_STRIDE = 2
# A service's metrics port: its gRPC port + METRICS_OFFSET.
METRICS_OFFSET = 1000
# The web console's HTTP port (services/console/): --port-base + CONSOLE_OFFSET
# (below the second replicas' ports, above any deployment's).
CONSOLE_OFFSET = 99


def deployment_offsets(index: int) -> tuple[int, int]:
    """(ingress, owner) offsets from --port-base of the `index`-th (0-based)
    deployment: the first keeps 0 and 3 (around hooks +1 and anchor +2); the
    N-th (N = index + 1 >= 2) uses 2N and 2N + 1."""
    if index == 0:
        return 0, 3
    n = index + 1
    return 2 * n, 2 * n + 1


def replica_label(name: str, replica: int) -> str:
    """ "hooks" for the first replica, "hooks-2" for the second, ..."""
    return name if replica == 0 else f"{name}-{replica + 1}"


def _listing(ports: Sequence[int]) -> str:
    return ", ".join(str(port) for port in ports)


@dataclass(frozen=True)
class DeploymentPorts:
    """The ports of one deployment's own processes, one per replica."""

    deployment_id: str
    ingresses: tuple[int, ...]
    owners: tuple[int, ...]

    @property
    def ingress(self) -> int:
        return self.ingresses[0]

    @property
    def owner(self) -> int:
        return self.owners[0]


@dataclass(frozen=True)
class Ports:
    """Every port of one `baton up`: one per replica of each service, a
    client and a peer port per etcd member."""

    hooks: tuple[int, ...]
    anchors: tuple[int, ...]
    etcd: tuple[tuple[int, int], ...]  # (client, peer) per member
    deployments: tuple[DeploymentPorts, ...]
    # Each service process's metrics port, by its gRPC port (see METRICS_OFFSET).
    metrics: Mapping[int, int] = field(default_factory=dict, compare=False)
    # The web console's HTTP port (0: none).
    console: int = field(default=0, compare=False)

    @property
    def ingress(self) -> int:
        """The first deployment's ingress (where the demo starts)."""
        return self.deployments[0].ingress

    @property
    def owner(self) -> int:
        return self.deployments[0].owner

    @property
    def etcd_client(self) -> int:
        return self.etcd[0][0]

    @property
    def etcd_peer(self) -> int:
        return self.etcd[0][1]

    @classmethod
    def plan(
        cls,
        port_base: int,
        etcd_port: int,
        deployment_ids: Sequence[str] = (DEFAULT_DEPLOYMENT_ID,),
        *,
        replicas: int = 1,
        etcd_members: int = 1,
    ) -> Ports:
        """Ports from the bases (see the module doc); a base of 0 picks free
        ports instead."""
        if replicas < 1 or etcd_members < 1:
            raise LaunchError("--replicas and --etcd-members must be at least 1")
        services = replicas * (2 + 2 * len(deployment_ids))
        count = 2 * services + 2 * etcd_members + 1
        spare = iter(_distinct_free_ports(count))

        def ports(first: int) -> tuple[int, ...]:
            if not port_base:
                return tuple(next(spare) for _ in range(replicas))
            return tuple(first + REPLICA_STRIDE * k for k in range(replicas))

        deployments = []
        for index, deployment_id in enumerate(deployment_ids):
            ingress_offset, owner_offset = deployment_offsets(index)
            deployments.append(
                DeploymentPorts(
                    deployment_id,
                    ports(port_base + ingress_offset),
                    ports(port_base + owner_offset),
                )
            )
        if etcd_port:
            etcd = tuple(
                (etcd_port + ETCD_MEMBER_STRIDE * m, etcd_port + ETCD_MEMBER_STRIDE * m + 1)
                for m in range(etcd_members)
            )
        else:
            etcd = tuple((next(spare), next(spare)) for _ in range(etcd_members))
        hooks = ports(port_base + SHARED_OFFSETS["hooks"])
        anchors = ports(port_base + SHARED_OFFSETS["anchor"])
        grpc_ports = [*hooks, *anchors]
        for dep in deployments:
            grpc_ports += [*dep.ingresses, *dep.owners]
        metrics = {port: port + METRICS_OFFSET if port_base else next(spare) for port in grpc_ports}
        console = port_base + CONSOLE_OFFSET if port_base else next(spare)
        plan = cls(hooks, anchors, etcd, tuple(deployments), metrics, console)
        plan.validate()
        return plan

    def service_ports(self, name: str, dep: DeploymentPorts | None = None) -> tuple[int, ...]:
        """The ports of every replica of `name` (of `dep`, for owner/ingress)."""
        if dep is None:
            return self.hooks if name == "hooks" else self.anchors
        return dep.owners if name == "owner" else dep.ingresses

    def items(self) -> list[tuple[str, int]]:
        items = []
        for m, (client, peer) in enumerate(self.etcd):
            items += [(f"{replica_label('etcd', m)} client", client)]
            items += [(f"{replica_label('etcd', m)} peer", peer)]
        for name in SHARED_OFFSETS:
            for k, port in enumerate(self.service_ports(name)):
                items.append((replica_label(name, k), port))
        for dep in self.deployments:
            for name in ("ingress", "owner"):
                for k, port in enumerate(self.service_ports(name, dep)):
                    items.append((f"{replica_label(name, k)} of {dep.deployment_id}", port))
        services = items[2 * len(self.etcd) :]
        items += [(f"{name} metrics", self.metrics[port]) for name, port in services]
        if self.console:
            items.append(("console", self.console))
        return items

    def summary(self) -> str:
        """The plan on one line, as `baton up` prints it before starting."""
        clients = _listing([client for client, _ in self.etcd])
        peers = _listing([peer for _, peer in self.etcd])
        parts = [
            f"etcd {clients} (peer {peers})"
            if len(self.etcd) == 1
            else f"etcd {clients} (peers {peers})",
            f"hooks {_listing(self.hooks)}",
            f"anchor {_listing(self.anchors)}",
        ]
        for dep in self.deployments:
            parts.append(
                f"{dep.deployment_id}: ingress {_listing(dep.ingresses)}, "
                f"owner {_listing(dep.owners)}"
            )
        return "; ".join(parts)

    def validate(self) -> None:
        seen: dict[int, str] = {}
        for name, port in self.items():
            if not 0 < port < 65536:
                raise LaunchError(f"{name} port {port} is out of range")
            if port in seen:
                raise LaunchError(f"{name} and {seen[port]} would both use port {port}")
            seen[port] = name

    def check_free(self) -> None:
        """Fail early if any port is taken. gRPC servers bind with SO_REUSEPORT,
        so a second Baton would otherwise share ports with the first silently."""
        for name, port in self.items():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError as exc:
                    raise LaunchError(
                        f"{name} port 127.0.0.1:{port} is not free ({exc.strerror}); "
                        "is another `baton up` running? Try --port-base/--etcd-port"
                    ) from exc


def _distinct_free_ports(count: int) -> list[int]:
    """`count` different ports that were free a moment ago (held open together
    so that the kernel cannot hand out the same one twice)."""
    with contextlib.ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
