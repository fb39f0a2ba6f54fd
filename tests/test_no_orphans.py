"""An interrupted run leaves no process behind: a test run that is sent
SIGTERM, or that hits its timeout (pytest-timeout ends the process at once),
takes its etcd and services with it (services/cli/system/processes.py starts every
child with PR_SET_PDEATHSIG), although each child runs in a session of its
own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# The processes start in a fixture and the test only sleeps: the child run
# times its test function alone (timeout_func_only), so its timeout can be
# short however long a loaded machine takes to start etcd and hooks.
CHILD_TEST = textwrap.dedent(
    """
    import os, time
    from pathlib import Path

    import pytest

    from baton_runtime.cli.system.etcd_process import EtcdProcess
    from baton_runtime.cli.system.processes import ServiceProcess, free_port, wait_serving
    from baton_runtime.common.security.tls import Security

    @pytest.fixture
    def processes() -> None:
        etcd = EtcdProcess().start()
        port = free_port()
        hooks = ServiceProcess(
            "hooks",
            f"127.0.0.1:{{port}}",
            {{"BATON_PLAINTEXT": "1", "BATON_ETCD_ENDPOINT": etcd.endpoint}},
            log_path=str(Path({workdir!r}) / "hooks.log"),
        ).start()
        wait_serving(f"127.0.0.1:{{port}}", Security.plaintext(), timeout=60)
        pids = Path({workdir!r}) / "pids"
        pids.write_text(f"{{etcd.proc.pid}} {{hooks.pid}}")

    @pytest.mark.timeout({timeout})
    def test_holds_processes(processes: None) -> None:
        time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped yet) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def run_and_interrupt(tmp_path: Path, *, timeout: int, sigterm: bool) -> list[int]:
    (tmp_path / "test_child.py").write_text(
        CHILD_TEST.format(timeout=timeout, workdir=str(tmp_path))
    )
    runner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-o", "timeout_method=thread", "-o", "timeout_func_only=true", "test_child.py"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids_file = tmp_path / "pids"
    try:
        deadline = time.monotonic() + 90
        while not pids_file.exists() or not pids_file.read_text().strip():
            assert runner.poll() is None, "the child test run ended before it started etcd"
            assert time.monotonic() < deadline, "the child test run never started its processes"
            time.sleep(0.1)
        pids = [int(p) for p in pids_file.read_text().split()]
        assert all(alive(pid) for pid in pids)
        if sigterm:
            runner.send_signal(signal.SIGTERM)
        runner.wait(timeout + 60)
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [pid for pid in pids if alive(pid)]
    finally:
        if runner.poll() is None:
            runner.kill()
        if pids_file.exists():
            for pid in (int(p) for p in pids_file.read_text().split()):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_test_run_sent_sigterm_leaves_no_etcd_or_service(tmp_path: Path) -> None:
    assert run_and_interrupt(tmp_path, timeout=300, sigterm=True) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_test_run_that_times_out_leaves_no_etcd_or_service(tmp_path: Path) -> None:
    assert run_and_interrupt(tmp_path, timeout=3, sigterm=False) == []
