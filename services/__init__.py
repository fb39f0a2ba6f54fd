"""Baton's services: hooks, anchor, owner, ingress, and their common package.

A service process (`python -m baton_runtime.<service>`) runs on gRPC's
classic poller instead of its EventEngine client and listener: each message
costs 0.77-0.81x the CPU there, and a one-step turn was 0.88x its latency
(bench/README.md, "gRPC's classic poller"). gRPC reads `GRPC_EXPERIMENTS`
when it is imported, so it is set here, before anything imports gRPC; an
explicit `GRPC_EXPERIMENTS` wins (`GRPC_EXPERIMENTS=""`: the EventEngine).
Every other process that imports this package (the CLI, `baton up`, the
SDK's users, tests, benches) keeps gRPC's default: `baton up`'s synchronous
health probes, in a process that used grpc.aio before, never answered on
the classic poller.
"""

import sys as _sys

_SERVICE_MODULES = frozenset(
    f"baton_runtime.{name}" for name in ("hooks", "anchor", "owner", "ingress")
)


def _is_service_process(argv: list[str]) -> bool:
    """`python [options] -m baton_runtime.<service> ...`"""
    if "-m" not in argv:
        return False
    at = argv.index("-m")
    return at + 1 < len(argv) and argv[at + 1] in _SERVICE_MODULES


if _is_service_process(_sys.orig_argv):
    import os as _os

    _os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")
