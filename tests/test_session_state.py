"""One session state, composed (services/owner/rules/held.py), and the seal of
a commit (services/owner/rules/sealing.py): pure, no etcd, no gRPC, no event
loop."""

from __future__ import annotations

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.rules.held import RunIdentity, make_event, timestamp
from baton_runtime.owner.rules.sealing import seal

K = s.EventKind
SID = "ses_" + "a" * 26
IDENTITY = RunIdentity(s.Fence(session_id=SID, owner_run_id="run_1", epoch=1), "dep-a", "i1")


def test_a_seal_numbers_the_events_on_and_stamps_the_snapshot() -> None:
    snapshot = s.SessionSnapshot(
        session_id=SID, next_event_seq=7, deployment_id="dep-old", last_trace_id="t0"
    )
    stamped = make_event(IDENTITY, K.EVENT_KIND_TURN_STARTED)
    stamped.time.CopyFrom(timestamp(50.0))
    bare = s.Event(session_id=SID, kind=K.EVENT_KIND_SESSION_STARTED)
    seal(snapshot, [stamped, bare], deployment_id="dep-a", now=100.25)
    assert (stamped.seq, bare.seq, snapshot.next_event_seq) == (7, 8, 9)
    assert stamped.time == timestamp(50.0), "a rule's time is kept"
    assert bare.time == timestamp(100.25), "an event without one gets the commit's"
    assert snapshot.deployment_id == "dep-a" and snapshot.last_trace_id == "t0"
    seal(snapshot, [], deployment_id="dep-a", now=101.0, trace_id="t1")
    assert snapshot.next_event_seq == 9 and snapshot.last_trace_id == "t1"


def test_a_seal_deletes_consumed_entries_no_further_than_the_snapshots_position() -> None:
    snapshot = s.SessionSnapshot(session_id=SID, inbox_next_seq=5)
    assert seal(snapshot, [], deployment_id="dep-a", now=1.0) is None
    assert seal(snapshot, [], deployment_id="dep-a", now=1.0, consumed_from=3) == 3
    # A snapshot rolled back to a refused commit's is behind what was consumed.
    assert seal(snapshot, [], deployment_id="dep-a", now=1.0, consumed_from=9) == 5
