"""`baton up` and `baton demo` as real processes: start, talk, stop, and leave
nothing running."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from baton_runtime.cli.__main__ import main as baton_main
from baton_runtime.cli.system.launch_settings import DEMO_API_KEY, LaunchError, LaunchSettings
from baton_runtime.cli.system.launcher import DEMO_DONE_LINE, READY_LINE
from baton_runtime.cli.system.local_system import CERTS_DIR, LocalSystem
from baton_runtime.cli.system.port_plan import DeploymentPorts, Ports
from tests.scrape import Scrape, scrape

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 90.0
DEMO_TIMEOUT = 90.0
STOP_TIMEOUT = 60.0
# Printed labels: shared processes by name, the others as "owner of dep-1".
PROCESSES = {"etcd", "hooks", "anchor", "owner of dep-1", "ingress of dep-1", "console"}
TWO_DEPLOYMENTS = {
    "etcd",
    "hooks",
    "anchor",
    "owner of dep-1",
    "ingress of dep-1",
    "owner of dep-2",
    "ingress of dep-2",
    "console",
}

_STARTED = re.compile(r"^baton up: started ([\w-]+(?: of \S+)?) \(pid (\d+)\) on (\S+)$")
_EVENT = re.compile(r"^#(\d+) +(\S+)")
_RUN_DIR = re.compile(r"^baton up: run dir (\S+),")
_METRICS = re.compile(r"^  (\S+(?: of \S+)?) +(http://127\.0\.0\.1:\d+/metrics)$")


def process_state(pid: int) -> str | None:
    """The /proc state letter of `pid`, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_running(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def is_ours(pid: int) -> bool:
    """Still the etcd/service process we were told about (not a reused PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"baton_runtime." in cmdline or b"etcd" in cmdline


@dataclass
class Launcher:
    """A running `python -m baton_runtime.cli up` and what it has printed."""

    proc: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # label -> metrics URL
    run_dir: str = ""
    # The CLI profile this `baton up` writes: a file of the test's own, never
    # the user's ~/.config/baton/profile.json.
    profile: Path = field(default_factory=Path)
    _readers: list[asyncio.Task[None]] = field(default_factory=list)
    _new_line: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    async def start(cls, *args: str, env: Mapping[str, str] | None = None) -> Launcher:
        profile_path = Path(tempfile.mkdtemp(prefix="baton-profile-")) / "profile.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "baton_runtime.cli",
            "up",
            "--port-base",
            "0",
            "--etcd-port",
            "0",
            *args,
            cwd=ROOT,
            env={**os.environ, "BATON_PROFILE": str(profile_path), **(env or {})},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        launcher = cls(proc, profile=profile_path)
        assert proc.stdout is not None and proc.stderr is not None
        launcher._readers = [
            asyncio.create_task(launcher._read(proc.stdout, launcher.lines)),
            asyncio.create_task(launcher._read(proc.stderr, launcher.errors)),
        ]
        return launcher

    async def _read(self, stream: asyncio.StreamReader, into: list[str]) -> None:
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            into.append(line)
            if match := _STARTED.match(line):
                self.pids[match[1]] = int(match[2])
                self.addresses[match[1]] = match[3]
            elif match := _RUN_DIR.match(line):
                self.run_dir = match[1]
            elif match := _METRICS.match(line):
                self.metrics[match[1]] = match[2]
            self._new_line.set()
        self._new_line.set()

    @property
    def output(self) -> str:
        return "\n".join([*self.lines, "--- stderr ---", *self.errors])

    async def wait_for_line(self, pattern: str, timeout: float) -> re.Match[str]:
        """Poll the printed lines until one matches `pattern` (re.fullmatch);
        fail if the launcher ends first or the time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines:
                if match := re.fullmatch(pattern, line):
                    return match
            if self.proc.returncode is not None or all(r.done() for r in self._readers):
                pytest.fail(f"launcher ended before printing {pattern!r}:\n{self.output}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no {pattern!r} after {timeout:g}s:\n{self.output}")
            self._new_line.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new_line.wait(), min(remaining, 1.0))

    async def wait_exit(self, timeout: float) -> int:
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            pytest.fail(f"launcher did not exit within {timeout:g}s:\n{self.output}")
        await asyncio.wait_for(asyncio.gather(*self._readers), 10)
        return code

    async def kill_everything(self) -> None:
        """Last resort for a failed test: nothing may outlive it."""
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        for pid in self.pids.values():
            if is_running(pid) and is_ours(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        shutil.rmtree(self.profile.parent, ignore_errors=True)


@contextlib.asynccontextmanager
async def launched(*args: str, env: Mapping[str, str] | None = None) -> AsyncIterator[Launcher]:
    launcher = await Launcher.start(*args, env=env)
    try:
        yield launcher
    finally:
        await launcher.kill_everything()


async def run_demo(launcher: Launcher, ingress: str, *args: str) -> tuple[int, str]:
    """`baton demo` against `ingress`, over TLS trusting the launcher's CA,
    with the demo key from the environment."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "baton_runtime.cli",
        "demo",
        "--ingress",
        ingress,
        "--ca-cert",
        str(Path(launcher.run_dir) / CERTS_DIR / "ca.crt"),
        *args,
        cwd=ROOT,
        env={**os.environ, "BATON_API_KEY": DEMO_API_KEY},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), DEMO_TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(errors="replace")


async def scrape_every_process(launcher: Launcher) -> dict[str, Scrape]:
    """Every service process `baton up` started printed its metrics URL, and
    each answers with its build info (etcd serves its own)."""
    # (the web console serves no Prometheus metrics)
    services = {name for name in launcher.pids if not name.startswith(("etcd", "console"))}
    assert set(launcher.metrics) == services, launcher.output
    scrapes = {name: await scrape(url) for name, url in launcher.metrics.items()}
    for name, scraped in scrapes.items():
        assert scraped.total("baton_build_info") == 1, (name, scraped.samples)
    return scrapes


def assert_all_stopped(launcher: Launcher, started: set[str] = PROCESSES) -> None:
    """Exactly `started` were started, none is running, the run dir is gone."""
    assert set(launcher.pids) == started, launcher.output
    running = {name: pid for name, pid in launcher.pids.items() if is_running(pid)}
    assert not running, f"still running after the launcher exited: {running}"
    assert launcher.run_dir, launcher.output
    assert not Path(launcher.run_dir).exists(), f"{launcher.run_dir} was not removed"


async def test_up_then_demo_then_sigterm_stops_everything() -> None:
    async with launched() as launcher:
        await launcher.wait_for_line(re.escape(READY_LINE), STARTUP_TIMEOUT)
        assert set(launcher.pids) == PROCESSES
        assert all(is_running(pid) for pid in launcher.pids.values()), launcher.output

        code, demo_output = await run_demo(launcher, launcher.addresses["ingress of dep-1"])
        assert code == 0, demo_output
        assert "The result is 35." in demo_output, demo_output
        assert '"echo: hello"' in demo_output
        assert "calculator(" in demo_output and "calculator -> 35" in demo_output
        # A subagent (a child session) answers inside a turn.
        assert '"helper says: The result is 42."' in demo_output, demo_output
        assert re.search(
            r"^subagent: helper \(child session ses_\w+\) answered inside turn_3 at #\d+",
            demo_output,
            re.M,
        ), demo_output
        assert "demo finished" in demo_output

        scrapes = await scrape_every_process(launcher)
        owner, ingress = scrapes["owner of dep-1"], scrapes["ingress of dep-1"]
        assert owner.total("baton_turns_total", outcome="completed") >= 3, owner.samples
        assert owner.total("baton_build_info", deployment="dep-1") == 1
        assert ingress.total("baton_sends_total", outcome="accepted") >= 3, ingress.samples
        assert scrapes["hooks"].total("baton_live_instances", deployment="dep-1") == 1

        launcher.proc.send_signal(signal.SIGTERM)
        assert await launcher.wait_exit(STOP_TIMEOUT) == 0, launcher.output
        assert_all_stopped(launcher)
        assert launcher.lines[-1] == "baton up: stopped", launcher.output


async def baton(*args: str, env: Mapping[str, str]) -> tuple[int, str, str]:
    """A `baton` command as a process (awaited, never waited on)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "baton_runtime.cli",
        *args,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("BATON_")} | dict(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), DEMO_TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_baton_sessions_needs_no_flags_against_baton_up() -> None:
    """`baton up` writes the CLI profile (its ingress, hooks, anchor, CA and
    operator certificate) before it says it is ready; `baton sessions
    list/get`, `deployments describe`, `sessions resume` then need no flag and no
    variable but the profile's place (here a test file, not the user's);
    stopping removes the profile."""
    async with launched() as launcher:
        await launcher.wait_for_line(re.escape(READY_LINE), STARTUP_TIMEOUT)
        assert launcher.profile.exists(), launcher.output
        env = {"BATON_PROFILE": str(launcher.profile)}
        code, out, err = await baton("sessions", "list", "-o", "json", env=env)
        assert (code, json.loads(out)) == (0, []), err
        code, demo_output = await run_demo(launcher, launcher.addresses["ingress of dep-1"])
        assert code == 0, demo_output
        session_id = re.search(r"demo finished: session (ses_\w+)", demo_output)
        assert session_id, demo_output
        code, out, err = await baton("sessions", "list", env=env)
        assert code == 0, err
        assert session_id[1] in out
        code, out, err = await baton("sessions", "get", session_id[1], "-o", "json", env=env)
        assert code == 0, err
        assert json.loads(out)["session_id"] == session_id[1]
        # The operator's commands too: the profile names hooks, anchor and
        # operator.crt/.key.
        code, out, err = await baton("deployments", "describe", "dep-1", "-o", "json", env=env)
        assert code == 0, err
        described = json.loads(out)
        # (with the demo's child sessions)
        assert session_id[1] in [v["session_id"] for v in described["sessions"]]
        assert len(described["deployment"]["instances"]) == 1
        code, out, err = await baton("sessions", "resume", session_id[1], env=env)
        assert code == 0 and "is not stalled" in out, err
        launcher.proc.send_signal(signal.SIGTERM)
        assert await launcher.wait_exit(STOP_TIMEOUT) == 0, launcher.output
        assert not launcher.profile.exists()
        assert_all_stopped(launcher)


