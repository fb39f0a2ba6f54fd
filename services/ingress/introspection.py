"""Session introspection at the edge (docs/design.md §14): GetSession and
ListSessions for the caller's channel.

A view is gathered from what is already stored: anchor's last committed
snapshot and the latest events of the stream (their times, a stall, the
latest failure), then hooks' record of the session (owner, parked, inbox
head and the oldest unconsumed entry, tokens, parent link, creation time).
The snapshot is read first, so the inbox depth (head minus the snapshot's
consumed position and what it consumed ahead of it) is never negative. The
status comes from the one pure function,
`baton_runtime.common.status.session_status`.

Another channel's session is NOT_FOUND exactly like a missing one (AIP-211):
hooks checks the tenant of the session's inbox token, the snapshot names it
too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.answers import SessionDescription
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.errors import NotFound, OutOfRange
from baton_runtime.common.status import SessionFacts, Status, StatusView, session_status
from baton_runtime.ingress import listing
from baton_runtime.ingress.edge import session_not_found

RECENT_EVENTS = 16
"""Events read back from the stream head: the latest one dates the last
commit and tells a stall; the latest failure among them is reported."""

ANY_CHANNEL = ""
"""`SessionViews.gather`'s channel for an operator: every channel."""

LIST_CONCURRENCY = 16
"""Sessions of one ListSessions page gathered at once."""

MAX_SCANNED = 4 * listing.MAX_PAGE_SIZE
"""Index entries one ListSessions call looks at before it returns a short
page (with a token) rather than keep a caller waiting on a sparse filter."""
MAX_PAGE_BYTES = 2 * 1024 * 1024
"""A page is cut short (with a token) before its sessions pass this size, so
that it fits in one message (4 MiB); 200 sessions of 256 aliases each would
not."""

STATUS_PROTO = {
    Status.IDLE: pb.SESSION_STATUS_IDLE,
    Status.RUNNING: pb.SESSION_STATUS_RUNNING,
    Status.WAITING_FOR_INPUT: pb.SESSION_STATUS_WAITING_FOR_INPUT,
    Status.WAITING_FOR_AUTHORIZATION: pb.SESSION_STATUS_WAITING_FOR_AUTHORIZATION,
    Status.PARKED: pb.SESSION_STATUS_PARKED,
    Status.STALLED: pb.SESSION_STATUS_STALLED,
    Status.HANDING_OFF: pb.SESSION_STATUS_HANDING_OFF,
    Status.FINALIZED: pb.SESSION_STATUS_FINALIZED,
}
_FAILURES = {
    s.EVENT_KIND_TURN_FAILED,
    s.EVENT_KIND_SESSION_FAILED,
    s.EVENT_KIND_SESSION_STALLED,
    s.EVENT_KIND_TASK_FAILED,
    s.EVENT_KIND_COMMAND_REJECTED,
}


@dataclass(frozen=True)
class Gathered:
    """A view and the fields a filter compares."""

    session: pb.Session
    fields: listing.SessionFields


def facts_of(
    snapshot: s.SessionSnapshot | None,
    described: SessionDescription,
    latest: s.Event | None,
) -> SessionFacts:
    """What the status function needs, from what was read."""
    turn = snapshot.open_turn if snapshot is not None else s.OpenTurn()
    handles: Sequence[s.ChildHandle] = snapshot.handles if snapshot is not None else ()
    stalled = latest is not None and latest.kind == s.EVENT_KIND_SESSION_STALLED
    return SessionFacts(
        committed=snapshot is not None,
        finalized=snapshot is not None and snapshot.status == s.SESSION_STATUS_FINALIZED,
        owner_run_id=described.owner.owner_run_id,
        owner_deployment_id=described.owner.deployment_id,
        snapshot_deployment_id=snapshot.deployment_id if snapshot is not None else "",
        parked=described.parked,
        inbox_depth=inbox_depth(snapshot, described),
        turn_open=snapshot is not None and snapshot.HasField("open_turn"),
        pending_inputs=len(turn.pending_inputs),
        pending_authorizations=len(turn.pending_authorizations),
        children_running=sum(h.state == s.HANDLE_STATE_RUNNING for h in handles),
        children_waiting=sum(h.waiting for h in handles),
        stalled_by_run=latest.owner_run_id if stalled and latest is not None else "",
        stalled_reason=latest.error.reason if stalled and latest is not None else "",
        stalled_message=latest.error.message if stalled and latest is not None else "",
    )


