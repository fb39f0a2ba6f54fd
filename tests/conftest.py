from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import aetcd
import pytest

from baton_runtime.cli.system.etcd_process import EtcdProcess
from tests.certs import etcd_client, etcd_tls, start_etcd
from tests.procs import ProcessStack
from tests.stack import Stack, start_stack, stop_stack


class _SpareEtcd:
    """Starts the next module's etcd while the current module's tests run, so
    no module waits for an etcd to boot (about 0.5-1 s each, ~47 modules).
    Every module still gets an etcd of its own, fresh and unused.

    One worker thread, alive for the whole test session, starts them all: a
    child started through the orphan guard dies with the thread that
    started it (PR_SET_PDEATHSIG), so that thread must outlive the etcds."""

    def __init__(self) -> None:
        # The test PKI and etcd's certificates, made here: never by two
        # threads at once.
        etcd_tls()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spare-etcd")
        self._next: Future[EtcdProcess] | None = None
        self._stops: list[Future[None]] = []

    def take(self) -> EtcdProcess:
        ready = self._next or self._worker.submit(start_etcd)
        self._next = self._worker.submit(start_etcd)
        return ready.result()

    def retire(self, server: EtcdProcess) -> None:
        """Stop a module's etcd off the test's path (a used etcd takes about
        a second to shut down gracefully)."""
        self._stops.append(self._worker.submit(server.stop))

    def close(self) -> None:
        if self._next is not None:
            with contextlib.suppress(Exception):
                self._next.result().stop()
        self._worker.shutdown(wait=True)
        for stopped in self._stops:
            stopped.result()


@pytest.fixture(scope="session")
def spare_etcd() -> Iterator[_SpareEtcd]:
    spare = _SpareEtcd()
    try:
        yield spare
    finally:
        spare.close()


@pytest.fixture(scope="module")
def etcd_server(spare_etcd: _SpareEtcd) -> Iterator[EtcdProcess]:
    """One real etcd per test module, with TLS and auth on; tests isolate by
    key prefix. (Per module, not per session: a module that leaves etcd busy
    cannot slow the next. The next module's is started while this one runs.)"""
    server = spare_etcd.take()
    try:
        yield server
    finally:
        spare_etcd.retire(server)


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
async def stack_never_parks(etcd_endpoint: str) -> AsyncIterator[Stack]:
    """`stack` with parking off, for tests that compare statuses with
    `idle`: a session idle for 10 s parks, which a loaded machine reaches
    between two steps of a test."""
    running = await start_stack(etcd_endpoint, park_after=None)
    try:
        yield running
    finally:
        await stop_stack(running)


@pytest.fixture
async def raw(etcd_endpoint: str) -> AsyncIterator[aetcd.Client]:
    """A raw etcd client on the module's etcd, for tests that start their
    own stack."""
    client = await etcd_client(etcd_endpoint)
    try:
        yield client
    finally:
        await client.close()


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
