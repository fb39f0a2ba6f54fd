"""`baton up`: the whole system on one machine, as real processes.

Creates a throwaway CA and one certificate per role in `{run dir}/certs`
(TLS on every hop; see `baton_runtime.common.security.pki`), starts etcd (one member, or a
cluster of `--etcd-members`) with TLS and user/role auth (the hooks and
anchor certificates are etcd users limited to the `/baton/` prefix), then
hooks and anchor (shared), then an owner and an ingress for each deployment
id given (each of them `--replicas` times), each as a child process with its
log in the run directory. `--plaintext` runs all of it without TLS or etcd
auth, on loopback. Waits until every process answers its health check and
every owner has registered with hooks, prints the endpoints, optionally runs
the demo, and then supervises: SIGINT/SIGTERM (or any child exiting) stops
everything it started, by PID — SIGTERM first, a kill after a timeout — and
removes the run directory unless the user chose it.

This module is the run of one `baton up` from start to stop, what it prints
and the demo child; the rooms it drives: `launch_settings.py` (what was
asked), `port_plan.py` (the ports), `local_system.py` (starting, awaiting
and stopping the processes), `service_env.py` (each service's environment)
and `supervised.py` (children and stop signals).

Every client is given all replicas of what it calls (comma-separated
addresses, balanced round-robin) and every etcd member's endpoint.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from baton_runtime.cli.system import profile
from baton_runtime.cli.system.launch_settings import (
    DEMO_API_KEY,
    DEMO_CHANNEL,
    LaunchError,
    LaunchSettings,
)
from baton_runtime.cli.system.local_system import LocalSystem
from baton_runtime.cli.system.port_plan import Ports
from baton_runtime.cli.system.service_env import python_path
from baton_runtime.cli.system.supervised import StopSignals
from baton_runtime.common.security.identity import Role

# What `baton up --demo` says once the demo has ended: the system stays up.
DEMO_DONE_LINE = (
    "baton up: the demo is over; Baton keeps running (try `baton sessions list`). "
    "Ctrl-C or SIGTERM stops everything."
)
READY_LINE = "baton up: ready"


def demo_command(ports: Ports, ca_cert: str = "") -> list[str]:
    """`baton demo` arguments for this system: the session starts on the first
    deployment's ingress and, with more deployments, moves through the others';
    TLS trusting `ca_cert`, else plaintext."""
    args = ["--ingress", f"127.0.0.1:{ports.ingress}"]
    for dep in ports.deployments[1:]:
        args += ["--upgrade-ingress", f"127.0.0.1:{dep.ingress}"]
    return args + (["--ca-cert", ca_cert] if ca_cert else ["--plaintext"])


def _run_demo_child(system: LocalSystem, signals: StopSignals, time_limit: float) -> None:
    """Run `baton demo` as a child process against this system, supervising it.
    It uses the demo key, or BATON_API_KEY when given a key file."""
    key = os.environ.get("BATON_API_KEY", "") if system.settings.api_key_file else ""
    env = {**os.environ, "PYTHONPATH": python_path(), "BATON_API_KEY": key or DEMO_API_KEY}
    system.say("baton up: running the demo")
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "baton_runtime.cli",
            "demo",
            *demo_command(system.ports, system.ca_cert),
            "--time-limit",
            f"{time_limit:g}",
        ],
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + time_limit + 30
        while demo.poll() is None:
            if signals.requested or time.monotonic() > deadline:
                return
            system.raise_if_any_died(during="the demo")
            time.sleep(0.1)
        if demo.returncode != 0:
            system.say(f"baton up: the demo failed (exit code {demo.returncode}); still running")
        system.say(DEMO_DONE_LINE)
    finally:
        if demo.poll() is None:
            demo.terminate()
            try:
                demo.wait(5)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait(5)


def _announce(system: LocalSystem) -> None:
    settings = system.settings
    deployments = system.ports.deployments
    if len(deployments) == 1:
        only = deployments[0]
        system.say(
            f"Baton is up: deployment {only.deployment_id}, public API at 127.0.0.1:{only.ingress}"
        )
    else:
        apis = ", ".join(
            f"{dep.deployment_id} (public API at 127.0.0.1:{dep.ingress})" for dep in deployments
        )
        system.say(f"Baton is up: deployments {apis}")
    for line in system.describe():
        system.say(line)
    system.say("Prometheus metrics (plaintext HTTP, loopback):")
    for line in system.describe_metrics():
        system.say(line)
    if not settings.api_key_file:
        system.say(
            f"API key: channel {DEMO_CHANNEL!r}, key {DEMO_API_KEY!r} "
            f"(authorization: Bearer {DEMO_API_KEY}; loopback demo only)"
        )
    else:
        system.say(f"API keys: from {settings.api_key_file} (re-read on SIGHUP to the ingress)")
    if system.pki is not None:
        system.say(
            f"TLS on every hop: CA {system.ca_cert}, certificates in {system.cert_dir} "
            "(operator.crt/.key for internal servers)"
        )
        tls = f"-cacert {system.ca_cert}"
    else:
        system.say("PLAINTEXT: no TLS and no etcd auth (--plaintext; loopback only)")
        tls = "-plaintext"
    system.say(
        f"Console: {system.console_url} (loopback; other callers present the console "
        f"token {system.console_token}: docs/console.md)"
    )
    system.say(f"Try:  baton demo {' '.join(demo_command(system.ports, system.ca_cert))}")
    system.say(f"      grpcurl {tls} 127.0.0.1:{system.ports.ingress} list")
    system.say("Ctrl-C or SIGTERM stops everything.")
    system.say(READY_LINE)


def _write_profile(system: LocalSystem) -> None:
    """Where `baton sessions ...` finds this system with no flags
    (services/cli/system/profile.py)."""
    path = profile.default_path()
    operator = system.pki.files(Role.OPERATOR) if system.pki is not None else None
    try:
        profile.write(
            path,
            profile.Profile(
                ingress=f"127.0.0.1:{system.ports.ingress}",
                ca_cert=system.ca_cert,
                plaintext=system.pki is None,
                hooks=f"127.0.0.1:{system.ports.hooks[0]}",
                anchor=f"127.0.0.1:{system.ports.anchors[0]}",
                operator_cert=operator.cert if operator is not None else "",
                operator_key=operator.key if operator is not None else "",
                run_dir=str(system.run_dir),
            ),
        )
    except OSError as exc:
        system.say(f"baton up: no CLI profile written ({exc}); pass --ingress/--ca-cert")
        return
    system.say(f"CLI profile: {path} (baton sessions list, baton deployments list need no flags)")


def launch(settings: LaunchSettings, out: TextIO | None = None) -> int:
    """`baton up`: returns the process exit code."""
    stream = out or sys.stdout
    with StopSignals().installed() as signals:
        try:
            ports = _planned_ports(settings)
        except LaunchError as exc:
            _complain(str(exc))
            return 1
        run_dir, own_dir = _run_dir(settings)
        system = LocalSystem(settings, ports, run_dir, stream)
        system.say(f"baton up: run dir {run_dir}, service logs in {system.log_dir}")
        system.say(f"baton up: ports: {ports.summary()}")
        code = 0
        try:
            _run(system, signals)
        except LaunchError as exc:
            _complain(str(exc))
            code = 1
        finally:
            if not _stop(system, signals, own_dir):
                code = 1
        return code


def _planned_ports(settings: LaunchSettings) -> Ports:
    """The port plan, every port checked to be free (else LaunchError)."""
    ports = Ports.plan(
        settings.port_base,
        settings.etcd_port,
        settings.deployment_ids,
        replicas=settings.replicas,
        etcd_members=settings.etcd_members,
    )
    ports.check_free()
    return ports


def _run_dir(settings: LaunchSettings) -> tuple[Path, bool]:
    """The run directory, and whether it is ours to remove (none was given)."""
    if settings.run_dir is None:
        return Path(tempfile.mkdtemp(prefix="baton-up-")), True
    run_dir = Path(settings.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, False


def _run(system: LocalSystem, signals: StopSignals) -> None:
    """Start everything, say so, run the demo if asked, then supervise
    until a stop signal; raises LaunchError when a child dies."""
    if not system.start(signals):
        return
    _write_profile(system)  # before the ready line: readers may start then
    _announce(system)
    if system.settings.demo:
        _run_demo_child(system, signals, time_limit=60.0)
    while not signals.requested:
        system.raise_if_any_died(during="operation")
        time.sleep(0.2)


def _stop(system: LocalSystem, signals: StopSignals, own_dir: bool) -> bool:
    """Stop every child, forget the profile and remove a run dir of our
    own; False if a child could not be stopped."""
    system.say(f"baton up: stopping ({signals.name or 'error'})")
    profile.remove_if_ours(profile.default_path(), str(system.run_dir))
    problems = system.stop()
    for problem in problems:
        _complain(f"could not stop {problem}")
    if own_dir:
        shutil.rmtree(system.run_dir, ignore_errors=True)
        system.say(f"baton up: removed {system.run_dir}")
    system.say("baton up: stopped")
    return not problems


def _complain(line: str) -> None:
    print(f"baton up: {line}", file=sys.stderr, flush=True)
