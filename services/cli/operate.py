"""The command line of the commands that talk to a running Baton:
`baton sessions ...`, `baton deployments ...`, `baton handoffs ...`.

Tenant commands (sessions list|get|events|send|cancel|reset) call the public
ingress with the API key in BATON_API_KEY; operator commands (sessions
resume, deployments list|describe|drain, handoffs get) call hooks, anchor
and owners with the operator certificate. Connection defaults come from the
profile `baton up` writes (services/cli/profile.py).

Exit codes (every command but drain): 0 done, 1 refused (the reason is
printed), 2 usage, 3 not found, 4 unavailable; 130 interrupted. Drain: 0
drained, 2 usage or refused, 3 sessions left.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from services.cli import demo, deployments, operator, profile, session_actions, sessions
from services.common.errors import BatonError
from services.common.tls import Security

_ENV_TRUE = ("1", "true")


def _non_negative(value: str) -> int:
    try:
        number = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from exc
    if number < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {number}")
    return number


def _output(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("-o", "--output", choices=sessions.OUTPUTS, default="text")


def _profile_flag(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--profile",
        default="",
        help="profile file (env BATON_PROFILE; default ~/.config/baton/profile.json)",
    )


def _tenant_flags(sub: argparse.ArgumentParser) -> None:
    """Where the ingress is and how to trust it (the API key: env only)."""
    _output(sub)
    sub.add_argument(
        "--ingress",
        default=os.environ.get("BATON_INGRESS_ADDR", ""),
        help=f"ingress host:port (env BATON_INGRESS_ADDR; default: the profile's, "
        f"else {demo.DEFAULT_INGRESS})",
    )
    tls = sub.add_mutually_exclusive_group()
    tls.add_argument(
        "--ca-cert",
        default=os.environ.get("BATON_TLS_CA", ""),
        help="CA the ingress certificate chains to (env BATON_TLS_CA; default: the profile's)",
    )
    tls.add_argument(
        "--plaintext",
        action="store_true",
        default=os.environ.get("BATON_PLAINTEXT", "") in _ENV_TRUE,
        help="talk plaintext (env BATON_PLAINTEXT=1; a `baton up --plaintext`)",
    )
    sub.add_argument("--tls-server-name", default="", help="name to verify the ingress as")
    _profile_flag(sub)


def _operator_flags(sub: argparse.ArgumentParser) -> None:
    """Where hooks and anchor are, and the operator certificate (the same
    flags on every operator command, whichever services it calls)."""
    _output(sub)
    _operator_services(sub)
    sub.add_argument(
        "--plaintext",
        action="store_true",
        default=os.environ.get("BATON_PLAINTEXT", "") in _ENV_TRUE,
        help="talk plaintext (env BATON_PLAINTEXT=1; a `baton up --plaintext`)",
    )
    _profile_flag(sub)


def _operator_services(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--hooks",
        default=os.environ.get("BATON_HOOKS_ADDR", ""),
        help=f"hooks host:port (env BATON_HOOKS_ADDR; default: the profile's, else "
        f"{operator.DEFAULT_HOOKS})",
    )
    sub.add_argument(
        "--anchor",
        default=os.environ.get("BATON_ANCHOR_ADDR", ""),
        help=f"anchor host:port (env BATON_ANCHOR_ADDR; default: the profile's, else "
        f"{operator.DEFAULT_ANCHOR})",
    )
    for flag, env, what in (
        ("--tls-cert", "BATON_TLS_CERT", "an operator certificate"),
        ("--tls-key", "BATON_TLS_KEY", "its key"),
        ("--tls-ca", "BATON_TLS_CA", "the CA of the services' certificates"),
    ):
        sub.add_argument(
            flag,
            default=os.environ.get(env, ""),
            help=f"{what} (env {env}; default: the profile's)",
        )
    sub.add_argument(
        "--tls-ip-server-name",
        default=os.environ.get("BATON_TLS_IP_SERVER_NAME", ""),
        help="name the owners, dialled at the IP they registered, are verified against "
        "(env BATON_TLS_IP_SERVER_NAME; default the IP)",
    )


def _session_arg(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("session", metavar="ID", help="a session id (ses_...) or an alias")


def add_session_commands(commands: Any) -> None:
    group = commands.add_parser(
        "sessions",
        help="look into and talk to sessions (list, get, events, send, cancel, reset, resume)",
        description=(
            "Sessions through the public API, as the channel whose API key is in BATON_API_KEY "
            "(default: the loopback demo key); `resume` is an operator's (the operator "
            "certificate). Connection defaults come from the profile `baton up` writes, so "
            "against `baton up` no flag is needed. Exit codes: 0 done, 1 refused (the reason "
            "is printed), 2 usage, 3 not found, 4 unavailable."
        ),
    ).add_subparsers(dest="action", metavar="ACTION")
    _add_list(group)
    one = group.add_parser("get", help="one session", description="One session, by id or alias.")
    _session_arg(one)
    one.add_argument(
        "--all-channels",
        action="store_true",
        help="operator: a session of any channel (by id), as its channel's GetSession shows "
        "it, through hooks and anchor with the operator certificate (--hooks/--anchor/--tls-*)",
    )
    _tenant_flags(one)
    _operator_services(one)
    _add_events(group)
    _add_send_and_controls(group)
    _add_resume(group)


def _add_list(group: Any) -> None:
    listing = group.add_parser(
        "list",
        help="list the channel's sessions",
        description="List the channel's sessions in session id order, every page up to --limit.",
    )
    listing.add_argument(
        "--filter",
        default="",
        help="e.g. 'status = idle AND deployment = \"dep-1\"' (fields: status, deployment, "
        "create_time, update_time; see docs/introspection.md)",
    )
    listing.add_argument(
        "--limit", type=_non_negative, default=100, help="at most this many (0 = all; default 100)"
    )
    listing.add_argument(
        "--page-size", type=_non_negative, default=0, help="sessions per call (default: server's)"
    )
    listing.add_argument(
        "--all-channels",
        action="store_true",
        help="operator: every channel's sessions, in (channel, session id) order, through "
        "hooks and anchor with the operator certificate (the --hooks/--anchor/--tls-* flags)",
    )
    _tenant_flags(listing)
    _operator_services(listing)


def _add_events(group: Any) -> None:
    stream = group.add_parser(
        "events",
        help="a session's event stream (--follow: live)",
        description=(
            "Print a session's events from --from (default 0); with --follow, keep printing "
            "them as they are committed until the session's terminal event (Ctrl-C stops). "
            "-o json prints one array, so it needs the stream's end: not with --follow."
        ),
    )
    _session_arg(stream)
    stream.add_argument("--follow", "-f", action="store_true", help="keep following live")
    stream.add_argument(
        "--from", dest="start_seq", type=_non_negative, default=0, help="first seq (default 0)"
    )
    _tenant_flags(stream)


def _add_send_and_controls(group: Any) -> None:
    send = group.add_parser(
        "send",
        help="send a message",
        description=(
            "Send a message; accepted means durably in the session's inbox. Repeating it with "
            "the same --delivery-id returns the first receipt and is not delivered twice."
        ),
    )
    _session_arg(send)
    send.add_argument("text", metavar="TEXT")
    send.add_argument("--delivery-id", default="", help="idempotency key (default: generated)")
    send.add_argument("--queue", action="store_true", help="wait for the open turn to settle")
    _tenant_flags(send)
    for action, what in (
        ("cancel", "cancel the running turn"),
        ("reset", "finalize the session (terminal: its stream closes)"),
    ):
        sub = group.add_parser(action, help=what, description=what[0].upper() + what[1:] + ".")
        _session_arg(sub)
        sub.add_argument("--reason", default="", help="why (kept with the command)")
        sub.add_argument("--delivery-id", default="", help="idempotency key (default: generated)")
        _tenant_flags(sub)


def _add_resume(group: Any) -> None:
    again = group.add_parser(
        "resume",
        help="operator: run a stalled session again (docs/failures.md)",
        description=(
            "Run a stalled session (its restart budget spent) again once the cause of its "
            "failures is fixed: the instance holding it renews the budget and runs it from its "
            "inbox, which kept every accepted command. A session that is not stalled is left "
            "alone. Needs the operator certificate."
        ),
    )
    again.add_argument("session", metavar="ID", help="a session id (ses_...)")
    _operator_flags(again)


def add_deployment_commands(commands: Any) -> None:
    fleet = commands.add_parser(
        "deployments", help="operator: the deployments' owner fleets (list, describe, drain)"
    ).add_subparsers(dest="action", metavar="ACTION")
    listing = fleet.add_parser(
        "list",
        help="every deployment the registry knows, with its status",
        description=(
            "Every deployment the registry knows (a live owner instance, or sessions left in "
            "its ownership index): its status (active, draining, drained, or retired: no live "
            "instance, sessions left on it; docs/cli.md), its instances and sessions, 0 "
            "included."
        ),
    )
    _operator_flags(listing)
    describe = fleet.add_parser(
        "describe",
        help="a deployment's instances (leases, session counts) and sessions (statuses)",
        description=(
            "A deployment's live owner instances with their leases and how many sessions each "
            "owns, and its sessions (of every channel) with their statuses, as GetSession "
            "reports them: run it again to watch a drain."
        ),
    )
    describe.add_argument("deployment", metavar="DEPLOYMENT", help="the exact deployment id")
    describe.add_argument(
        "--limit", type=_non_negative, default=100, help="sessions listed (0 = all; default 100)"
    )
    _operator_flags(describe)
    drain = fleet.add_parser(
        "drain",
        help="hand every session of a deployment to another one",
        description=(
            "Ask every live owner instance of OLD to hand every session it holds to NEW "
            "through the ordinary handoff (idle and parked ones at once, busy ones the "
            "moment they are next idle), report progress, and stop when nothing is left "
            "or after --wait seconds, listing what is left and why (exit 3). Safe to "
            "repeat."
        ),
    )
    drain.add_argument("old", metavar="OLD", help="the exact deployment id to drain")
    drain.add_argument("--to", dest="new", required=True, metavar="NEW", help="exact target")
    drain.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for the drain (default 60)"
    )
    _operator_flags(drain)


def add_handoff_commands(commands: Any) -> None:
    group = commands.add_parser(
        "handoffs", help="operator: recorded handoffs (get)"
    ).add_subparsers(dest="action", metavar="ACTION")
    get = group.add_parser(
        "get",
        help="a handoff by id",
        description=(
            "The recorded outcome of a handoff (a trigger, a drain or an adoption): the "
            "successor run, its deployment and instance, the new epoch. The handoff id is on "
            "the session's session.handed_off event; a handoff is kept for the deduplication "
            "window (a day by default), and found by its id alone."
        ),
    )
    get.add_argument("handoff", metavar="HANDOFF_ID")
    get.add_argument(
        "--session",
        default="",
        help="the session it moved (ses_...); needed only for a handoff recorded before the "
        "handoff index existed",
    )
    _operator_flags(get)


def _profile(args: argparse.Namespace) -> profile.Profile:
    if args.profile:
        return profile.read(Path(args.profile)) or profile.Profile()
    try:
        path = profile.default_path()
    except RuntimeError:  # no home directory (a container's uid without one): no profile
        return profile.Profile()
    return profile.read(path) or profile.Profile()


def _tenant_connection(args: argparse.Namespace) -> sessions.Connection:
    """Flags and environment first, then the profile, then the defaults."""
    found = _profile(args)
    explicit_tls = bool(args.ca_cert or args.plaintext)
    return sessions.Connection(
        ingress=args.ingress or found.ingress or demo.DEFAULT_INGRESS,
        api_key=os.environ.get("BATON_API_KEY") or demo.DEFAULT_API_KEY,
        ca_cert=args.ca_cert or ("" if explicit_tls else found.ca_cert),
        plaintext=args.plaintext or (not explicit_tls and found.plaintext),
        server_name=args.tls_server_name,
    )


def _operator_connection(args: argparse.Namespace) -> operator.OperatorConnection:
    found = _profile(args)
    hooks = args.hooks or found.hooks or operator.DEFAULT_HOOKS
    anchor = args.anchor or found.anchor or operator.DEFAULT_ANCHOR
    explicit = bool(args.tls_cert or args.tls_key or args.tls_ca)
    if args.plaintext or (not explicit and found.plaintext and not found.operator_cert):
        return operator.OperatorConnection(hooks, anchor, Security.plaintext())
    cert = args.tls_cert or ("" if explicit else found.operator_cert)
    key = args.tls_key or ("" if explicit else found.operator_key)
    ca = args.tls_ca or found.ca_cert
    if not (cert and key and ca):
        raise sessions.UsageError(
            "pass an operator certificate (--tls-cert/--tls-key/--tls-ca or BATON_TLS_*; "
            "`baton up` writes operator.crt/.key and a profile naming them) or --plaintext"
        )
    security = Security.tls(cert, key, ca, ip_server_name=args.tls_ip_server_name)
    return operator.OperatorConnection(hooks, anchor, security)


def _tenant_call(args: argparse.Namespace) -> Coroutine[Any, Any, int]:
    connection = _tenant_connection(args)
    if args.action == "get":
        return sessions.get(connection, args.session, args.output)
    if args.action == "list":
        return sessions.list_sessions(
            connection,
            args.output,
            filter_text=args.filter,
            limit=args.limit,
            page_size=args.page_size,
        )
    if args.action == "events":
        return session_actions.events(
            connection, args.session, args.output, follow=args.follow, start_seq=args.start_seq
        )
    if args.action == "send":
        return session_actions.send(
            connection,
            args.session,
            args.text,
            args.output,
            delivery_id=args.delivery_id,
            queue=args.queue,
        )
    return session_actions.control(
        connection,
        args.session,
        args.action,
        args.output,
        reason=args.reason,
        delivery_id=args.delivery_id,
    )


def _operator_call(args: argparse.Namespace) -> Coroutine[Any, Any, int]:
    connection = _operator_connection(args)
    if args.command == "sessions":
        return operator.resume(connection, args.session, args.output)
    if args.command == "handoffs":
        return operator.handoff_get(connection, args.session, args.handoff, args.output)
    if args.action == "list":
        return operator.deployments_list(connection, args.output)
    return operator.deployments_describe(connection, args.deployment, args.output, limit=args.limit)


def _drain(args: argparse.Namespace) -> int:
    try:
        connection = _operator_connection(args)
        return asyncio.run(
            deployments.drain(
                connection.hooks,
                args.old,
                args.new,
                connection.security,
                wait_s=args.wait,
                output=args.output,
            )
        )
    except (sessions.UsageError, profile.ProfileError, deployments.DrainError) as exc:
        print(f"baton deployments drain: {exc}", file=sys.stderr)
        return deployments.EXIT_USAGE
    except BatonError as exc:
        print(f"baton deployments drain: {exc.reason}: {exc.message}", file=sys.stderr)
        return deployments.EXIT_USAGE
    except KeyboardInterrupt:
        return 130


_TENANT = {"list", "get", "events", "send", "cancel", "reset"}
_COMMANDS = {
    "sessions": {*_TENANT, "resume"},
    "deployments": {"list", "describe", "drain"},
    "handoffs": {"get"},
}


def handles(args: argparse.Namespace) -> bool:
    return getattr(args, "action", None) in _COMMANDS.get(args.command, set())


def run(args: argparse.Namespace) -> int:
    """Run a command `handles` said yes to; its exit code."""
    if args.command == "deployments" and args.action == "drain":
        return _drain(args)
    name = f"baton {args.command} {args.action}"
    try:
        if args.command == "sessions" and args.action == "list" and args.all_channels:
            call = operator.sessions_all_channels(
                _operator_connection(args), args.output, filter_text=args.filter, limit=args.limit
            )
        elif args.command == "sessions" and args.action == "get" and args.all_channels:
            connection = _operator_connection(args)
            call = operator.session_any_channel(connection, args.session, args.output)
        elif args.command == "sessions" and args.action in _TENANT:
            call = _tenant_call(args)
        else:
            call = _operator_call(args)
        return asyncio.run(call)
    except (sessions.UsageError, profile.ProfileError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return sessions.EXIT_USAGE
    except BatonError as exc:
        print(f"{name}: {exc.reason}: {exc.message}", file=sys.stderr)
        return sessions.exit_code_of(exc)
    except KeyboardInterrupt:
        return 130
