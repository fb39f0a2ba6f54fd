"""The requests of IngressService, built once for the sync and asyncio
clients: addressing, idempotency keys filled in, and a follower's cursor.
No I/O here."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from baton_client._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_client._proto.baton.session.v1 import session_pb2 as s
from baton_client.errors import InvalidArgument, Reason, StreamGap
from baton_client.types import TERMINAL_KINDS, Event, LiveBatch

#: Produces the ids the SDK generates (delivery ids, request ids).
IdSource = Callable[[], str]


def random_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Target:
    """A session named by its id or by an alias of the caller's channel."""

    session_id: str = ""
    alias: str = ""

    @classmethod
    def of(cls, session_id: str, alias: str) -> Target:
        if bool(session_id) == bool(alias):
            raise InvalidArgument(Reason.MISSING_FIELD, "name the session by session_id or alias")
        return cls(session_id, alias)

    def fields(self) -> dict[str, str]:
        return {"session_id": self.session_id} if self.session_id else {"alias": self.alias}


def create(
    new_id: IdSource,
    request_id: str,
    aliases: Sequence[str],
    timeout_seconds: int,
    token_budget: int,
) -> pb.CreateSessionRequest:
    """A request id is always sent, so a retry finds the session the first
    attempt created instead of creating another."""
    return pb.CreateSessionRequest(
        request_id=request_id or f"sdk-req-{new_id()}",
        aliases=list(aliases),
        timeout_seconds=timeout_seconds,
        token_budget=token_budget,
    )


def send(
    new_id: IdSource,
    target: Target,
    text: str,
    input_responses: Iterable[s.InputResponse],
    turn_policy: s.TurnPolicy.ValueType,
    delivery_id: str,
    caller: str,
    labels: Mapping[str, str] | None,
) -> pb.SendMessageRequest:
    """A delivery id is always sent: a retry returns the first receipt."""
    return pb.SendMessageRequest(
        **target.fields(),
        text=text,
        input_responses=list(input_responses),
        turn_policy=turn_policy,
        delivery_id=delivery_id or f"sdk-dlv-{new_id()}",
        caller=caller,
        labels=dict(labels or {}),
    )


def control(
    new_id: IdSource,
    target: Target,
    kind: pb.ControlKind.ValueType,
    reason: str,
    attempt_id: str,
    granted: bool,
    delivery_id: str,
    caller: str,
) -> pb.SendControlRequest:
    return pb.SendControlRequest(
        **target.fields(),
        kind=kind,
        reason=reason,
        attempt_id=attempt_id,
        granted=granted,
        delivery_id=delivery_id or f"sdk-dlv-{new_id()}",
        caller=caller,
    )


class Cursor:
    """Where a follower stands: the next seq it expects. Takes each batch
    the server sends, drops what it has seen (a resumed read may overlap)
    and refuses a gap, so the caller sees every event exactly once, in order."""

    def __init__(self, session_id: str, next_seq: int = 0) -> None:
        self.session_id = session_id
        self.next_seq = next_seq
        self.closed = False

    def request(self, follow: bool, live: bool = False) -> pb.StreamEventsRequest:
        return pb.StreamEventsRequest(
            session_id=self.session_id, start_seq=self.next_seq, follow=follow, live=live
        )

    def current(self, batch: LiveBatch) -> bool:
        """Whether a live batch is of a step not yet committed as far as this
        follower has read: a resumed read may send the items of a step whose
        commit the caller has already seen."""
        return not self.closed and batch.step.base_seq >= self.next_seq

    def page(self, response: pb.StreamEventsResponse) -> list[Event | LiveBatch]:
        """One response's fresh events, or its live batch if still current."""
        if response.HasField("live"):
            return [response.live] if self.current(response.live) else []
        return list(self.accept(response.events))

    def accept(self, events: Iterable[Event]) -> list[Event]:
        fresh: list[Event] = []
        for event in events:
            if event.seq < self.next_seq:
                continue
            if event.seq > self.next_seq:
                raise StreamGap(
                    Reason.STREAM_GAP,
                    f"session {self.session_id}: expected seq {self.next_seq}, got {event.seq}",
                )
            fresh.append(event)
            self.next_seq = event.seq + 1
            if event.kind in TERMINAL_KINDS:
                self.closed = True
                break
        return fresh
