"""The chaos run's fault layer (tests/netfaults.py) on its own: each fault
does to a real TCP connection on loopback what it says, and nothing else."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import pytest

from tests.netfaults import UP, Network, Route


class Server:
    """A TCP server on loopback that records what each connection sent and
    answers each chunk with `reply(chunk)`."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.got = asyncio.Event()
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> Server:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        how = "eof"
        try:
            while chunk := await reader.read(65536):
                self.received += chunk
                self.got.set()
                writer.write(b"re:" + chunk)
                await writer.drain()
        except ConnectionResetError:
            how = "reset"
        if not self.ended.done():
            self.ended.set_result(how)
        writer.close()

    async def wait_for(self, nbytes: int) -> bytes:
        while len(self.received) < nbytes:
            self.got.clear()
            await asyncio.wait_for(self.got.wait(), 5)
        return bytes(self.received)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[Network, Server, int]]:
    network = Network(established_after=0.0)
    server = await Server().start()
    port = await network.link("client", "server", server.port)
    try:
        yield network, server, port
    finally:
        await network.close()
        await server.close()


async def read_exactly(reader: asyncio.StreamReader, nbytes: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(nbytes), 5)


def route(network: Network) -> Route:
    return network.route("client", "server")


async def test_bytes_flow_both_ways_and_an_end_reaches_the_other_side(
    proxied: tuple[Network, Server, int],
) -> None:
    network, server, port = proxied
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"hello")
    assert await read_exactly(reader, 8) == b"re:hello"
    writer.write_eof()
    assert await asyncio.wait_for(server.ended, 5) == "eof"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_a_held_direction_forwards_nothing_until_it_heals(
    proxied: tuple[Network, Server, int],
) -> None:
    network, server, port = proxied
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"a")
    assert await read_exactly(reader, 4) == b"re:a"
    route(network).hold(up=True, down=False)
    (conn,) = route(network).connections
    writer.write(b"b")
    await writer.drain()
    # Held: the proxy reads nothing more from the client, so nothing can
    # reach the server (its bytes wait in the client's socket).
    assert conn.client.transport is not None and not conn.client.transport.is_reading()
    assert bytes(server.received) == b"a"
    route(network).heal()
    assert await read_exactly(reader, 4) == b"re:b"
    writer.close()


async def test_a_held_reply_direction_keeps_the_answer_until_it_heals(
    proxied: tuple[Network, Server, int],
) -> None:
    network, server, port = proxied
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"a")
    assert await read_exactly(reader, 4) == b"re:a"
    route(network).hold(up=False, down=True)
    writer.write(b"b")
    assert await server.wait_for(2) == b"ab"  # the request went through
    (conn,) = route(network).connections
    assert conn.server.transport is not None and not conn.server.transport.is_reading()
    route(network).heal()
    assert await read_exactly(reader, 4) == b"re:b"
    writer.close()


async def test_a_delay_holds_each_chunk_at_least_that_long(
    proxied: tuple[Network, Server, int],
) -> None:
    network, server, port = proxied
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    route(network).set_delay(up=0.3, down=0.2)
    started = time.monotonic()
    writer.write(b"x")
    assert await read_exactly(reader, 4) == b"re:x"
    assert time.monotonic() - started >= 0.5
    writer.close()


async def test_a_cut_resets_the_connection_after_so_many_bytes(
    proxied: tuple[Network, Server, int],
) -> None:
    network, server, port = proxied
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"ab")
    assert await read_exactly(reader, 5) == b"re:ab"
    route(network).cut_after(UP, 3)
    writer.write(b"cdefgh")
    assert await asyncio.wait_for(server.ended, 5) == "reset"
    assert bytes(server.received) == b"abcde"
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await read_exactly(reader, 100)
    assert route(network).resets == 1
    writer.close()


async def test_a_lost_reply_is_a_request_done_and_its_answer_never_seen(
    proxied: tuple[Network, Server, int],
) -> None:
    network, server, port = proxied
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"a")
    assert await read_exactly(reader, 4) == b"re:a"
    route(network).lose_replies = True
    request = b"r" * 200  # a call, not a keepalive
    writer.write(request)
    assert await server.wait_for(201) == b"a" + request  # done by the server
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await read_exactly(reader, 4 + len(request))  # but its answer never arrives
    assert route(network).replies_lost == 1
    writer.close()


async def test_a_reset_ends_both_sides(proxied: tuple[Network, Server, int]) -> None:
    network, server, port = proxied
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"a")
    assert await read_exactly(reader, 4) == b"re:a"
    route(network).reset()
    assert await asyncio.wait_for(server.ended, 5) == "reset"
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await read_exactly(reader, 1)
    writer.close()


async def test_a_peer_link_puts_each_connection_on_its_callers_route() -> None:
    """etcd's peers: a connection belongs to the process that opened it,
    whatever it sends (here, this test's own process as "m1")."""
    network = Network()
    server = await Server().start()
    callers = {os.getpid(): "m1"}
    port = await network.peer_link("m0", server.port, lambda: callers)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x")
        assert await read_exactly(reader, 4) == b"re:x"
        assert len(network.route("m1", "m0").connections) == 1
        callers.clear()  # a caller it cannot tell: a route no fault touches
        reader2, writer2 = await asyncio.open_connection("127.0.0.1", port)
        writer2.write(b"y")
        assert await read_exactly(reader2, 4) == b"re:y"
        assert len(network.route("?", "m0").connections) == 1
        network.route("m1", "m0").hold()
        writer2.write(b"more")
        assert await read_exactly(reader2, 7) == b"re:more"  # not on the held route
        writer.close()
        writer2.close()
    finally:
        await network.close()
        await server.close()


async def test_a_link_to_a_server_that_is_gone_resets_its_client() -> None:
    network = Network()
    server = await Server().start()
    port = await network.link("client", "server", server.port)
    await server.close()
    assert server.server is not None
    await server.server.wait_closed()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"a")
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await read_exactly(reader, 1)
        writer.close()
    finally:
        await network.close()
