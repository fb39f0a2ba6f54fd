"""Bad input at the edge: every refusal has its exact status and ErrorInfo
reason, and nothing is written. Also config refusal and commands of a kind
the owner does not know."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.owner.v1 import owner_pb2 as owner_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import BatonError, InvalidArgument, Reason
from baton_runtime.common.etcd.keys import Keys, prefix_end
from baton_runtime.common.rpc.status_map import from_rpc_error
from baton_runtime.ingress.config import IngressConfig
from baton_runtime.owner.config import OwnerConfig
from tests.stack import SLACK, SLACK_KEY, WEB, Stack

K = s.EventKind
Code = grpc.StatusCode
Metadata = tuple[tuple[str, str], ...]

MAX_TEXT = 32 * 1024


State = list[tuple[bytes, bytes, int]]


async def durable_state(stack: Stack, etcd: aetcd.Client) -> State:
    """Every session key and token-index entry under the stack's prefix (with
    mod revisions), except owner records, which an idle owner may touch."""
    root = stack.etcd.prefix.encode()
    result = await etcd.get_range(root, prefix_end(root))
    return [
        (kv.key, kv.value, kv.mod_revision)
        for kv in result
        if (kv.key.startswith(root + b"s/") and not kv.key.endswith(b"/owner"))
        or kv.key.startswith(root + b"t/")
    ]


async def session_keys(stack: Stack, etcd: aetcd.Client, session_id: str) -> list[bytes]:
    prefix = Keys(stack.etcd.prefix).session_prefix(session_id)
    return [kv.key for kv in await etcd.get_range(prefix, prefix_end(prefix))]


async def refused(call: Any, code: grpc.StatusCode, reason: str) -> BatonError:
    """Await a unary call (or drain a stream) and check the exact refusal."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if hasattr(call, "__aiter__"):
            async for item in call:
                raise AssertionError(f"expected {code.name}/{reason}, got {item}")
        else:
            await call
    assert info.value.code() == code, (info.value.code(), info.value.details())
    err = from_rpc_error(info.value)
    assert err.reason == reason, (err.reason, err.message)
    return err


def send(stack: Stack, metadata: Metadata = SLACK, **fields: Any) -> Any:
    return stack.ingress_stub.SendMessage(
        ingress_pb.SendMessageRequest(**fields), metadata=metadata, timeout=10
    )


def read(stack: Stack, metadata: Metadata = SLACK, **fields: Any) -> Any:
    return stack.ingress_stub.StreamEvents(
        ingress_pb.StreamEventsRequest(**fields), metadata=metadata, timeout=10
    )


def create(stack: Stack, metadata: Metadata = SLACK, **fields: Any) -> Any:
    return stack.ingress_stub.CreateSession(
        ingress_pb.CreateSessionRequest(**fields), metadata=metadata, timeout=20
    )


def get_session(stack: Stack, metadata: Metadata = SLACK, **fields: Any) -> Any:
    return stack.ingress_stub.GetSession(
        ingress_pb.GetSessionRequest(**fields), metadata=metadata, timeout=10
    )


def list_sessions(stack: Stack, metadata: Metadata = SLACK, **fields: Any) -> Any:
    return stack.ingress_stub.ListSessions(
        ingress_pb.ListSessionsRequest(**fields), metadata=metadata, timeout=10
    )


async def follow_until(
    stack: Stack,
    session_id: str,
    done: Callable[[list[s.Event]], bool],
    timeout: float = 20,
) -> list[s.Event]:
    seen: list[s.Event] = []
    call = read(stack, session_id=session_id, follow=True)

    async def collect() -> None:
        async for response in call:
            for event in response.events:
                seen.append(event)
                if done(seen):
                    return

    try:
        await asyncio.wait_for(collect(), timeout)
    finally:
        call.cancel()
    return seen


def answered(text: str) -> Callable[[list[s.Event]], bool]:
    return lambda seen: any(
        e.kind == K.EVENT_KIND_MESSAGE_COMPLETED and e.text == f"echo: {text}" for e in seen
    )


# -- addressing ------------------------------------------------------------------


async def test_unknown_session_id_is_not_found(stack: Stack, etcd: aetcd.Client) -> None:
    await stack.create()  # a bystander session, so there is something to disturb
    unknown = ids.new_session_id()
    before = await durable_state(stack, etcd)
    # Through the inbox token index or the journal: either way NOT_FOUND.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await send(stack, session_id=unknown, text="anyone?")
    assert info.value.code() == Code.NOT_FOUND
    assert from_rpc_error(info.value).reason in (Reason.SESSION_NOT_FOUND, Reason.TOKEN_NOT_FOUND)
    await refused(
        read(stack, session_id=unknown, follow=False), Code.NOT_FOUND, Reason.SESSION_NOT_FOUND
    )
    assert await session_keys(stack, etcd, unknown) == []
    assert await durable_state(stack, etcd) == before


