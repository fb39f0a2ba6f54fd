"""The servers' distribution, built as a user's pip builds it: its wheel and
its sdist hold one import package, `baton_runtime` (services/ and the
generated protos under it), no `services` or `baton`; the wheel built from
the sdist is the same; from the wheel alone, with `services` and `baton`
unimportable, every module imports and `baton --version` answers."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "baton_runtime"


def offline_env() -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    return {**keep, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}


def source_tree(into: Path) -> Path:
    """What a clone holds for the build: pyproject, README, services/ and the
    symlink (kept a symlink)."""
    into.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, into / name)
    shutil.copytree(
        ROOT / "services",
        into / "services",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    (into / PACKAGE).symlink_to(os.readlink(ROOT / PACKAGE))
    return into


def build_wheel(source: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(source)],
        check=True, env=offline_env(), cwd=source.parent, timeout=300,
    )  # fmt: skip
    (wheel,) = out.glob("baton_runtime-*.whl")
    return wheel


def top_levels(names: list[str]) -> set[str]:
    return {PurePosixPath(name).parts[0] for name in names}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(wheel from the tree, sdist, wheel from the unpacked sdist)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("the build backend (setuptools) is not installed here")
    root = tmp_path_factory.mktemp("packaging")
    source = source_tree(root / "src")
    wheel = build_wheel(source, root / "wheel")
    sdists = root / "sdist"
    subprocess.run(
        [sys.executable, "-c",
         "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
         str(sdists)],
        check=True, env=offline_env(), cwd=source, timeout=300, capture_output=True,
    )  # fmt: skip
    (sdist,) = sdists.glob("baton_runtime-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(root / "unpacked", filter="data")
    (unpacked,) = (root / "unpacked").iterdir()
    again = build_wheel(unpacked, root / "wheel-from-sdist")
    return wheel, sdist, again


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_holds_baton_runtime_alone(built: tuple[Path, Path, Path]) -> None:
    wheel, _, _ = built
    names = wheel_names(wheel)
    (info,) = {top for top in top_levels(names) if top.endswith(".dist-info")}
    assert top_levels(names) == {PACKAGE, info}
    for expected in (
        "baton_runtime/py.typed",
        "baton_runtime/cli/__main__.py",
        "baton_runtime/owner/agents/fixture.py",
        "baton_runtime/_proto/baton/ingress/v1/ingress_pb2.py",
        "baton_runtime/_proto/baton/ingress/v1/ingress_pb2.pyi",
        "baton_runtime/_proto/baton/session/v1/session_pb2_grpc.py",
        # the web console's pages and script (package data)
        "baton_runtime/console/templates/session.html",
        "baton_runtime/console/static/console.js",
    ):
        assert expected in names, expected
    with zipfile.ZipFile(wheel) as archive:
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        top_level = archive.read(f"{info}/top_level.txt").decode().split()
    assert "baton = baton_runtime.cli.__main__:main" in entry_points
    assert top_level == [PACKAGE]
    # Every module of services/ is in it (nothing left behind by discovery).
    modules = {
        f"{PACKAGE}/{path.relative_to(ROOT / 'services').as_posix()}"
        for path in (ROOT / "services").rglob("*.py")
    }
    assert modules <= set(names), sorted(modules - set(names))


def test_the_sdist_builds_the_same_wheel(built: tuple[Path, Path, Path]) -> None:
    wheel, sdist, again = built
    with tarfile.open(sdist) as tar:
        members = [PurePosixPath(m.name) for m in tar.getmembers()]
    inside = {m.parts[1] for m in members if len(m.parts) > 1}
    assert PACKAGE in inside and "services" not in inside and "baton" not in inside
    assert sorted(wheel_names(again)) == sorted(wheel_names(wheel))


def test_the_wheel_runs_without_services_or_baton(
    built: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    wheel, _, _ = built
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")
    code = "\n".join(
        [
            "import importlib, pkgutil, sys",
            f"sys.path.insert(0, {str(tmp_path / 'site')!r})",
            "sys.modules['services'] = None  # import services -> ImportError",
            "sys.modules['baton'] = None",
            f"import {PACKAGE}",
            f"assert {PACKAGE}.__file__.startswith({str(tmp_path)!r}), {PACKAGE}.__file__",
            f"for m in pkgutil.walk_packages({PACKAGE}.__path__, '{PACKAGE}.'):",
            "    if not m.name.endswith('__main__'):",
            "        importlib.import_module(m.name)",
            "from baton_runtime.cli.__main__ import main",
            "sys.argv = ['baton', '--version']",
            "main()",
        ]
    )
    # -I: neither the working directory nor PYTHONPATH (the checkout) is on the path.
    result = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("baton "), result.stdout
