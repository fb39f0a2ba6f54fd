"""deploy/: the manifests render, validate and say what the design asks; the
container's entrypoint runs the commands the manifests give it.

- `render.py check` renders every overlay and validates it offline against
  the Kubernetes schemas (what CI runs).
- The rendered objects are read back: a three-member etcd with volumes, TLS,
  auth, compaction and a quota (in every overlay); two or more hooks and
  anchor replicas; a fleet per deployment id labelled with it, with that
  id's certificates; TLS settings pointing at mounted Secrets in every
  container, etcd client certificates for hooks and anchor, the API key
  file for ingress, nothing plaintext; headless Services; gRPC probes on
  the plaintext health port; PodDisruptionBudgets; only ingress reachable
  from outside; Secrets for what pods reference; requests and limits; grace
  periods that cover the services' own shutdown grace; the drain Job.
- The certificates gen-secrets.sh writes name the roles (and deployment
  ids) Baton reads, and verify under the names the manifests dial.
- Every BATON_* variable a manifest sets is a setting of that service
  (`python -m baton_runtime.<name> --help`), so the manifests invent no flags.
- The image's entrypoint script starts hooks, anchor, owner and ingress with
  the arguments and environment of their rendered Deployments (addresses
  moved to loopback, mounted files to the test PKI's), they answer the
  kubelet's probes on the health port, and a conversation runs through
  them over TLS (and etcd with auth).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.system.processes import free_port, wait_serving
from baton_runtime.common.etcd.releases import corruption_check_flags, judge, parse_version
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.tls import Security
from tests import certs
from tests.certs import TEST_PREFIX
from tests.procs import eventually
from tests.scrape import scrape
from tests.stack import SLACK_KEY, public_channel

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RENDER = [sys.executable, str(DEPLOY / "render.py")]
DEPLOYMENT_ID = "build-2026-11-30"
_RENDER_SPEC = importlib.util.spec_from_file_location("render", DEPLOY / "render.py")
assert _RENDER_SPEC is not None and _RENDER_SPEC.loader is not None
render_py = importlib.util.module_from_spec(_RENDER_SPEC)  # deploy/render.py, as a module
_RENDER_SPEC.loader.exec_module(render_py)
LABEL = "baton.dev/deployment-id"
BATON_ROLES = ("hooks", "anchor", "owner", "ingress")
# Variables a container may set that are not service settings: inputs of
# $(VAR) expansion in the manifests, and the OpenAI adapter's own settings.
NOT_SETTINGS = {"POD_NAME", "POD_IP", "POD_NAMESPACE", "CLUSTER_DOMAIN"}
AGENT_SETTINGS = {"BATON_OPENAI_API_KEY"}
# anchor's object store library reads its endpoint and credentials itself.
OBJECT_STORE_SETTINGS = {
    "AWS_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ENDPOINT_URL",
}


def render(*args: str) -> str:
    result = subprocess.run([*RENDER, *args], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


@dataclass
class Rendered:
    """Every object of the dev overlay: shared tier, a fleet, the public entry."""

    objects: list[dict[str, Any]]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        (found,) = [o for o in self.of(kind) if o["metadata"]["name"] == name]
        return found

    def workloads(self) -> list[dict[str, Any]]:
        return [*self.of("Deployment"), *self.of("StatefulSet"), *self.of("Job")]


def gen_secrets(secrets: Path, namespace: str, *deployment_ids: str) -> None:
    """gen-secrets.sh: the shared files, then each deployment id's."""
    script = str(DEPLOY / "gen-secrets.sh")
    subprocess.run(["sh", script, str(secrets), namespace], check=True, capture_output=True)
    for deployment_id in deployment_ids:
        subprocess.run(
            ["sh", script, "fleet", str(secrets), deployment_id, namespace],
            check=True,
            capture_output=True,
        )


