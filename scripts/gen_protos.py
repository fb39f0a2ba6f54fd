"""Generate Python code, gRPC stubs and mypy stubs from protos/ into
services/_proto/ (the servers' copy, imported as `baton_runtime._proto`) and
the client SDK's copy of the public protos into sdk/baton_client/_proto/.

The one way to regenerate: `python scripts/gen_protos.py`. CI runs it and fails
on a diff, so the committed code always matches the protos.

protoc writes modules named after the proto packages (`baton.ingress.v1`),
and `baton` is a top-level name taken on PyPI; so the code is generated into a
scratch directory and copied under the package that imports it, its imports of
`baton.` rewritten to `<package>.baton.` (as temporalio/sdk-python's
gen_protos rewrites its imports): `baton_runtime._proto.baton.ingress.v1` for
the servers, `baton_client._proto.baton.ingress.v1` for the SDK. The SDK (its
own distribution, sdk/) installs without the servers, so it carries the
generated code of the public API only (IngressService and the session messages
it uses). The descriptors are byte for byte the same in both copies, so both
load into one process (the tests) and share their message classes.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
# services/ is installed and imported as `baton_runtime` (pyproject.toml).
SERVER_PACKAGE = "baton_runtime._proto"
SERVER_OUT = ROOT / "services" / "_proto"
SDK_PACKAGE = "baton_client._proto"
SDK_OUT = ROOT / "sdk" / "baton_client" / "_proto"
# The public API and what it imports (google/protobuf comes with protobuf).
SDK_AREAS = ("ingress", "session")
_IMPORT = re.compile(r"^(from|import) baton\.", re.MULTILINE)
# The module name the builder gives the generated classes.
_MODULE = re.compile(r"'baton\.(\w+\.v1\.\w+_pb2)'")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="baton-protos-") as scratch:
        generated = Path(scratch)
        sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
        include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "grpc_tools.protoc",
            f"-I{PROTOS}",
            f"-I{include}",
            f"--python_out={generated}",
            f"--grpc_python_out={generated}",
            f"--mypy_out={generated}",
            f"--mypy_grpc_out={generated}",
            *sources,
        ]
        if protoc.main(args) != 0:
            print("protoc failed", file=sys.stderr)
            return 1
        areas = sorted(p.name for p in (generated / "baton").iterdir() if p.is_dir())
        copy_under(generated, SERVER_PACKAGE, SERVER_OUT, areas)
        copy_under(generated, SDK_PACKAGE, SDK_OUT, SDK_AREAS)
    return 0


def copy_under(generated: Path, package: str, out: Path, areas: Iterable[str]) -> None:
    """`out` anew: the generated code of `areas`, imported as `package.baton.…`."""
    if out.exists():
        shutil.rmtree(out)
    for area in areas:
        source = generated / "baton" / area / "v1"
        target = out / "baton" / area / "v1"
        target.mkdir(parents=True)
        for path in sorted(source.iterdir()):
            if path.suffix not in (".py", ".pyi"):
                continue
            text = _IMPORT.sub(rf"\1 {package}.baton.", path.read_text())
            text = _MODULE.sub(rf"'{package}.baton.\1'", text)
            (target / path.name).write_text(text)
    for directory in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").write_text("")


if __name__ == "__main__":
    sys.exit(main())
