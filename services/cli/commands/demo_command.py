"""`baton demo`: its flags (where the ingresses are, how to trust them, what
to say) and the run of services/cli/commands/demo.py they ask for."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from baton_runtime.cli.commands import demo
from baton_runtime.cli.system.launch_settings import DEMO_API_KEY


def add_demo_command(commands: Any) -> None:
    """`baton demo` and its flags, in the order `--help` lists them."""
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
    _add_ingresses(run)
    _add_conversation(run)


def _add_ingresses(run: argparse.ArgumentParser) -> None:
    """The ingress to start on, those to upgrade through, and their TLS."""
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


def _add_conversation(run: argparse.ArgumentParser) -> None:
    """What the demo says, and how long it may take."""
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


def run_demo_command(args: argparse.Namespace) -> int:
    """`baton demo`: 0 when it finished, 1 when it failed, 2 on a usage error."""
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
                os.environ.get("BATON_API_KEY") or DEMO_API_KEY,
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