async def test_up_with_demo_and_sigint() -> None:
    async with launched("--demo") as launcher:
        await launcher.wait_for_line(re.escape(READY_LINE), STARTUP_TIMEOUT)
        await launcher.wait_for_line(r"demo finished: session ses_\w+", DEMO_TIMEOUT)
        assert any("The result is 35." in line for line in launcher.lines), launcher.output
        # Still up after the demo, and it says so, and how to stop it.
        await launcher.wait_for_line(re.escape(DEMO_DONE_LINE), DEMO_TIMEOUT)
        assert "keeps running" in DEMO_DONE_LINE and "Ctrl-C" in DEMO_DONE_LINE
        assert launcher.proc.returncode is None
        assert all(is_running(pid) for pid in launcher.pids.values()), launcher.output

        launcher.proc.send_signal(signal.SIGINT)
        assert await launcher.wait_exit(STOP_TIMEOUT) == 0, launcher.output
        assert_all_stopped(launcher)


async def test_sigterm_during_startup_stops_what_was_started() -> None:
    async with launched() as launcher:
        await launcher.wait_for_line(r"baton up: started hooks .*", STARTUP_TIMEOUT)
        launcher.proc.send_signal(signal.SIGTERM)
        assert await launcher.wait_exit(STOP_TIMEOUT) == 0, launcher.output
        # Whatever had been started by the time the signal arrived is stopped.
        assert {"etcd", "hooks"} <= set(launcher.pids), launcher.output
        assert_all_stopped(launcher, started=set(launcher.pids))


