"""What the commands that talk to a running Baton run (`baton sessions
...`, `baton deployments ...`, `baton handoffs ...`; their flags are
services/cli/commands/operate_parser.py): the connection from flags, environment
and profile, the call each command makes, and its exit code.

Tenant commands (sessions list|create|get|events|send|answer|cancel|reset) call the public
ingress with the API key in BATON_API_KEY; operator commands (sessions
resume, deployments list|describe|drain|undrain, handoffs get) call hooks, anchor
and owners with the operator certificate. Connection defaults come from the
profile `baton up` writes (services/cli/system/profile.py).

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

from baton_runtime.cli.commands import (
    demo,
    deployments,
    operator,
    session_actions,
    sessions,
)
from baton_runtime.cli.system import profile
from baton_runtime.cli.system.launch_settings import DEMO_API_KEY
from baton_runtime.common.errors import BatonError
from baton_runtime.common.security.tls import Security


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
        api_key=os.environ.get("BATON_API_KEY") or DEMO_API_KEY,
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
            order_by=args.order_by,
            limit=args.limit,
            page_size=args.page_size,
        )
    if args.action == "create":
        return session_actions.create(
            connection,
            args.output,
            aliases=args.aliases,
            request_id=args.request_id,
            timeout_seconds=args.timeout,
            token_budget=args.token_budget,
        )
    if args.action == "answer":
        return session_actions.answer(
            connection,
            args.session,
            args.request,
            args.output,
            approved=args.approved,
            text=args.text,
            delivery_id=args.delivery_id,
        )
    if args.action == "events":
        return session_actions.events(
            connection,
            args.session,
            args.output,
            follow=args.follow,
            start_seq=args.start_seq,
            live=args.follow and args.live,
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
    if args.action == "undrain":
        return deployments.undrain(
            connection.hooks, args.deployment, connection.security, output=args.output
        )
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


_TENANT = {"list", "create", "get", "events", "send", "answer", "cancel", "reset"}
_COMMANDS = {
    "sessions": {*_TENANT, "resume"},
    "deployments": {"list", "describe", "drain", "undrain"},
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
                _operator_connection(args),
                args.output,
                filter_text=args.filter,
                order_by=args.order_by,
                limit=args.limit,
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