@pytest.mark.parametrize(
    "bad_id",
    ["ses_short", "not-a-session", "ses_" + "A" * 26, "ses_" + "a" * 27, "ses_abc/../../t/x"],
)
async def test_malformed_session_id_is_invalid(
    stack: Stack, etcd: aetcd.Client, bad_id: str
) -> None:
    session_id = await stack.create()
    before = await durable_state(stack, etcd)
    await refused(
        send(stack, session_id=bad_id, text="hi"), Code.INVALID_ARGUMENT, Reason.INVALID_SESSION_ID
    )
    await refused(read(stack, session_id=bad_id), Code.INVALID_ARGUMENT, Reason.INVALID_SESSION_ID)
    assert await durable_state(stack, etcd) == before
    assert (await stack.send(session_id, "fine")).receipt.seq == 0


async def test_no_target_is_missing_field(stack: Stack, etcd: aetcd.Client) -> None:
    before = await durable_state(stack, etcd)
    await refused(send(stack, text="to whom?"), Code.INVALID_ARGUMENT, Reason.MISSING_FIELD)
    await refused(read(stack), Code.INVALID_ARGUMENT, Reason.MISSING_FIELD)
    assert await durable_state(stack, etcd) == before


async def test_unknown_alias_is_token_not_found(stack: Stack, etcd: aetcd.Client) -> None:
    await stack.create(aliases=["known"])
    before = await durable_state(stack, etcd)
    for alias in ("nobody-home", "slack:nobody-home"):
        await refused(send(stack, alias=alias, text="hi"), Code.NOT_FOUND, Reason.TOKEN_NOT_FOUND)
        await refused(read(stack, alias=alias), Code.NOT_FOUND, Reason.TOKEN_NOT_FOUND)
    assert await durable_state(stack, etcd) == before


@pytest.mark.parametrize(
    "alias", ["bad alias", "a/b", "../t/slack:x", "ümlaut", "x" * 201, "slack:", "Slack:x", ":x"]
)
async def test_invalid_alias_characters_are_invalid_token(
    stack: Stack, etcd: aetcd.Client, alias: str
) -> None:
    session_id = await stack.create()
    before = await durable_state(stack, etcd)
    await refused(send(stack, alias=alias, text="hi"), Code.INVALID_ARGUMENT, Reason.INVALID_TOKEN)
    await refused(read(stack, alias=alias), Code.INVALID_ARGUMENT, Reason.INVALID_TOKEN)
    await refused(
        create(stack, request_id="bad-alias", aliases=["good", alias]),
        Code.INVALID_ARGUMENT,
        Reason.INVALID_TOKEN,
    )
    assert await durable_state(stack, etcd) == before
    assert await session_keys(stack, etcd, ids.session_id_for_request("slack", "bad-alias")) == []
    assert (await stack.send(session_id, "fine")).receipt.seq == 0


# -- message content -------------------------------------------------------------------


async def test_oversize_and_empty_messages_are_refused(stack: Stack, etcd: aetcd.Client) -> None:
    session_id = await stack.create()
    before = await durable_state(stack, etcd)
    oversize = ["x" * (MAX_TEXT + 1), "é" * (MAX_TEXT // 2 + 1), "x" * (200 * 1024)]
    for text in oversize:  # bytes count, not characters
        await refused(
            send(stack, session_id=session_id, text=text),
            Code.INVALID_ARGUMENT,
            Reason.MESSAGE_TOO_LARGE,
        )
    for text in ("", " ", "\n\t  \r\n"):
        await refused(
            send(stack, session_id=session_id, text=text),
            Code.INVALID_ARGUMENT,
            Reason.EMPTY_MESSAGE,
        )
    assert await durable_state(stack, etcd) == before

    # The limit itself is accepted, and processed.
    at_limit = "y" * MAX_TEXT
    response = await stack.send(session_id, at_limit)
    assert response.receipt.seq == 0 and not response.receipt.duplicate
    await follow_until(stack, session_id, answered(at_limit))


async def test_input_responses_cannot_bypass_the_message_size_limit(
    stack: Stack, etcd: aetcd.Client
) -> None:
    """The size limit is on what the user sends, whichever field carries it: an
    input response is user text that enters the history like a message."""
    session_id = await stack.create()
    before = await durable_state(stack, etcd)
    big = s.InputResponse(request_id="input_1", text="z" * (MAX_TEXT + 1))
    await refused(
        send(stack, session_id=session_id, input_responses=[big]),
        Code.INVALID_ARGUMENT,
        Reason.MESSAGE_TOO_LARGE,
    )
    assert await durable_state(stack, etcd) == before


async def test_bad_delivery_fields_are_invalid(stack: Stack, etcd: aetcd.Client) -> None:
    session_id = await stack.create()
    before = await durable_state(stack, etcd)
    cases: list[dict[str, Any]] = [
        {"delivery_id": "has spaces"},
        {"delivery_id": "x" * 129},
        {"delivery_id": "a/b"},
        {"caller": "bad caller!"},
        {"labels": {f"k{i}": "v" for i in range(33)}},
        {"labels": {"k": "v" * 300}},
    ]
    for fields in cases:
        await refused(
            send(stack, session_id=session_id, text="hi", **fields),
            Code.INVALID_ARGUMENT,
            Reason.INVALID_FIELD,
        )
    assert await durable_state(stack, etcd) == before


# -- authentication and tenancy ------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ((), Reason.MISSING_API_KEY),
        ((("authorization", ""),), Reason.MISSING_API_KEY),
        ((("authorization", "Bearer not-a-known-key"),), Reason.INVALID_API_KEY),
        ((("authorization", "Bearer "),), Reason.INVALID_API_KEY),
        ((("authorization", f"Basic {SLACK_KEY}"),), Reason.INVALID_API_KEY),
        ((("authorization", SLACK_KEY),), Reason.INVALID_API_KEY),
        ((("authorization", f"Bearer {SLACK_KEY[:-1]}"),), Reason.INVALID_API_KEY),
    ],
    ids=["none", "empty", "unknown", "no-key", "basic", "no-scheme", "prefix"],
)
async def test_bad_api_key_is_unauthenticated(
    stack: Stack, etcd: aetcd.Client, metadata: Metadata, reason: str
) -> None:
    session_id = await stack.create(aliases=["mine"])
    before = await durable_state(stack, etcd)
    await refused(
        send(stack, metadata, session_id=session_id, text="hi"), Code.UNAUTHENTICATED, reason
    )
    await refused(send(stack, metadata, alias="mine", text="hi"), Code.UNAUTHENTICATED, reason)
    await refused(read(stack, metadata, session_id=session_id), Code.UNAUTHENTICATED, reason)
    await refused(create(stack, metadata, request_id="anon"), Code.UNAUTHENTICATED, reason)
    assert await durable_state(stack, etcd) == before


