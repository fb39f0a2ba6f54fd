"""ListSessions' pure rules (services/ingress/listing.py): page sizes, the
page token, and the AIP-160 filter subset."""

from __future__ import annotations

import json
from pathlib import Path

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
        "inbox_depth > -1",
        "inbox_depth = many",
        'inbox_depth > "1.5"',
        "inbox_depth > ²",
        'oldest_unconsumed_age > "１s"',
        'oldest_unconsumed_age = "30s"',
        'oldest_unconsumed_age > "30"',
        'oldest_unconsumed_age > "30 s"',
        'oldest_unconsumed_age > "1d"',
        'oldest_unconsumed_age > "99999999999999999h"',
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


def test_inbox_depth_and_the_oldest_unconsumed_age() -> None:
    """The fleet question: sessions with something waiting longer than 30 s."""
    waiting = listing.parse_filter('inbox_depth > 0 AND oldest_unconsumed_age > "30s"')
    assert waiting.matches(fields_with(depth=1, age_ms=30_001))
    assert not waiting.matches(fields_with(depth=1, age_ms=30_000))
    assert not waiting.matches(fields_with(depth=0, age_ms=0))
    assert listing.parse_filter("inbox_depth = 3").matches(fields_with(depth=3))
    assert not listing.parse_filter("inbox_depth != 3").matches(fields_with(depth=3))
    assert listing.parse_filter("inbox_depth <= 2").matches(fields_with(depth=2))
    for text, ms in (('"1.5s"', 1500), ("500ms", 500), ('"2m"', 120_000), ("1h", 3_600_000)):
        f = listing.parse_filter(f"oldest_unconsumed_age >= {text}")
        assert f.matches(fields_with(age_ms=ms)) and not f.matches(fields_with(age_ms=ms - 1))


def fields_with(depth: int = 0, age_ms: int = 0) -> listing.SessionFields:
    accepted = T0 - age_ms if depth else 0
    return listing.SessionFields(Status.RUNNING, "dep-a", T0, T0, depth, age_ms, accepted)


def test_an_order_by_a_number_then_the_session_id() -> None:
    assert listing.parse_order("") is None and listing.parse_order("  ") is None
    desc = listing.parse_order("oldest_unconsumed_age desc")
    asc = listing.parse_order("inbox_depth")
    assert desc == listing.Order("oldest_unconsumed_age", True)
    assert asc == listing.parse_order("inbox_depth asc") == listing.Order("inbox_depth", False)
    assert desc is not None and asc is not None
    rows = {"ses_b": fields_with(2, 10), "ses_a": fields_with(2, 90), "ses_c": fields_with(0, 0)}
    by_age = sorted(rows, key=lambda sid: desc.key(rows[sid], sid))
    by_depth = sorted(rows, key=lambda sid: asc.key(rows[sid], sid))
    assert by_age == ["ses_a", "ses_b", "ses_c"] and by_depth == ["ses_c", "ses_a", "ses_b"]
    # The age ranks by acceptance time: a page later (every age grown) the
    # rank, and so a page token's position, is the same.
    later = listing.SessionFields(Status.RUNNING, "dep-a", T0, T0, 2, 5_090, T0 - 90)
    assert desc.rank(later) == desc.rank(rows["ses_a"])
    young = listing.parse_order("oldest_unconsumed_age")
    assert young is not None
    assert sorted(rows, key=lambda sid: young.key(rows[sid], sid)) == ["ses_c", "ses_b", "ses_a"]
    for bad in ("status", "inbox_depth down", "inbox_depth desc asc", "x" * 65):
        with pytest.raises(InvalidArgument) as info:
            listing.parse_order(bad)
        assert info.value.reason == Reason.INVALID_FIELD
        assert info.value.metadata.get("field") == "order_by"


def test_an_ordered_page_token_is_bound_to_its_order() -> None:
    sid = ids.new_session_id()
    token = listing.encode_page_token("slack", "", sid, "inbox_depth desc", 7)
    assert listing.decode_ordered_page_token(token, "slack", "", "inbox_depth desc") == (sid, 7)
    for order in ("inbox_depth", ""):
        with pytest.raises(InvalidArgument) as info:
            listing.decode_ordered_page_token(token, "slack", "", order)
        assert info.value.reason == Reason.INVALID_PAGE_TOKEN
    plain = listing.encode_page_token("slack", "", sid)
    with pytest.raises(InvalidArgument):
        listing.decode_ordered_page_token(plain, "slack", "", "inbox_depth desc")


