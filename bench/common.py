"""What every benchmark's command line does alike: smoke counts, a log
directory that is removed after a clean run and kept (and named) after a
failed one, the JSON figures file and timestamped progress lines."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any


def apply_smoke(
    parser: argparse.ArgumentParser, args: argparse.Namespace, smoke: Mapping[str, Any]
) -> None:
    """With --smoke, tiny counts for the options not given explicitly."""
    if not args.smoke:
        return
    for name, value in smoke.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)


@contextlib.contextmanager
def log_dir(given: str | None, prefix: str) -> Iterator[str]:
    """`given` (kept), or a fresh temporary directory that is removed when the
    block ends cleanly and kept, with a line saying where, when it fails."""
    path = given or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(path, exist_ok=True)
    try:
        yield path
    except BaseException:
        if not given:
            print(f"logs kept in {path}", file=sys.stderr)
        raise
    if not given:
        shutil.rmtree(path, ignore_errors=True)


def write_json(path: str | None, figures: Any) -> None:
    if not path:
        return
    with open(path, "w") as out:
        json.dump(figures, out, indent=2)
        out.write("\n")


def progress(message: str) -> None:
    """A timestamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
