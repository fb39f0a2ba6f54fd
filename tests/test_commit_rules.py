"""The pure part of a commit (services/anchor/commits.py): what a step's
commit may hold, checked before anything is written, and what a refused
commit transaction's read-back means (our own applied commit retried, a
closed stream, a stale snapshot or a seq conflict). No etcd, no gRPC."""

from __future__ import annotations

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.anchor.commits import (
    EncodedCommit,
    RefusedRead,
    check_consumed_from,
    encode_commit,
    refused_commit,
)
from baton_runtime.common.errors import Aborted, FailedPrecondition, InvalidArgument, Reason

SID = "ses_" + "a" * 26
FENCE = s.Fence(session_id=SID, owner_run_id="run_1", epoch=1)


def event(seq: int, kind: s.EventKind.ValueType = s.EVENT_KIND_TURN_STARTED) -> s.Event:
    return s.Event(session_id=SID, seq=seq, kind=kind)


def snapshot(next_event_seq: int, inbox_next_seq: int = 0) -> s.SessionSnapshot:
    return s.SessionSnapshot(
        session_id=SID, next_event_seq=next_event_seq, inbox_next_seq=inbox_next_seq
    )


def two_events() -> EncodedCommit:
    return encode_commit(FENCE, [event(4), event(5)], snapshot(6), close=False)


def test_a_valid_commit_is_encoded_once_and_continues_at_its_first_event() -> None:
    commit = two_events()
    assert commit.first_seq == 4
    assert [s.Event.FromString(raw).seq for raw in commit.encoded_events] == [4, 5]
    assert commit.size == len(commit.snapshot_bytes) + sum(map(len, commit.encoded_events))
    assert encode_commit(FENCE, [], snapshot(9), close=False).first_seq == 9


@pytest.mark.parametrize(
    ("events", "snap", "close", "message"),
    [
        ([event(4), event(6)], snapshot(7), False, "consecutive"),
        ([event(4)], snapshot(9), False, "next_event_seq"),
        ([event(4, s.EVENT_KIND_SESSION_COMPLETED), event(5)], snapshot(6), True, "terminal"),
        ([event(4)], snapshot(5), True, "close_stream"),
        ([s.Event(session_id="ses_" + "b" * 26, seq=4)], snapshot(5), False, "fenced session"),
    ],
)
def test_an_inconsistent_commit_is_refused_before_anything_is_written(
    events: list[s.Event], snap: s.SessionSnapshot, close: bool, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message) as refused:
        encode_commit(FENCE, events, snap, close)
    assert refused.value.reason == Reason.INVALID_FIELD


def test_a_commit_without_a_fence_epoch_or_of_another_session_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="epoch"):
        encode_commit(s.Fence(session_id=SID, owner_run_id="run_1"), [], snapshot(0), False)
    other = s.SessionSnapshot(session_id="ses_" + "b" * 26)
    with pytest.raises(InvalidArgument, match="differs from the fence"):
        encode_commit(FENCE, [], other, False)


def test_the_consumed_position_may_not_pass_the_snapshots() -> None:
    check_consumed_from(None, snapshot(0, inbox_next_seq=3))
    check_consumed_from(3, snapshot(0, inbox_next_seq=3))
    with pytest.raises(InvalidArgument, match="beyond the snapshot's inbox_next_seq 3"):
        check_consumed_from(4, snapshot(0, inbox_next_seq=3))


def seen(commit: EncodedCommit, **overrides: object) -> RefusedRead:
    """What the txn reads back after our own commit was applied."""
    fields: dict[str, object] = {
        "snapshot": commit.snapshot_bytes,
        "snapshot_revision": 17,
        "first_event": commit.encoded_events[0] if commit.events else None,
        "closed": False,
        "horizon": 0,
    }
    fields.update(overrides)
    return RefusedRead(**fields)  # type: ignore[arg-type]


def test_a_retry_of_an_applied_commit_answers_its_revision() -> None:
    commit = two_events()
    assert refused_commit(commit, seen(commit), None) == 17
    assert refused_commit(commit, seen(commit), expected_snapshot_revision=3) == 17
    # The applied commit's first event is already below the horizon.
    assert refused_commit(commit, seen(commit, first_event=None, horizon=5), None) == 17


def test_another_commit_at_the_same_seq_is_a_seq_conflict() -> None:
    commit = two_events()
    other_first = event(4, s.EVENT_KIND_TURN_COMPLETED).SerializeToString()
    with pytest.raises(Aborted) as conflict:
        refused_commit(commit, seen(commit, first_event=other_first), None)
    assert conflict.value.reason == Reason.SEQ_CONFLICT
    with pytest.raises(Aborted) as gone:  # below the horizon, but not ours by its snapshot
        refused_commit(commit, seen(commit, snapshot=b"x", first_event=None, horizon=5), None)
    assert gone.value.reason == Reason.SEQ_CONFLICT


def test_a_closed_stream_comes_before_a_stale_snapshot() -> None:
    commit = two_events()
    with pytest.raises(FailedPrecondition) as closed:
        refused_commit(commit, seen(commit, snapshot=None, closed=True), 17)
    assert closed.value.reason == Reason.SESSION_FINALIZED
    with pytest.raises(Aborted) as stale:
        refused_commit(commit, seen(commit, snapshot=b"newer", snapshot_revision=20), 17)
    assert stale.value.reason == Reason.STALE_SNAPSHOT
    assert "revision 20, not 17" in stale.value.message
    with pytest.raises(Aborted) as absent:  # expected revision 0: no snapshot yet
        refused_commit(commit, seen(commit, snapshot=b"first", snapshot_revision=9), 0)
    assert absent.value.reason == Reason.STALE_SNAPSHOT