def _remaining(snapshot: s.SessionSnapshot) -> pb.RemainingLimits:
    remaining = pb.RemainingLimits()
    limits, usage = snapshot.limits, snapshot.usage
    if limits.token_budget:
        used = usage.input_tokens + usage.output_tokens
        remaining.tokens = max(0, limits.token_budget - used)
    if limits.cost_budget_micros:
        remaining.cost_micros = max(0, limits.cost_budget_micros - usage.cost_micros)
    return remaining


def _ms(stamp: Timestamp | None) -> int:
    return stamp.ToMilliseconds() if stamp is not None and stamp.ByteSize() else 0


def _copy_snapshot(session: pb.Session, snapshot: s.SessionSnapshot) -> None:
    """What the view shows of the last committed snapshot."""
    session.stream_head = snapshot.next_event_seq
    session.turn_count = snapshot.turn_count
    session.usage.CopyFrom(snapshot.usage)
    session.limits.CopyFrom(snapshot.limits)
    session.remaining.CopyFrom(_remaining(snapshot))
    session.pending_inputs.extend(snapshot.open_turn.pending_inputs)
    session.pending_authorizations.extend(snapshot.open_turn.pending_authorizations)
    session.children.extend(snapshot.handles)
    session.last_trace_id = snapshot.last_trace_id
    if snapshot.HasField("timeout") and snapshot.timeout.HasField("deadline"):
        session.timeout_deadline.CopyFrom(snapshot.timeout.deadline)


def inbox_depth(snapshot: s.SessionSnapshot | None, described: SessionDescription) -> int:
    """The commands accepted and not consumed: past the consumed position,
    less those consumed ahead of it (taken past a queued message that waits
    for the open turn to end)."""
    if snapshot is None:
        return described.inbox_head
    consumed = snapshot.inbox_next_seq + len(snapshot.inbox_consumed_ahead)
    return max(0, described.inbox_head - consumed)


def _copy_inbox(
    session: pb.Session,
    snapshot: s.SessionSnapshot | None,
    described: SessionDescription,
    now_ms: int,
) -> None:
    """The inbox's depth past the consumed position, and its oldest entry's age."""
    session.inbox_depth = inbox_depth(snapshot, described)
    oldest = described.oldest_unconsumed_accepted_at
    if session.inbox_depth and oldest is not None:
        age = Duration()
        age.FromMilliseconds(max(0, now_ms - _ms(oldest)))
        session.oldest_unconsumed_age.CopyFrom(age)


def _last_failure(recent: Sequence[s.Event]) -> pb.SessionFailure | None:
    """The latest failure among the recent events, if any."""
    for event in reversed(recent):
        if event.kind in _FAILURES:
            return pb.SessionFailure(
                reason=event.error.reason,
                message=event.error.message,
                turn_id=event.turn_id,
                seq=event.seq,
                time=event.time,
            )
    return None


def build_view(
    session_id: str,
    snapshot: s.SessionSnapshot | None,
    described: SessionDescription,
    recent: Sequence[s.Event],
    now_ms: int,
    earliest_seq: int = 0,
) -> Gathered:
    """The public view from what was read (pure); `earliest_seq` is the
    stream's retention horizon read with the snapshot."""
    latest = recent[-1] if recent else None
    view: StatusView = session_status(facts_of(snapshot, described, latest))
    session = pb.Session(
        session_id=session_id,
        channel=described.channel,
        status=STATUS_PROTO[view.status],
        deployment_id=described.owner.deployment_id,
        owner_run_id=described.owner.owner_run_id,
        epoch=described.fence.epoch,
        instance_id=described.owner.instance_id,
        aliases=described.hooks,
    )
    if view.reason:
        session.status_reason.reason = view.reason
        session.status_reason.message = view.message
    if snapshot is not None:
        _copy_snapshot(session, snapshot)
        session.earliest_seq = earliest_seq
    _copy_inbox(session, snapshot, described, now_ms)
    if described.parent is not None:
        session.parent.CopyFrom(described.parent)
        del session.parent.outbox[:]
    failure = _last_failure(recent)
    if failure is not None:
        session.last_failure.CopyFrom(failure)
    if described.create_time is not None:
        session.create_time.CopyFrom(described.create_time)
    if latest is not None and latest.HasField("time"):
        session.update_time.CopyFrom(latest.time)
    elif described.create_time is not None:
        session.update_time.CopyFrom(described.create_time)
    fields = listing.SessionFields(
        status=view.status,
        deployment_id=session.deployment_id,
        create_ms=_ms(session.create_time if session.HasField("create_time") else None),
        update_ms=_ms(session.update_time if session.HasField("update_time") else None),
    )
    return Gathered(session, fields)