def render_install(overlay: str, secrets_root: Path) -> Rendered:
    namespace = {"dev": "baton-dev", "production": "baton"}[overlay]
    secrets = secrets_root / overlay
    gen_secrets(secrets, namespace, DEPLOYMENT_ID)
    text = render(
        "install",
        "--overlay",
        overlay,
        "--deployment-id",
        DEPLOYMENT_ID,
        "--image",
        f"baton:{DEPLOYMENT_ID}",
        "--secrets",
        str(secrets),
    )
    return Rendered([doc for doc in yaml.safe_load_all(text) if doc])


@pytest.fixture(scope="module", params=["dev", "production"])
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    """Everything `render.py install` gives for an overlay."""
    return render_install(request.param, tmp_path_factory.mktemp("secrets"))


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return render_install("dev", tmp_path_factory.mktemp("secrets"))


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    return containers


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_check_renders_and_validates_every_overlay_offline(tmp_path: Path) -> None:
    """What CI runs. (Offline: kubernetes-validate ships its schemas; CI runs
    this under `unshare -n` where it can.)"""
    result = subprocess.run(
        [*RENDER, "check", "--out", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in tmp_path.glob("*.yaml"))
    assert names == sorted(
        f"{overlay}-{part}.yaml"
        for overlay in ("dev", "production")
        for part in ("shared", "fleet", "public", "drain", "secrets")
    )
    assert result.stderr.count("valid (Kubernetes") == len(names)
    assert "monitoring: alerts.yaml: " in result.stderr, result.stderr


@pytest.mark.parametrize("bad", ["latest", "Build-1", "build_1", "-x", "x" * 56])
def test_a_deployment_id_that_cannot_name_objects_is_refused(bad: str) -> None:
    result = subprocess.run(
        [*RENDER, "fleet", f"--deployment-id={bad}"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1 and "cannot name Kubernetes objects" in result.stderr


def test_the_shared_tier_needs_an_exact_image() -> None:
    for image in ("", "registry.example.com/baton", "localhost:5000/baton"):
        result = subprocess.run(
            [*RENDER, "shared", "--image", image], capture_output=True, text=True, check=False
        )
        assert result.returncode == 1 and "exact build" in result.stderr, image


def test_etcd_is_three_members_with_volumes_tls_auth_compaction_and_quota(
    rendered: Rendered,
) -> None:
    etcd = rendered.one("StatefulSet", "etcd")
    assert etcd["spec"]["replicas"] == 3
    assert etcd["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    args = containers(etcd)[0]["args"]
    for flag in (
        "--client-cert-auth=true",
        "--peer-client-cert-auth=true",
        "--auto-compaction-mode=periodic",
        "--quota-backend-bytes=4294967296",
        "--max-txn-ops=1024",
    ):
        assert flag in args
    assert any(a.startswith("--auth-token=jwt,") for a in args)
    assert all(a.endswith(":2380") for a in args if a.startswith("--initial-advertise"))
    initial = next(a for a in args if a.startswith("--initial-cluster="))
    assert initial.count("https://") == 3
    assert rendered.one("Job", "etcd-auth-bootstrap")
    assert rendered.one("Service", "etcd")["spec"]["publishNotReadyAddresses"] is True


def test_etcd_pins_a_good_release_with_its_corruption_checks_on(
    rendered: Rendered, tmp_path: Path
) -> None:
    etcd = rendered.one("StatefulSet", "etcd")
    (container,) = containers(etcd)
    version = parse_version(container["image"].rpartition(":")[2])
    assert version is not None and judge(version).ok, judge(version).explain()
    for flag in corruption_check_flags(version):
        assert flag in container["args"], flag
    # The check refuses a known-bad pin (and a good pin without the checks).
    bad = tmp_path / "etcd.yaml"
    source = (DEPLOY / "kustomize" / "base" / "etcd.yaml").read_text()
    bad.write_text(source.replace(container["image"], "quay.io/coreos/etcd:v3.5.1"))
    with pytest.raises(render_py.RenderError, match="13766"):
        render_py.check_etcd_release(bad)
    bad.write_text(source.replace("- --experimental-initial-corrupt-check=true\n", ""))
    with pytest.raises(render_py.RenderError, match="initial-corrupt-check"):
        render_py.check_etcd_release(bad)
    assert render_py.check_etcd_release() == str(version)


def test_replicas_fleets_services_and_budgets(rendered: Rendered) -> None:
    for name in ("hooks", "anchor"):
        assert rendered.one("Deployment", name)["spec"]["replicas"] >= 2
    for role in ("owner", "ingress"):
        fleet = rendered.one("Deployment", f"{role}-{DEPLOYMENT_ID}")
        assert fleet["metadata"]["labels"][LABEL] == DEPLOYMENT_ID
        assert fleet["spec"]["selector"]["matchLabels"][LABEL] == DEPLOYMENT_ID
        assert fleet["spec"]["template"]["metadata"]["labels"][LABEL] == DEPLOYMENT_ID
        env = env_of(containers(fleet)[0])
        assert env["BATON_DEPLOYMENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            f"metadata.labels['{LABEL}']"
        )
    ingress_env = env_of(containers(rendered.one("Deployment", f"ingress-{DEPLOYMENT_ID}"))[0])
    assert ingress_env["BATON_OWNER_ADDR"]["value"].startswith(
        "dns:///owner-$(BATON_DEPLOYMENT_ID)."
    )
    for service in rendered.of("Service"):
        if service["metadata"]["name"] != "baton-public":
            assert service["spec"]["clusterIP"] == "None", service["metadata"]["name"]
    selectors = [p["spec"]["selector"]["matchLabels"] for p in rendered.of("PodDisruptionBudget")]
    for workload in [*rendered.of("Deployment"), *rendered.of("StatefulSet")]:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(sel.items() <= labels.items() for sel in selectors), (
            f"no PodDisruptionBudget covers {workload['metadata']['name']}"
        )


def test_probes_resources_and_grace(rendered: Rendered) -> None:
    for workload in rendered.workloads():
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            resources = container["resources"]
            assert resources["requests"] and resources["limits"], container["name"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
        if workload["kind"] != "Deployment":
            continue
        (container,) = pod["containers"]
        role = container["args"][0]
        assert role in BATON_ROLES
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        # The kubelet's gRPC probes cannot speak TLS: they ask the plaintext
        # health-only listener.
        health = env_of(container)["BATON_HEALTH_LISTEN"]["value"]
        assert health == f"0.0.0.0:{ports['health']}" and ports["grpc"] != ports["health"]
        ready = container["readinessProbe"]["grpc"]
        assert ready["port"] == ports["health"]
        assert ready["service"].startswith(f"baton.{role}.v1.")
        for probe in ("livenessProbe", "startupProbe"):
            if role in ("hooks", "anchor"):
                # Their health follows etcd: liveness must not.
                assert container[probe]["tcpSocket"]["port"] == ports["grpc"]
            else:
                assert container[probe]["grpc"]["port"] == ports["health"]
        grace = float(env_of(container)["BATON_SHUTDOWN_GRACE"]["value"])
        # The service drains for its grace, then closes its clients (an owner
        # stops its runs and revokes its lease): the pod must not be killed first.
        assert pod["terminationGracePeriodSeconds"] >= grace + 15, workload["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_only_ingress_is_reachable_from_outside(rendered: Rendered) -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in rendered.of("NetworkPolicy")}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    open_to_all = [
        spec["podSelector"]
        for spec in policies.values()
        for rule in spec.get("ingress", [])
        if "from" not in rule
    ]
    assert open_to_all == [{"matchLabels": {"app.kubernetes.io/component": "ingress"}}]
    exposed = [
        s["metadata"]["name"]
        for s in rendered.of("Service")
        if s["spec"].get("type") in ("LoadBalancer", "NodePort")
    ]
    assert exposed == ["baton-public"]
    public = rendered.one("Service", "baton-public")["spec"]["selector"]
    assert public == {
        "app.kubernetes.io/name": "ingress",
        "app.kubernetes.io/component": "ingress",
        LABEL: DEPLOYMENT_ID,
    }


def test_every_service_pod_is_scraped_on_its_metrics_port(rendered: Rendered) -> None:
    """The prometheus.io annotations name the port BATON_METRICS_LISTEN
    binds and the container declares, and only Prometheus may reach it."""
    scraped = set()
    for workload in rendered.of("Deployment"):
        (container,) = containers(workload)
        role = container["args"][0]
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", role
        assert annotations["prometheus.io/path"] == "/metrics", role
        port = annotations["prometheus.io/port"]
        assert env_of(container)["BATON_METRICS_LISTEN"]["value"] == f"0.0.0.0:{port}", role
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(port), role
        scraped.add(role)
    assert scraped == set(BATON_ROLES)
    policy = rendered.one("NetworkPolicy", "metrics")["spec"]
    (selector,) = policy["podSelector"]["matchExpressions"]
    assert set(selector["values"]) == {*BATON_ROLES, "etcd"}
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": 9102}, {"port": 2381}]
    etcd = rendered.one("StatefulSet", "etcd")["spec"]["template"]
    assert etcd["metadata"]["annotations"]["prometheus.io/port"] == "2381"
    (member,) = etcd["spec"]["containers"]
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in member["args"]
    assert rule["from"] == [
        {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]


def test_the_dashboard_is_rendered_and_the_alert_rules_name_baton_series() -> None:
    """deploy/monitoring: the committed dashboard is what render.py renders;
    check_monitoring refuses an alert naming a series Baton does not expose
    (and, with promtool, a rule that does not parse or whose unit test fails)."""
    assert (DEPLOY / "monitoring" / "dashboard.json").read_text() == render("dashboard")
    sys.path.insert(0, str(DEPLOY))
    import render as module

    done = module.check_monitoring()
    assert any("alerts, every series known" in line for line in done), done
    known = module._known_series()
    assert {"baton_turns_total", "baton_sessions", "baton_build_info"} <= known
    assert module._unknown_series("rate(baton_turn_duration_seconds_bucket[5m])", known) == set()
    assert module._unknown_series("baton_turns", known) == {"baton_turns"}
    assert module._unknown_series("sum(baton_no_such_total)", known) == {"baton_no_such_total"}


def test_every_secret_a_pod_needs_is_rendered(rendered: Rendered) -> None:
    have = {secret["metadata"]["name"]: secret for secret in rendered.of("Secret")}
    for workload in rendered.workloads():
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in have
        for container in pod["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["key"] in have[ref["name"]]["data"], ref


def mounted_file(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in the container."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        directory = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(directory):
            volume = volumes[mount["name"]]
            assert "secret" in volume, (path, volume)
            return volume["secret"]["secretName"], path[len(directory) :]
    raise AssertionError(f"{path} is not mounted in {container['name']}")


def test_every_hop_is_tls_from_mounted_secrets(rendered: Rendered) -> None:
    """Every Baton container's certificate, key and CA are files of a
    mounted TLS Secret (owner and ingress: their deployment id's); hooks and
    anchor reach etcd with its client certificate; ingress reads its API
    keys from a Secret file; nothing asks for plaintext."""
    secrets = {s["metadata"]["name"]: s for s in rendered.of("Secret")}
    for workload in rendered.of("Deployment"):
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        role = container["args"][0]
        env = {k: v.get("value", "") for k, v in env_of(container).items()}
        assert not {"BATON_PLAINTEXT", "BATON_ETCD_PLAINTEXT", "BATON_API_KEYS"} & set(env)
        wanted = {"BATON_TLS_CERT": "tls.crt", "BATON_TLS_KEY": "tls.key", "BATON_TLS_CA": "ca.crt"}
        if role in ("hooks", "anchor"):
            wanted |= {"BATON_ETCD_CERT": "tls.crt", "BATON_ETCD_KEY": "tls.key"}
            wanted |= {"BATON_ETCD_CA": "ca.crt"}
        if role == "ingress":
            wanted["BATON_API_KEYS_FILE"] = "api-keys"
        for setting, key in wanted.items():
            secret, file = mounted_file(pod, container, env[setting])
            assert file == key and key in secrets[secret]["data"], (role, setting)
        tls_secret, _ = mounted_file(pod, container, env["BATON_TLS_CERT"])
        own = f"-{DEPLOYMENT_ID}" if role in ("owner", "ingress") else ""
        assert tls_secret == f"baton-tls-{role}{own}", role
        if role in ("hooks", "anchor"):
            assert mounted_file(pod, container, env["BATON_ETCD_CERT"])[0] == "etcd-baton-client"
        if role == "owner":
            assert env["BATON_TLS_IP_SERVER_NAME"] == "owner.$(POD_NAMESPACE).svc.$(CLUSTER_DOMAIN)"


def test_the_drain_job_runs_as_the_operator_and_may_reach_hooks_and_owners(
    rendered: Rendered,
) -> None:
    namespace = rendered.one("Deployment", "hooks")["metadata"]["namespace"]
    overlay = {"baton-dev": "dev", "baton": "production"}[namespace]
    old = "build-2026-11-01"
    text = render("drain", "--overlay", overlay, "--from", old, "--to", DEPLOYMENT_ID)
    (job,) = [doc for doc in yaml.safe_load_all(text) if doc]
    assert job["kind"] == "Job" and job["metadata"]["name"] == "drain-build-2026-11-01"
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:6] == [
        "baton",
        "deployments",
        "drain",
        "build-2026-11-01",
        "--to",
        DEPLOYMENT_ID,
    ]
    assert container["image"].endswith(f"baton:{DEPLOYMENT_ID}")
    env = {k: v.get("value", "") for k, v in env_of(container).items()}
    assert mounted_file(pod, container, env["BATON_TLS_CERT"])[0] == "baton-tls-operator"
    assert "baton-tls-operator" in {s["metadata"]["name"] for s in rendered.of("Secret")}
    labels = job["spec"]["template"]["metadata"]["labels"]
    policies = {p["metadata"]["name"]: p["spec"] for p in rendered.of("NetworkPolicy")}

    def admitted(policy: str, port: int) -> bool:
        for rule in policies[policy]["ingress"]:
            if port not in [p["port"] for p in rule["ports"]]:
                continue
            for source in rule["from"]:
                selector = source["podSelector"]
                expressions = selector.get("matchExpressions", [])
                if selector.get("matchLabels", {}).items() <= labels.items() and all(
                    labels.get(e["key"]) in e["values"] for e in expressions
                ):
                    return True
        return False

    assert admitted("hooks-and-anchor", 50052) and admitted("owner", 50054)
    assert not admitted("hooks-and-anchor", 50053) and not admitted("etcd", 2379)


async def test_gen_secrets_certificates_carry_the_identities_and_names_baton_checks(
    tmp_path: Path,
) -> None:
    """Each certificate names its role (owner and ingress: and deployment id)
    in the one spiffe://baton/ URI SAN Baton reads, and carries the DNS names
    the manifests dial it by (hooks' Service, owner-<id>'s, the shared owner
    name for pod-IP dials, the public entry)."""
    from cryptography import x509

    from baton_runtime.common.security.identity import Caller, Role

    secrets = tmp_path / "secrets"
    gen_secrets(secrets, "baton", "build-1")
    svc = "baton.svc.cluster.local"
    expected = {
        "hooks": (Role.HOOKS, "", {f"hooks.{svc}"}),
        "anchor": (Role.ANCHOR, "", {f"anchor.{svc}"}),
        "operator": (Role.OPERATOR, "", set()),
        "owner-build-1": (Role.OWNER, "build-1", {f"owner.{svc}", f"owner-build-1.{svc}"}),
        "ingress-build-1": (
            Role.INGRESS,
            "build-1",
            {f"ingress-build-1.{svc}", f"baton-public.{svc}"},
        ),
    }
    for stem, (role, deployment_id, names) in expected.items():
        cert = x509.load_pem_x509_certificate((secrets / "tls" / f"{stem}.crt").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u.encode() for u in sans.get_values_for_type(x509.UniformResourceIdentifier)]
        caller = Caller.from_peer(uris)
        assert (caller.role, caller.deployment_id) == (role, deployment_id), stem
        assert names <= set(sans.get_values_for_type(x509.DNSName)), stem
    await handshakes(secrets / "tls", svc)


async def handshakes(tls: Path, svc: str) -> None:
    """Servers with gen-secrets.sh's certificates, on loopback, answer
    clients with the callers' certificates that verify them by the names the
    manifests dial (dns:/// Service names, the shared owner name for pod IPs
    through BATON_TLS_IP_SERVER_NAME, the public entry's name)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from baton_runtime.common.clients.channels import open_channel
    from baton_runtime.common.rpc.server import build_server

    def security(stem: str, server_name: str = "") -> Security:
        files = (str(tls / f"{stem}.crt"), str(tls / f"{stem}.key"), str(tls / "ca.crt"))
        return Security.tls(*files, ip_server_name=server_name)

    cases = [  # server, client, name the client verifies the server by
        ("hooks", "owner-build-1", f"hooks.{svc}"),
        ("anchor", "ingress-build-1", f"anchor.{svc}"),
        ("hooks", "operator", f"hooks.{svc}"),
        ("owner-build-1", "ingress-build-1", f"owner-build-1.{svc}"),
        ("owner-build-1", "owner-build-1", f"owner.{svc}"),
        ("ingress-build-1", "operator", f"baton-public.{svc}"),
    ]
    for server_stem, client_stem, name in cases:
        server = build_server("127.0.0.1:0", [], service="probe", security=security(server_stem))
        await server.start()
        channel = open_channel(f"127.0.0.1:{server.port}", security(client_stem, name))
        try:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await channel.close()
            await server.stop(0)


def settings_of(role: str) -> set[str]:
    """The environment variables `python -m baton_runtime.<role> --help` names."""
    result = subprocess.run(
        [sys.executable, "-m", f"baton_runtime.{role}", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "400"},
    )
    return set(re.findall(r"\(env (BATON_[A-Z_]+)\)", result.stdout))


def test_manifests_set_only_settings_the_services_have(rendered: Rendered) -> None:
    for workload in rendered.of("Deployment"):
        (container,) = containers(workload)
        role = container["args"][0]
        known = settings_of(role)
        assert known, role
        extra = {"owner": AGENT_SETTINGS, "anchor": OBJECT_STORE_SETTINGS}.get(role, set())
        unknown = set(env_of(container)) - known - NOT_SETTINGS - extra
        assert not unknown, f"{role}: not settings of baton_runtime.{role}: {sorted(unknown)}"


def test_anchor_names_its_bucket_and_takes_the_credentials_from_their_secret(
    rendered: Rendered,
) -> None:
    """docs/deploy.md "The object store": the bucket in BATON_OBJECT_STORE
    (no credential in the URL), the credentials only from the Secret
    baton-object-store (optional keys: a workload identity may stand in)."""
    (anchor,) = [w for w in rendered.of("Deployment") if w["metadata"]["name"] == "anchor"]
    (container,) = containers(anchor)
    env = env_of(container)
    url = env["BATON_OBJECT_STORE"]["value"]
    assert url.startswith("s3://") and "@" not in url
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "baton-object-store" and ref["optional"] is True, ref
    assert "baton-object-store" in render_py.OPTIONAL_SECRETS


def test_the_image_runs_the_entrypoint_script() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["baton-entrypoint"]' in dockerfile
    assert "COPY --chmod=0755 deploy/entrypoint.sh /usr/local/bin/baton-entrypoint" in dockerfile
    assert re.search(r"^USER \$\{BATON_UID\}", dockerfile, re.M)
    assert dockerfile.count("\nFROM ") == 2, "multi-stage: a build stage and a runtime stage"
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*" and "!deploy/entrypoint.sh" in ignore
    for bad in ([], ["nope"]):
        result = subprocess.run(
            ["sh", str(DEPLOY / "entrypoint.sh"), *bad], capture_output=True, text=True, check=False
        )
        assert result.returncode == 2 and "baton-entrypoint" in result.stderr


# -- the entrypoint, with the manifests' commands -----------------------------------


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value or argument."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value)


def pod_env(
    container: dict[str, Any], pod: dict[str, str], secrets: dict[tuple[str, str], str]
) -> dict[str, str]:
    """The container's environment as the kubelet would build it, for a pod
    with the given fields (name, ip, namespace, labels)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[item["name"]] = pod[source["fieldRef"]["fieldPath"]]
        else:
            ref = source["secretKeyRef"]
            if (ref["name"], ref["key"]) in secrets:
                env[item["name"]] = secrets[ref["name"], ref["key"]]
            else:
                assert ref.get("optional"), ref
    return env


def spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """`baton-entrypoint ARGS` as the image runs it, with only `env` (and
    PATH, and this tree on PYTHONPATH in place of the image's venv)."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            ["sh", str(DEPLOY / "entrypoint.sh"), *args],
            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@dataclass
class Started:
    role: str
    address: str
    proc: subprocess.Popen[bytes]
    grace: int


@pytest.fixture
def started() -> Iterator[list[Started]]:
    procs: list[Started] = []
    try:
        yield procs
    finally:
        for item in procs:
            if item.proc.poll() is None:
                item.proc.kill()
                item.proc.wait(5)


# Plaintext side listeners every service has besides its API port.
_PLAINTEXT_LISTENERS = ("BATON_HEALTH_LISTEN", "BATON_METRICS_LISTEN")


async def test_the_entrypoint_runs_each_service_as_its_manifest_says(
    dev: Rendered, etcd_endpoint: str, tmp_path: Path, started: list[Started]
) -> None:
    rendered = dev
    ports = {role: free_port() for role in BATON_ROLES}
    loopback = {role: f"127.0.0.1:{port}" for role, port in ports.items()}
    health = {role: f"127.0.0.1:{free_port()}" for role in BATON_ROLES}
    metrics = {role: f"127.0.0.1:{free_port()}" for role in BATON_ROLES}
    api_key = SLACK_KEY
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"slack={api_key}\n")
    secrets: dict[tuple[str, str], str] = {}
    # Where Kubernetes names would resolve to pods, loopback addresses
    # instead; where Secrets are mounted, the test PKI's files (its
    # certificates name localhost, its etcd users are hooks and anchor).
    overrides = {
        "BATON_ETCD_ENDPOINT": etcd_endpoint,
        "BATON_ETCD_PREFIX": f"{TEST_PREFIX}deploy-test/{tmp_path.name}/",
        "BATON_HOOKS_ADDR": loopback["hooks"],
        "BATON_ANCHOR_ADDR": loopback["anchor"],
        "BATON_OWNER_ADDR": loopback["owner"],
        "BATON_OWNER_ADVERTISE": loopback["owner"],
        "BATON_TLS_IP_SERVER_NAME": "localhost",
        "BATON_API_KEYS_FILE": str(key_file),
    }
    names = {
        "hooks": "hooks",
        "anchor": "anchor",
        "owner": f"owner-{DEPLOYMENT_ID}",
        "ingress": f"ingress-{DEPLOYMENT_ID}",
    }
    for role in BATON_ROLES:
        workload = rendered.one("Deployment", names[role])
        pod_spec = workload["spec"]["template"]
        (container,) = pod_spec["spec"]["containers"]
        pod = {
            "metadata.name": f"{names[role]}-abc12",
            "metadata.namespace": "baton-dev",
            "status.podIP": "127.0.0.1",
            **{f"metadata.labels['{k}']": v for k, v in pod_spec["metadata"]["labels"].items()},
        }
        env = pod_env(container, pod, secrets)
        listen = next(k for k in env if k.endswith("_LISTEN") and k not in _PLAINTEXT_LISTENERS)
        env[listen] = loopback[role]
        env["BATON_HEALTH_LISTEN"] = health[role]
        env["BATON_METRICS_LISTEN"] = metrics[role]
        own = certs.files(Role(role), DEPLOYMENT_ID if role in ("owner", "ingress") else "")
        files = {"BATON_TLS_CERT": own.cert, "BATON_TLS_KEY": own.key, "BATON_TLS_CA": own.ca}
        files |= {"BATON_ETCD_CERT": own.cert, "BATON_ETCD_KEY": own.key}
        files["BATON_ETCD_CA"] = own.ca
        env |= {k: v for k, v in (overrides | files).items() if k in env}
        args = [expand(a, env) for a in container["args"]]
        proc = spawn(args, env, tmp_path / f"{role}.log")
        started.append(
            Started(role, loopback[role], proc, pod_spec["spec"]["terminationGracePeriodSeconds"])
        )
        # The kubelet's readiness probe: plaintext, on the health port.
        service = container["readinessProbe"]["grpc"]["service"]
        await asyncio.to_thread(wait_serving, health[role], Security.plaintext(), service, 60)
        assert env["BATON_DEPLOYMENT_ID" if role in ("owner", "ingress") else listen]
    with pytest.raises(TimeoutError):  # the API port itself speaks TLS only
        await asyncio.to_thread(wait_serving, loopback["hooks"], Security.plaintext(), "", 1)

    channel = public_channel(loopback["ingress"])
    stub = ingress_pb2_grpc.IngressServiceStub(channel)
    auth = (("authorization", f"Bearer {api_key}"),)
    try:

        async def created() -> str:
            response = await stub.CreateSession(
                ingress_pb.CreateSessionRequest(request_id="deploy-1"), metadata=auth, timeout=10
            )
            return response.session_id

        session_id = await eventually(created, "a session through the ingress")
        await stub.SendMessage(
            ingress_pb.SendMessageRequest(session_id=session_id, text="calc 6*7"),
            metadata=auth,
            timeout=10,
        )

        async def answered() -> bool:
            call = stub.StreamEvents(
                ingress_pb.StreamEventsRequest(session_id=session_id, follow=False),
                metadata=auth,
                timeout=10,
            )
            texts = [
                e.text
                async for r in call
                for e in r.events
                if e.kind == s.EVENT_KIND_MESSAGE_COMPLETED
            ]
            return texts == ["The result is 42."]

        await eventually(answered, "the answer")
        # Each serves Prometheus metrics where its manifest says (moved to loopback).
        for role in BATON_ROLES:
            scraped = await scrape(f"http://{metrics[role]}/metrics")
            assert scraped.total("baton_build_info") == 1, role
        owner = await scrape(f"http://{metrics['owner']}/metrics")
        assert owner.total("baton_turns_total", outcome="completed") == 1
    finally:
        await channel.close()
    # SIGTERM, as the kubelet sends it: each exits 0 well within its grace.
    for item in reversed(started):
        item.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(item.proc.wait, item.grace)
        assert code == 0, (item.role, (tmp_path / f"{item.role}.log").read_text()[-2000:])