async def test_a_child_dying_during_startup_stops_everything() -> None:
    # The owner cannot load this agent, so it exits while starting.
    async with launched(env={"BATON_AGENT": "no_such_module:build_agent"}) as launcher:
        code = await launcher.wait_exit(STARTUP_TIMEOUT)
        assert code != 0, launcher.output
        assert READY_LINE not in launcher.lines
        assert any("owner" in line and "during startup" in line for line in launcher.errors), (
            launcher.output
        )
        # The owner died after etcd, hooks and anchor were up (the ingress starts
        # alongside the owner, so it may or may not have been started).
        assert {"etcd", "hooks", "anchor", "owner of dep-1"} <= set(launcher.pids), launcher.output
        assert_all_stopped(launcher, started=set(launcher.pids))


async def test_a_taken_port_is_refused_before_starting_anything() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with launched("--port-base", str(port)) as launcher:
            code = await launcher.wait_exit(STARTUP_TIMEOUT)
    assert code == 1, launcher.output
    assert any(f"127.0.0.1:{port} is not free" in line for line in launcher.errors), launcher.output
    assert launcher.pids == {}


def event_seqs(lines: list[str]) -> list[int]:
    """The seqs of the event lines the demo printed, in print order."""
    return [int(match[1]) for line in lines if (match := _EVENT.match(line))]


