"""Placement among peer owner instances (services/owner/handoff/peers.py): pure."""

from __future__ import annotations

import zlib

import pytest

from baton_runtime.owner.handoff.peers import place


def test_placement_is_a_stable_hash_of_the_session_id() -> None:
    choices = ["i1", "i2", "i3"]
    sid = "ses_" + "a" * 26
    assert place(sid, choices) == choices[zlib.crc32(sid.encode()) % 3]
    assert all(place(sid, choices) == place(sid, choices) for _ in range(3))


def test_placement_spreads_sessions_over_every_choice() -> None:
    choices = ["i1", "i2", "i3", "i4"]
    placed = {place(f"ses_{n:026d}", choices) for n in range(200)}
    assert placed == set(choices)


def test_nowhere_to_place_is_an_error() -> None:
    with pytest.raises(ValueError):
        place("ses_x", [])
