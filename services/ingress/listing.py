"""ListSessions' rules: the page size (AIP-158), the opaque page token, the
filter (a subset of AIP-160) and the order (AIP-132). Pure: no I/O, no gRPC.

The filter is comparisons joined by `AND` (case-sensitive keyword):

    status = idle                 status != finalized
    deployment = "dep-1"          deployment != dep-1
    create_time >= "2026-01-01T00:00:00Z"   update_time < "2026-12-01T10:00:00+01:00"
    inbox_depth > 0               oldest_unconsumed_age > "30s"

`status` takes a status name (services/common/status.py: idle, running,
waiting_for_input, waiting_for_authorization, parked, stalled, handing_off,
finalized); `deployment` an exact deployment id; the times `<`, `<=`, `>`,
`>=` an RFC 3339 time; `inbox_depth` (accepted commands not consumed yet)
any comparison with a whole number; `oldest_unconsumed_age` (how long the
oldest of them has waited; 0 when none waits) `<`, `<=`, `>`, `>=` a
duration: a number with `s` (as protobuf's JSON writes a Duration: "30s",
"1.5s"), `ms`, `m` or `h`. Values may be double-quoted. Anything else is
INVALID_ARGUMENT/INVALID_FILTER naming what is wrong.

The order (`order_by`) is empty (session id order) or one of `inbox_depth`
and `oldest_unconsumed_age`, then `desc` or `asc` (default), ties broken by
session id.

The page token carries where the previous page stopped (the last session
id it covered, and in an order its value) and a digest of the channel,
filter and order it was made for; a token used with another filter or order
(or by another channel, or altered) is INVALID_ARGUMENT/INVALID_PAGE_TOKEN.
Pages in session-id order see every session that existed when the listing
started exactly once, and a session created meanwhile at most once. In an
order, each page is sorted afresh from live values: a session whose value
changed between two pages may be listed twice or not at all.
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
_NUMBER_FIELDS = ("inbox_depth", "oldest_unconsumed_age")
ORDER_FIELDS = _NUMBER_FIELDS
MAX_ORDER_BY_LENGTH = 64
_DURATION = re.compile(r"^(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<unit>ms|s|m|h)$")
_WHOLE = re.compile(r"^[0-9]+$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
MAX_NUMBER = 2**63 - 1
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
    """What a filter compares and an order sorts by: one session's status,
    deployment, times (unix milliseconds; 0 when unknown), inbox depth and
    the age of its oldest unconsumed command (milliseconds; 0 when none)."""

    status: Status
    deployment_id: str
    create_ms: int
    update_ms: int
    inbox_depth: int = 0
    oldest_unconsumed_ms: int = 0
    oldest_accepted_ms: int = 0
    """When that oldest command was accepted (unix ms; 0 when none waits)."""

    def number(self, name: str) -> int:
        """`inbox_depth` or `oldest_unconsumed_age` (milliseconds)."""
        return self.inbox_depth if name == "inbox_depth" else self.oldest_unconsumed_ms


@dataclass(frozen=True)
class Filter:
    """A parsed filter; the empty one matches everything."""

    statuses_in: frozenset[Status] = frozenset()
    statuses_out: frozenset[Status] = frozenset()
    deployments_in: frozenset[str] = frozenset()
    deployments_out: frozenset[str] = frozenset()
    # (field, operator, unix ms)
    times: tuple[tuple[str, str, int], ...] = field(default=())
    # (field, operator, number: a depth, or an age in ms)
    numbers: tuple[tuple[str, str, int], ...] = field(default=())

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
        return all(_compare(session.number(name), op, n) for name, op, n in self.numbers)


def _compare(value: int, op: str, bound: int) -> bool:
    if op == "=":
        return value == bound
    if op == "!=":
        return value != bound
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


def _number(name: str, op: str, value: str) -> int:
    """An inbox depth (a whole number) or an age (a duration, in ms)."""
    if name == "inbox_depth":
        if not _WHOLE.match(value) or int(value) > MAX_NUMBER:
            raise invalid_filter(f"inbox_depth compares with a whole number, not {value[:40]!r}")
        return int(value)
    if op in ("=", "!="):
        raise invalid_filter("oldest_unconsumed_age takes <, <=, > or >=")
    match = _DURATION.match(value)
    if match is None:
        raise invalid_filter(
            f'oldest_unconsumed_age compares with a duration such as "30s", "500ms", '
            f'"5m" or "1h", not {value[:40]!r}'
        )
    ms = round(float(match["number"]) * _UNIT_MS[match["unit"]])
    if ms > MAX_NUMBER:
        raise invalid_filter(f"the duration {value[:40]!r} is too long")
    return ms


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
    numbers: list[tuple[str, str, int]] = []
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
        elif name in _NUMBER_FIELDS:
            numbers.append((name, op, _number(name, op, value)))
        else:
            raise invalid_filter(
                f"unknown field {name[:40]!r}; filter on status, deployment, create_time, "
                "update_time, inbox_depth or oldest_unconsumed_age"
            )
    if len(s_in) > 1 or len(d_in) > 1:
        # `status = a AND status = b` can match nothing: say so instead.
        raise invalid_filter("a field compared with = may appear once (the terms are ANDed)")
    return Filter(
        frozenset(s_in),
        frozenset(s_out),
        frozenset(d_in),
        frozenset(d_out),
        tuple(times),
        tuple(numbers),
    )


@dataclass(frozen=True)
class Order:
    """An order of a listing (AIP-132): by one number, then by session id.
    The age is ranked by when the oldest command was accepted, which does
    not move between two pages as an age does (older first when
    descending; a session with nothing waiting is the youngest)."""

    field: str
    descending: bool

    def rank(self, fields: SessionFields) -> int:
        """The first part of the sort key (what a page token keeps)."""
        if self.field == "inbox_depth":
            return -fields.inbox_depth if self.descending else fields.inbox_depth
        accepted = fields.oldest_accepted_ms or MAX_NUMBER
        return accepted if self.descending else -accepted

    def key(self, fields: SessionFields, session_id: str) -> tuple[int, str]:
        """Sorts ascending into the order."""
        return (self.rank(fields), session_id)


def invalid_order(message: str) -> InvalidArgument:
    return InvalidArgument(Reason.INVALID_FIELD, message, field="order_by")


def parse_order(text: str) -> Order | None:
    """`inbox_depth desc`, `oldest_unconsumed_age` (ascending), ...; None
    for the empty order (session id order)."""
    if len(text) > MAX_ORDER_BY_LENGTH:
        raise invalid_order(f"order_by is longer than {MAX_ORDER_BY_LENGTH} characters")
    words = text.split()
    if not words:
        return None
    name, *direction = words
    if name not in ORDER_FIELDS or len(direction) > 1 or direction not in ([], ["asc"], ["desc"]):
        raise invalid_order(
            f"cannot order by {text[:64]!r}: write one of {', '.join(ORDER_FIELDS)}, then "
            "asc or desc"
        )
    return Order(name, direction == ["desc"])


def _digest(channel: str, filter_text: str, order_by: str = "") -> str:
    scope = f"{channel}\0{filter_text}" + (f"\0{order_by}" if order_by else "")
    return hashlib.sha256(scope.encode()).hexdigest()[:24]


def encode_page_token(
    channel: str,
    filter_text: str,
    after_session_id: str,
    order_by: str = "",
    after_rank: int = 0,
) -> str:
    data: dict[str, object] = {"a": after_session_id, "d": _digest(channel, filter_text, order_by)}
    if order_by:
        data["v"] = after_rank
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


def decode_page_token(token: str, channel: str, filter_text: str) -> str:
    """The session id the previous page stopped after ("" for no token)."""
    return decode_ordered_page_token(token, channel, filter_text, "")[0]


def decode_ordered_page_token(
    token: str, channel: str, filter_text: str, order_by: str
) -> tuple[str, int]:
    """Where the previous page stopped: its last session id ("" for no
    token) and, in an order, that session's rank (`Order.rank`)."""
    if not token:
        return "", 0

    def invalid(message: str) -> InvalidArgument:
        return InvalidArgument(Reason.INVALID_PAGE_TOKEN, message, field="page_token")

    if len(token) > MAX_PAGE_TOKEN_LENGTH:
        raise invalid("page_token is not one ListSessions returned")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        after, digest = str(data["a"]), str(data["d"])
        value = int(data["v"]) if order_by else 0
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise invalid("page_token is not one ListSessions returned") from None
    if digest != _digest(channel, filter_text, order_by):
        raise invalid("page_token was made for another filter or order; start again without it")
    if not -MAX_NUMBER <= value <= MAX_NUMBER:
        raise invalid("page_token is not one ListSessions returned")
    try:
        return ids.validate_session_id(after), value
    except InvalidArgument:
        raise invalid("page_token is not one ListSessions returned") from None
