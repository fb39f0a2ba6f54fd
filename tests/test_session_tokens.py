"""The pure part of a session's creation (services/hooks/claims.py
`session_tokens` of a `NewSession`): the request's ids are validated and the tokens the
session claims decided before anything is read or written. No etcd, no
gRPC."""

from __future__ import annotations

import pytest

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.errors import InvalidArgument, Reason
from baton_runtime.hooks.claims import NewSession, session_tokens

SID = "ses_" + "a" * 26
OWNER = s.OwnerIdentity(owner_run_id="run_1", deployment_id="dep-a", instance_id="i1")


def test_the_inbox_token_comes_first_and_each_alias_once() -> None:
    aliases = ("slack:T1", "slack:T2", "slack:T1", ids.inbox_token(SID))
    assert session_tokens(NewSession(SID, OWNER, "slack", aliases)) == [
        ids.inbox_token(SID),
        "slack:T1",
        "slack:T2",
    ]
    assert session_tokens(NewSession(SID, OWNER, "slack")) == [ids.inbox_token(SID)]


def test_an_alias_without_a_namespace_is_refused() -> None:
    with pytest.raises(InvalidArgument) as refused:
        session_tokens(NewSession(SID, OWNER, "slack", ("no-namespace",)))
    assert refused.value.reason == Reason.INVALID_TOKEN


def test_more_tokens_than_a_session_may_hold_are_refused() -> None:
    most = tuple(f"slack:T{n}" for n in range(ids.MAX_HOOKS_PER_SESSION - 1))
    assert len(session_tokens(NewSession(SID, OWNER, "slack", most))) == ids.MAX_HOOKS_PER_SESSION
    with pytest.raises(InvalidArgument) as refused:
        session_tokens(NewSession(SID, OWNER, "slack", (*most, "slack:one-more")))
    assert refused.value.reason == Reason.TOO_MANY_HOOKS


@pytest.mark.parametrize(
    ("session_id", "owner", "channel"),
    [
        ("not-a-session", OWNER, "slack"),
        (SID, OWNER, "Not A Channel"),
        (SID, s.OwnerIdentity(owner_run_id="run_1", instance_id="i1"), "slack"),
        (SID, s.OwnerIdentity(deployment_id="dep-a", instance_id="i1"), "slack"),
        (SID, s.OwnerIdentity(owner_run_id="run_1", deployment_id="dep-a"), "slack"),
    ],
)
def test_a_create_with_a_bad_id_is_refused(
    session_id: str, owner: s.OwnerIdentity, channel: str
) -> None:
    with pytest.raises(InvalidArgument):
        session_tokens(NewSession(session_id, owner, channel))