async def test_another_channels_alias_is_cross_tenant(stack: Stack, etcd: aetcd.Client) -> None:
    slack_session = await stack.create(SLACK, aliases=["x"])
    before = await durable_state(stack, etcd)
    # Refused the same way whether or not the alias exists: no existence leak.
    for alias in ("slack:x", "slack:does-not-exist", f"session:{slack_session}"):
        await refused(
            send(stack, WEB, alias=alias, text="hi"), Code.PERMISSION_DENIED, Reason.CROSS_TENANT
        )
        await refused(read(stack, WEB, alias=alias), Code.PERMISSION_DENIED, Reason.CROSS_TENANT)
    await refused(
        create(stack, WEB, request_id="steal", aliases=["slack:x"]),
        Code.PERMISSION_DENIED,
        Reason.CROSS_TENANT,
    )
    assert await durable_state(stack, etcd) == before
    assert await session_keys(stack, etcd, ids.session_id_for_request("web", "steal")) == []

    # The same raw alias in the web channel is a different token: no conflict.
    web_session = await stack.create(WEB, aliases=["x"])
    assert web_session != slack_session
    response = await stack.send(alias="x", text="web x", metadata=WEB)
    assert response.receipt.session_id == web_session
    response = await stack.send(alias="x", text="slack x", metadata=SLACK)
    assert response.receipt.session_id == slack_session


async def test_another_channels_session_id_answers_like_an_unknown_one(
    stack: Stack, etcd: aetcd.Client
) -> None:
    """Google AIP-211: a caller must not learn that a session it may not
    address exists. Another channel's session id gets exactly the answer an
    unknown id gets (code, reason and message), for every call."""
    slack_session = await stack.create(SLACK)
    await stack.send(slack_session, "private")
    await follow_until(stack, slack_session, answered("private"))
    unknown = ids.new_session_id()
    before = await durable_state(stack, etcd)

    def calls(session_id: str) -> list[Any]:
        return [
            send(stack, WEB, session_id=session_id, text="let me in"),
            read(stack, WEB, session_id=session_id, follow=False),
            read(stack, WEB, session_id=session_id, follow=True, start_seq=3),
            stack.ingress_stub.SendControl(
                ingress_pb.SendControlRequest(
                    session_id=session_id, kind=ingress_pb.CONTROL_KIND_RESET
                ),
                metadata=WEB,
                timeout=10,
            ),
        ]

    for theirs, nobodys in zip(calls(slack_session), calls(unknown), strict=True):
        a = await refused(theirs, Code.NOT_FOUND, Reason.SESSION_NOT_FOUND)
        b = await refused(nobodys, Code.NOT_FOUND, Reason.SESSION_NOT_FOUND)
        assert a.message.replace(slack_session, "?") == b.message.replace(unknown, "?")
        assert a.metadata == b.metadata
    assert await durable_state(stack, etcd) == before


# -- creation ---------------------------------------------------------------------------


