"""A report of the largest modules and functions in services/ (generated code aside).

A report, not a gate: a module is as long as its one concern needs, and
functions stay short by habit (docs/testing.md). Run `python scripts/code_shape.py`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SERVICES = Path(__file__).resolve().parent.parent / "services"


def main(top: int = 15) -> None:
    modules = sorted(p for p in SERVICES.rglob("*.py") if "_proto" not in p.parts)
    sizes = sorted(((len(p.read_text().splitlines()), p) for p in modules), reverse=True)
    functions: list[tuple[int, str]] = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                where = f"{path.relative_to(SERVICES)}:{node.lineno} {node.name}"
                functions.append((lines, where))
    print(f"{len(modules)} modules; the largest {top}:")
    for lines, path in sizes[:top]:
        print(f"  {lines:5d}  {path.relative_to(SERVICES)}")
    print(f"{len(functions)} functions; the longest {top}:")
    for lines, where in sorted(functions, reverse=True)[:top]:
        print(f"  {lines:5d}  {where}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
