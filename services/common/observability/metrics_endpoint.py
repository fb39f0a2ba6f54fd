"""The endpoint that serves Baton's metrics (`--metrics-listen`,
docs/metrics.md): `GET /metrics` in Prometheus' text format.

A small asyncio HTTP responder on the server's own event loop, not
prometheus-client's threaded server: collectors read the owner's maps on the
loop that changes them, and a refresh may await etcd."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from baton_runtime.common.observability import rpc_metrics

log = structlog.get_logger("baton.metrics")

Refresh = Callable[[], Awaitable[None]]
"""Run before each scrape (e.g. hooks counting live instances in etcd)."""

_REFRESH_SECONDS = 2.0
_MAX_REQUEST_BYTES = 8192


class MetricsEndpoint:
    """`GET /metrics` in Prometheus' text format on `listen` (plaintext HTTP;
    `--metrics-listen`), served on the running event loop."""

    def __init__(self, listen: str, registry: CollectorRegistry) -> None:
        self.listen = listen
        self.registry = registry
        self.refresh: list[Refresh] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    def add(self, collector: Collector) -> None:
        self.registry.register(collector)

    async def start(self) -> None:
        host, _, port = self.listen.rpartition(":")
        self._server = await asyncio.start_server(
            self._serve, host.strip("[]"), int(port), limit=_MAX_REQUEST_BYTES
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        rpc_metrics.RPC.enabled = True

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, _, rest = head.decode("latin-1").partition(" ")
            path = rest.partition(" ")[0].partition("?")[0]
            if method != "GET" or path != "/metrics":
                await _answer(writer, "404 Not Found", b"GET /metrics\n", "text/plain")
                return
            await self._refresh()
            await _answer(writer, "200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _refresh(self) -> None:
        for refresh in self.refresh:
            try:
                await asyncio.wait_for(refresh(), _REFRESH_SECONDS)
            except Exception as exc:  # noqa: BLE001 - a scrape shows the last values
                log.warning("metrics refresh failed", error=repr(exc)[:200])


async def _answer(
    writer: asyncio.StreamWriter, status: str, body: bytes, content_type: str
) -> None:
    writer.write(
        (
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        + body
    )
    await writer.drain()
