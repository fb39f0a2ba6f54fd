"""The hop map holds (issue 21): the six paths of docs/hops.md, counted on
real processes by the same code that writes docs/hops.json (bench/hops.py),
carry exactly the gRPC messages and etcd requests the map lists.

A change that adds (or drops) a call, a stream message, a transaction or a
read fails here with the path and the row; if it is meant, regenerate both
documents with `python -m bench.hops --write` and let the diff of hops.json
show it.

Exact: every call, stream opened, etcd request and watch event (the inbox
and event watches leave deletions out, so a run's watch that ends with the
path has no late delete to miss). Bounded
(`BATCHED`): what etcd's watch batching or a stream's paging may merge - the
watch responses carrying the events, and the pages of the inbox and event
streams (two commits landing together are one page): at least one when the
map has any, never more than the map. Left out (bench/hops.py BACKGROUND):
what runs by the clock, not by the path (lease keep-alives, alarm checks, the
ingress' orphan-liveness rechecks).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from bench import hops
from tests.scrape import parse

# Rows that batching may merge (see the module docstring), besides every
# `watch_responses`.
BATCHED = (
    # An owner's commits ride CommitSteps, appends ride ResumeHooks: calls
    # ready together share a message, and so do their answers.
    "send owner -> anchor CommitSteps",
    "stream anchor -> owner CommitSteps",
    "send ingress -> hooks ResumeHooks",
    "stream hooks -> ingress ResumeHooks",
    "send owner -> hooks ResumeHooks",
    "stream hooks -> owner ResumeHooks",
    "stream hooks -> owner StreamInbox",
    # An owner's inbox follows ride FollowInboxes: follows and stops made
    # together share a message, and so do pages and ends ready together.
    "send owner -> hooks FollowInboxes",
    "stream hooks -> owner FollowInboxes",
    # Event reads ride FollowEvents, the same way.
    "send ingress -> anchor FollowEvents",
    "stream anchor -> ingress FollowEvents",
    "send owner -> anchor FollowEvents",
    "stream anchor -> owner FollowEvents",
    "stream anchor -> ingress ReadEvents",
    "stream anchor -> owner ReadEvents",
    "edge ingress -> client StreamEvents",
    # An owner's live items (in memory only): batches queued together share
    # a message on its PublishLive stream.
    "send owner -> anchor PublishLive",
)


def _batched(key: str) -> bool:
    return key.endswith(" watch_responses") or key in BATCHED


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(hops.JSON_PATH.read_text())
    return loaded


@pytest.fixture(scope="module")
def measured(etcd_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One counted run of every path (about 40 s), shared by the tests."""
    return asyncio.run(hops.measure(etcd_endpoint, Path(tmp_path_factory.mktemp("hops"))))


def differences(want: dict[str, int], got: dict[str, int]) -> list[str]:
    wrong = []
    for key in sorted(set(want) | set(got)):
        w, g = want.get(key, 0), got.get(key, 0)
        if _batched(key):
            if not (min(w, 1) <= g <= w):
                wrong.append(f"{key}: {g}, the map has {w} (batching may merge, never add)")
        elif w != g:
            wrong.append(f"{key}: {g}, the map has {w}")
    return wrong


def test_the_map_lists_every_path_with_its_totals(expected: dict[str, Any]) -> None:
    """docs/hops.json is what `bench.hops --write` makes of its counts (the
    totals and docs/hops.md agree with the rows)."""
    assert list(expected["paths"]) == list(hops.PATHS)
    for path in expected["paths"].values():
        assert path["messages"] == hops.messages(path["counts"])
        assert path["etcd_requests"] == hops.etcd_requests(path["counts"])
        assert not set(path["counts"]) & set(hops.BACKGROUND)
    assert hops.MD_PATH.read_text() == hops.as_markdown(expected), "run bench.hops --render"


@pytest.mark.parametrize("path", hops.PATHS)
def test_a_path_carries_the_messages_and_requests_of_the_map(
    path: str, expected: dict[str, Any], measured: dict[str, Any]
) -> None:
    want = expected["paths"][path]
    got = measured["paths"][path]
    assert got["events"] == want["events"], "the path itself changed (its events)"
    assert got.get("held_sessions") == want.get("held_sessions")
    wrong = differences(want["counts"], got["counts"])
    assert not wrong, (
        f"{path} differs from docs/hops.json (if that is meant: python -m bench.hops --write):"
        + "".join(f"\n  {line}" for line in wrong)
    )


_H = "/baton.hooks.v1.HookRegistryService/"
_HOOKS_SCRAPE = f"""\
# TYPE baton_rpc_server_handled_total counter
baton_rpc_server_handled_total{{method="{_H}ListInstances",code="OK"}} 3
baton_rpc_server_handled_total{{method="{_H}ResumeHook",code="OK"}} 9
# TYPE baton_etcd_txn_seconds histogram
baton_etcd_txn_seconds_bucket{{op="txn_write",le="+Inf"}} 4
baton_etcd_txn_seconds_count{{op="txn_write"}} 4
baton_etcd_txn_seconds_sum{{op="txn_write"}} 0.01
# TYPE baton_etcd_watch_events_total counter
baton_etcd_watch_events_total 7
"""
_OWNER_SCRAPE = f"""\
# TYPE baton_rpc_client_handled_total counter
baton_rpc_client_handled_total{{target="hooks",method="{_H}StreamInbox",code="CANCELLED"}} 1
baton_rpc_client_handled_total{{target="hooks",method="{_H}ListInstances",code="OK"}} 1
baton_rpc_client_handled_total{{target="anchor",\
method="/baton.anchor.v1.AnchorService/CommitStep",code="OK"}} 2
# TYPE baton_rpc_client_streams_opened_total counter
baton_rpc_client_streams_opened_total{{target="hooks",method="{_H}StreamInbox"}} 2
# TYPE baton_rpc_client_stream_messages_received_total counter
baton_rpc_client_stream_messages_received_total{{target="hooks",method="{_H}StreamInbox"}} 5
"""


def test_scrapes_read_as_hop_rows() -> None:
    """A caller's calls are rows of the caller, a stream's end is no
    message, etcd rows are the store's; messages and requests add up."""
    owner = hops.counts_of("a1", parse(_OWNER_SCRAPE))
    assert owner == {
        "end owner -> hooks StreamInbox [CANCELLED]": 1,
        "rpc owner -> anchor CommitStep": 2,
        "rpc owner -> hooks ListInstances": 1,
        "open owner -> hooks StreamInbox": 2,
        "stream hooks -> owner StreamInbox": 5,
    }
    assert hops.messages(owner) == 2 * 2 + 2 * 1 + 2 + 5
    store = hops.counts_of("hooks", parse(_HOOKS_SCRAPE))
    assert store == {
        "served hooks ListInstances": 3,
        "etcd hooks txn_write": 4,
        "etcd hooks watch_events": 7,
    }
    assert hops.etcd_requests(store) == 4
    both = hops.combined({"a1": owner, "hooks": store})
    assert hops.orphan_checks(both) == 2  # 3 served, 1 of them the owner's
    own, background = hops.split(hops.difference(both, {"etcd hooks txn_write": 1}))
    assert own["etcd hooks txn_write"] == 3
    assert background == {"served hooks ListInstances": 3}
