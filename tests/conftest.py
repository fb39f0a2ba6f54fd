from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aetcd
import pytest

from services.cli.etcd_process import EtcdProcess
from tests.certs import etcd_client, start_etcd
from tests.procs import ProcessStack
from tests.stack import Stack, start_stack, stop_stack


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdProcess]:
    """One real etcd per test module, with TLS and auth on; tests isolate by
    key prefix. (Per module, not per session: a module that leaves etcd busy
    cannot slow the next.)"""
    server = start_etcd()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def etcd_endpoint(etcd_server: EtcdProcess) -> str:
    return etcd_server.endpoint


@pytest.fixture
async def stack(etcd_endpoint: str) -> AsyncIterator[Stack]:
    running = await start_stack(etcd_endpoint)
    try:
        yield running
    finally:
        await stop_stack(running)


@pytest.fixture
async def etcd(stack: Stack) -> AsyncIterator[aetcd.Client]:
    """A raw etcd client, to inspect what the stack wrote."""
    client = await etcd_client(stack.etcd.endpoint)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def stacks() -> Iterator[list[ProcessStack]]:
    """Stacks of real service processes a test starts (append them); every
    one is stopped when the test ends, however it ends."""
    made: list[ProcessStack] = []
    try:
        yield made
    finally:
        for stack in made:
            stack.stop()
