"""The console's pages (starlette, server-rendered jinja2 templates) and
their live parts (server-sent events).

Pages: the overview (`/`), sessions (`/sessions`, the AIP-160 filter of
ListSessions across channels, paged), a session (`/sessions/ID`: its header
and timeline, older pages on demand, new events as they are committed),
deployments (`/deployments/ID`: describe, drain), a handoff
(`/handoffs/ID`). Actions (cancel, reset, resume, drain) are each a
confirmation page whose form POSTs the action; see `guard` for who may.

Live parts: a session page follows its session from its cursor
(`/sessions/ID/follow`, one follow on the console's FollowEvents stream to
anchor, like any reader), with the live items of the step in flight (its
text as the model writes it: a `live` message with the draft, an empty one
when the step's commit supersedes it); a drain's progress
(`/deployments/ID/drain/follow`).
Nothing else polls: an open page whose session is idle costs a blocked
follow and a keep-alive comment every `KEEPALIVE` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands.operator import reason_name
from baton_runtime.common.errors import BatonError, ErrorKind, OutOfRange
from baton_runtime.console import present
from baton_runtime.console.config import ConsoleConfig
from baton_runtime.console.guard import CSRF_FIELD, SECURITY_HEADERS, Guard
from baton_runtime.console.operator import EVENTS_PAGE, PAGE_SIZES, Operator, close_reader

log = structlog.get_logger("baton.console")

HERE = Path(__file__).resolve().parent
STATIC = {
    "console.css": "text/css",
    "console.js": "text/javascript",
    "favicon.svg": "image/svg+xml",
}
KEEPALIVE = 20.0
"""Seconds between SSE comments on a quiet stream (they tell a gone browser)."""
NOTICES = 100
"""Outcomes of actions kept for the page they redirect to."""
_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.OUT_OF_RANGE: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.PERMISSION_DENIED: 403,
    ErrorKind.UNAUTHENTICATED: 403,
    ErrorKind.FAILED_PRECONDITION: 409,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.DEADLINE_EXCEEDED: 504,
}
SESSION_ACTIONS = {
    "cancel": "Cancel the running turn",
    "reset": "Reset (finalize) the session",
    "resume": "Resume the stalled session",
}

Handler = Callable[[Request], Awaitable[Response]]
_TURN_OPEN = {
    ingress_pb.SESSION_STATUS_RUNNING,
    ingress_pb.SESSION_STATUS_WAITING_FOR_INPUT,
    ingress_pb.SESSION_STATUS_WAITING_FOR_AUTHORIZATION,
}


def offered_actions(status: ingress_pb.SessionStatus.ValueType) -> list[str]:
    """The actions a session's page offers in this status (each is still
    accepted in any: the services answer what it does then)."""
    if status == ingress_pb.SESSION_STATUS_FINALIZED:
        return []
    offered = ["cancel"] if status in _TURN_OPEN else []
    if status == ingress_pb.SESSION_STATUS_STALLED:
        offered.append("resume")
    return [*offered, "reset"]


def sse(event: str, data: str, event_id: str = "") -> str:
    lines = [f"event: {event}"]
    if event_id:
        lines.append(f"id: {event_id}")
    lines += [f"data: {line}" for line in data.splitlines() or [""]]
    return "\n".join(lines) + "\n\n"


class Console:
    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.guard = Guard(config.token)
        self.operator: Operator | None = None
        self.notices: OrderedDict[str, str] = OrderedDict()
        self.templates = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(["html"]),
            enable_async=False,
        )
        self.templates.globals.update(
            status_label=present.status_label,
            session_status=present.session_status,
            deployment_status=present.deployment_status,
            when=present.when,
            age=present.age,
            reason_name=reason_name,
            page_sizes=PAGE_SIZES,
            csrf_field=CSRF_FIELD,
        )

    @property
    def ops(self) -> Operator:
        assert self.operator is not None, "the console is not started"
        return self.operator

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        self.operator = Operator(self.config)
        try:
            yield
        finally:
            await self.operator.close()

    def app(self) -> Starlette:
        g = self.guarded
        routes = [
            Route("/", g(self.overview)),
            Route("/static/{name}", g(self.static)),
            Route("/sessions", g(self.sessions)),
            Route("/sessions/{sid}", g(self.session)),
            Route("/sessions/{sid}/header", g(self.session_header)),
            Route("/sessions/{sid}/events", g(self.older_events)),
            Route("/sessions/{sid}/follow", g(self.follow_session)),
            Route("/sessions/{sid}/{action}", g(self.confirm_session_action), methods=["GET"]),
            Route("/sessions/{sid}/{action}", g(self.session_action), methods=["POST"]),
            Route("/deployments/{dep}", g(self.deployment)),
            Route("/deployments/{dep}/drain", g(self.confirm_drain), methods=["GET"]),
            Route("/deployments/{dep}/drain", g(self.drain), methods=["POST"]),
            Route("/deployments/{dep}/drain/follow", g(self.follow_drain)),
            Route("/handoffs/{hid}", g(self.handoff)),
        ]
        return Starlette(routes=routes, lifespan=self.lifespan)

    # -- plumbing ----------------------------------------------------------

    def guarded(self, handler: Handler) -> Handler:
        """Admitted callers only; BatonErrors as an error page; the security
        headers and the CSRF cookie on every answer."""

        async def run(request: Request) -> Response:
            refused = self.guard.admit(request)
            if refused is not None:
                response = refused
            else:
                try:
                    response = await handler(request)
                except BatonError as exc:
                    response = self.page(
                        request,
                        "error.html",
                        _STATUS.get(exc.kind, 502),
                        title=f"Refused: {exc.reason}",
                        error=exc,
                    )
            response.headers.update(SECURITY_HEADERS)
            self.guard.set_csrf_cookie(request, response)
            return response

        return run

    def render(self, request: Request, template: str, **values: Any) -> str:
        return self.templates.get_template(template).render(
            request=request, csrf=self.guard.csrf_token(request), **values
        )

    def page(self, request: Request, template: str, status: int = 200, **values: Any) -> Response:
        return HTMLResponse(self.render(request, template, **values), status_code=status)

    def notice(self, text: str) -> str:
        key = secrets.token_urlsafe(8)
        self.notices[key] = text
        while len(self.notices) > NOTICES:
            self.notices.popitem(last=False)
        return key

    def _notice_of(self, request: Request) -> str:
        return self.notices.get(request.query_params.get("notice", ""), "")

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(HERE / "static" / name, media_type=STATIC[name])

    async def _form_checked(self, request: Request) -> Response | None:
        form = await request.form()
        token = form.get(CSRF_FIELD)
        why = self.guard.cross_site(request, token if isinstance(token, str) else "")
        if why:
            log.warning("console.cross_site_refused", path=request.url.path, why=why)
            return self.page(
                request,
                "refused.html",
                403,
                title="Refused: not from the console's own page",
                why=why,
            )
        return None

    # -- pages -------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        found = await self.ops.overview()
        return self.page(request, "overview.html", title="Overview", overview=found)

    async def sessions(self, request: Request) -> Response:
        query = request.query_params
        filter_text = query.get("filter", "")
        size = int(query.get("size", "0") or 0) if query.get("size", "").isdigit() else 0
        size = size if size in PAGE_SIZES else PAGE_SIZES[0]
        after = (query.get("after_channel", ""), query.get("after", ""))
        found = await self.ops.sessions_page(filter_text, after, size)
        return self.page(
            request,
            "sessions.html",
            title="Sessions",
            page=found,
            filter_text=filter_text,
            size=size,
            first=after == ("", ""),
        )

    async def session(self, request: Request) -> Response:
        view = await self.ops.session(request.path_params["sid"])
        events, start = await self.ops.latest_events(view)
        return self.page(
            request,
            "session.html",
            title=f"Session {view.session_id}",
            view=view,
            events=[present.event_view(e) for e in events],
            start=start,
            head=start + len(events),
            notice=self._notice_of(request),
            actions={a: SESSION_ACTIONS[a] for a in offered_actions(view.status)},
        )

    async def session_header(self, request: Request) -> Response:
        view = await self.ops.session(request.path_params["sid"])
        return HTMLResponse(self.render(request, "_header.html", view=view))

    async def older_events(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        before_text = request.query_params.get("before", "")
        if not before_text.isdigit():
            return PlainTextResponse("before: a stream seq", status_code=400)
        before = int(before_text)
        start = max(0, before - EVENTS_PAGE)
        view = await self.ops.session(sid)
        start = max(start, view.earliest_seq)
        try:
            events = await self.ops.events(sid, start, before)
        except OutOfRange:
            view = await self.ops.session(sid)
            start = max(start, view.earliest_seq)
            events = await self.ops.events(sid, start, before)
        html = self.render(
            request,
            "_events.html",
            events=[present.event_view(e) for e in events],
            start=start,
            earliest=view.earliest_seq,
        )
        return HTMLResponse(html, headers={"X-Start-Seq": str(start)})

    async def follow_session(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        cursor = request.headers.get("last-event-id") or request.query_params.get("from", "")
        if not cursor.isdigit():
            return PlainTextResponse("from: a stream seq", status_code=400)
        start = int(cursor)
        reader = self.ops.follow(sid, start)

        async def frames() -> AsyncIterator[str]:
            pages: asyncio.Queue[list[s.Event] | s.LiveBatch | BaseException | None] = (
                asyncio.Queue(4)
            )
            draft = present.LiveDraft(start)

            async def pump() -> None:
                try:
                    async for page in reader:
                        await pages.put(page)
                    await pages.put(None)
                except BatonError as exc:
                    await pages.put(exc)
                finally:
                    await close_reader(reader)

            task = asyncio.get_running_loop().create_task(pump())
            try:
                yield "retry: 2000\n\n"
                while True:
                    try:
                        item = await asyncio.wait_for(pages.get(), KEEPALIVE)
                    except TimeoutError:
                        yield ": idle\n\n"
                        continue
                    if item is None:
                        yield sse("end", "the session's stream is closed")
                        return
                    if isinstance(item, BatonError) and item.retryable:
                        return  # the browser reconnects from its last event
                    if isinstance(item, BaseException):
                        yield sse("problem", str(item))
                        return
                    if isinstance(item, s.LiveBatch):
                        if draft.add(item):
                            yield sse("live", self.render(request, "_live.html", draft=draft))
                        continue
                    if not item:
                        continue
                    if draft.committed(item):  # the commit supersedes the draft
                        yield sse("live", "")
                    views = [present.event_view(e) for e in item]
                    html = self.render(request, "_events.html", events=views, start=-1)
                    yield sse("events", html, str(item[-1].seq + 1))
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        return StreamingResponse(frames(), media_type="text/event-stream")

    async def confirm_session_action(self, request: Request) -> Response:
        action = request.path_params["action"]
        if action not in SESSION_ACTIONS:
            return PlainTextResponse("not found", status_code=404)
        view = await self.ops.session(request.path_params["sid"])
        return self.page(
            request,
            "confirm.html",
            title=f"Confirm: {action} session {view.session_id}",
            question=f"{SESSION_ACTIONS[action]} {view.session_id}?",
            detail=f"It is {present.session_status(view.status)} on {view.deployment_id}.",
            action_url=f"/sessions/{view.session_id}/{action}",
            button=action.capitalize(),
            back=f"/sessions/{view.session_id}",
        )

    async def session_action(self, request: Request) -> Response:
        refused = await self._form_checked(request)
        if refused is not None:
            return refused
        sid, action = request.path_params["sid"], request.path_params["action"]
        if action not in SESSION_ACTIONS:
            return PlainTextResponse("not found", status_code=404)
        if action == "resume":
            outcome = await self.ops.resume(sid)
        else:
            outcome = await self.ops.control(sid, action)
        log.info("console.action", action=action, session_id=sid, outcome=outcome)
        return RedirectResponse(f"/sessions/{sid}?notice={self.notice(outcome)}", 303)

    async def deployment(self, request: Request) -> Response:
        info, listed, total = await self.ops.deployment(request.path_params["dep"], 50)
        others = [
            d.deployment_id
            for d in await self.ops.deployments()
            if d.deployment_id != info.deployment_id
            and d.status == hooks_pb.DEPLOYMENT_STATUS_ACTIVE
        ]
        return self.page(
            request,
            "deployment.html",
            title=f"Deployment {info.deployment_id}",
            info=info,
            sessions=listed,
            total=total,
            others=others,
            drain=self.ops.drains.get(info.deployment_id),
            notice=self._notice_of(request),
        )

    async def confirm_drain(self, request: Request) -> Response:
        info, _, total = await self.ops.deployment(request.path_params["dep"], 1)
        target = request.query_params.get("to", "")
        return self.page(
            request,
            "confirm.html",
            title=f"Confirm: drain {info.deployment_id}",
            question=f"Drain deployment {info.deployment_id} to {target}?",
            detail=(
                f"Each of its {len(info.instances)} live instance(s) hands its sessions "
                f"({total} now) to {target}: idle ones at once, busy ones when next idle."
            ),
            action_url=f"/deployments/{info.deployment_id}/drain",
            hidden={"to": target},
            button="Drain",
            back=f"/deployments/{info.deployment_id}",
        )

    async def drain(self, request: Request) -> Response:
        refused = await self._form_checked(request)
        if refused is not None:
            return refused
        dep = request.path_params["dep"]
        target = (await request.form()).get("to")
        run = self.ops.start_drain(dep, target if isinstance(target, str) else "")
        log.info("console.drain", deployment_id=run.old, to=run.new)
        return RedirectResponse(f"/deployments/{run.old}", 303)

    async def follow_drain(self, request: Request) -> Response:
        run = self.ops.drains.get(request.path_params["dep"])
        if run is None:
            return PlainTextResponse("no drain of this deployment", status_code=404)

        async def frames() -> AsyncIterator[str]:
            sent = 0
            while True:
                run.changed.clear()
                for line in run.lines[sent:]:
                    yield sse("line", line)
                sent = len(run.lines)
                if run.done:
                    yield sse("done", str(run.code))
                    return
                try:
                    await asyncio.wait_for(run.changed.wait(), KEEPALIVE)
                except TimeoutError:
                    yield ": idle\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    async def handoff(self, request: Request) -> Response:
        hid = request.path_params["hid"]
        found = await self.ops.handoff(request.query_params.get("session", ""), hid)
        return self.page(
            request, "handoff.html", title=f"Handoff {hid}", handoff_id=hid, transfer=found
        )


def create_app(config: ConsoleConfig) -> Starlette:
    return Console(config).app()
