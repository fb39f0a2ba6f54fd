"""The `baton` command (also `python -m baton_runtime.cli`).

baton up [--deployment-id dep-1 [--deployment-id dep-2 ...]] [--agent [DEP=]MODULE:FACTORY ...]
         [--port-base 50051]
         [--etcd-port 23790] [--replicas 1] [--etcd-members 1] [--demo]
         [--api-key-file FILE] [--run-dir DIR] [--plaintext]
         [--etcd-binary PATH] [--accept-etcd-risk]    (docs/etcd.md: a safe etcd)
         [--stream-retention-events 100000] [--stream-retention 604800]
baton demo [--ingress 127.0.0.1:50051] [--upgrade-ingress 127.0.0.1:50055 ...]
           (--ca-cert CA | --plaintext)              (API key: env BATON_API_KEY)
baton hash-key CHANNEL                               (reads the key from stdin)
baton etcd check [--etcd ENDPOINTS] [-o text|json]   (root's etcd certificate: --etcd-cert/
                                                      key/ca or BATON_ETCD_*, or --plaintext)
baton etcd binary                                    (the etcd `baton up` would start)
baton --version

As a channel (API key: env BATON_API_KEY), through the ingress:
baton sessions list [--filter F] [--order-by O] [--limit 100] [--page-size N]
baton sessions create [--alias RAW ...] [--request-id K] [--timeout S] [--token-budget N]
baton sessions get ID|ALIAS
baton sessions events ID|ALIAS [--follow] [--from SEQ]
baton sessions send ID|ALIAS TEXT [--delivery-id D] [--queue]
baton sessions answer ID|ALIAS REQUEST (--approve | --deny | --text T) [--delivery-id D]
baton sessions cancel|reset ID|ALIAS [--reason R] [--delivery-id D]
      [--ingress ADDR] [--ca-cert CA | --plaintext] [--tls-server-name NAME]
As an operator (BATON_TLS_CERT/KEY/CA), through hooks, anchor and owners:
baton sessions resume ID | get ID --all-channels | list --all-channels
baton deployments list | describe DEP [--limit 100] | drain OLD --to NEW [--wait 60]
      | undrain DEP
baton handoffs get HANDOFF_ID [--session ID]
      [--hooks ADDR] [--anchor ADDR] [--tls-cert C --tls-key K --tls-ca CA | --plaintext]
Every one of these takes -o text|json|jsonl; defaults come from `baton up`'s
profile (services/cli/system/profile.py); exit codes in services/cli/commands/operate.py
(and 141 when the reader of the output closed the pipe, `... | head`).

API keys never come from argv: the ingress reads a key file, `baton demo`
the environment (default: the loopback demo key).

This module assembles the parser from each command group's own module
(up_command, demo_command, operate_parser, key_commands, etcd_commands) and
dispatches to the run each names.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from baton_runtime.cli.commands import operate, operate_parser
from baton_runtime.cli.commands.demo_command import add_demo_command, run_demo_command
from baton_runtime.cli.commands.etcd_commands import (
    add_etcd_commands,
    run_etcd_binary,
    run_etcd_check,
)
from baton_runtime.cli.commands.key_commands import add_hash_key_command, run_hash_key
from baton_runtime.cli.commands.up_command import add_up_command, run_up
from baton_runtime.common.observability import build_info


def build_parser() -> argparse.ArgumentParser:
    """Every `baton` command, in the order `baton --help` lists them."""
    parser = argparse.ArgumentParser(prog="baton", description="Run Baton locally and talk to it.")
    parser.add_argument("--version", action="version", version=f"baton {build_info.version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_up_command(commands)
    add_demo_command(commands)
    operate_parser.add_session_commands(commands)
    operate_parser.add_deployment_commands(commands)
    operate_parser.add_handoff_commands(commands)
    add_hash_key_command(commands)
    add_etcd_commands(commands)
    return parser


EXIT_PIPE_CLOSED = 141
"""A reader closed the pipe (`... -o jsonl | head`): what a shell reports
for a process SIGPIPE ended (128 + 13), said quietly."""


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "up":
        return run_up(args)
    if args.command == "demo":
        return run_demo_command(args)
    if operate.handles(args):
        return operate.run(args)
    if args.command == "hash-key":
        return run_hash_key(args)
    if args.command == "etcd" and getattr(args, "action", None) == "check":
        return run_etcd_check(args)
    if args.command == "etcd" and getattr(args, "action", None) == "binary":
        return run_etcd_binary()
    parser.print_help(sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = _run(parser, args)
        sys.stdout.flush()  # here, where a closed pipe can still be said quietly
    except BrokenPipeError:
        # The reader is gone: no traceback, and nothing more to flush at exit
        # (Python's own advice: point stdout at devnull).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = EXIT_PIPE_CLOSED
    sys.exit(code)


if __name__ == "__main__":
    main()