async def test_two_deployments_demo_upgrades_mid_conversation() -> None:
    async with launched("--deployment-id", "dep-1", "--deployment-id", "dep-2", "--demo") as up:
        await up.wait_for_line(re.escape(READY_LINE), STARTUP_TIMEOUT)
        assert set(up.pids) == TWO_DEPLOYMENTS, up.output
        first, second = up.addresses["ingress of dep-1"], up.addresses["ingress of dep-2"]
        await up.wait_for_line(r"demo finished: session ses_\w+", DEMO_TIMEOUT)
        output = "\n".join(up.lines)

        # The port plan is printed before anything starts.
        plan = next(line for line in up.lines if line.startswith("baton up: ports: "))
        assert "; dep-1: ingress " in plan and "; dep-2: ingress " in plan, plan
        assert f"baton demo --ingress {first} --upgrade-ingress {second}" in output

        # A turn on dep-1, then the send through dep-2's ingress moves the session.
        assert "The result is 35." in output and '"The result is dep-1."' in output, output
        assert f"> whoami   (via the ingress at {second})" in output, output
        handed = [line for line in up.lines if "session.handed_off" in line]
        assert len(handed) == 1 and handed[0].endswith("from dep-1 to dep-2"), output
        assert '"The result is dep-2."' in output, output
        assert output.index(handed[0]) < output.index('"The result is dep-2."')
        assert re.search(
            r"^upgraded: session ses_\w+ moved from dep-1 to dep-2 at #\d+", output, re.M
        )
        # The one follower (on dep-1's ingress) saw every seq once, in order.
        seqs = event_seqs(up.lines)
        assert seqs == list(range(len(seqs))) and len(seqs) > 20, output
        assert (
            f"follower: one StreamEvents call on {first} read #0..#{seqs[-1]} in order: "
            "no gap, no duplicate, no reconnect"
        ) in output
        assert up.proc.returncode is None
        assert all(is_running(pid) for pid in up.pids.values()), up.output

        # `baton demo` on its own: back the other way (dep-2 -> dep-1) ...
        code, demo_output = await run_demo(
            up, second, "--upgrade-ingress", first, "--message", "hi"
        )
        assert code == 0, demo_output
        assert "session.handed_off     from dep-2 to dep-1" in demo_output, demo_output
        assert '"The result is dep-1."' in demo_output, demo_output
        # ... and an "upgrade" to the deployment the session is on is refused.
        code, demo_output = await run_demo(up, first, "--upgrade-ingress", first, "--message", "hi")
        assert code == 1, demo_output
        assert "an upgrade ingress must serve another deployment" in demo_output, demo_output

        up.proc.send_signal(signal.SIGINT)
        assert await up.wait_exit(STOP_TIMEOUT) == 0, up.output
        assert_all_stopped(up, started=TWO_DEPLOYMENTS)
        assert up.lines[-1] == "baton up: stopped", up.output


REPLICATED = {
    "etcd",
    "etcd-2",
    "etcd-3",
    "hooks",
    "hooks-2",
    "anchor",
    "anchor-2",
    "owner of dep-1",
    "owner-2 of dep-1",
    "ingress of dep-1",
    "ingress-2 of dep-1",
    "console",
}


async def test_up_with_three_etcd_members_and_two_replicas_of_everything() -> None:
    async with launched("--etcd-members", "3", "--replicas", "2", "--demo") as up:
        await up.wait_for_line(re.escape(READY_LINE), STARTUP_TIMEOUT)
        assert set(up.pids) == REPLICATED, up.output
        # etcd's health included its members' consistency (one hash, no alarm).
        assert any("etcd consistent: 3 member(s) agree" in line for line in up.lines), up.output
        await up.wait_for_line(r"demo finished: session ses_\w+", DEMO_TIMEOUT)
        assert any("The result is 35." in line for line in up.lines), up.output
        # The demo again, through the second ingress replica.
        code, demo_output = await run_demo(
            up, up.addresses["ingress-2 of dep-1"], "--message", "hi"
        )
        assert code == 0, demo_output
        scrapes = await scrape_every_process(up)
        assert len(scrapes) == 8
        # Both ingress replicas ran a demo conversation.
        for ingress in ("ingress of dep-1", "ingress-2 of dep-1"):
            assert scrapes[ingress].total("baton_sends_total", outcome="accepted") >= 1, ingress
        # One log per process, etcd members included.
        logs = Path(up.run_dir) / "logs"
        assert {p.name for p in logs.glob("*.log")} >= {
            "etcd.log",
            "etcd-3.log",
            "hooks-2.log",
            "owner-2-dep-1.log",
        }
        up.proc.send_signal(signal.SIGTERM)
        assert await up.wait_exit(STOP_TIMEOUT) == 0, up.output
        assert_all_stopped(up, started=REPLICATED)


@pytest.mark.parametrize(
    "value", ["dep-1,dep-1", "latest", "dep-1,"], ids=["repeated", "latest", "empty"]
)
def test_bad_deployment_ids_are_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        baton_main(["up", "--deployment-id", "dep-0", "--deployment-id", value])
    assert exited.value.code == 2
    assert "baton up: deployment id" in capsys.readouterr().err


