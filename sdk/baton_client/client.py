"""The synchronous client: `Client` and its `Follower`.

Every call has a deadline (`Settings.timeout`, or the call's `timeout=`),
is retried only on a retryable failure and only when repeating it is safe
(baton_client.retry), and raises a typed error (baton_client.errors).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast, overload

import grpc

from baton_client import requests
from baton_client._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_client._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_client._proto.baton.session.v1 import session_pb2 as s
from baton_client.errors import BatonError, from_rpc_error
from baton_client.requests import Cursor, IdSource, Target, random_id
from baton_client.retry import Attempts, RetryBudget
from baton_client.settings import Settings
from baton_client.types import CreatedSession, Event, LiveBatch, Receipt, Session, SessionPage

_Response = TypeVar("_Response")
#: What a follower yields: `Event`, or with live items `Event | LiveBatch`.
_Item = TypeVar("_Item", covariant=True)


def open_channel(settings: Settings) -> grpc.Channel:
    credentials = settings.credentials()
    if credentials is None:
        return grpc.insecure_channel(settings.target, options=settings.channel_options())
    return grpc.secure_channel(settings.target, credentials, options=settings.channel_options())


class Client:
    """A channel gateway's client of one Baton (an ingress or a balanced
    set of them). Close it, or use it as a context manager."""

    def __init__(
        self,
        settings: Settings,
        *,
        channel: grpc.Channel | None = None,
        new_id: IdSource = random_id,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.settings = settings
        self._owns_channel = channel is None
        self._channel = channel if channel is not None else open_channel(settings)
        self._stub = ingress_pb2_grpc.IngressServiceStub(self._channel)
        self._new_id = new_id
        self._sleep = sleep
        self._budget = RetryBudget()
        self.closed = False

    @classmethod
    def from_profile(cls, path: str | Path | None = None, **overrides: Any) -> Client:
        """A client of the Baton `baton up` runs (see `Settings.from_profile`)."""
        return cls(Settings.from_profile(path, **overrides))

    def close(self) -> None:
        """Close the channel (it ends followers reading through it)."""
        self.closed = True
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls ---------------------------------------------------------------------

    def create_session(
        self,
        *,
        request_id: str = "",
        aliases: Sequence[str] = (),
        timeout_seconds: int = 0,
        token_budget: int = 0,
        timeout: float | None = None,
    ) -> CreatedSession:
        """Create a session (on the ingress's deployment). `request_id` makes
        it idempotent; one is generated when absent, so retries are safe."""
        request = requests.create(self._new_id, request_id, aliases, timeout_seconds, token_budget)
        raw = self._call(self._stub.CreateSession, request, timeout)
        return CreatedSession._from_raw(raw, request.request_id)

    def send(
        self,
        session_id: str = "",
        text: str = "",
        *,
        alias: str = "",
        input_responses: Iterable[s.InputResponse] = (),
        turn_policy: s.TurnPolicy.ValueType = s.TURN_POLICY_UNSPECIFIED,
        delivery_id: str = "",
        caller: str = "",
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Receipt:
        """Deliver a message (or input responses). Accepted means durable.
        Retried with one delivery id (the caller's, or generated), so it is
        appended once however often it is sent."""
        request = requests.send(
            self._new_id,
            Target.of(session_id, alias),
            text,
            input_responses,
            turn_policy,
            delivery_id,
            caller,
            labels,
        )
        raw = self._call(self._stub.SendMessage, request, timeout)
        return Receipt._from_raw(raw.receipt, raw.delivery_id, raw.accepted_deployment_id)

    def control(
        self,
        session_id: str = "",
        kind: pb.ControlKind.ValueType = pb.CONTROL_KIND_UNSPECIFIED,
        *,
        alias: str = "",
        reason: str = "",
        attempt_id: str = "",
        granted: bool = False,
        delivery_id: str = "",
        caller: str = "",
        timeout: float | None = None,
    ) -> Receipt:
        """Deliver a control command (cancel, reset, clear, compact, a
        sign-in callback), with a delivery id like `send`."""
        request = requests.control(
            self._new_id,
            Target.of(session_id, alias),
            kind,
            reason,
            attempt_id,
            granted,
            delivery_id,
            caller,
        )
        raw = self._call(self._stub.SendControl, request, timeout)
        return Receipt._from_raw(raw.receipt, raw.delivery_id)

    def get_session(
        self, session_id: str = "", *, alias: str = "", timeout: float | None = None
    ) -> Session:
        """One session of the caller's channel, as introspection sees it."""
        request = pb.GetSessionRequest(**Target.of(session_id, alias).fields())
        return self._call(self._stub.GetSession, request, timeout).session

    def list_sessions(
        self,
        *,
        filter: str = "",
        order_by: str = "",
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> SessionPage:
        """One page of the channel's sessions (AIP-158 paging, an AIP-160
        filter subset, an AIP-132 order: see docs/introspection.md)."""
        request = pb.ListSessionsRequest(
            page_size=page_size, page_token=page_token, filter=filter, order_by=order_by
        )
        raw = self._call(self._stub.ListSessions, request, timeout)
        return SessionPage(tuple(raw.sessions), raw.next_page_token)

    def iter_sessions(
        self, *, filter: str = "", order_by: str = "", page_size: int = 0
    ) -> Iterator[Session]:
        """Every session of the channel matching `filter`, page after page."""
        token = ""
        while True:
            page = self.list_sessions(
                filter=filter, order_by=order_by, page_size=page_size, page_token=token
            )
            yield from page.sessions
            token = page.next_page_token
            if not token:
                return

    @overload
    def follow(
        self,
        session_id: str = "",
        *,
        alias: str = "",
        start_seq: int = 0,
        follow: bool = True,
        live: Literal[False] = False,
    ) -> Follower[Event]: ...

    @overload
    def follow(
        self,
        session_id: str = "",
        *,
        alias: str = "",
        start_seq: int = 0,
        follow: bool = True,
        live: Literal[True],
    ) -> Follower[Event | LiveBatch]: ...

    def follow(
        self,
        session_id: str = "",
        *,
        alias: str = "",
        start_seq: int = 0,
        follow: bool = True,
        live: bool = False,
    ) -> Follower[Event] | Follower[Event | LiveBatch]:
        """The session's events from `start_seq`, each once and in order;
        with `follow`, live until the session's terminal event, resuming
        from its cursor whenever the connection drops (see `Follower`).
        With `live` (and `follow`), also the live items of running steps as
        `LiveBatch`es among the events (`baton_client.live.LiveView`
        assembles them into the answer so far)."""
        return Follower(self, Target.of(session_id, alias), start_seq, follow, live)

    def _call(
        self, method: Callable[..., _Response], request: Any, timeout: float | None
    ) -> _Response:
        attempts = Attempts(self.settings.retry, self._budget)
        while True:
            try:
                response = method(
                    request,
                    metadata=self.settings.metadata,
                    timeout=timeout or self.settings.timeout,
                )
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                wait = attempts.next_wait(error)
                if wait is None:
                    raise error from exc
                self._sleep(wait)
                continue
            attempts.succeeded()
            return response


class Follower(Iterator[_Item], Generic[_Item]):
    """A session's events, each exactly once and in seq order, across
    dropped connections, ingress restarts and handoffs: when the stream
    breaks with a retryable failure it reads again from its cursor (the next
    seq it expects), dropping any overlap and refusing any gap (`StreamGap`).

    With `live`, also the live items of running steps (`LiveBatch`), each in
    its place among the events; after a reconnect the step in flight's
    items come again from its start (`LiveView` skips what it has), and
    items of a step whose commit was already yielded are not yielded.

    A cursor below the stream's retention horizon raises `OutOfRange` (with
    `earliest_seq`); a refusal or a connection that stays down past
    `Settings.follow_retry` raises its typed error. Iteration ends after the
    terminal event (or, without `follow`, at the stream's current end).
    `close()` (from any thread) stops it."""

    def __init__(
        self, client: Client, target: Target, start_seq: int, follow: bool, live: bool = False
    ) -> None:
        self._client = client
        self._alias = target.alias
        self._cursor = Cursor(target.session_id, start_seq)
        self._follow = follow
        self._live = live
        self._lock = threading.Lock()
        self._call: grpc.RpcContext | None = None
        self._closed = False
        self._events = cast(Iterator[_Item], self._read())

    @property
    def session_id(self) -> str:
        """The session ("" until a follower by alias has looked it up)."""
        return self._cursor.session_id

    @property
    def next_seq(self) -> int:
        """The seq of the next event: pass it as `start_seq` to resume later."""
        return self._cursor.next_seq

    def __iter__(self) -> Follower[_Item]:
        return self

    def __next__(self) -> _Item:
        return next(self._events)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._call is not None:
                self._call.cancel()

    def __enter__(self) -> Follower[_Item]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> Iterator[Event | LiveBatch]:
        client = self._client
        settings = client.settings
        if self._alias:  # read by id: the alias may move, the session may not
            self._cursor.session_id = client.get_session(alias=self._alias).session_id
        attempts = Attempts(settings.follow_retry, None)
        while not self._cursor.closed:
            call = client._stub.StreamEvents(
                self._cursor.request(self._follow, self._live),
                metadata=settings.metadata,
                timeout=None if self._follow else settings.timeout,
            )
            with self._lock:
                if self._closed:
                    call.cancel()
                    return
                self._call = call
            try:
                for response in call:
                    fresh = self._cursor.page(response)
                    if fresh:
                        attempts.progressed()
                    yield from fresh
                    if self._cursor.closed:
                        return  # the terminal event: the stream is over
                return  # the server ended the stream: it is over
            except grpc.RpcError as exc:
                if self._closed or client.closed:
                    return
                error: BatonError = from_rpc_error(exc)
                wait = attempts.next_wait(error)
                if wait is None:
                    raise error from exc
                client._sleep(wait)
            finally:
                call.cancel()
