"""The hop map holds (issue 21): the six paths of docs/hops.md, counted on
real processes by the same code that writes docs/hops.json (bench/hops.py),
carry exactly the gRPC messages and etcd requests the map lists.

A change that adds (or drops) a call, a stream message, a transaction or a
read fails here with the path and the row; if it is meant, regenerate both
documents with `python -m bench.hops --write` and let the diff of hops.json
show it.

Exact: every call, stream opened, etcd request and watch event. Bounded
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

# Rows that batching may merge (see the module docstring), besides every
# `watch_responses`.
BATCHED = (
    "stream hooks -> owner StreamInbox",
    "stream anchor -> ingress ReadEvents",
    "stream anchor -> owner ReadEvents",
    "edge ingress -> client StreamEvents",
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
    assert not wrong, f"{path} differs from docs/hops.json:\n  " + "\n  ".join(wrong)
