"""An HTTP webhook gateway for Baton, on Starlette and the Baton SDK.

- `POST /webhook` `{"id", "conversation", "text", "callback_url"?}`: the
  conversation is a session, found by its alias `conversation-<id>` (created
  on its first message, with the alias, idempotently); the text is sent with
  the webhook's id as the delivery id, so a webhook delivered twice is one
  message. Answers `202` with the session and `from`, the stream cursor the
  answer starts at.
- `GET /conversations/{id}/events?from=SEQ` (or `Last-Event-ID`): the
  answers as server-sent events (`answer`, `approval` with two links,
  `question`, `waiting`), each with its stream seq as the SSE id.
- With a `callback_url`, the gateway posts each of those events to it
  instead, in order, once: the cursor of each session is saved after each
  post (state.py), so a restarted gateway goes on where it stopped.
- `GET /decide/{session}/{request}/{approve|deny}?sig=...`: an approval link
  a person clicks (signed: links.py); the answer is sent once, however often
  it is clicked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from baton_client import AsyncClient, Event, EventKind, InputKind, InputResponse, NotFound
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from webhook_gateway import links
from webhook_gateway.state import GatewayState

_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
CALLBACK_RETRY_SECONDS = 1.0


def alias_of(conversation: str) -> str:
    return f"conversation-{conversation}"


class Gateway:
    """The gateway's state: the Baton client, the saved cursors and the
    callback dispatchers."""

    def __init__(
        self,
        client: AsyncClient,
        state: GatewayState,
        secret: bytes,
        base_url: str,
        http: httpx.AsyncClient,
    ) -> None:
        self.client = client
        self.state = state
        self.secret = secret
        self.base_url = base_url.rstrip("/")
        self.http = http
        self._dispatchers: dict[str, asyncio.Task[None]] = {}

    async def session_for(self, conversation: str) -> str:
        """The conversation's session: found by its alias, else created with
        it (a retry with the same request id finds the same session)."""
        alias = alias_of(conversation)
        try:
            return (await self.client.get_session(alias=alias)).session_id
        except NotFound:
            created = await self.client.create_session(
                aliases=[alias], request_id=f"conversation-{conversation}"
            )
            return created.session_id

    def render(self, event: Event) -> dict[str, Any] | None:
        """What a chat user sees of an event (None: nothing)."""
        seen: dict[str, Any] = {"seq": event.seq, "session_id": event.session_id}
        if event.kind == EventKind.EVENT_KIND_MESSAGE_COMPLETED:
            return {**seen, "event": "answer", "text": event.text}
        if event.kind == EventKind.EVENT_KIND_SESSION_WAITING:
            return {**seen, "event": "waiting"}
        if event.kind != EventKind.EVENT_KIND_INPUT_REQUESTED or event.child_session_id:
            return None
        asked = event.input_request
        if asked.kind == InputKind.INPUT_KIND_QUESTION:
            return {**seen, "event": "question", "prompt": asked.prompt}
        decide = {
            verdict: links.link(
                self.base_url, self.secret, event.session_id, asked.request_id, verdict
            )
            for verdict in ("approve", "deny")
        }
        return {**seen, "event": "approval", "prompt": asked.prompt, **decide}

    def dispatch(self, session_id: str) -> None:
        """Post the session's events to its callback, from its saved cursor
        (one dispatcher per session)."""
        running = self._dispatchers.get(session_id)
        if running is None or running.done():
            self._dispatchers[session_id] = asyncio.create_task(self._post_all(session_id))

    async def _post_all(self, session_id: str) -> None:
        start = self.state.cursors.get(session_id, 0)
        async for event in self.client.follow(session_id, start_seq=start):
            shown = self.render(event)
            while shown is not None:
                try:
                    posted = await self.http.post(self.state.callbacks[session_id], json=shown)
                    if posted.status_code < 300:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(CALLBACK_RETRY_SECONDS)  # the receiver will be back
            self.state.cursors[session_id] = event.seq + 1
            self.state.save()

    async def close(self) -> None:
        for task in self._dispatchers.values():
            task.cancel()
        await asyncio.gather(*self._dispatchers.values(), return_exceptions=True)
        await self.client.close()
        await self.http.aclose()


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def webhook(request: Request) -> Response:
    try:
        body = await request.json()
    except ValueError:
        return JSONResponse({"error": "the body is not JSON"}, status_code=400)
    if not isinstance(body, dict):
        return JSONResponse({"error": "the body is not a JSON object"}, status_code=400)
    webhook_id, conversation = str(body.get("id", "")), str(body.get("conversation", ""))
    text, callback = str(body.get("text", "")), str(body.get("callback_url", ""))
    if not _ID.match(webhook_id) or not _ID.match(conversation) or not text.strip():
        return JSONResponse(
            {"error": "id and conversation ([A-Za-z0-9._-], 1-64) and text are required"},
            status_code=400,
        )
    gateway = _gateway(request)
    session_id = await gateway.session_for(conversation)
    start = (await gateway.client.get_session(session_id)).stream_head
    receipt = await gateway.client.send(session_id, text, delivery_id=f"webhook-{webhook_id}")
    if callback and session_id not in gateway.state.callbacks:
        gateway.state.callbacks[session_id] = callback
        gateway.state.cursors.setdefault(session_id, start)
        gateway.state.save()
    if session_id in gateway.state.callbacks:
        gateway.dispatch(session_id)
    answer = {
        "session_id": session_id,
        "inbox_seq": receipt.seq,
        "duplicate": receipt.duplicate,
        "from": start,
        "events": f"/conversations/{conversation}/events?from={start}",
    }
    return JSONResponse(answer, status_code=202)


async def events(request: Request) -> Response:
    conversation = request.path_params["conversation"]
    if not _ID.match(conversation):
        return JSONResponse({"error": "bad conversation id"}, status_code=400)
    gateway = _gateway(request)
    try:
        session_id = (await gateway.client.get_session(alias=alias_of(conversation))).session_id
    except NotFound:
        return JSONResponse({"error": f"no conversation {conversation}"}, status_code=404)
    last = request.headers.get("last-event-id", "")
    start = int(last) + 1 if last.isdigit() else int(request.query_params.get("from", "0") or 0)

    async def stream() -> AsyncIterator[str]:
        async for event in gateway.client.follow(session_id, start_seq=start):
            shown = gateway.render(event)
            if shown is not None:
                yield f"id: {event.seq}\nevent: {shown['event']}\ndata: {json.dumps(shown)}\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


async def decide(request: Request) -> Response:
    params = request.path_params
    session_id, request_id, verdict = params["session"], params["request"], params["verdict"]
    gateway = _gateway(request)
    sig = request.query_params.get("sig", "")
    if verdict not in ("approve", "deny") or not links.valid(
        gateway.secret, session_id, request_id, verdict, sig
    ):
        return PlainTextResponse("this link is not valid", status_code=403)
    answer = InputResponse(request_id=request_id, approved=verdict == "approve")
    # One delivery id per request: a second click (either link) is the first answer.
    await gateway.client.send(
        session_id, input_responses=[answer], delivery_id=f"decide-{session_id}-{request_id}"
    )
    return PlainTextResponse("approved" if verdict == "approve" else "denied")


def create_app(
    client: Callable[[], AsyncClient],
    *,
    state_path: Path,
    secret: bytes,
    base_url: str,
    http: Callable[[], httpx.AsyncClient] = lambda: httpx.AsyncClient(timeout=10),
) -> Starlette:
    """The gateway's ASGI app. `client` makes the Baton client (in the
    server's event loop, at startup); the dispatchers of the callbacks the
    state file names start with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gateway = Gateway(client(), GatewayState.load(state_path), secret, base_url, http())
        app.state.gateway = gateway
        for session_id in gateway.state.callbacks:
            gateway.dispatch(session_id)
        try:
            yield
        finally:
            await gateway.close()

    return Starlette(
        routes=[
            Route("/webhook", webhook, methods=["POST"]),
            Route("/conversations/{conversation}/events", events),
            Route("/decide/{session}/{request}/{verdict}", decide),
        ],
        lifespan=lifespan,
    )
