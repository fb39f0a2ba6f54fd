"""The `baton` command (also `python -m baton_runtime.cli`).

baton up [--deployment-id dep-1 [--deployment-id dep-2 ...]] [--port-base 50051]
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
baton sessions list [--filter F] [--limit 100] [--page-size N]
baton sessions get ID|ALIAS
baton sessions events ID|ALIAS [--follow] [--from SEQ]
baton sessions send ID|ALIAS TEXT [--delivery-id D] [--queue]
baton sessions cancel|reset ID|ALIAS [--reason R] [--delivery-id D]
      [--ingress ADDR] [--ca-cert CA | --plaintext] [--tls-server-name NAME]
As an operator (BATON_TLS_CERT/KEY/CA), through hooks, anchor and owners:
baton sessions resume ID | get ID --all-channels | list --all-channels
baton deployments list | describe DEP [--limit 100] | drain OLD --to NEW [--wait 60]
baton handoffs get HANDOFF_ID [--session ID]
      [--hooks ADDR] [--anchor ADDR] [--tls-cert C --tls-key K --tls-ca CA | --plaintext]
Every one of these takes -o text|json|jsonl; defaults come from `baton up`'s
profile (services/cli/system/profile.py); exit codes in services/cli/commands/operate.py.

API keys never come from argv: the ingress reads a key file, `baton demo`
the environment (default: the loopback demo key).

This module assembles the parser from each command group's own module
(up_command, demo_command, operate_parser, key_commands, etcd_commands) and
dispatches to the run each names.
"""

from __future__ import annotations

import argparse
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "up":
        sys.exit(run_up(args))
    if args.command == "demo":
        sys.exit(run_demo_command(args))
    if operate.handles(args):
        sys.exit(operate.run(args))
    if args.command == "hash-key":
        sys.exit(run_hash_key(args))
    if args.command == "etcd" and getattr(args, "action", None) == "check":
        sys.exit(run_etcd_check(args))
    if args.command == "etcd" and getattr(args, "action", None) == "binary":
        sys.exit(run_etcd_binary())
    parser.print_help(sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
