"""A fault layer for the network between Baton's processes (issue 38): a TCP
proxy on loopback in front of every link, in the test's own event loop.

Every process of the chaos topology dials its peers through a proxy of
its own (`Network.link(client, server, port)`), so each link — the gateway
to an ingress, an ingress to hooks, an owner to anchor, hooks to an etcd
member — is a `Route` the test can fault on its own, in each direction:

- `delay`: every chunk waits this long before it is forwarded (in order);
- `hold`: nothing is forwarded and nothing more read (a one-way or a full
  partition: the sender's bytes pile up in its socket, as behind a link that
  drops every packet; when the hold ends they flow again, unless the
  connection was reset or its owner gave up on it meanwhile);
- `cut_after(direction, n)`: each connection is reset once n more bytes
  went that way (a request cut half-way, a reply cut short);
- `lose_replies`: on a connection that carries calls, a request is
  forwarded and then nothing comes back; the connection is reset soon
  after (the work was done, the answer lost);
- `reset`: every connection gets an RST now.

TLS passes through untouched: a proxy forwards bytes, and every certificate
names 127.0.0.1, the address clients dial the proxy at.

etcd's peers dial each other at the URLs the members advertise, one per
member, so a member's peer proxy (`Network.peer_link`) serves connections
from both other members: it asks the kernel which process holds the other
end of each connection it accepts (`caller_pid`: the socket in
/proc/net/tcp, then the process that has it open), and the connection
belongs to the route from that member. Every connection counts, raft's
streams and the requests that carry no member id alike (a follower
forwarding a lease renewal to the leader), so a partition leaves no way
round it. A caller that cannot be told (it exited meanwhile) gets a route
from "?" that no fault touches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

Way = Literal["up", "down"]  # up: client -> server; down: server -> client
UP: Way = "up"
DOWN: Way = "down"
# Bytes a direction may queue (delayed) before the proxy stops reading its source.
_HIGH_WATER = 1 << 20
# A request, not a keepalive: an HTTP/2 PING or WINDOW_UPDATE in a TLS
# record is under 64 bytes; a call's HEADERS and DATA are more.
_REQUEST_BYTES = 100
# A connection carries calls once its TLS and HTTP/2 handshakes are done
# (`Network.established_after`).
ESTABLISHED_AFTER = 1.0
# How long a lost reply's connection stays open, silent, before its reset.
_LOST_REPLY_RESET_AFTER = 0.5


def route_name(client: str, server: str) -> str:
    return f"{client}>{server}"


@dataclass
class Direction:
    """What happens to one direction of a route's traffic."""

    delay: float = 0.0
    held: bool = False
    cut_after: int | None = None  # reset each connection after this many more bytes


@dataclass
class Route:
    """The traffic from `client` to `server` through one proxy, with the
    faults on it. Changes apply at once to the connections open on it and
    to every later one."""

    client: str
    server: str
    up: Direction = field(default_factory=Direction)
    down: Direction = field(default_factory=Direction)
    lose_replies: bool = False
    connections: set[Connection] = field(default_factory=set)
    # What the faults did (for the run's report).
    replies_lost: int = 0
    resets: int = 0

    @property
    def name(self) -> str:
        return route_name(self.client, self.server)

    def way(self, way: Way) -> Direction:
        return self.up if way == UP else self.down

    def hold(self, up: bool = True, down: bool = True) -> None:
        self.up.held = self.up.held or up
        self.down.held = self.down.held or down
        for conn in list(self.connections):
            conn.changed()

    def set_delay(self, up: float = 0.0, down: float = 0.0) -> None:
        self.up.delay, self.down.delay = up, down

    def cut_after(self, way: Way, nbytes: int) -> None:
        self.way(way).cut_after = nbytes
        for conn in list(self.connections):
            conn.arm_cut(way, nbytes)

    def reset(self) -> None:
        for conn in list(self.connections):
            conn.reset()

    def heal(self) -> None:
        """No fault any more: held bytes flow again, delays end."""
        self.up, self.down = Direction(), Direction()
        self.lose_replies = False
        for conn in list(self.connections):
            conn.disarm()
            conn.changed()


class _End(asyncio.Protocol):
    """One socket of a proxied connection: the client's or the server's."""

    def __init__(self, conn: Connection, way: Way) -> None:
        self.conn = conn
        self.way = way  # the direction of what this end receives
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.way == UP:
            self.conn.link.opened(self.conn)

    def data_received(self, data: bytes) -> None:
        self.conn.received(self.way, data)

    def eof_received(self) -> bool:
        self.conn.eof(self.way)
        return True  # half-close: keep the socket until the other side is done

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.lost()

    def pause_writing(self) -> None:
        self.conn.writing_paused(self.way, True)

    def resume_writing(self) -> None:
        self.conn.writing_paused(self.way, False)


