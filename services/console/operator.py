"""What the console reads and does, as an operator: the same calls as the
CLI's operator commands (services/cli/commands/operator.py, deployments.py),
made with the operator certificate to hooks, anchor and the owners, and the
tenant controls (cancel, reset) through the session's deployment's public
ingress with the console's API key, as `baton sessions cancel|reset` sends
them.

Nothing here is unbounded: a list page gathers at most one page of
sessions, the overview at most `OVERVIEW_SCAN`, a timeline page at most
`EVENTS_PAGE` events; a live session page is one follow on this process'
FollowEvents stream to anchor, which costs nothing while the session is
idle.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands.deployments import EXIT_DRAINED, DrainError, drain
from baton_runtime.cli.commands.operator import deployment_sessions
from baton_runtime.cli.commands.sessions import Connection, UsageError
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.answers import RecordedTransfer
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.errors import (
    BatonError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    Reason,
    Unavailable,
)
from baton_runtime.common.rpc.status_map import from_rpc_error
from baton_runtime.common.security.tls import channel_credentials, load_material
from baton_runtime.console.config import ConsoleConfig
from baton_runtime.ingress import listing
from baton_runtime.ingress.introspection import ANY_CHANNEL, LIST_CONCURRENCY, SessionViews

OVERVIEW_SCAN = 100
"""Sessions the overview gathers (in index order) to count them by status
and find the stalled ones and the oldest waiting message."""
PAGE_SIZES = (20, 50, 100)
EVENTS_PAGE = 50
"""Events of a timeline page (the latest on opening, then older on demand)."""
MAX_SCANNED = 4 * max(PAGE_SIZES)
"""Index entries one list page looks at before it returns a short page with
a link to the next (a sparse filter does not keep the page waiting)."""
CONTROL_TIMEOUT = 30.0
DRAIN_WAIT = 120.0
ANNOUNCE_WAIT = 15.0
"""Seconds a finished drain waits for the registry to say DRAINED."""
CONTROLS = {"cancel": pb.CONTROL_KIND_CANCEL, "reset": pb.CONTROL_KIND_RESET}


@dataclass(frozen=True)
class Overview:
    deployments: list[hooks_pb.DeploymentInfo]
    scanned: list[pb.Session]
    more: bool  # the index holds more sessions than were scanned
    health: dict[str, str]

    @property
    def by_status(self) -> list[tuple[str, int]]:
        counts = Counter(pb.SessionStatus.Name(v.status) for v in self.scanned)
        return sorted(counts.items())

    @property
    def stalled(self) -> list[pb.Session]:
        return [v for v in self.scanned if v.status == pb.SESSION_STATUS_STALLED]

    @property
    def oldest_waiting(self) -> pb.Session | None:
        waiting = [v for v in self.scanned if v.HasField("oldest_unconsumed_age")]
        return max(waiting, key=lambda v: v.oldest_unconsumed_age.ToTimedelta(), default=None)

    @property
    def failures(self) -> list[pb.Session]:
        """The scanned sessions with a failure among their recent events,
        the latest first."""
        failed = [v for v in self.scanned if v.last_failure.reason]
        return sorted(failed, key=lambda v: v.last_failure.time.ToMilliseconds(), reverse=True)


@dataclass(frozen=True)
class SessionsPage:
    sessions: list[pb.Session]
    # Where the next page starts ((channel, session id) of the last entry
    # looked at), or None at the end.
    after: tuple[str, str] | None


@dataclass
class DrainRun:
    """A drain asked for from the console, running in the background."""

    old: str
    new: str
    lines: list[str] = field(default_factory=list)
    code: int | None = None  # 0 drained, 3 sessions left; None while it runs
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def say(self, line: str) -> None:
        self.lines.append(line)
        self.changed.set()

    @property
    def done(self) -> bool:
        return self.code is not None


async def close_reader(reader: AsyncIterator[Any]) -> None:
    """End a read left early (its follow on the feed is stopped)."""
    aclose = getattr(reader, "aclose", None)
    if aclose is not None:
        await aclose()


class Operator:
    """The console's clients of hooks, anchor and owners (one of each,
    shared by every page), and its drains."""

    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.hooks = HooksClient(config.hooks, security=config.security)
        self.anchor = AnchorClient(config.anchor, security=config.security)
        self.views = SessionViews(self.hooks, self.anchor)
        self.drains: dict[str, DrainRun] = {}
        self._slots = asyncio.Semaphore(LIST_CONCURRENCY)

    async def close(self) -> None:
        for run in self.drains.values():
            if run.task is not None:
                run.task.cancel()
        await self.hooks.close()
        await self.anchor.close()

    # -- reads -------------------------------------------------------------

    async def _gather(self, session_id: str) -> pb.Session | None:
        async with self._slots:
            try:
                return (await self.views.gather(ANY_CHANNEL, session_id)).session
            except NotFound:  # gone (retention) since the index was read
                return None

    async def session(self, session_id: str) -> pb.Session:
        ids.validate_session_id(session_id)
        return (await self.views.gather(ANY_CHANNEL, session_id)).session

    async def deployments(self) -> list[hooks_pb.DeploymentInfo]:
        return await self.hooks.list_deployments()

    async def deployment(
        self, deployment_id: str, limit: int
    ) -> tuple[hooks_pb.DeploymentInfo, list[pb.Session], int]:
        deployment_id = ids.validate_deployment_id(deployment_id)
        info = await self.hooks.describe_deployment(deployment_id)
        listed, total = await deployment_sessions(self.hooks, self.anchor, deployment_id, limit)
        return info, listed, total

    async def handoff(self, session_id: str, handoff_id: str) -> RecordedTransfer:
        if session_id:
            ids.validate_session_id(session_id)
        ids.validate_id(handoff_id, "handoff_id")
        return await self.hooks.get_transfer(session_id, handoff_id)

    async def sessions_page(
        self, filter_text: str, after: tuple[str, str], size: int
    ) -> SessionsPage:
        """Up to `size` sessions of every channel after `after`, in (channel,
        session id) order, matching the AIP-160 filter of ListSessions
        (checked before any call)."""
        if len(filter_text) > listing.MAX_FILTER_LENGTH:
            raise listing.invalid_filter("the filter is too long")
        wanted = listing.parse_filter(filter_text)
        found: list[pb.Session] = []
        scanned = 0
        while True:
            page, more = await self.hooks.list_all_sessions(*after, size)
            gathered = await asyncio.gather(
                *(self.views.gather(ANY_CHANNEL, sid) for _, sid in page),
                return_exceptions=True,
            )
            for entry, got in zip(page, gathered, strict=True):
                after = entry
                scanned += 1
                if isinstance(got, NotFound):
                    continue
                if isinstance(got, BaseException):
                    raise got
                if wanted.matches(got.fields):
                    found.append(got.session)
                    if len(found) == size:
                        return SessionsPage(found, after if more or entry != page[-1] else None)
            if not more or not page:
                return SessionsPage(found, None)
            if scanned >= MAX_SCANNED:
                return SessionsPage(found, after)

    async def overview(self) -> Overview:
        deployments, (entries, more), health = await asyncio.gather(
            self.deployments(),
            self.hooks.list_all_sessions("", "", OVERVIEW_SCAN),
            self.health(),
        )
        gathered = await asyncio.gather(*(self._gather(sid) for _, sid in entries))
        return Overview(deployments, [v for v in gathered if v is not None], more, health)

    async def health(self) -> dict[str, str]:
        """hooks' and anchor's health (each stops serving while etcd is
        unreachable or has an alarm raised: services/common/etcd/health.py)."""

        async def check(address: str) -> str:
            channel = self._health_channel(address)
            try:
                # Any: types-grpcio-health-checking's HealthStub declares no methods.
                stub: Any = health_pb2_grpc.HealthStub(channel)
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
                name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
                return name
            except grpc.aio.AioRpcError as exc:
                return f"unreachable ({exc.code().name})"
            finally:
                await channel.close()

        hooks = self.config.hooks.split(",")[0]
        anchor = self.config.anchor.split(",")[0]
        found = await asyncio.gather(check(hooks), check(anchor))
        return {"hooks": found[0], "anchor": found[1]}

    def _health_channel(self, address: str) -> grpc.aio.Channel:
        files = self.config.security.files
        if files is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, channel_credentials(load_material(files)))

    async def events(self, session_id: str, start: int, end: int) -> list[s.Event]:
        """The committed events [start, end) (fewer at the head); OutOfRange
        below the retention horizon."""
        ids.validate_session_id(session_id)
        found: list[s.Event] = []
        if start >= end:
            return found
        reader = self.anchor.read_events(session_id, start)
        try:
            async for page in reader:
                found.extend(e for e in page if start <= e.seq < end)
                if page and page[-1].seq + 1 >= end:
                    break
        finally:
            await close_reader(reader)
        return found

    async def latest_events(self, view: pb.Session) -> tuple[list[s.Event], int]:
        """The last page of the session's timeline and where it starts (the
        retention horizon may be passed meanwhile: then from the horizon)."""
        head = view.stream_head
        start = max(view.earliest_seq, head - EVENTS_PAGE)
        for _ in range(3):
            try:
                return await self.events(view.session_id, start, head), start
            except OutOfRange as exc:
                start = int(exc.metadata.get("earliest_seq", head))
        return [], head

    def follow(self, session_id: str, start: int) -> AsyncIterator[list[s.Event] | s.LiveBatch]:
        """New events from `start` as they are committed (a follow on the
        FollowEvents stream, like any reader's), and the live items of the
        step in flight (docs/design.md "Live items") between them."""
        ids.validate_session_id(session_id)
        return self.anchor.follow_events_live(session_id, start)

    # -- actions -----------------------------------------------------------

    async def resume(self, session_id: str) -> str:
        """`baton sessions resume`: the instance holding the session runs it
        again with a renewed restart budget."""
        ids.validate_session_id(session_id)
        owner = await self.hooks.get_owner(session_id)
        instances = await self.hooks.list_instances(owner.owner.deployment_id)
        holder = next((i for i in instances if i.instance_id == owner.owner.instance_id), None)
        if holder is None:
            raise Unavailable(
                Reason.UPSTREAM_UNAVAILABLE,
                f"session {session_id} is owned by instance {owner.owner.instance_id}, which is "
                "not live: another instance of its deployment takes it over",
            )
        client = OwnerClient(holder.address, security=self.config.security)
        try:
            resumed, _ = await client.resume_session(session_id)
        finally:
            await client.close()
        if resumed:
            return f"resumed: the session runs again on {holder.instance_id} with a renewed budget"
        return f"the session is not stalled on {holder.instance_id}: nothing to resume"

    async def control(self, session_id: str, action: str) -> str:
        """`baton sessions cancel|reset`: a control command through the
        session's deployment's public ingress, with the console's API key."""
        view = await self.session(session_id)
        address = self.config.ingresses.get(view.deployment_id)
        if not self.config.api_key or address is None:
            raise FailedPrecondition(
                Reason.DENIED,
                f"{action} goes through deployment {view.deployment_id}'s public ingress with "
                "a channel API key: the console has none (BATON_API_KEY, --ingresses)",
            )
        connection = Connection(
            ingress=address,
            api_key=self.config.api_key,
            ca_cert=self.config.ca_cert,
            plaintext=not self.config.ca_cert,
        )
        try:
            channel = connection.open()
        except UsageError as exc:
            raise FailedPrecondition(Reason.DENIED, str(exc)) from exc
        try:
            stub = ingress_pb2_grpc.IngressServiceStub(channel)
            request = pb.SendControlRequest(
                session_id=session_id, kind=CONTROLS[action], reason="from the console"
            )
            try:
                response = await stub.SendControl(
                    request, metadata=connection.metadata, timeout=CONTROL_TIMEOUT
                )
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from exc
        finally:
            await channel.close()
        return f"{action} accepted into the inbox at seq {response.receipt.seq}"

    async def _registry_says_drained(self, deployment_id: str) -> None:
        """Wait (bounded) until the registry reports the drained deployment
        DRAINED: its owners announce their drain target on their next
        keep-alive, so a page shown at once could still say active."""
        deadline = time.monotonic() + ANNOUNCE_WAIT
        while time.monotonic() < deadline:
            try:
                info = await self.hooks.describe_deployment(deployment_id)
            except NotFound:  # no instance and no session left: nothing to wait for
                return
            if info.status == hooks_pb.DEPLOYMENT_STATUS_DRAINED:
                return
            await asyncio.sleep(0.5)

    def start_drain(self, old: str, new: str) -> DrainRun:
        """Drain `old` to `new` in the background (`baton deployments
        drain`); a drain of `old` already running is answered as it is."""
        old = ids.validate_deployment_id(old)
        new = ids.validate_deployment_id(new)
        if old == new:
            raise InvalidArgument(
                Reason.INVALID_DEPLOYMENT_ID, f"deployment {old} cannot be drained to itself"
            )
        running = self.drains.get(old)
        if running is not None and not running.done:
            return running
        run = DrainRun(old, new)
        run.say(f"draining {old} to {new} (started {time.strftime('%H:%M:%S')})")

        async def work() -> None:
            try:
                run.code = await drain(
                    self.config.hooks,
                    old,
                    new,
                    self.config.security,
                    wait_s=DRAIN_WAIT,
                    write=run.say,
                )
                if run.code == EXIT_DRAINED:
                    await self._registry_says_drained(old)
            except DrainError as exc:
                run.say(f"refused: {exc}")
                run.code = 2
            except BatonError as exc:
                run.say(f"refused: {exc.reason}: {exc.message}")
                run.code = 2
            run.changed.set()

        run.task = asyncio.get_running_loop().create_task(work())
        self.drains[old] = run
        return run