class SessionViews:
    """GetSession and ListSessions over hooks and anchor."""

    def __init__(
        self,
        hooks: HooksClient,
        anchor: AnchorClient,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._hooks = hooks
        self._anchor = anchor
        self._clock = clock

    async def gather(self, channel: str, session_id: str) -> Gathered:
        """One session of `channel`; NotFound when missing or another's.
        ANY_CHANNEL ("") is an operator's view (the CLI, with the operator
        certificate): the session of whichever channel; a tenant's call
        always names its authenticated channel."""
        ids.validate_session_id(session_id)
        earliest = 0
        try:
            snapshot: s.SessionSnapshot | None
            snapshot, earliest = await self._anchor.snapshot_and_horizon(session_id)
        except NotFound:
            snapshot = None  # no commit yet: what hooks knows is all there is
        if channel != ANY_CHANNEL and snapshot is not None and snapshot.channel != channel:
            raise session_not_found(session_id)
        consumed = snapshot.inbox_next_seq if snapshot is not None else 0
        try:
            described = await self._hooks.describe_session(session_id, channel, consumed)
        except NotFound:
            raise session_not_found(session_id) from None
        head = snapshot.next_event_seq if snapshot is not None else 0
        recent = await self._recent(session_id, head) if head else []
        now_ms = int(self._clock() * 1000)
        return build_view(session_id, snapshot, described, recent, now_ms, earliest)

    async def _recent(self, session_id: str, head: int) -> list[s.Event]:
        """The latest events before `head`; when fewer are kept (the stream's
        retention horizon is closer), the ones from the horizon on."""
        start = max(0, head - RECENT_EVENTS)
        for _ in range(3):  # the horizon may pass `start` between the reads
            recent: list[s.Event] = []
            try:
                async for page in self._anchor.read_events(session_id, start):
                    recent.extend(e for e in page if e.seq < head)
                return recent
            except OutOfRange as exc:
                start = int(exc.metadata.get("earliest_seq", head))
        return []

    async def get(self, channel: str, session_id: str) -> pb.Session:
        return (await self.gather(channel, session_id)).session

    async def list(
        self, channel: str, page_size: int, page_token: str, filter_text: str
    ) -> tuple[list[pb.Session], str]:
        """One page (AIP-158) of the channel's sessions matching the filter,
        and the next page's token ("" at the end). Every argument is
        validated before anything is read."""
        size = listing.page_size(page_size)
        if len(filter_text) > listing.MAX_FILTER_LENGTH:
            raise listing.invalid_filter("the filter is too long")
        after = listing.decode_page_token(page_token, channel, filter_text)
        wanted = listing.parse_filter(filter_text)
        out: list[pb.Session] = []
        total = 0  # serialized bytes of `out`
        scanned = 0
        limit = asyncio.Semaphore(LIST_CONCURRENCY)

        async def one(session_id: str) -> Gathered | None:
            async with limit:
                try:
                    return await self.gather(channel, session_id)
                except NotFound:  # deleted (retention) since the index was read
                    return None

        while True:
            page = await self._hooks.list_channel_sessions(channel, after, size)
            gathered = await asyncio.gather(*(one(sid) for sid, _ in page.sessions))
            for (session_id, _), found in zip(page.sessions, gathered, strict=True):
                listed = found is not None and wanted.matches(found.fields)
                if listed:
                    assert found is not None
                    cost = found.session.ByteSize()
                    if out and total + cost > MAX_PAGE_BYTES:
                        # Full by size: this session opens the next page.
                        return out, self._token(channel, filter_text, after, True)
                    out.append(found.session)
                    total += cost
                after = session_id
                scanned += 1
                if listed and len(out) == size:
                    more = page.more or session_id != page.sessions[-1][0]
                    return out, self._token(channel, filter_text, after, more)
            if not page.more:
                return out, ""
            if scanned >= MAX_SCANNED:
                return out, self._token(channel, filter_text, after, True)

    @staticmethod
    def _token(channel: str, filter_text: str, after: str, more: bool) -> str:
        return listing.encode_page_token(channel, filter_text, after) if more else ""
