"""The flags of the commands that talk to a running Baton: `baton sessions
...`, `baton deployments ...`, `baton handoffs ...` (tenant flags: the
ingress and its CA; operator flags: hooks, anchor and the operator
certificate; each defaulting to the environment, then the profile). What
they run is services/cli/commands/operate.py."""

from __future__ import annotations

import argparse
import os
from typing import Any

from baton_runtime.cli.commands import demo, operator, sessions
from baton_runtime.cli.commands.arguments import non_negative

_ENV_TRUE = ("1", "true")


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
        help="look into and talk to sessions (list, create, get, events, send, answer, cancel, "
        "reset, resume)",
        description=(
            "Sessions through the public API, as the channel whose API key is in BATON_API_KEY "
            "(default: the loopback demo key); `resume` is an operator's (the operator "
            "certificate). Connection defaults come from the profile `baton up` writes, so "
            "against `baton up` no flag is needed. Exit codes: 0 done, 1 refused (the reason "
            "is printed), 2 usage, 3 not found, 4 unavailable."
        ),
    ).add_subparsers(dest="action", metavar="ACTION")
    _add_list(group)
    _add_create(group)
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
        help="e.g. 'status = idle AND deployment = \"dep-1\"' or 'inbox_depth > 0 AND "
        'oldest_unconsumed_age > "30s"\' (fields: status, deployment, create_time, '
        "update_time, inbox_depth, oldest_unconsumed_age; see docs/introspection.md)",
    )
    listing.add_argument(
        "--order-by",
        default="",
        metavar="FIELD [asc|desc]",
        help="e.g. 'oldest_unconsumed_age desc' (inbox_depth or oldest_unconsumed_age; "
        "default: session id order)",
    )
    listing.add_argument(
        "--limit", type=non_negative, default=100, help="at most this many (0 = all; default 100)"
    )
    listing.add_argument(
        "--page-size", type=non_negative, default=0, help="sessions per call (default: server's)"
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
            "them as they are committed until the session's terminal event (Ctrl-C stops), "
            "and the running step's live items as they come (lines that start with ~: the "
            "answer growing, then its committed event; -o jsonl: lines with a `live` key). "
            "-o json prints one array, so it needs the stream's end: not with --follow."
        ),
    )
    _session_arg(stream)
    stream.add_argument("--follow", "-f", action="store_true", help="keep following live")
    stream.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        help="with --follow: committed events only, no live items of running steps",
    )
    stream.add_argument(
        "--from", dest="start_seq", type=non_negative, default=0, help="first seq (default 0)"
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
    _add_answer(group)
    for action, what in (
        ("cancel", "cancel the running turn"),
        ("reset", "finalize the session (terminal: its stream closes)"),
    ):
        sub = group.add_parser(action, help=what, description=what[0].upper() + what[1:] + ".")
        _session_arg(sub)
        sub.add_argument("--reason", default="", help="why (kept with the command)")
        sub.add_argument("--delivery-id", default="", help="idempotency key (default: generated)")
        _tenant_flags(sub)


def _add_create(group: Any) -> None:
    create = group.add_parser(
        "create",
        help="create a session",
        description=(
            "Create a session on the ingress's deployment and print its id. Repeating it "
            "with the same --request-id finds the session the first created."
        ),
    )
    create.add_argument(
        "--alias",
        action="append",
        dest="aliases",
        default=[],
        metavar="RAW",
        help="an alias of the channel to claim for it (repeatable)",
    )
    create.add_argument("--request-id", default="", help="idempotency key (default: generated)")
    create.add_argument(
        "--timeout", type=non_negative, default=0, help="session lifetime, seconds (0 = none)"
    )
    create.add_argument(
        "--token-budget", type=non_negative, default=0, help="token budget (0 = unlimited)"
    )
    _tenant_flags(create)


def _add_answer(group: Any) -> None:
    answer = group.add_parser(
        "answer",
        help="answer a pending input request (an approval or a question)",
        description=(
            "Answer the input request REQUEST (its id is on the session's input.requested "
            "event, and in `sessions get`): --approve or --deny a tool call waiting for "
            "approval (or a spent limit), or --text for the model's question (with "
            "--approve/--deny: sent along with it). Accepted means durable; the "
            "turn goes on when its owner takes it up."
        ),
    )
    _session_arg(answer)
    answer.add_argument("request", metavar="REQUEST", help="the input request id")
    verdict = answer.add_mutually_exclusive_group()
    verdict.add_argument(
        "--approve", dest="approved", action="store_const", const=True, default=None
    )
    verdict.add_argument("--deny", dest="approved", action="store_const", const=False)
    answer.add_argument("--text", default="", help="the answer's text")
    answer.add_argument("--delivery-id", default="", help="idempotency key (default: generated)")
    _tenant_flags(answer)


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
        "deployments",
        help="operator: the deployments' owner fleets (list, describe, drain, undrain)",
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
        "--limit", type=non_negative, default=100, help="sessions listed (0 = all; default 100)"
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
    undrain = fleet.add_parser(
        "undrain",
        help="stop a drain: the deployment keeps its sessions and takes handoffs again",
        description=(
            "Ask every live owner instance of DEPLOYMENT to stop its drain: the sessions "
            "still on it stay, and it is a handoff target again (once its registry entry "
            "says so, within a keep-alive); sessions that moved stay where they are. Safe "
            "to repeat. A deployment with no live instance is NOT_FOUND (exit 3)."
        ),
    )
    undrain.add_argument("deployment", metavar="DEPLOYMENT", help="the exact deployment id")
    _operator_flags(undrain)


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
