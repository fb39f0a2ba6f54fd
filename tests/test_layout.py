"""The tree is the architecture (docs/architecture.md): every module under
services/ is named on that page, calls between a service's subpackages go
one way, lowest layer first, as the page's tables say, and the rooms a run's
shell drives hold none of each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parent.parent / "services"
ARCHITECTURE = (SERVICES.parent / "docs" / "architecture.md").read_text()

# Each service's subpackages, lowest first: a subpackage may import only those
# before it in its list (and anything outside its service that is below it).
LAYERS = {
    "common": ["observability", "security", "etcd", "rpc", "streams", "clients"],
    "owner": ["agents", "rules", "handoff", "run", "host"],
    "cli": ["system", "commands"],
}
# common's floor (its top-level modules) imports no subpackage, but config.py,
# which builds the settings of the TLS and etcd rooms.
COMMON_FLOOR_EXCEPTIONS = {"config.py"}
# rpc/ serves without etcd: a store is the domain's, never the server's.
NOT_BELOW = {("common", "rpc"): {"etcd"}}


def _modules() -> list[Path]:
    return sorted(
        p
        for p in SERVICES.rglob("*.py")
        if "_proto" not in p.parts and p.name not in {"__init__.py", "__main__.py"}
    )


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("baton_runtime."):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _room(dotted: str) -> tuple[str, str] | None:
    """(service, subpackage or '') of a module path under baton_runtime."""
    parts = dotted.split(".")[1:]
    if not parts or parts[0] == "_proto":
        return None
    service = parts[0]
    if len(parts) >= 2 and parts[1] in LAYERS.get(service, []):
        return service, parts[1]
    return service, ""


def test_every_module_is_named_in_architecture_md() -> None:
    missing = []
    for path in _modules():
        inside_service = path.relative_to(SERVICES).parts[1:]
        if f"`{'/'.join(inside_service)}`" not in ARCHITECTURE:
            missing.append(str(path.relative_to(SERVICES)))
    assert _modules()
    assert not missing, f"docs/architecture.md does not name: {missing}"


@pytest.mark.parametrize("service", sorted(LAYERS))
def test_calls_go_one_way(service: str) -> None:
    order = LAYERS[service]
    upward = []
    for path in (SERVICES / service).rglob("*.py"):
        if "_proto" in path.parts:
            continue
        inside = path.relative_to(SERVICES / service).parts
        own = inside[0] if len(inside) > 1 and inside[0] in order else ""
        if not own and not (service == "common" and inside[0] not in COMMON_FLOOR_EXCEPTIONS):
            continue  # the top level of owner and cli assembles everything
        for target in _imports(path):
            room = _room(target)
            if room is None or room[0] != service or room[1] == own:
                continue
            allowed = order[: order.index(own)] if own else []
            allowed = [r for r in allowed if r not in NOT_BELOW.get((service, own), set())]
            if room[1] and room[1] not in allowed:
                upward.append(f"{path.relative_to(SERVICES)} imports {target}")
    assert not upward, "calls that run back up:\n" + "\n".join(sorted(upward))


# The rooms a run's shell (owner/run/session.py) drives: each holds and calls
# none of the others and never the shell; the shell asks the rules and carries
# out what they answer (docs/architecture.md, owner).
SHELL_ROOMS = {"inbox_buffer", "step", "commit", "upkeep", "departures", "compaction"}


def test_the_rooms_of_a_run_call_no_other_room_and_never_the_shell() -> None:
    run = SERVICES / "owner" / "run"
    calls = []
    for room in sorted(SHELL_ROOMS):
        for target in _imports(run / f"{room}.py"):
            parts = target.split(".")
            if parts[:3] != ["baton_runtime", "owner", "run"] or len(parts) < 4:
                continue
            if parts[3] in SHELL_ROOMS | {"session"} and parts[3] != room:
                calls.append(f"run/{room}.py imports {target}")
    assert not calls, "rooms that hold or call each other:\n" + "\n".join(sorted(set(calls)))


BENCH = SERVICES.parent / "bench"


def _imports_of_tests(path: Path) -> list[str]:
    """The modules of tests/ that `path` imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found += [name for name in names if name == "tests" or name.startswith("tests.")]
    return found


def test_bench_imports_nothing_from_tests() -> None:
    """The benches stand on the package's launcher and their own library
    (bench/stack.py, measure.py, floor.py, turns.py, scrape.py), never on
    the test suite."""
    modules = sorted(BENCH.rglob("*.py"))
    assert modules
    found = [
        f"{p.relative_to(BENCH.parent)} imports {m}" for p in modules for m in _imports_of_tests(p)
    ]
    assert not found, "bench imports tests:\n" + "\n".join(found)