def test_port_plan_is_validated() -> None:
    one = DeploymentPorts("dep-1", (50051,), (50054,))
    assert Ports.plan(50051, 23790) == Ports((50052,), (50053,), ((23790, 23791),), (one,))
    two = Ports.plan(50051, 23790, ("dep-1", "dep-2", "dep-3"))
    assert two.deployments == (
        one,
        DeploymentPorts("dep-2", (50055,), (50056,)),
        DeploymentPorts("dep-3", (50057,), (50058,)),
    )
    assert (two.ingress, two.hooks, two.anchors, two.owner) == (50051, (50052,), (50053,), 50054)
    assert two.summary() == (
        "etcd 23790 (peer 23791); hooks 50052; anchor 50053; "
        "dep-1: ingress 50051, owner 50054; dep-2: ingress 50055, owner 50056; "
        "dep-3: ingress 50057, owner 50058"
    )
    with pytest.raises(LaunchError, match="out of range"):
        Ports.plan(65534, 23790)
    with pytest.raises(LaunchError, match="out of range"):
        Ports.plan(65529, 23790, ("dep-1", "dep-2", "dep-3"))
    with pytest.raises(LaunchError, match="both use port 50052"):
        Ports.plan(50051, 50052)
    with pytest.raises(LaunchError, match="ingress of dep-2 and etcd .* both use port 50055"):
        Ports.plan(50051, 50055, ("dep-1", "dep-2"))
    free = Ports.plan(0, 0, ("dep-1", "dep-2"))
    # etcd's two, a gRPC and a metrics port for each of 6 service processes,
    # and the console's.
    assert len({port for _, port in free.items()}) == 2 + 2 * 6 + 1
    based = Ports.plan(50051, 23790)
    assert based.metrics == {50052: 51052, 50053: 51053, 50051: 51051, 50054: 51054}
    with pytest.raises(LaunchError, match="hooks metrics and .* both use port 51052"):
        Ports.plan(50051, 51052)


def test_port_plan_with_replicas_and_etcd_members() -> None:
    plan = Ports.plan(50051, 23790, ("dep-1", "dep-2"), replicas=2, etcd_members=3)
    assert plan.hooks == (50052, 50152) and plan.anchors == (50053, 50153)
    assert plan.deployments == (
        DeploymentPorts("dep-1", (50051, 50151), (50054, 50154)),
        DeploymentPorts("dep-2", (50055, 50155), (50056, 50156)),
    )
    assert plan.etcd == ((23790, 23791), (23792, 23793), (23794, 23795))
    assert plan.summary() == (
        "etcd 23790, 23792, 23794 (peers 23791, 23793, 23795); hooks 50052, 50152; "
        "anchor 50053, 50153; dep-1: ingress 50051, 50151, owner 50054, 50154; "
        "dep-2: ingress 50055, 50155, owner 50056, 50156"
    )
    names = [name for name, _ in plan.items()]
    assert names[:6] == [
        "etcd client",
        "etcd peer",
        "etcd-2 client",
        "etcd-2 peer",
        "etcd-3 client",
        "etcd-3 peer",
    ]
    assert "owner-2 of dep-2" in names and "hooks-2" in names
    free = Ports.plan(0, 0, ("dep-1",), replicas=3, etcd_members=3)
    assert len({port for _, port in free.items()}) == 2 * 3 * 4 + 6 + 1
    with pytest.raises(LaunchError, match="would both use"):
        Ports.plan(50051, 50151, replicas=2)


def test_up_passes_the_dedupe_window_to_hooks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`baton up --dedupe-window S` becomes hooks' BATON_DEDUPE_WINDOW (only
    hooks'); without it hooks keeps its default; less than a second is a
    usage error."""
    ports = Ports.plan(50051, 23790)
    system = LocalSystem(
        LaunchSettings(plaintext=True, dedupe_window=5.0), ports, tmp_path, io.StringIO()
    )
    assert system.service_env("hooks", None)["BATON_DEDUPE_WINDOW"] == "5"
    assert "BATON_DEDUPE_WINDOW" not in system.service_env("anchor", None)
    default = LocalSystem(LaunchSettings(plaintext=True), ports, tmp_path, io.StringIO())
    assert "BATON_DEDUPE_WINDOW" not in default.service_env("hooks", None)
    with pytest.raises(SystemExit) as exited:
        baton_main(["up", "--dedupe-window", "0.5"])
    assert exited.value.code == 2
    assert "at least 1 second" in capsys.readouterr().err
