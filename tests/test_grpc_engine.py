"""Which gRPC engine a process runs on (services/__init__.py): a service
process gets the classic poller unless GRPC_EXPERIMENTS says otherwise;
any other process importing baton_runtime keeps gRPC's default."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from baton_runtime import _is_service_process
from tests.procs import ProcessStack

CLASSIC = "-event_engine_client,-event_engine_listener"


@pytest.mark.parametrize(
    ("argv", "service"),
    [
        (["python", "-m", "baton_runtime.hooks"], True),
        (["python", "-u", "-X", "dev", "-m", "baton_runtime.owner", "--listen", "x"], True),
        (["python", "-m", "baton_runtime.ingress"], True),
        (["python", "-m", "baton_runtime.anchor"], True),
        (["python", "-m", "baton_runtime.cli", "up"], False),
        (["python", "-m", "baton_runtime.cli.system.orphan_guard", "1", "--"], False),
        (["python", "-m", "pytest"], False),
        (["python", "-m"], False),
        (["baton", "up"], False),
    ],
)
def test_only_a_service_main_is_a_service_process(argv: list[str], service: bool) -> None:
    assert _is_service_process(argv) is service


def _serving_line(log: Path) -> dict[str, object]:
    for line in log.read_text().splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("event") == "serving":
            return dict(record)
    raise AssertionError(f"no serving line in {log}")


def test_service_processes_run_on_the_classic_poller_and_an_explicit_setting_wins(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    """Real processes: each service's "serving" line names the engine
    setting it runs with, and how many start-up objects it froze out of
    the collector's generations (gc.freeze); the test process itself (it
    imported baton_runtime) kept gRPC's default."""
    assert os.environ.get("GRPC_EXPERIMENTS", "") == ""
    stack = ProcessStack(etcd_endpoint, tmp_path / "default", deployment_id="dep-e")
    stacks.append(stack)
    stack.start_deployments(owners={"e1": ("dep-e", "")}, ingresses={"ing-e": ("dep-e", "e1")})
    for name in ("hooks", "anchor", "e1", "ing-e"):
        line = _serving_line(tmp_path / "default" / f"{name}.log")
        assert line["grpc_experiments"] == CLASSIC, name
        assert isinstance(line["frozen_objects"], int) and line["frozen_objects"] > 10_000, name
    chosen = ProcessStack(
        etcd_endpoint,
        tmp_path / "chosen",
        deployment_id="dep-f",
        env={"GRPC_EXPERIMENTS": ""},
    )
    stacks.append(chosen)
    chosen.start_deployments(owners={"f1": ("dep-f", "")}, ingresses={})
    for name in ("hooks", "f1"):
        assert _serving_line(tmp_path / "chosen" / f"{name}.log")["grpc_experiments"] == "", name