async def test_alias_held_by_another_session_is_token_claimed(
    stack: Stack, etcd: aetcd.Client
) -> None:
    holder = await stack.create(aliases=["shared"])
    before = await durable_state(stack, etcd)
    for aliases in (["shared"], ["fresh-one", "shared"], ["slack:shared", "another"]):
        err = await refused(
            create(stack, request_id="second", aliases=aliases),
            Code.ALREADY_EXISTS,
            Reason.TOKEN_CLAIMED,
        )
        assert err.metadata.get("session_id") == holder, err.metadata
        assert err.metadata.get("token") == "slack:shared", err.metadata
    # All or nothing: no part of the refused session exists, no token moved.
    assert await session_keys(stack, etcd, ids.session_id_for_request("slack", "second")) == []
    assert await durable_state(stack, etcd) == before
    response = await stack.send(alias="shared", text="still the holder's")
    assert response.receipt.session_id == holder


async def test_too_many_aliases(stack: Stack, etcd: aetcd.Client) -> None:
    before = await durable_state(stack, etcd)
    too_many = [f"a{i}" for i in range(ids.MAX_HOOKS_PER_SESSION)]  # + the inbox token
    await refused(
        create(stack, request_id="crowded", aliases=too_many),
        Code.INVALID_ARGUMENT,
        Reason.TOO_MANY_HOOKS,
    )
    assert await durable_state(stack, etcd) == before


async def test_a_session_can_hold_256_addresses_and_release_them(
    stack: Stack, etcd: aetcd.Client
) -> None:
    """DESIGN §2: a session may hold 256 addresses: 255 aliases + its inbox
    token. Creating it, and releasing every token when it finalizes, must work
    at that size (not only below etcd's per-transaction operation limit)."""
    aliases = [f"a{i}" for i in range(ids.MAX_HOOKS_PER_SESSION - 1)]
    session_id = await stack.create(request_id="full", aliases=aliases)
    hooks = stack.hooks_client()
    try:
        assert (await hooks.lookup("slack:a254", "slack")).session_id == session_id
        await stack.ingress_stub.SendControl(
            ingress_pb.SendControlRequest(
                session_id=session_id, kind=ingress_pb.CONTROL_KIND_RESET
            ),
            metadata=SLACK,
            timeout=10,
        )
        await follow_until(
            stack, session_id, lambda seen: seen[-1].kind == K.EVENT_KIND_SESSION_COMPLETED
        )
        tokens = f"{stack.etcd.prefix}t/slack:a".encode()
        deadline = asyncio.get_running_loop().time() + 10
        while len(await etcd.get_range(tokens, prefix_end(tokens))) > 0:
            assert asyncio.get_running_loop().time() < deadline, "aliases were not released"
            await asyncio.sleep(0.05)
    finally:
        await hooks.close()


async def test_client_cannot_set_accepted_deployment_id(stack: Stack, etcd: aetcd.Client) -> None:
    session_id = await stack.create()
    labels = {"accepted_deployment_id": "dep-evil", "deployment_id": "latest"}
    # The entry as appended, seen by a watch: the commit that consumes it
    # deletes it, possibly before a read after the send.
    watch = await etcd.watch_prefix(Keys(stack.etcd.prefix).inbox_prefix(session_id))
    try:
        response = await stack.send(session_id, "who accepted me?", labels=labels)

        async def appended() -> bytes:
            async for event in watch:
                if event.kv.value:
                    return bytes(event.kv.value)
            raise AssertionError("the watch ended")

        stored = await asyncio.wait_for(appended(), 10)
    finally:
        await watch.cancel()
    assert response.accepted_deployment_id == stack.deployment_id
    entry = s.InboxEntry.FromString(stored)
    assert entry.seq == response.receipt.seq
    assert entry.command.delivery.accepted_deployment_id == stack.deployment_id
    assert entry.command.delivery.channel == "slack"
    assert dict(entry.command.delivery.labels) == labels

    events = await follow_until(stack, session_id, answered("who accepted me?"))
    assert {e.deployment_id for e in events} == {stack.deployment_id}


async def test_send_to_a_finalized_session_is_failed_precondition(
    stack: Stack, etcd: aetcd.Client
) -> None:
    session_id = await stack.create(aliases=["short-lived"])
    await stack.ingress_stub.SendControl(
        ingress_pb.SendControlRequest(session_id=session_id, kind=ingress_pb.CONTROL_KIND_RESET),
        metadata=SLACK,
        timeout=10,
    )
    events = await follow_until(
        stack, session_id, lambda seen: seen[-1].kind == K.EVENT_KIND_SESSION_COMPLETED
    )
    assert events[-1].kind == K.EVENT_KIND_SESSION_COMPLETED
    before = await durable_state(stack, etcd)
    await refused(
        send(stack, session_id=session_id, text="too late"),
        Code.FAILED_PRECONDITION,
        Reason.SESSION_FINALIZED,
    )
    assert await durable_state(stack, etcd) == before
    # The stream stays readable and ends with its one terminal event.
    again = await stack.events(session_id, follow=True)
    assert [e.SerializeToString() for e in again] == [e.SerializeToString() for e in events]


