"""Generate Python code, gRPC stubs and mypy stubs from protos/ into baton/,
and the client SDK's copy of the public protos into sdk/baton_client/_proto/.

The one way to regenerate: `python scripts/gen_protos.py`. CI runs it and fails
on a diff, so the committed code always matches the protos.

The SDK (its own distribution, sdk/) installs without the servers, so it
carries the generated code of the public API (IngressService and the
session messages it uses) under its own package: the same files with their
imports of `baton.` rewritten to `baton_client._proto.baton.` (as
temporalio/sdk-python's gen_protos rewrites its imports). The descriptors
are byte for byte the servers', so both copies load into one process (the
tests) and share their message classes.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "baton"
SDK_PACKAGE = "baton_client._proto"
SDK_OUT = ROOT / "sdk" / "baton_client" / "_proto"
# The public API and what it imports (google/protobuf comes with protobuf).
SDK_AREAS = ("ingress", "session")
_IMPORT = re.compile(r"^(from|import) baton\.", re.MULTILINE)
# The module name the builder gives the generated classes.
_MODULE = re.compile(r"'baton\.(\w+\.v1\.\w+_pb2)'")


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
    copy_for_sdk()
    return 0


def copy_for_sdk() -> None:
    """The SDK's copy of the public protos' generated code, imports rewritten."""
    if SDK_OUT.exists():
        shutil.rmtree(SDK_OUT)
    for area in SDK_AREAS:
        source = OUT / area / "v1"
        target = SDK_OUT / "baton" / area / "v1"
        target.mkdir(parents=True)
        for path in sorted(source.iterdir()):
            if path.suffix not in (".py", ".pyi"):
                continue
            text = _IMPORT.sub(rf"\1 {SDK_PACKAGE}.baton.", path.read_text())
            text = _MODULE.sub(rf"'{SDK_PACKAGE}.baton.\1'", text)
            (target / path.name).write_text(text)
    for directory in [SDK_OUT, *(p for p in SDK_OUT.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").write_text("")


if __name__ == "__main__":
    sys.exit(main())
