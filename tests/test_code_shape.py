"""The shape the code keeps (issues 17 and 21): no module
in services/ over 400 lines and no function over 50, generated code aside. A
change that outgrows one splits it by concern instead."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parent.parent / "services"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50


def _modules() -> list[Path]:
    return sorted(p for p in SERVICES.rglob("*.py") if "_proto" not in p.parts)


def test_no_module_in_services_is_over_400_lines() -> None:
    long = {
        str(path.relative_to(SERVICES)): lines
        for path in _modules()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert _modules(), "no modules found"
    assert not long, f"over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_in_services_is_over_50_lines() -> None:
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SERVICES)}:{node.lineno} {node.name} {lines}")
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"
