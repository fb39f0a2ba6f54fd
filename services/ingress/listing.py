"""ListSessions' rules: the page size (AIP-158), the opaque page token, and
the filter (a subset of AIP-160). Pure: no I/O, no gRPC.

The filter is comparisons joined by `AND` (case-sensitive keyword):

    status = idle                 status != finalized
    deployment = "dep-1"          deployment != dep-1
    create_time >= "2026-01-01T00:00:00Z"   update_time < "2026-12-01T10:00:00+01:00"

`status` takes a status name (services/common/status.py: idle, running,
waiting_for_input, waiting_for_authorization, parked, stalled, handing_off,
finalized); `deployment` an exact deployment id; the times `<`, `<=`, `>`,
`>=` an RFC 3339 time. Values may be double-quoted. Anything else is
INVALID_ARGUMENT/INVALID_FILTER naming what is wrong.

The page token carries where the previous page stopped (the last session
id it covered) and a digest of the channel and filter it was made for; a
token used with another filter (or by another channel, or altered) is
INVALID_ARGUMENT/INVALID_PAGE_TOKEN. Pages follow session-id order, so a
listing sees every session that existed when it started exactly once, and a
session created meanwhile at most once.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime

from baton_runtime.common import ids
from baton_runtime.common.bounds import check_range
from baton_runtime.common.errors import InvalidArgument, Reason
from baton_runtime.common.status import Status

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 200
MAX_FILTER_LENGTH = 1024
MAX_PAGE_TOKEN_LENGTH = 512
MAX_TERMS = 16

_TERM = re.compile(
    r'^\s*(?P<field>[a-z_]+)\s*(?P<op><=|>=|!=|=|<|>)\s*(?P<value>"[^"]*"|[^\s"]+)\s*$'
)
_TIME_FIELDS = ("create_time", "update_time")
_STATUSES = {status.value: status for status in Status}


def invalid_filter(message: str) -> InvalidArgument:
    return InvalidArgument(Reason.INVALID_FILTER, message, field="filter")


def page_size(requested: int) -> int:
    """AIP-158: 0 is the default, above the maximum is the maximum,
    negative is refused."""
    check_range(requested, "page_size", 2**31 - 1)
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)


@dataclass(frozen=True)
class SessionFields:
    """What a filter compares: one session's status, deployment and times
    (unix milliseconds; 0 when unknown)."""

    status: Status
    deployment_id: str
    create_ms: int
    update_ms: int


@dataclass(frozen=True)
class Filter:
    """A parsed filter; the empty one matches everything."""

    statuses_in: frozenset[Status] = frozenset()
    statuses_out: frozenset[Status] = frozenset()
    deployments_in: frozenset[str] = frozenset()
    deployments_out: frozenset[str] = frozenset()
    # (field, operator, unix ms)
    times: tuple[tuple[str, str, int], ...] = field(default=())

    def matches(self, session: SessionFields) -> bool:
        if self.statuses_in and session.status not in self.statuses_in:
            return False
        if session.status in self.statuses_out:
            return False
        if self.deployments_in and session.deployment_id not in self.deployments_in:
            return False
        if session.deployment_id in self.deployments_out:
            return False
        for name, op, ms in self.times:
            value = session.create_ms if name == "create_time" else session.update_ms
            if not _compare(value, op, ms):
                return False
        return True


def _compare(value: int, op: str, bound: int) -> bool:
    if op == "<":
        return value < bound
    if op == "<=":
        return value <= bound
    if op == ">":
        return value > bound
    return value >= bound


def _time_ms(text: str) -> int:
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise invalid_filter(f"{text!r} is not an RFC 3339 time") from None
    if moment.tzinfo is None:
        raise invalid_filter(f"{text!r} has no time zone (add Z or an offset)")
    return int(moment.timestamp() * 1000)


def parse_filter(text: str) -> Filter:
    """Parse a filter (see the module docstring)."""
    if len(text) > MAX_FILTER_LENGTH:
        raise invalid_filter(f"the filter is longer than {MAX_FILTER_LENGTH} characters")
    if not text.strip():
        return Filter()
    terms = re.split(r"\s+AND\s+", text.strip())
    if len(terms) > MAX_TERMS:
        raise invalid_filter(f"at most {MAX_TERMS} comparisons")
    s_in: set[Status] = set()
    s_out: set[Status] = set()
    d_in: set[str] = set()
    d_out: set[str] = set()
    times: list[tuple[str, str, int]] = []
    for term in terms:
        match = _TERM.match(term)
        if match is None:
            raise invalid_filter(
                f"cannot read {term[:80]!r}: write FIELD OP VALUE, comparisons joined by AND"
            )
        name, op, value = match["field"], match["op"], match["value"].strip('"')
        if name == "status":
            if op not in ("=", "!="):
                raise invalid_filter("status takes = or !=")
            if value not in _STATUSES:
                raise invalid_filter(
                    f"unknown status {value[:40]!r}; one of {', '.join(sorted(_STATUSES))}"
                )
            (s_in if op == "=" else s_out).add(_STATUSES[value])
        elif name == "deployment":
            if op not in ("=", "!="):
                raise invalid_filter("deployment takes = or !=")
            ids.validate_deployment_id(value)
            (d_in if op == "=" else d_out).add(value)
        elif name in _TIME_FIELDS:
            if op in ("=", "!="):
                raise invalid_filter(f"{name} takes <, <=, > or >=")
            times.append((name, op, _time_ms(value)))
        else:
            raise invalid_filter(
                f"unknown field {name[:40]!r}; filter on status, deployment, create_time "
                "or update_time"
            )
    if len(s_in) > 1 or len(d_in) > 1:
        # `status = a AND status = b` can match nothing: say so instead.
        raise invalid_filter("a field compared with = may appear once (the terms are ANDed)")
    return Filter(
        frozenset(s_in), frozenset(s_out), frozenset(d_in), frozenset(d_out), tuple(times)
    )


def _digest(channel: str, filter_text: str) -> str:
    return hashlib.sha256(f"{channel}\0{filter_text}".encode()).hexdigest()[:24]


def encode_page_token(channel: str, filter_text: str, after_session_id: str) -> str:
    data = json.dumps({"a": after_session_id, "d": _digest(channel, filter_text)})
    return base64.urlsafe_b64encode(data.encode()).decode().rstrip("=")


def decode_page_token(token: str, channel: str, filter_text: str) -> str:
    """The session id the previous page stopped after ("" for no token)."""
    if not token:
        return ""

    def invalid(message: str) -> InvalidArgument:
        return InvalidArgument(Reason.INVALID_PAGE_TOKEN, message, field="page_token")

    if len(token) > MAX_PAGE_TOKEN_LENGTH:
        raise invalid("page_token is not one ListSessions returned")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        after, digest = str(data["a"]), str(data["d"])
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise invalid("page_token is not one ListSessions returned") from None
    if digest != _digest(channel, filter_text):
        raise invalid("page_token was made for another filter; start again without it")
    try:
        return ids.validate_session_id(after)
    except InvalidArgument:
        raise invalid("page_token is not one ListSessions returned") from None