class Connection:
    """A client's connection through a proxy and the proxy's connection to
    the server, forwarding each way through the route's faults."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.route: Route | None = None  # set once the client end is made (`Link.opened`)
        self.opened = time.monotonic()
        self.client = _End(self, UP)
        self.server = _End(self, DOWN)
        self.queues: dict[Way, deque[tuple[float, bytes]]] = {UP: deque(), DOWN: deque()}
        self.queued: dict[Way, int] = {UP: 0, DOWN: 0}
        self.eofs: set[Way] = set()
        self.blocked: dict[Way, bool] = {UP: False, DOWN: False}  # its writer paused
        self.cuts: dict[Way, int | None] = {UP: None, DOWN: None}
        self.reply_lost = False
        self.timers: dict[Way, asyncio.TimerHandle | None] = {UP: None, DOWN: None}
        self.closed = False

    # -- wiring ---------------------------------------------------------------------

    def attach(self, route: Route) -> None:
        self.route = route
        route.connections.add(self)
        for way in (UP, DOWN):
            if route.way(way).cut_after is not None:
                self.arm_cut(way, route.way(way).cut_after)

    def source(self, way: Way) -> _End:
        return self.client if way == UP else self.server

    def sink(self, way: Way) -> _End:
        return self.server if way == UP else self.client

    def direction(self, way: Way) -> Direction:
        return self.route.way(way) if self.route is not None else _OPEN

    # -- forwarding -----------------------------------------------------------------

    def received(self, way: Way, data: bytes) -> None:
        if self.closed:
            return
        due = time.monotonic() + self.direction(way).delay
        self.queues[way].append((due, data))
        self.queued[way] += len(data)
        self.pump(way)

    def pump(self, way: Way) -> None:
        """Forward what is due in `way`, unless it is held or its writer full."""
        if self.closed:
            return
        timer = self.timers[way]
        if timer is not None:
            timer.cancel()
            self.timers[way] = None
        queue = self.queues[way]
        sink = self.sink(way).transport
        now = time.monotonic()
        direction = self.direction(way)
        while queue and sink is not None and not direction.held and not self.blocked[way]:
            if way == DOWN and self.reply_lost:
                break
            due, data = queue[0]
            if due > now:
                loop = asyncio.get_running_loop()
                self.timers[way] = loop.call_at(loop.time() + (due - now), self.pump, way)
                break
            queue.popleft()
            self.queued[way] -= len(data)
            cut = self.cuts[way]
            if cut is not None and len(data) >= cut:
                sink.write(data[:cut])
                self.reset()
                return
            if cut is not None:
                self.cuts[way] = cut - len(data)
            sink.write(data)
            if way == UP and self.route is not None and self.route.lose_replies:
                self.maybe_lose_reply(data)
        if not queue and way in self.eofs and sink is not None:
            self.forward_eof(way)
            return
        self.flow(way)

    def forward_eof(self, way: Way) -> None:
        """The source of `way` finished and everything it sent is through:
        half-close toward the sink; once both ways are done, close."""
        sink = self.sink(way).transport
        assert sink is not None
        if sink.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                sink.write_eof()
        if self.eofs == {UP, DOWN} and not self.queues[UP] and not self.queues[DOWN]:
            self.closed = True
            self.forget()
            for end in (self.client, self.server):
                if end.transport is not None:
                    end.transport.close()

    def flow(self, way: Way) -> None:
        """Read the source of `way` only while what it sent can move on."""
        source = self.source(way).transport
        if source is None or source.is_closing():
            return
        stop = self.direction(way).held or self.blocked[way] or self.queued[way] > _HIGH_WATER
        if stop:
            source.pause_reading()
        else:
            source.resume_reading()

    def maybe_lose_reply(self, data: bytes) -> None:
        """A request on an established connection went through: its reply
        never comes back, and the connection is reset soon after."""
        route = self.route
        assert route is not None
        if self.reply_lost or len(data) < _REQUEST_BYTES:
            return
        if time.monotonic() - self.opened < self.link.network.established_after:
            return
        self.reply_lost = True
        route.replies_lost += 1
        asyncio.get_running_loop().call_later(_LOST_REPLY_RESET_AFTER, self.reset)

    def eof(self, way: Way) -> None:
        self.eofs.add(way)
        self.pump(way)

    def writing_paused(self, way: Way, paused: bool) -> None:
        # The end whose writing paused receives `way`; what it writes is the other way.
        other: Way = DOWN if way == UP else UP
        self.blocked[other] = paused
        if paused:
            self.flow(other)
        else:
            self.pump(other)

    def changed(self) -> None:
        """The route's faults changed: forward (or stop) accordingly."""
        for way in (UP, DOWN):
            self.pump(way)

    def arm_cut(self, way: Way, nbytes: int | None) -> None:
        self.cuts[way] = nbytes

    def disarm(self) -> None:
        self.cuts = {UP: None, DOWN: None}

    # -- ending ---------------------------------------------------------------------

    def reset(self) -> None:
        """A fault's reset: RST both sockets (counted on the route)."""
        if not self.closed and self.route is not None:
            self.route.resets += 1
        self.abort()

    def abort(self) -> None:
        """RST both sockets (SO_LINGER 0, then close)."""
        if self.closed:
            return
        for end in (self.client, self.server):
            transport = end.transport
            if transport is None:
                continue
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        self.lost()

    def forget(self) -> None:
        for timer in self.timers.values():
            if timer is not None:
                timer.cancel()
        if self.route is not None:
            self.route.connections.discard(self)
        self.link.connections.discard(self)

    def lost(self) -> None:
        """One side is gone: the other goes too (as a reset, as the kernel
        would answer a peer that vanished)."""
        if self.closed:
            return
        self.closed = True
        self.forget()
        for end in (self.client, self.server):
            if end.transport is not None and not end.transport.is_closing():
                end.transport.abort()


