"""Baton as real processes over a given etcd, for tests and benchmarks
(`ServiceStack`): hooks, anchor, and the owner instances and ingresses of
one deployment or several, each started by name, with the means to kill,
pause, resume and start them again. A configuration of the one launcher
(services/cli/system/service_launcher.py): every process gets its role's
certificate from the stack's PKI (TLS on every hop and to etcd) and the
ingresses read their API key from a file of the work directory.

tests/procs.py's `ProcessStack` is this stack on the test PKI and prefix;
bench/hops.py and bench/receipt_cost.py run it on a PKI of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from baton_runtime.cli.system.processes import ServiceProcess
from baton_runtime.cli.system.service_env import wiring_env
from baton_runtime.cli.system.service_launcher import ServiceLauncher
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import Security


@dataclass
class ServiceStack:
    """hooks + anchor + ingress + owner instances of one deployment (more
    with `start_deployments`, `start_owner`, `start_ingress`), named:
    "hooks", "anchor", "ingress", the owners by instance id."""

    etcd_endpoint: str
    workdir: Path
    pki: LocalPki | None
    prefix: str
    deployment_id: str = "dep-r"
    lease_ttl: int = 2
    park_after: float | None = None
    owner_env: dict[str, str] = field(default_factory=dict)  # every owner's extra env
    anchor_env: dict[str, str] = field(default_factory=dict)  # anchor's extra env
    env: dict[str, str] = field(default_factory=dict)  # every process's extra env
    # With `serve_metrics`, every process serves Prometheus metrics on a port
    # of its own (`metrics_url`).
    serve_metrics: bool = False
    # The ingresses' one API key, of channel `channel`.
    api_key: str = "stack-key-000001-loopback"
    channel: str = "slack"
    log_level: str = "info"
    owners: dict[str, ServiceProcess] = field(default_factory=dict, init=False)
    ingresses: dict[str, ServiceProcess] = field(default_factory=dict, init=False)
    launcher: ServiceLauncher = field(init=False)

    def __post_init__(self) -> None:
        # The stack's `env` (the same dict) comes before each process's own.
        self.launcher = ServiceLauncher(
            self.workdir, self.pki, self.log_level, self.env, metrics=self.serve_metrics
        )

    # -- names -----------------------------------------------------------------

    @property
    def ports(self) -> dict[str, int]:
        return self.launcher.ports

    @property
    def metrics_ports(self) -> dict[str, int]:
        return self.launcher.metrics_ports

    def _process(self, name: str) -> ServiceProcess | None:
        return self.launcher.processes.get(name)

    @property
    def hooks(self) -> ServiceProcess | None:
        return self._process("hooks")

    @property
    def anchor(self) -> ServiceProcess | None:
        return self._process("anchor")

    @property
    def ingress(self) -> ServiceProcess | None:
        return self._process("ingress")

    def addr(self, name: str) -> str:
        return self.launcher.addr(name)

    def metrics_url(self, name: str) -> str:
        return self.launcher.metrics_url(name)

    def security(self, role: Role = Role.OWNER, deployment_id: str = "") -> Security:
        """A certificate of `role` (for owners and ingresses: of the stack's
        deployment unless named)."""
        return self.launcher.security(role, deployment_id or self.deployment_id)

    @property
    def probe(self) -> Security:
        """What health probes present: an operator's certificate."""
        return self.launcher.operator

    # -- start -----------------------------------------------------------------

    def _env(self, kind: str, deployment_id: str, owners: str = "") -> dict[str, str]:
        wiring = wiring_env(
            kind,
            etcd=self.etcd_endpoint,
            prefix=self.prefix,
            hooks=self.addr("hooks"),
            anchor=self.addr("anchor"),
            deployment_id=deployment_id,
            owners=owners,
            api_keys_file=self._key_file(),
        )
        return wiring | {"BATON_ETCD_TIMEOUT": "2", "BATON_SHUTDOWN_GRACE": "1"}

    def _start(
        self, name: str, kind: str, env: dict[str, str], *, deployment_id: str = ""
    ) -> ServiceProcess:
        return self.launcher.start(name, kind, env, deployment_id=deployment_id, wait=False)

    def _shared(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._start("hooks", "hooks", self._env("hooks", ""))
        self._start("anchor", "anchor", self._env("anchor", "") | self._anchor_env())

    def _anchor_env(self) -> dict[str, str]:
        """anchor's extra env; its object store a directory of the workdir
        unless the stack's `anchor_env` names one."""
        return {"BATON_OBJECT_STORE": f"file://{self.workdir / 'objects'}", **self.anchor_env}

    def _key_file(self) -> str:
        path = self.workdir / "api-keys"
        if not path.exists():
            self.workdir.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{self.channel}={self.api_key}\n")
        return str(path)

    def wait_serving(self, names: list[str]) -> None:
        self.launcher.wait_serving(names)

    def start(self, owners: int = 2) -> ServiceStack:
        """Start everything and wait until it serves."""
        instances = [f"o{i}" for i in range(1, owners + 1)]
        for name in ("hooks", "anchor", "ingress", *instances):
            self.addr(name)
        self._shared()
        for instance_id in instances:
            self.start_owner(instance_id, wait=False)
        ingress = self._env("ingress", self.deployment_id, owners=self.addr("o1"))
        self._start("ingress", "ingress", ingress, deployment_id=self.deployment_id)
        self.wait_serving(["hooks", "anchor", "ingress", *self.owners])
        return self

    def start_deployments(
        self, owners: dict[str, tuple[str, str]], ingresses: dict[str, tuple[str, str]]
    ) -> ServiceStack:
        """Several deployments side by side. `owners`: instance id ->
        (deployment id, failpoints); `ingresses`: name -> (deployment id,
        the owner instance it creates sessions on)."""
        for name in ("hooks", "anchor", *ingresses, *owners):
            self.addr(name)
        self._shared()
        for instance_id, (deployment_id, points) in owners.items():
            self.start_owner(
                instance_id, wait=False, deployment_id=deployment_id, failpoints=points
            )
        for name, (deployment_id, owner) in ingresses.items():
            env = self._env("ingress", deployment_id, owners=self.addr(owner))
            self.ingresses[name] = self._start(name, "ingress", env, deployment_id=deployment_id)
        self.wait_serving(["hooks", "anchor", *ingresses, *owners])
        return self

    def start_ingress(
        self, name: str, deployment_id: str, owners: list[str], env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Another ingress, of `deployment_id`, creating sessions on `owners`."""
        wiring = self._env("ingress", deployment_id, owners=self.launcher.addrs(owners))
        self.ingresses[name] = process = self._start(
            name, "ingress", wiring | (env or {}), deployment_id=deployment_id
        )
        self.wait_serving([name])
        return process

    def start_owner(
        self,
        instance_id: str,
        *,
        wait: bool = True,
        deployment_id: str = "",
        failpoints: str = "",
        env: dict[str, str] | None = None,
    ) -> ServiceProcess:
        """Start (or start again, on its port) owner `instance_id`."""
        deployment_id = deployment_id or self.deployment_id
        extra = {
            "BATON_INSTANCE_ID": instance_id,
            "BATON_OWNER_LEASE_TTL": str(self.lease_ttl),
            "BATON_OWNER_PARK_AFTER": str(self.park_after or 0),
            "BATON_FAILPOINTS": failpoints,
            **self.owner_env,
            **(env or {}),
        }
        wiring = self._env("owner", deployment_id)
        self.owners[instance_id] = process = self._start(
            instance_id, "owner", wiring | extra, deployment_id=deployment_id
        )
        if wait:
            self.wait_serving([instance_id])
        return process

    def restart_anchor(self, env: dict[str, str] | None = None) -> ServiceProcess:
        """Start anchor again on its port (after it died or was killed),
        with `env` replacing the stack's anchor env where it says."""
        if self.anchor is not None:
            self.launcher.kill("anchor")
        self.anchor_env = {**self.anchor_env, **(env or {})}
        process = self._start("anchor", "anchor", self._env("anchor", "") | self._anchor_env())
        self.wait_serving(["anchor"])
        return process

    # -- faults and stop ---------------------------------------------------------

    def kill(self, instance_id: str) -> None:
        """kill -9."""
        self.launcher.kill(instance_id)

    def pause(self, instance_id: str) -> None:
        self.launcher.pause(instance_id)

    def resume(self, instance_id: str) -> None:
        self.launcher.resume(instance_id)

    def stop(self) -> None:
        """Kill every process (each resumed first, in case one is paused)."""
        self.launcher.stop(graceful=False)
