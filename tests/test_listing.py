"""ListSessions' pure rules (services/ingress/listing.py): page sizes, the
page token, and the AIP-160 filter subset."""

from __future__ import annotations

import pytest

from baton_runtime.common import ids
from baton_runtime.common.errors import InvalidArgument, Reason
from baton_runtime.common.status import Status
from baton_runtime.ingress import listing

T0 = 1_780_000_000_000  # unix ms


def fields(
    status: Status = Status.IDLE, deployment: str = "dep-a", created: int = T0, updated: int = T0
) -> listing.SessionFields:
    return listing.SessionFields(status, deployment, created, updated)


def test_page_size_default_maximum_and_negative() -> None:
    assert listing.page_size(0) == listing.DEFAULT_PAGE_SIZE == 50
    assert listing.page_size(7) == 7
    assert listing.page_size(10**6) == listing.MAX_PAGE_SIZE == 200
    with pytest.raises(InvalidArgument) as info:
        listing.page_size(-1)
    assert info.value.reason == Reason.INVALID_FIELD


def test_a_page_token_round_trips_only_with_its_channel_and_filter() -> None:
    sid = ids.new_session_id()
    token = listing.encode_page_token("slack", "status = idle", sid)
    assert listing.decode_page_token(token, "slack", "status = idle") == sid
    assert listing.decode_page_token("", "slack", "anything") == ""
    for channel, text in (("web", "status = idle"), ("slack", "status = running"), ("slack", "")):
        with pytest.raises(InvalidArgument) as info:
            listing.decode_page_token(token, channel, text)
        assert info.value.reason == Reason.INVALID_PAGE_TOKEN
    forged = listing.encode_page_token("slack", "", "ses_../../t/x")
    for bad in ("!!", "e30", token[:-2], forged, "a" * 600):
        with pytest.raises(InvalidArgument) as info:
            listing.decode_page_token(bad, "slack", "")
        assert info.value.reason == Reason.INVALID_PAGE_TOKEN


def test_the_empty_filter_matches_everything() -> None:
    assert listing.parse_filter("").matches(fields())
    assert listing.parse_filter("   ").matches(fields(Status.FINALIZED))


def test_status_and_deployment_comparisons() -> None:
    f = listing.parse_filter('status = waiting_for_input AND deployment = "dep-b"')
    assert f.matches(fields(Status.WAITING_FOR_INPUT, "dep-b"))
    assert not f.matches(fields(Status.WAITING_FOR_INPUT, "dep-a"))
    assert not f.matches(fields(Status.IDLE, "dep-b"))
    g = listing.parse_filter("status != finalized AND status != parked AND deployment != dep-a")
    assert g.matches(fields(Status.RUNNING, "dep-b"))
    assert not g.matches(fields(Status.PARKED, "dep-b"))
    assert not g.matches(fields(Status.RUNNING, "dep-a"))


def test_time_ranges() -> None:
    f = listing.parse_filter(
        'create_time >= "2026-05-28T20:26:40Z" AND update_time < "2026-05-28T22:26:40+02:00"'
    )
    assert f.matches(fields(created=T0, updated=T0 - 1))
    assert not f.matches(fields(created=T0 - 1, updated=T0 - 1))
    assert not f.matches(fields(created=T0, updated=T0))
    assert listing.parse_filter('create_time > "2026-05-28T20:26:40Z"').matches(
        fields(created=T0 + 1)
    )
    assert not listing.parse_filter('create_time <= "2026-05-28T20:26:39.999Z"').matches(
        fields(created=T0)
    )


@pytest.mark.parametrize(
    "text",
    [
        "status = sleeping",
        "status < idle",
        "deployment > dep-a",
        "create_time = 2026-01-01T00:00:00Z",
        'create_time > "2026-01-01T00:00:00"',
        'update_time > "soon"',
        "owner = x",
        "status = idle OR status = running",
        "status = idle and deployment = dep-a",
        "status = idle AND status = running",
        "status",
        " AND ".join(["status != idle"] * 17),
        "x" * 1025,
    ],
)
def test_bad_filters_are_invalid_filter(text: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        listing.parse_filter(text)
    assert info.value.reason == Reason.INVALID_FILTER
    assert info.value.metadata.get("field") == "filter"


def test_a_bad_deployment_in_a_filter_is_refused_as_such() -> None:
    with pytest.raises(InvalidArgument) as info:
        listing.parse_filter("deployment = latest")
    assert info.value.reason == Reason.INVALID_DEPLOYMENT_ID