async def test_unknown_control_kind_is_refused(stack: Stack, etcd: aetcd.Client) -> None:
    session_id = await stack.create()
    before = await durable_state(stack, etcd)
    for kind in (ingress_pb.CONTROL_KIND_UNSPECIFIED, 99):
        await refused(
            stack.ingress_stub.SendControl(
                ingress_pb.SendControlRequest(session_id=session_id, kind=kind),  # type: ignore[arg-type]
                metadata=SLACK,
                timeout=10,
            ),
            Code.INVALID_ARGUMENT,
            Reason.UNKNOWN_COMMAND,
        )
    assert await durable_state(stack, etcd) == before


# -- deployments ------------------------------------------------------------------------

PLAINTEXT = {"BATON_PLAINTEXT": "1"}


@pytest.fixture
def ingress_env(tmp_path: Path) -> dict[str, str]:
    keys = tmp_path / "api-keys"
    keys.write_text(f"slack={SLACK_KEY}\n")
    return {"BATON_API_KEYS_FILE": str(keys), **PLAINTEXT}


@pytest.mark.parametrize("bad", [None, "", "latest", "LATEST", "Latest", "dep a", "-dep"])
def test_config_refuses_a_missing_or_latest_deployment_id(
    bad: str | None, ingress_env: dict[str, str]
) -> None:
    environ = dict(ingress_env)
    if bad is not None:
        environ["BATON_DEPLOYMENT_ID"] = bad
    with pytest.raises(ConfigError):
        IngressConfig.load(argv=[], environ=environ)
    with pytest.raises(ConfigError):
        OwnerConfig.load(argv=[], environ={k: v for k, v in environ.items() if "API" not in k})
    if bad:
        with pytest.raises(ConfigError):
            IngressConfig.load(argv=[f"--deployment-id={bad}"], environ=ingress_env)
        with pytest.raises(ConfigError):
            OwnerConfig.load(argv=[f"--deployment-id={bad}"], environ=PLAINTEXT)


def test_config_accepts_an_exact_deployment_id(ingress_env: dict[str, str]) -> None:
    environ = dict(ingress_env, BATON_DEPLOYMENT_ID="build-2024.06.01-7")
    assert IngressConfig.load(argv=[], environ=environ).deployment_id == "build-2024.06.01-7"
    owner = OwnerConfig.load(argv=["--deployment-id", "build-7"], environ=PLAINTEXT)
    assert owner.deployment_id == "build-7"


