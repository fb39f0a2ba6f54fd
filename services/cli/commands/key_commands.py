"""`baton hash-key CHANNEL`: the API key file line that grants a key (read
from stdin, never argv) as a hash, so the file need not hold the key."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import BatonError
from baton_runtime.common.ids import validate_channel
from baton_runtime.ingress import api_keys


def add_hash_key_command(commands: Any) -> None:
    hash_key = commands.add_parser(
        "hash-key",
        help="print the API key file line that grants a key (read from stdin) as a hash",
        description=(
            "Read an API key from stdin (never argv) and print `CHANNEL=sha256:<hex>`, "
            "the key file line that grants it without storing it."
        ),
    )
    hash_key.add_argument("channel")


def run_hash_key(args: argparse.Namespace) -> int:
    """Print `CHANNEL=sha256:<hex>`; 2 for a bad channel or key."""
    key = sys.stdin.readline().strip()
    try:
        print(api_keys.hash_line(validate_channel(args.channel), key))
    except (ConfigError, BatonError) as exc:
        print(f"baton hash-key: {exc}", file=sys.stderr)
        return 2
    return 0
