"""Who may use the console, and the cross-site protection of its actions.

- A caller is let in without the console token only when it is on loopback
  AND names a loopback host (`Host: 127.0.0.1:PORT`, `localhost`, `[::1]`):
  a page of another site that rebinds its own name to 127.0.0.1 is refused.
  Any other caller presents the token: `Authorization: Bearer TOKEN`, or
  once `?token=TOKEN` (which sets an HttpOnly, SameSite=Strict cookie and
  redirects to the same page without it). Without a token configured,
  nobody else gets in.
- Every state-changing request (POST) must come from the console's own
  pages: its Origin (or, without one, its Referer) is the console's own
  origin, Sec-Fetch-Site (when sent) is same-origin, and its form carries
  the browser's CSRF token (a random per-browser value in an HttpOnly,
  SameSite=Strict cookie, repeated in each form: the double-submit
  pattern).
- Every answer says: no caching, no framing, scripts and styles from the
  console only.
"""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import urlsplit

from starlette.datastructures import URL
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

from baton_runtime.console.config import is_loopback_host

AUTH_COOKIE = "baton_console_auth"
CSRF_COOKIE = "baton_console_csrf"
CSRF_FIELD = "csrf"
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _host_name(host_header: str) -> str:
    return urlsplit(f"//{host_header}").hostname or ""


class Guard:
    def __init__(self, token: str) -> None:
        self.token = token

    def local(self, request: Request) -> bool:
        """On loopback, and asked for by a loopback name."""
        peer = request.client.host if request.client else ""
        host = _host_name(request.headers.get("host", ""))
        return is_loopback_host(peer) and is_loopback_host(host)

    def _presented(self, request: Request) -> bool:
        if not self.token:
            return False
        header = request.headers.get("authorization", "")
        if header.startswith("Bearer ") and _same(header.removeprefix("Bearer "), self.token):
            return True
        return _same(request.cookies.get(AUTH_COOKIE, ""), self.token)

    def admit(self, request: Request) -> Response | None:
        """None to go on; else the answer (a refusal, or the redirect that
        sets the token's cookie)."""
        if self.local(request) or self._presented(request):
            return None
        offered = request.query_params.get("token", "")
        if self.token and offered and _same(offered, self.token):
            params = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = URL(request.url.path).include_query_params(**dict(params))
            redirect = RedirectResponse(str(target), status_code=303)
            redirect.set_cookie(AUTH_COOKIE, self.token, httponly=True, samesite="strict", path="/")
            return redirect
        return PlainTextResponse(
            "refused: the console answers loopback callers, and others that present its "
            "token (docs/console.md)",
            status_code=401,
        )

    @staticmethod
    def csrf_token(request: Request) -> str:
        """The browser's CSRF token (a new one when it has none yet)."""
        token = request.cookies.get(CSRF_COOKIE, "") or getattr(request.state, "new_csrf", "")
        if not token:
            token = request.state.new_csrf = secrets.token_urlsafe(32)
        return str(token)

    @staticmethod
    def set_csrf_cookie(request: Request, response: Response) -> None:
        new = getattr(request.state, "new_csrf", "")
        if new:
            response.set_cookie(CSRF_COOKIE, new, httponly=True, samesite="strict", path="/")

    @staticmethod
    def cross_site(request: Request, form_token: str) -> str:
        """Why a POST is refused as cross-site ("" when it is the console's own)."""
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        site = request.headers.get("sec-fetch-site")
        if site is not None and site != "same-origin":
            return f"Sec-Fetch-Site is {site!r}"
        origin = request.headers.get("origin")
        if origin is None:
            referer = request.headers.get("referer", "")
            parts = urlsplit(referer)
            origin = f"{parts.scheme}://{parts.netloc}" if referer else ""
        if origin != own:
            return f"origin {origin or 'missing'!r} is not the console's {own!r}"
        cookie = request.cookies.get(CSRF_COOKIE, "")
        if not cookie or not form_token or not _same(cookie, form_token):
            return "the form's CSRF token does not match this browser's"
        return ""
