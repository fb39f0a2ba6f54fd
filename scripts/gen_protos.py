"""Generate Python code, gRPC stubs and mypy stubs from protos/ into baton/.

The one way to regenerate: `python scripts/gen_protos.py`. CI runs it and fails
on a diff, so the committed code always matches the protos.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "baton"


def main() -> int:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        f"--mypy_out={ROOT}",
        f"--mypy_grpc_out={ROOT}",
        *sources,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for directory in [OUT, *(p for p in OUT.rglob("*") if p.is_dir())]:
        init = directory / "__init__.py"
        if not init.exists():
            init.write_text("")
    (OUT / "py.typed").write_text("")
    return 0


if __name__ == "__main__":
    sys.exit(main())
