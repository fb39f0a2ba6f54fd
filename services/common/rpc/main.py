"""A Baton service's process: the `python -m baton_runtime.<name>` entry
(config, tracing, logging), serving until SIGTERM/SIGINT, then a graceful
shutdown within a bounded grace period, and reload on SIGHUP."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import structlog

from baton_runtime.common.config import ConfigError
from baton_runtime.common.observability import tracing
from baton_runtime.common.rpc.server import GrpcServer

log = structlog.get_logger("baton.server")

_C = TypeVar("_C", bound="_ServiceConfig")


async def run_until_signalled(server: GrpcServer, *, grace: float) -> None:
    """Start, serve until SIGTERM/SIGINT, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reloader(server))
    await server.start()
    settle_heap()
    log.info(
        "serving",
        port=server.port,
        grpc_experiments=os.environ.get("GRPC_EXPERIMENTS", ""),
        frozen_objects=gc.get_freeze_count(),
        services=list(server.service_names),
        **({"health_port": server.health_port} if server.health_server else {}),
        **({"metrics_port": server.metrics_port} if server.metrics else {}),
    )
    await stop.wait()
    log.info("shutting down", grace_s=grace)
    await server.stop(grace)
    log.info("stopped")


def settle_heap() -> None:
    """Once started: what start-up built (modules, descriptors, the
    server's own objects, some 40,000 of them) lives as long as the process,
    so it leaves the collector's generations (`gc.freeze`) and a full
    collection no longer walks it; what a request allocates is collected as
    before. (A frozen object is still freed when its last reference goes;
    only a cycle among frozen objects is kept.)"""
    gc.collect()
    gc.freeze()


def _reloader(server: GrpcServer) -> Callable[[], None]:
    def reload() -> None:
        log.info("SIGHUP: reloading certificates and settings")
        try:
            server.reload()
        except Exception:  # noqa: BLE001 - a bad reload keeps the old settings
            log.exception("reload failed; keeping the previous settings")

    return reload


class _ServiceConfig(Protocol):
    @property
    def log_level(self) -> str: ...

    @property
    def grace(self) -> float: ...


def run_main(
    load: Callable[[], _C], create: Callable[[_C], Awaitable[GrpcServer]], *, service: str
) -> None:
    """The `python -m baton_runtime.<name>` entry: config, tracing (if the OTEL_*
    environment asks, baton_runtime.common.observability.tracing), logging, serve, exit."""
    from baton_runtime.common.observability.logs import configure_logging

    try:
        config = load()
        # Before any channel opens: channels get tracing's interceptors then.
        tracing.TRACING.configure(
            service,
            str(getattr(config, "deployment_id", "")),
            str(getattr(config, "instance_id", "")),
        )
    except ConfigError as exc:
        sys.exit(str(exc))
    configure_logging(config.log_level)

    async def _serve() -> None:
        server = await create(config)
        await run_until_signalled(server, grace=config.grace)

    try:
        asyncio.run(_serve())
    except ConfigError as exc:
        sys.exit(str(exc))
    finally:
        tracing.TRACING.shutdown()  # exports the spans still buffered