@pytest.mark.parametrize("bad", ["", "latest", "LATEST", " latest", "latest "])
def test_validate_deployment_id_refuses_empty_and_latest(bad: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        ids.validate_deployment_id(bad)
    assert info.value.reason == Reason.INVALID_DEPLOYMENT_ID


async def test_no_start_uses_latest_or_an_absent_deployment(
    stack: Stack, etcd: aetcd.Client
) -> None:
    owner = stack.owner_client()
    hooks = stack.hooks_client()
    before = await durable_state(stack, etcd)
    try:
        for deployment in ("", "latest", "LATEST"):
            with pytest.raises(BatonError) as info:
                await owner.start_session(
                    owner_pb.StartSessionRequest(
                        session_id=ids.new_session_id(), deployment_id=deployment, channel="slack"
                    )
                )
            assert info.value.reason == Reason.INVALID_DEPLOYMENT_ID
            identity = s.OwnerIdentity(
                owner_run_id=ids.new_run_id(), deployment_id=deployment, instance_id="i"
            )
            with pytest.raises(BatonError) as info:
                await hooks.create_session(ids.new_session_id(), identity, "slack", [])
            assert info.value.reason == Reason.INVALID_DEPLOYMENT_ID
        with pytest.raises(BatonError) as info:
            await owner.start_session(
                owner_pb.StartSessionRequest(
                    session_id=ids.new_session_id(), deployment_id="dep-other", channel="slack"
                )
            )
        assert info.value.reason == Reason.WRONG_DEPLOYMENT
    finally:
        await owner.close()
        await hooks.close()
    assert await durable_state(stack, etcd) == before


# -- commands the owner does not know ------------------------------------------------


def unknown_kind_commands() -> list[s.Command]:
    delivery = s.DeliveryMetadata(
        delivery_id="from-the-future", channel="slack", accepted_deployment_id="dep-b"
    )
    no_kind = s.Command(delivery=delivery)
    # A newer ingress's oneof member (field 30, length-delimited, empty): an
    # unknown field to this deployment's Command.
    newer = s.Command.FromString(
        s.Command(delivery=s.DeliveryMetadata(delivery_id="newer-kind")).SerializeToString()
        + b"\xf2\x01\x00"
    )
    assert newer.WhichOneof("kind") is None
    return [no_kind, newer]


async def test_unknown_command_kind_is_rejected_and_the_owner_keeps_running(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    hooks = stack.hooks_client()
    try:
        receipts = [
            await hooks.append(ids.inbox_token(session_id), command)
            for command in unknown_kind_commands()
        ]
    finally:
        await hooks.close()
    assert [r.seq for r in receipts] == [0, 1]
    after = await stack.send(session_id, "still there?")
    assert after.receipt.seq == 2

    events = await follow_until(stack, session_id, answered("still there?"))
    rejected = [e for e in events if e.kind == K.EVENT_KIND_COMMAND_REJECTED]
    assert [e.inbox_seq for e in rejected] == [0, 1]
    assert [e.error.reason for e in rejected] == ["UNKNOWN_COMMAND"] * 2
    assert [e.delivery_id for e in rejected] == ["from-the-future", "newer-kind"]
    assert all(e.error.message for e in rejected)
    received = [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED]
    assert [e.inbox_seq for e in received] == [2]
    assert [e.seq for e in events] == list(range(len(events)))


async def test_a_child_start_with_a_bad_parent_link_creates_nothing(
    stack: Stack, etcd: aetcd.Client
) -> None:
    owner = stack.owner_client(security=stack.owner_security())  # a parent's owner
    parent = ids.new_session_id()
    good = s.ParentLink(parent_session_id=parent, kind=s.TASK_KIND_SUBAGENT, name="helper")
    cases = [
        (
            s.ParentLink(parent_session_id=parent, kind=s.TASK_KIND_SUBAGENT, name="nobody"),
            [],
            Reason.UNKNOWN_SUBAGENT,
        ),
        (
            s.ParentLink(parent_session_id=parent, kind=s.TASK_KIND_BACKGROUND, name="calculator"),
            [],
            Reason.UNKNOWN_SUBAGENT,
        ),
        (s.ParentLink(parent_session_id=parent, name="helper"), [], Reason.INVALID_FIELD),
        (
            s.ParentLink(parent_session_id="ses_x", kind=s.TASK_KIND_SUBAGENT, name="helper"),
            [],
            Reason.INVALID_SESSION_ID,
        ),
        (good, ["slack:child-alias"], Reason.INVALID_FIELD),
    ]
    before = await durable_state(stack, etcd)
    try:
        for link, aliases, reason in cases:
            with pytest.raises(BatonError) as info:
                await owner.start_session(
                    owner_pb.StartSessionRequest(
                        session_id=ids.new_session_id(),
                        deployment_id=stack.deployment_id,
                        channel="slack",
                        aliases=aliases,
                        parent=link,
                    )
                )
            assert info.value.reason == reason, (link, aliases)
    finally:
        await owner.close()
    assert await durable_state(stack, etcd) == before


# -- introspection -----------------------------------------------------------------------


async def test_get_session_refusals(stack: Stack, etcd: aetcd.Client) -> None:
    """GetSession addresses like every other call: each refusal has its
    reason, another channel's session answers as an unknown one, and
    reading writes nothing."""
    session_id = await stack.create(aliases=["mine"])
    before = await durable_state(stack, etcd)
    unknown = ids.new_session_id()
    missing = await refused(
        get_session(stack, session_id=unknown), Code.NOT_FOUND, Reason.SESSION_NOT_FOUND
    )
    theirs = await refused(
        get_session(stack, WEB, session_id=session_id), Code.NOT_FOUND, Reason.SESSION_NOT_FOUND
    )
    assert theirs.message.replace(session_id, unknown) == missing.message
    await refused(
        get_session(stack, session_id="ses_nope"), Code.INVALID_ARGUMENT, Reason.INVALID_SESSION_ID
    )
    await refused(get_session(stack), Code.INVALID_ARGUMENT, Reason.MISSING_FIELD)
    await refused(get_session(stack, alias="nobody"), Code.NOT_FOUND, Reason.TOKEN_NOT_FOUND)
    await refused(
        get_session(stack, alias="bad alias!"), Code.INVALID_ARGUMENT, Reason.INVALID_TOKEN
    )
    await refused(
        get_session(stack, WEB, alias="slack:mine"), Code.PERMISSION_DENIED, Reason.CROSS_TENANT
    )
    await refused(
        get_session(stack, (("authorization", "Bearer nope"),), session_id=session_id),
        Code.UNAUTHENTICATED,
        Reason.INVALID_API_KEY,
    )
    err = await refused(
        get_session(stack, session_id="x" * 20_000),
        Code.INVALID_ARGUMENT,
        Reason.INVALID_SESSION_ID,
    )
    assert len(err.message) < 300
    assert await durable_state(stack, etcd) == before


async def test_list_sessions_refusals(stack: Stack, etcd: aetcd.Client) -> None:
    """ListSessions: a negative page size, a filter outside the documented
    subset, an oversize filter and a page token that is not one it returned
    for this filter are INVALID_ARGUMENT with their reasons, not echoed, and
    nothing is written."""
    for _ in range(2):
        await stack.create()
    before = await durable_state(stack, etcd)
    await refused(list_sessions(stack, page_size=-5), Code.INVALID_ARGUMENT, Reason.INVALID_FIELD)
    for bad in ("status = bored", "owner = me", "status = idle OR status = running"):
        await refused(
            list_sessions(stack, filter=bad), Code.INVALID_ARGUMENT, Reason.INVALID_FILTER
        )
    err = await refused(
        list_sessions(stack, filter="x" * 20_000), Code.INVALID_ARGUMENT, Reason.INVALID_FILTER
    )
    assert len(err.message) < 300
    token = (await list_sessions(stack, page_size=1)).next_page_token
    assert token
    await refused(
        list_sessions(stack, page_size=1, page_token=token, filter="status = idle"),
        Code.INVALID_ARGUMENT,
        Reason.INVALID_PAGE_TOKEN,
    )
    err = await refused(
        list_sessions(stack, page_token="y" * 20_000),
        Code.INVALID_ARGUMENT,
        Reason.INVALID_PAGE_TOKEN,
    )
    assert len(err.message) < 300
    await refused(
        list_sessions(stack, (("authorization", "Bearer nope"),)),
        Code.UNAUTHENTICATED,
        Reason.INVALID_API_KEY,
    )
    assert await durable_state(stack, etcd) == before


# -- found by fuzzing the edge (issue 10) -----------------------------------------------


async def test_out_of_range_numbers_are_refused_before_anything_is_written(
    stack: Stack, etcd: aetcd.Client
) -> None:
    """A timeout of 10^12 s used to fail after hooks had written the session
    (INTERNAL, then a zombie session on retry). Now every number is range
    checked first; the same request id then creates the session normally."""
    before = await durable_state(stack, etcd)
    for fields in ({"timeout_seconds": 10**12}, {"token_budget": 2**63}):
        for _ in range(2):  # a retry with the same request id: the same refusal
            err = await refused(
                create(stack, request_id="huge", **fields),
                Code.INVALID_ARGUMENT,
                Reason.INVALID_FIELD,
            )
            assert next(iter(fields)) in err.message
    await refused(
        read(stack, session_id=ids.new_session_id(), start_seq=2**64 - 1),
        Code.INVALID_ARGUMENT,
        Reason.INVALID_FIELD,
    )
    assert await durable_state(stack, etcd) == before
    response = await create(stack, request_id="huge", timeout_seconds=3600)
    assert response.created
    sent = await stack.send(response.session_id, "alive?")
    await follow_until(stack, response.session_id, answered("alive?"))
    assert sent.receipt.seq == 0


@pytest.mark.parametrize("field", ["request_id", "session_id", "alias", "delivery_id"])
async def test_an_oversize_value_is_refused_without_echoing_it(
    stack: Stack, etcd: aetcd.Client, field: str
) -> None:
    """A 20,000-character value used to come back whole in the error message,
    overflowing a default client's 16 KiB trailer limit (RESOURCE_EXHAUSTED
    with no reason). The refusal quotes a short prefix only."""
    huge = "x" * 20_000
    session_id = await stack.create()
    before = await durable_state(stack, etcd)
    if field == "request_id":
        call = create(stack, request_id=huge)
    elif field == "delivery_id":
        call = send(stack, session_id=session_id, text="hi", delivery_id=huge)
    else:
        call = send(stack, text="hi", **{field: huge})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == Code.INVALID_ARGUMENT
    err = from_rpc_error(info.value)
    assert err.reason in (Reason.INVALID_FIELD, Reason.INVALID_SESSION_ID, Reason.INVALID_TOKEN)
    assert len(err.message) < 300 and "20000 characters" in err.message
    assert await durable_state(stack, etcd) == before


async def test_an_undecodable_body_is_invalid_argument_on_every_server(stack: Stack) -> None:
    """gRPC decodes before the handler runs; the servers decode themselves, so
    bytes that are not the method's message get INVALID_ARGUMENT with a
    reason (it used to be UNKNOWN), on public and internal servers alike."""
    from baton_runtime.common.clients.channels import open_channel
    from baton_runtime.common.security.identity import Role
    from tests.stack import public_channel

    garbage = b"\xff\xff\xff\xff\x0f"  # a field 0 / truncated varint: never a message
    cases = [
        (public_channel(stack.addr(stack.ingress)), "/baton.ingress.v1.IngressService/SendMessage"),
        (
            open_channel(stack.addr(stack.hooks), stack.owner_security()),
            "/baton.hooks.v1.HookRegistryService/ResumeHook",
        ),
        (
            open_channel(stack.addr(stack.anchor), stack.owner_security()),
            "/baton.anchor.v1.AnchorService/CommitStep",
        ),
        (
            open_channel(stack.addr(stack.owner), stack.security(Role.INGRESS, "dep-a")),
            "/baton.owner.v1.OwnerService/StartSession",
        ),
    ]
    for channel, method in cases:
        try:
            call = channel.unary_unary(method)  # raw bytes both ways
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(garbage, metadata=SLACK, timeout=10)
        finally:
            await channel.close()
        assert info.value.code() == Code.INVALID_ARGUMENT, (method, info.value.details())
        assert from_rpc_error(info.value).reason == Reason.MALFORMED_REQUEST


@pytest.mark.parametrize("streamed", ["CommitSteps", "ResumeHooks"])
async def test_multiplexed_stream_bounds_are_refused_and_write_nothing(
    stack: Stack, etcd: aetcd.Client, streamed: str
) -> None:
    """CommitSteps and ResumeHooks (an owner's commits, an ingress' appends,
    multiplexed): a message with no call, more than 256 or a bad
    traceparent, and an undecodable message end the stream with
    INVALID_ARGUMENT and a reason; a call id of 0 or one in flight is refused
    for that call alone, and a call the unary method would refuse is refused
    as it would be; nothing is written."""
    from google.rpc import status_pb2

    from baton_runtime._proto.baton.anchor.v1 import anchor_pb2 as a
    from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as h
    from baton_runtime.common.clients.channels import open_channel
    from baton_runtime.common.rpc.status_map import from_status_proto

    if streamed == "CommitSteps":
        method = "/baton.anchor.v1.AnchorService/CommitSteps"
        address, security = stack.addr(stack.anchor), stack.owner_security()
        batch, call_cls, answers_cls = a.CommitStepsRequest, a.CommitStepCall, a.CommitStepsResponse
        refused_request: Any = a.CommitStepRequest()  # no fence: MISSING_FIELD
    else:
        from baton_runtime.common.security.identity import Role

        method = "/baton.hooks.v1.HookRegistryService/ResumeHooks"
        address = stack.addr(stack.hooks)
        security = stack.security(Role.INGRESS, stack.deployment_id)
        batch, call_cls, answers_cls = h.ResumeHooksRequest, h.ResumeHookCall, h.ResumeHooksResponse
        refused_request = h.ResumeHookRequest(token="tok")  # no command: MISSING_FIELD
    before = await durable_state(stack, etcd)
    channel = open_channel(address, security)
    try:
        ending = {
            "no call": batch().SerializeToString(),
            "too many": batch(
                calls=[call_cls(call_id=i + 1, request=refused_request) for i in range(257)]
            ).SerializeToString(),
            "traceparent": batch(
                calls=[call_cls(call_id=1, request=refused_request, traceparent="00-xyz")]
            ).SerializeToString(),
            "undecodable": b"\xff\xff\xff\xff\x0f",
        }
        reasons = {}
        for what, body in ending.items():
            call = channel.stream_stream(method)()
            await call.write(body)
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            assert info.value.code() == Code.INVALID_ARGUMENT, (what, info.value.details())
            reasons[what] = from_rpc_error(info.value).reason
        assert reasons == {
            "no call": Reason.INVALID_FIELD,
            "too many": Reason.INVALID_FIELD,
            "traceparent": Reason.MALFORMED_TRACEPARENT,
            "undecodable": Reason.MALFORMED_REQUEST,
        }
        # Per call: a zero id, and the commit's own refusal (no fence).
        call = channel.stream_stream(
            method,
            request_serializer=batch.SerializeToString,
            response_deserializer=answers_cls.FromString,
        )()
        await call.write(
            batch(
                calls=[
                    call_cls(call_id=0, request=refused_request),
                    call_cls(call_id=5, request=refused_request),
                ]
            )
        )
        await call.done_writing()
        answers = [answer for message in [m async for m in call] for answer in message.answers]
        refused = {
            answer.call_id: from_status_proto(status_pb2.Status.FromString(answer.status)).reason
            for answer in answers
        }
        assert refused == {0: Reason.INVALID_FIELD, 5: Reason.MISSING_FIELD}
    finally:
        await channel.close()
    assert await durable_state(stack, etcd) == before


async def test_an_oversize_agent_label_is_refused_and_registers_nothing(stack: Stack) -> None:
    """RegisterInstance checks the agent label an owner names (spec, name,
    version: at most 256 characters each) before it grants a lease."""
    from baton_runtime.common.etcd.keys import AgentLabel

    hooks = stack.hooks_client()
    try:
        with pytest.raises(InvalidArgument) as info:
            await hooks.register_instance(
                stack.deployment_id, "probe-1", 5, "127.0.0.1:1", AgentLabel(spec="m:" + "f" * 300)
            )
        assert info.value.reason == Reason.INVALID_FIELD and "agent.spec" in info.value.message
        listed = await hooks.list_instances(stack.deployment_id)
        assert "probe-1" not in {i.instance_id for i in listed}
    finally:
        await hooks.close()
