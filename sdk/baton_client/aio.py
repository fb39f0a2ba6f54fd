"""The asyncio client: `AsyncClient` and its `AsyncFollower`, with the same
calls, deadlines, retries and typed errors as the sync `Client`."""

from __future__ import annotations

import asyncio
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast, overload

import grpc
import grpc.aio

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


def open_channel(settings: Settings) -> grpc.aio.Channel:
    credentials = settings.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(settings.target, options=settings.channel_options())
    return grpc.aio.secure_channel(settings.target, credentials, options=settings.channel_options())


class AsyncClient:
    """The asyncio twin of `baton_client.Client`. Close it (`await
    client.close()`), or use it as an async context manager."""

    def __init__(
        self,
        settings: Settings,
        *,
        channel: grpc.aio.Channel | None = None,
        new_id: IdSource = random_id,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
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
    def from_profile(cls, path: str | Path | None = None, **overrides: Any) -> AsyncClient:
        """A client of the Baton `baton up` runs (see `Settings.from_profile`)."""
        return cls(Settings.from_profile(path, **overrides))

    async def close(self) -> None:
        """Close the channel (it ends followers reading through it)."""
        self.closed = True
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create_session(
        self,
        *,
        request_id: str = "",
        aliases: Sequence[str] = (),
        timeout_seconds: int = 0,
        token_budget: int = 0,
        timeout: float | None = None,
    ) -> CreatedSession:
        """See `Client.create_session`."""
        request = requests.create(self._new_id, request_id, aliases, timeout_seconds, token_budget)
        raw = await self._call(self._stub.CreateSession, request, timeout)
        return CreatedSession._from_raw(raw, request.request_id)

    async def send(
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
        """See `Client.send`."""
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
        raw = await self._call(self._stub.SendMessage, request, timeout)
        return Receipt._from_raw(raw.receipt, raw.delivery_id, raw.accepted_deployment_id)

    async def control(
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
        """See `Client.control`."""
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
        raw = await self._call(self._stub.SendControl, request, timeout)
        return Receipt._from_raw(raw.receipt, raw.delivery_id)

    async def get_session(
        self, session_id: str = "", *, alias: str = "", timeout: float | None = None
    ) -> Session:
        """See `Client.get_session`."""
        request = pb.GetSessionRequest(**Target.of(session_id, alias).fields())
        return (await self._call(self._stub.GetSession, request, timeout)).session

    async def list_sessions(
        self,
        *,
        filter: str = "",
        order_by: str = "",
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> SessionPage:
        """See `Client.list_sessions`."""
        request = pb.ListSessionsRequest(
            page_size=page_size, page_token=page_token, filter=filter, order_by=order_by
        )
        raw = await self._call(self._stub.ListSessions, request, timeout)
        return SessionPage(tuple(raw.sessions), raw.next_page_token)

    async def iter_sessions(
        self, *, filter: str = "", order_by: str = "", page_size: int = 0
    ) -> AsyncIterator[Session]:
        """See `Client.iter_sessions`."""
        token = ""
        while True:
            page = await self.list_sessions(
                filter=filter, order_by=order_by, page_size=page_size, page_token=token
            )
            for session in page.sessions:
                yield session
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
    ) -> AsyncFollower[Event]: ...

    @overload
    def follow(
        self,
        session_id: str = "",
        *,
        alias: str = "",
        start_seq: int = 0,
        follow: bool = True,
        live: Literal[True],
    ) -> AsyncFollower[Event | LiveBatch]: ...

    def follow(
        self,
        session_id: str = "",
        *,
        alias: str = "",
        start_seq: int = 0,
        follow: bool = True,
        live: bool = False,
    ) -> AsyncFollower[Event] | AsyncFollower[Event | LiveBatch]:
        """See `Client.follow`: `async for event in client.follow(sid)`
        (with `live=True`, events and `LiveBatch`es)."""
        return AsyncFollower(self, Target.of(session_id, alias), start_seq, follow, live)

    async def _call(
        self, method: Callable[..., Awaitable[_Response]], request: Any, timeout: float | None
    ) -> _Response:
        attempts = Attempts(self.settings.retry, self._budget)
        while True:
            try:
                response = await method(
                    request,
                    metadata=self.settings.metadata,
                    timeout=timeout or self.settings.timeout,
                )
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(exc)
                wait = attempts.next_wait(error)
                if wait is None:
                    raise error from exc
                await self._sleep(wait)
                continue
            attempts.succeeded()
            return response


class AsyncFollower(Generic[_Item]):
    """The asyncio twin of `baton_client.Follower` (an async iterator of
    events, and with `live` of live batches too)."""

    def __init__(
        self,
        client: AsyncClient,
        target: Target,
        start_seq: int,
        follow: bool,
        live: bool = False,
    ) -> None:
        self._client = client
        self._alias = target.alias
        self._cursor = Cursor(target.session_id, start_seq)
        self._follow = follow
        self._live = live
        self._events = cast(AsyncGenerator[_Item, None], self._read())

    @property
    def session_id(self) -> str:
        """The session ("" until a follower by alias has looked it up)."""
        return self._cursor.session_id

    @property
    def next_seq(self) -> int:
        """The seq of the next event: pass it as `start_seq` to resume later."""
        return self._cursor.next_seq

    def __aiter__(self) -> AsyncFollower[_Item]:
        return self

    async def __anext__(self) -> _Item:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()

    async def __aenter__(self) -> AsyncFollower[_Item]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _read(self) -> AsyncGenerator[Event | LiveBatch, None]:
        client = self._client
        settings = client.settings
        if self._alias:  # read by id: the alias may move, the session may not
            self._cursor.session_id = (await client.get_session(alias=self._alias)).session_id
        attempts = Attempts(settings.follow_retry, None)
        while not self._cursor.closed:
            call = client._stub.StreamEvents(
                self._cursor.request(self._follow, self._live),
                metadata=settings.metadata,
                timeout=None if self._follow else settings.timeout,
            )
            try:
                async for response in call:
                    fresh = self._cursor.page(response)
                    if fresh:
                        attempts.progressed()
                    for event in fresh:
                        yield event
                    if self._cursor.closed:
                        return  # the terminal event: the stream is over
                return  # the server ended the stream: it is over
            except asyncio.CancelledError:
                if client.closed:
                    return  # grpc.aio cancels the calls of a closed channel
                raise
            except grpc.aio.AioRpcError as exc:
                if client.closed:
                    return
                error: BatonError = from_rpc_error(exc)
                wait = attempts.next_wait(error)
                if wait is None:
                    raise error from exc
                await client._sleep(wait)
            finally:
                call.cancel()
