"""The webhook gateway end to end: real HTTP (uvicorn on loopback) in
front of the Baton SDK, against a real Baton (baton_runtime.testing's
harness: etcd, hooks, anchor, owner and ingress) running the fixture agent.

A conversation becomes a session (by alias) on its first webhook; a webhook
delivered twice is one message; answers stream as server-sent events;
an approval is a link that, clicked (twice), answers once; with a callback
URL the answers are posted, and a restarted gateway posts what arrived while
it was down, once, from its saved cursor."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from baton_client import AsyncClient, Settings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from webhook_gateway import create_app

from baton_runtime.owner.agents.fixture import build_agent
from baton_runtime.testing import AgentHarness

SECRET = b"test-secret"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Served:
    """An ASGI app served by uvicorn on a loopback port, in this event loop."""

    def __init__(self, app: Any, port: int) -> None:
        self.port = port
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Served:
        self.task = asyncio.create_task(self.server.serve())
        async with asyncio.timeout(20):
            while not self.server.started:
                assert not self.task.done(), "the server did not start"
                await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


async def sse(http: httpx.AsyncClient, path: str, until: str) -> list[dict[str, Any]]:
    """Server-sent events from `path` until one of kind `until` (inclusive)."""
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(30), http.stream("GET", path) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        event_id, kind = "", ""
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["event"] == kind and str(data["seq"]) == event_id
                seen.append(data)
                if kind == until:
                    return seen
    raise AssertionError(f"the stream ended before {until}: {seen}")


def receiver() -> tuple[Starlette, list[dict[str, Any]], asyncio.Event]:
    """A callback endpoint recording what it is posted."""
    posted: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    async def callback(request: Request) -> JSONResponse:
        posted.append(await request.json())
        arrived.set()
        return JSONResponse({})

    return Starlette(routes=[Route("/hook", callback, methods=["POST"])]), posted, arrived


async def posted_until(posted: list[dict[str, Any]], arrived: asyncio.Event, count: int) -> None:
    async with asyncio.timeout(30):
        while len(posted) < count:
            arrived.clear()
            await arrived.wait()


async def test_the_webhook_gateway_end_to_end(tmp_path: Path) -> None:
    async with AgentHarness(build_agent, deployment_id="gw-1") as baton:
        settings = Settings(target=baton.ingress_address(), api_key=baton.api_key, plaintext=True)
        port = free_port()
        state = tmp_path / "gateway-state.json"

        def gateway() -> Served:
            app = create_app(
                lambda: AsyncClient(settings),
                state_path=state,
                secret=SECRET,
                base_url=f"http://127.0.0.1:{port}",
            )
            return Served(app, port)

        hook_app, posted, arrived = receiver()
        async with Served(hook_app, free_port()) as hooks:
            callback = f"{hooks.url}/hook"
            async with gateway() as served, httpx.AsyncClient(base_url=served.url) as http:
                # A conversation's first webhook creates its session; SSE answers.
                first = await http.post(
                    "/webhook", json={"id": "w-1", "conversation": "c-1", "text": "hello"}
                )
                assert first.status_code == 202, first.text
                sent = first.json()
                assert sent["duplicate"] is False and sent["session_id"].startswith("ses_")
                answers = await sse(http, sent["events"], until="waiting")
                assert [a["text"] for a in answers if a["event"] == "answer"] == ["echo: hello"]
                # The same webhook again: the first receipt, not a second message.
                again = await http.post(
                    "/webhook", json={"id": "w-1", "conversation": "c-1", "text": "hello"}
                )
                assert again.json()["duplicate"] is True
                assert again.json()["session_id"] == sent["session_id"]
                assert again.json()["inbox_seq"] == sent["inbox_seq"]

                # An approval is two links; a click approves (a second is the same answer).
                asked = await http.post(
                    "/webhook", json={"id": "w-2", "conversation": "c-1", "text": "transfer 5"}
                )
                (approval,) = [
                    e
                    for e in await sse(http, asked.json()["events"], until="approval")
                    if e["event"] == "approval"
                ]
                assert approval["prompt"] == 'Allow transfer({"amount":"5"})?'
                forged = approval["approve"].replace("sig=", "sig=0")
                assert (await http.get(forged)).status_code == 403
                for _ in range(2):
                    clicked = await http.get(approval["approve"])
                    assert (clicked.status_code, clicked.text) == (200, "approved")
                # (The turn waited for the approval: a `waiting` came first.)
                done = await sse(
                    http, f"/conversations/c-1/events?from={approval['seq'] + 1}", until="answer"
                )
                assert [e["text"] for e in done if e["event"] == "answer"] == [
                    "The result is transferred 5."
                ]
                # Resuming an SSE stream by Last-Event-ID.
                resumed = await http_last_event(http, approval["seq"])
                assert resumed[0]["seq"] > approval["seq"]

                # A callback conversation: its answers are posted.
                message = {"id": "w-3", "conversation": "c-2", "text": "hi"}
                hi = await http.post("/webhook", json={**message, "callback_url": callback})
                assert hi.status_code == 202
                await posted_until(posted, arrived, 2)
                assert [(p["event"], p.get("text")) for p in posted] == [
                    ("answer", "echo: hi"),
                    ("waiting", None),
                ]
                session = hi.json()["session_id"]

            # The gateway is down: the session goes on (a message straight to Baton).
            async with AsyncClient(settings) as client:
                await client.send(session, "while you were away")
                async with client.follow(session, start_seq=posted[-1]["seq"] + 1) as follower:
                    async for event in follower:
                        if event.text == "echo: while you were away":
                            break
            # Restarted from its state file: what arrived is posted, once.
            async with gateway():
                await posted_until(posted, arrived, 4)
            assert [(p["event"], p.get("text")) for p in posted] == [
                ("answer", "echo: hi"),
                ("waiting", None),
                ("answer", "echo: while you were away"),
                ("waiting", None),
            ]
            seqs = [p["seq"] for p in posted]
            assert seqs == sorted(set(seqs))  # each once, in order
            assert json.loads(state.read_text())["cursors"][session] == seqs[-1] + 1


async def http_last_event(http: httpx.AsyncClient, last: int) -> list[dict[str, Any]]:
    """The conversation's events after `last`, asked with Last-Event-ID."""
    seen: list[dict[str, Any]] = []
    async with (
        asyncio.timeout(30),
        http.stream(
            "GET", "/conversations/c-1/events", headers={"Last-Event-ID": str(last)}
        ) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
                return seen
    return seen
