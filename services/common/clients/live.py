"""An owner's sender of live items (docs/design.md "Live items"): each batch
goes to every anchor replica, on one PublishLive stream per replica, and
nothing ever waits for it.

The replicas are the addresses the anchor setting lists (`ip:port,...`),
or every address a `dns:///name:port` resolves to (looked up again every
DNS_REFRESH_SECONDS; its servers are verified against the name). Each
replica has its own bounded queue: a replica that is slow or down loses the
oldest batches it has not taken (their followers see the commit instead),
never holding back the owner or the other replicas. A broken stream is
opened again with a backoff; anchor's notes (a refusal, a cut) are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections import deque

import grpc
import structlog
from google.rpc import status_pb2

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as anchor_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits
from baton_runtime.common.clients.channels import open_channel
from baton_runtime.common.observability import rpc_metrics
from baton_runtime.common.retry import RetryPolicy
from baton_runtime.common.security.tls import Security

log = structlog.get_logger("baton.live")

DNS_REFRESH_SECONDS = 30.0
# Batches one replica may have waiting, in number and bytes (then the oldest
# are dropped).
QUEUE_BATCHES = 1024
QUEUE_BYTES = 4 * 1024 * 1024
_METHOD = "/baton.anchor.v1.AnchorService/PublishLive"
_RECONNECT = RetryPolicy("live stream", first=0.2, cap=5.0)


class LivePublisher:
    """`target`: the anchor setting; `security`: the owner's identity."""

    def __init__(self, target: str, security: Security) -> None:
        self._target = target
        self._security = security
        self._lanes: dict[str, _Lane] = {}
        self._resolver: asyncio.Task[None] | None = None
        self._closed = False
        # Batches published before a `dns:///` name was first looked up.
        self._resolved = False
        self._early: deque[s.LiveBatch] = deque()

    def publish(self, batch: s.LiveBatch) -> None:
        """Queue `batch` for every replica (never waits)."""
        if self._closed:
            return
        if self._resolver is None:
            self._resolver = asyncio.ensure_future(self._keep_lanes())
            target = self._target.strip()
            if not target.startswith("dns:"):
                for address in [a.strip() for a in target.split(",") if a.strip()]:
                    self._lanes[address] = _Lane(open_channel(address, self._security))
        if not self._resolved:
            self._early.append(batch)  # (until the name is looked up once)
            while len(self._early) > QUEUE_BATCHES:
                self._early.popleft()
        for lane in self._lanes.values():
            lane.put(batch)

    async def _keep_lanes(self) -> None:
        """The lanes of the replicas a `dns:///` name resolves to, looked up
        again now and then (a replica gone loses its lane); a list of
        addresses has its lanes from the first batch on."""
        target = self._target.strip()
        if not target.startswith("dns:"):
            self._resolved = True
            self._early.clear()
            return
        name, _, port = target.removeprefix("dns:").lstrip("/").rpartition(":")
        security = dataclasses.replace(self._security, ip_server_name=name)
        while not self._closed:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    name, int(port), type=socket.SOCK_STREAM
                )
                hosts = {str(info[4][0]) for info in infos}
            except (OSError, ValueError) as exc:
                log.warning("anchor replicas not resolved", target=target, error=repr(exc))
                hosts = set()
            addresses = {f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts}
            for address in addresses - self._lanes.keys():
                lane = self._lanes[address] = _Lane(open_channel(address, security))
                for batch in self._early:
                    lane.put(batch)
            if addresses:
                self._resolved = True
                self._early.clear()
            for address in set(self._lanes) - addresses if addresses else ():
                await self._lanes.pop(address).close()
            await asyncio.sleep(DNS_REFRESH_SECONDS)

    async def close(self) -> None:
        self._closed = True
        if self._resolver is not None:
            self._resolver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resolver
        for lane in self._lanes.values():
            await lane.close()
        self._lanes.clear()


class _Lane:
    """One replica's queue and the stream that drains it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._queue: deque[s.LiveBatch] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    def put(self, batch: s.LiveBatch) -> None:
        self._queue.append(batch)
        self._bytes += batch.ByteSize()
        while len(self._queue) > QUEUE_BATCHES or self._bytes > QUEUE_BYTES:
            self._bytes -= self._queue.popleft().ByteSize()
        self._ready.set()

    def _message(self) -> anchor_pb.PublishLiveRequest:
        """The next message: queued batches within the message's bounds."""
        request = anchor_pb.PublishLiveRequest()
        size = 0
        while self._queue and len(request.batches) < limits.LIVE_MAX_BATCHES:
            batch = self._queue[0]
            cost = batch.ByteSize() + 8
            if request.batches and size + cost > limits.LIVE_MAX_MESSAGE_BYTES:
                break
            request.batches.append(self._queue.popleft())
            self._bytes -= cost - 8
            size += cost
        return request

    async def _requests(self) -> object:
        while True:
            while not self._queue:
                self._ready.clear()
                await self._ready.wait()
            message = self._message()
            if rpc_metrics.RPC.enabled:
                rpc_metrics.RPC.sent_on_stream("anchor", _METHOD)
            yield message

    async def _run(self) -> None:
        backoff = _RECONNECT.backoff()
        call_of = self._channel.stream_stream(
            _METHOD,
            request_serializer=anchor_pb.PublishLiveRequest.SerializeToString,
            response_deserializer=anchor_pb.PublishLiveResponse.FromString,
        )
        while True:
            if rpc_metrics.RPC.enabled:
                rpc_metrics.RPC.opened("anchor", _METHOD)
            try:
                async for response in call_of(self._requests()):  # type: ignore[arg-type]
                    backoff.reset()
                    for note in response.notes:
                        status = status_pb2.Status.FromString(note.status)
                        log.info(
                            "anchor noted live items",
                            session_id=note.step.session_id,
                            code=status.code,
                            message=status.message,
                        )
            except grpc.aio.AioRpcError as exc:
                log.debug("live stream to anchor broke", code=exc.code().name)
            await backoff.wait()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._channel.close()