_OPEN = Direction()


class Link:
    """One proxy: a port on 127.0.0.1 that forwards to `target_port`. Its
    connections belong to the route from `client`, or, for an etcd peer
    link (`callers`: the members' processes by pid), to the route from the
    member that called (see the module doc)."""

    def __init__(
        self,
        network: Network,
        server: str,
        target_port: int,
        client: str = "",
        callers: Callable[[], dict[int, str]] | None = None,
    ) -> None:
        self.network = network
        self.server = server
        self.target_port = target_port
        self.client = client
        self.callers = callers
        self.connections: set[Connection] = set()
        self.server_socket: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self.server_socket = await loop.create_server(
            self.accepted, "127.0.0.1", port, reuse_address=True
        )
        self.port = self.server_socket.sockets[0].getsockname()[1]
        return self.port

    def accepted(self) -> _End:
        conn = Connection(self)
        self.connections.add(conn)
        return conn.client

    def opened(self, conn: Connection) -> None:
        """The client's connection is made: put it on its route, and dial
        the server (until then the client's bytes queue)."""
        client = self.client
        if self.callers is not None:
            assert conn.client.transport is not None
            _, port = conn.client.transport.get_extra_info("peername")
            callers = self.callers()
            client = callers.get(caller_pid(port, self.port, callers) or 0, "?")
        conn.attach(self.network.route(client or "?", self.server))
        asyncio.get_running_loop().create_task(self.dial(conn))

    async def dial(self, conn: Connection) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: conn.server, "127.0.0.1", self.target_port)
        except OSError:
            conn.abort()  # as the server's refusal would have been
            return
        if conn.closed:
            if conn.server.transport is not None:
                conn.server.transport.abort()
            return
        conn.changed()

    async def close(self) -> None:
        if self.server_socket is not None:
            self.server_socket.close()
        for conn in list(self.connections):
            conn.abort()
        if self.server_socket is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server_socket.wait_closed(), 2)


def caller_pid(client_port: int, server_port: int, candidates: Iterable[int]) -> int | None:
    """Which of the `candidates` processes holds the client end
    (127.0.0.1:`client_port`) of a loopback TCP connection to
    `server_port`, from /proc (Linux)."""
    wanted = f":{client_port:04X}", f":{server_port:04X}"
    inode = ""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in lines:
                fields = line.split()
                if len(fields) > 9 and fields[1].endswith(wanted[0]):
                    if fields[2].endswith(wanted[1]):
                        inode = fields[9]
                        break
        if inode:
            break
    if not inode or inode == "0":
        return None
    target = f"socket:[{inode}]"
    for pid in candidates:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return int(pid)
    return None


class Network:
    """Every proxy of a topology and the routes through them."""

    def __init__(self, established_after: float = ESTABLISHED_AFTER) -> None:
        self.established_after = established_after
        self.routes: dict[tuple[str, str], Route] = {}
        self.links: list[Link] = []

    def route(self, client: str, server: str) -> Route:
        key = (client, server)
        if key not in self.routes:
            self.routes[key] = Route(client, server)
        return self.routes[key]

    async def link(self, client: str, server: str, target_port: int) -> int:
        """A proxy for `client`'s calls to `server` (listening at
        `target_port`); returns the port `client` should dial instead."""
        link = Link(self, server, target_port, client=client)
        self.links.append(link)
        self.route(client, server)
        return await link.start()

    async def peer_link(
        self, server: str, target_port: int, callers: Callable[[], dict[int, str]]
    ) -> int:
        """A proxy in front of etcd member `server`'s peer port, for every
        other member: `callers()` names the members' processes by pid."""
        link = Link(self, server, target_port, callers=callers)
        self.links.append(link)
        return await link.start()

    def routes_of(self, client: str | None = None, server: str | None = None) -> list[Route]:
        return [
            route
            for (c, s), route in self.routes.items()
            if (client is None or c == client) and (server is None or s == server) and c != "?"
        ]

    def heal(self, routes: Iterable[Route] | None = None) -> None:
        for route in self.routes.values() if routes is None else routes:
            route.heal()

    def replies_lost(self) -> int:
        return sum(route.replies_lost for route in self.routes.values())

    def resets(self) -> int:
        return sum(route.resets for route in self.routes.values())

    async def close(self) -> None:
        for link in self.links:
            await link.close()
