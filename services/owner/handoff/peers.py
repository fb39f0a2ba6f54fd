"""Other owner instances, as this one reaches them: the live instances of a
deployment from the registry (cached briefly), where a session's work goes
among them (a hash of its id), and one client per peer address.

Used by the handoff broker (the target deployment's instances) and by
child sessions (the other instances of this deployment). The cache keeps a
non-empty listing for REGISTRY_CACHE_SECONDS; a caller that finds a peer
gone drops it (`forget`), so the next call asks the registry again.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from baton_runtime.common.clients.answers import OwnerInstance
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient

REGISTRY_CACHE_SECONDS = 5.0

_T = TypeVar("_T")


def place(key: str, choices: Sequence[_T]) -> _T:
    """Where `key` (a session id) goes among `choices`: stable while the
    choices are, spread evenly across them."""
    if not choices:
        raise ValueError("nowhere to place")
    return choices[zlib.crc32(key.encode()) % len(choices)]


class Peers:
    """The registry's live owner instances per deployment, and clients for them."""

    def __init__(
        self,
        hooks: HooksClient,
        *,
        call_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hooks = hooks
        self._call_seconds = call_seconds
        self._clock = clock
        self._listed: dict[str, tuple[float, list[OwnerInstance]]] = {}
        self._clients: dict[str, OwnerClient] = {}

    async def instances(self, deployment_id: str) -> list[OwnerInstance]:
        """The deployment's live instances (cached briefly; an empty answer
        is not). Raises the registry's BatonError."""
        cached = self._listed.get(deployment_id)
        if cached is not None and cached[0] > self._clock():
            return cached[1]
        instances = await self._hooks.list_instances(deployment_id)
        if instances:
            self._listed[deployment_id] = (self._clock() + REGISTRY_CACHE_SECONDS, instances)
        return instances

    def forget(self, deployment_id: str) -> None:
        """A peer of the deployment failed: ask the registry next time."""
        self._listed.pop(deployment_id, None)

    def client(self, address: str) -> OwnerClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = OwnerClient(
                address, timeout=self._call_seconds, security=self._hooks.security
            )
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