def test_a_bad_deployment_in_a_filter_is_refused_as_such() -> None:
    with pytest.raises(InvalidArgument) as info:
        listing.parse_filter("deployment = latest")
    assert info.value.reason == Reason.INVALID_DEPLOYMENT_ID


# -- against a real stack ----------------------------------------------------------


async def test_the_fleet_question_filtered_and_ordered_and_its_metric(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    """Sessions whose commands wait (stalled: their agent refuses to load
    them, so nothing consumes their inbox) are found by inbox depth and the
    age of the oldest one, ordered by either, page by page; the CLI does
    the same, and hooks' sweep finds the deployment's oldest unanswered
    message."""
    from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
    from baton_runtime.common.etcd.client import make_client
    from baton_runtime.common.etcd.keys import Keys
    from baton_runtime.common.etcd.store import Store
    from baton_runtime.common.security.identity import Role
    from baton_runtime.hooks.unanswered import OldestUnanswered
    from baton_runtime.owner.agents.fixture import LoadRefusal
    from tests import certs
    from tests.procs import eventually
    from tests.stack import SLACK, start_stack, stop_stack
    from tests.test_cli_sessions import cli, env_of, flags

    LoadRefusal.refusing = True
    stack = await start_stack(
        etcd_endpoint,
        agent="baton_runtime.owner.agents.fixture:build_refuse_load_until_fixed_agent",
        restart_budget=1,
        park_after=None,
    )
    try:
        first, busy, quiet = [await stack.create() for _ in range(3)]
        await stack.send(first, "one")
        for n in range(3):
            await stack.send(busy, f"more {n}")

        async def listed(filter_text: str = "", order_by: str = "", size: int = 0) -> list[str]:
            """Every page's session ids, in the order the pages give them."""
            out: list[str] = []
            token = ""
            while True:
                page = await stack.ingress_stub.ListSessions(
                    pb.ListSessionsRequest(
                        filter=filter_text, order_by=order_by, page_size=size, page_token=token
                    ),
                    metadata=SLACK,
                    timeout=10,
                )
                out += [v.session_id for v in page.sessions]
                token = page.next_page_token
                if not token:
                    return out

        async def all_stalled() -> bool:
            return len(await listed("status = stalled")) == 3

        await eventually(all_stalled, "the three sessions stalled", 30)
        assert sorted(await listed("inbox_depth > 0")) == sorted([first, busy])
        assert await listed("inbox_depth > 1") == [busy]
        assert await listed("inbox_depth = 0") == [quiet]
        assert await listed('oldest_unconsumed_age > "1h"') == []
        waiting = 'inbox_depth > 0 AND oldest_unconsumed_age > "0s"'
        assert sorted(await listed(waiting)) == sorted([first, busy])
        # Ordered, one session a page: the tokens carry the position.
        assert await listed(order_by="inbox_depth desc", size=1) == [busy, first, quiet]
        assert await listed(order_by="oldest_unconsumed_age desc", size=1) == [first, busy, quiet]
        assert await listed(waiting, "oldest_unconsumed_age desc") == [first, busy]
        assert (await listed(order_by="inbox_depth"))[0] == quiet

        # The CLI: the same question.
        env = env_of(tmp_path)
        run = await cli(
            "list", "--filter", waiting, "--order-by", "oldest_unconsumed_age desc", "-o", "jsonl",
            *flags(stack), env=env,
        )  # fmt: skip
        assert run.code == 0, run.err
        assert [json.loads(line)["session_id"] for line in run.out.splitlines()] == [first, busy]
        run = await cli("list", "--order-by", "colour", *flags(stack), env=env)
        assert run.code == 1 and "INVALID_FIELD" in run.err, run

        # hooks' sweep: the deployment's oldest unanswered message is first's.
        view = await stack.ingress_stub.GetSession(
            pb.GetSessionRequest(session_id=first), metadata=SLACK, timeout=10
        )
        before = view.session.oldest_unconsumed_age.ToMilliseconds() / 1000
        store = Store(make_client(stack.etcd.endpoint, 5, certs.security(Role.HOOKS)), 5)
        await store.connect()
        try:
            ages = await OldestUnanswered(store, Keys(stack.etcd.prefix)).sweep()
        finally:
            await store.close()
        assert set(ages) == {stack.deployment_id}
        assert ages[stack.deployment_id] >= before > 0
    finally:
        LoadRefusal.refusing = True
        await stop_stack(stack)
