"""The SDK installs and works on its own: built into a wheel, installed into
a fresh virtual environment that holds nothing but its three dependencies
(grpcio, protobuf, googleapis-common-protos, and what they require: this
machine's, linked in, so the test needs no network), where the servers, etcd's client and the dev
tools cannot be imported. There the example of docs/sdk.md runs
against a real stack."""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from baton_runtime.common.security.identity import Role
from tests.stack import SLACK_KEY, Stack

ROOT = Path(__file__).resolve().parent.parent
SDK_DEPENDENCIES = ("grpcio", "protobuf", "googleapis-common-protos")  # as sdk/pyproject.toml
# Importable next to the servers, never next to the SDK alone.
SERVER_SIDE = (
    "baton_runtime",
    "services",
    "baton",
    "aetcd",
    "structlog",
    "cryptography",
    "grpc_tools",
    "pytest",
)


def isolated_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH, no pip configuration or index: only what the venv has."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    return {**keep, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", **extra}


def with_requirements(names: tuple[str, ...]) -> list[str]:
    """`names` and what they require (not their extras), as installed here."""
    found: list[str] = []
    todo = list(names)
    while todo:
        name = todo.pop()
        if name.lower() in found:
            continue
        found.append(name.lower())
        for requirement in importlib.metadata.requires(name) or ():
            if "extra ==" not in requirement:
                match = re.match(r"[A-Za-z0-9._-]+", requirement)
                assert match, requirement
                todo.append(match.group(0))
    return found


def link_distribution(name: str, into: Path) -> None:
    """Symlink the installed files of distribution `name` under `into`."""
    dist = importlib.metadata.distribution(name)
    base = Path(str(dist.locate_file("")))
    for file in dist.files or ():
        source = base / file
        if file.parts[0] == ".." or not source.is_file():
            continue  # scripts outside site-packages
        target = into / file
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(source)


@pytest.fixture(scope="module")
def sdk_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh venv with `baton-client` installed from its wheel."""
    root = tmp_path_factory.mktemp("sdk-install")
    source = root / "sdk"
    shutil.copytree(
        ROOT / "sdk", source, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__")
    )
    wheels = root / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels)]
    if importlib.util.find_spec("setuptools") is not None:
        # Offline, with this machine's setuptools.
        build_env = isolated_env()
        build.append("--no-build-isolation")
    else:
        build_env = {**os.environ}  # pip fetches the build backend from PyPI
    subprocess.run([*build, str(source)], check=True, env=build_env, cwd=root, timeout=300)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=180)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        env=isolated_env(),
        timeout=60,
    ).stdout.strip()
    deps = root / "deps"
    for name in with_requirements(SDK_DEPENDENCIES):
        link_distribution(name, deps)
    (Path(site) / "sdk-deps.pth").write_text(f"{deps}\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--find-links", str(wheels), "baton-client"],
        check=True,
        env=isolated_env(),
        cwd=root,
        timeout=180,
    )
    return python


def run_in(python: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-c", code],
        capture_output=True,
        text=True,
        env=isolated_env(**env),
        cwd=python.parent,
        timeout=120,
    )


def test_the_sdk_installs_and_imports_without_the_servers(sdk_python: Path) -> None:
    check = f"""
import importlib.util, sys
import baton_client
from baton_client import AsyncClient, Client, Settings
print(baton_client.__version__, baton_client.__file__)
present = [m for m in {SERVER_SIDE!r} if importlib.util.find_spec(m) is not None]
assert not present, present
client = Client(Settings(target="127.0.0.1:1", api_key="k", plaintext=True))
client.close()
"""
    done = run_in(sdk_python, check)
    assert done.returncode == 0, done.stderr
    version, path = done.stdout.split()
    assert version == "0.1.0" and "site-packages" in path and not path.startswith(str(ROOT))
    pip_check = subprocess.run(
        [str(sdk_python), "-m", "pip", "check"],
        capture_output=True,
        text=True,
        env=isolated_env(),
        timeout=120,
    )
    assert pip_check.returncode == 0, pip_check.stdout


def documented_example(index: int = 0) -> str:
    """The python blocks of docs/sdk.md, by position (0: the first)."""
    text = (ROOT / "docs" / "sdk.md").read_text()
    found = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(found) > index, "docs/sdk.md lacks the python example"
    return str(found[index])


async def run_documented_example(sdk_python: Path, stack: Stack, tmp_path: Path, index: int) -> str:
    """Against a real stack, configured as `baton up` leaves it: a profile
    with the ingress and its CA. Its output."""
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "ingress": stack.addr(stack.ingress),
                "ca_cert": stack.pki.files(Role.OPERATOR).ca,
                "plaintext": False,
            }
        )
    )
    process = await asyncio.create_subprocess_exec(
        str(sdk_python),
        "-c",
        documented_example(index),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=isolated_env(BATON_PROFILE=str(profile), BATON_API_KEY=SLACK_KEY),
        cwd=str(tmp_path),
    )
    async with asyncio.timeout(90):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_the_documented_example_runs_with_the_sdk_alone(
    sdk_python: Path, stack: Stack, tmp_path: Path
) -> None:
    out = await run_documented_example(sdk_python, stack, tmp_path, 0)
    assert out.startswith("agent: "), out


async def test_the_documented_approval_example_runs_with_the_sdk_alone(
    sdk_python: Path, stack: Stack, tmp_path: Path
) -> None:
    """docs/sdk.md's approval: the request's tool call is shown, the
    approval sent, and the approved tool's result answered."""
    out = await run_documented_example(sdk_python, stack, tmp_path, 1)
    assert out.splitlines() == [
        'approve? transfer {"amount":"5"}',
        "agent: The result is transferred 5.",
    ], out


async def test_the_documented_streaming_example_runs_with_the_sdk_alone(
    sdk_python: Path, stack: Stack, tmp_path: Path
) -> None:
    """docs/sdk.md's streamed answer: the text printed as it is written (a
    prefix of the answer, most of it: the last part may race the commit),
    then the committed answer."""
    answer = "".join(f"{i}," for i in range(40))
    out = await run_documented_example(sdk_python, stack, tmp_path, 2)
    streamed, committed = out.splitlines()
    assert committed == f"agent: {answer}", out
    assert answer.startswith(streamed) and len(streamed) > len(answer) // 2, out
