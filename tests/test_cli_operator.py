"""The operator's commands as processes against a real in-process stack,
with the operator certificate: `baton sessions resume` (a stalled session
runs again once its cause is fixed, its restart budget renewed and its inbox
kept), `baton deployments list|describe` (instances with their leases and
session counts, sessions with their statuses while a drain moves them) and
`baton handoffs get`, in text and JSON; JSON views that match GetSession;
errors with their exit codes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands import sessions
from baton_runtime.cli.system.launch_settings import FIXTURE_AGENT, FIXTURE_AGENT_V2
from baton_runtime.common.security.identity import Role
from baton_runtime.owner.agents.fixture import LoadRefusal
from tests.procs import eventually
from tests.stack import (
    SLACK_KEY,
    WEB,
    WEB_KEY,
    Stack,
    add_deployment,
    start_stack,
    stop_deployment,
    stop_stack,
)
from tests.test_cli_sessions import as_json, baton, env_of, flags, get_session, idle_session

K = s.EventKind
ST = pb.SessionStatus


@pytest.fixture
def stack(stack_never_parks: Stack) -> Stack:
    """These tests compare statuses with `idle`: conftest's stack_never_parks."""
    return stack_never_parks


def operator_flags(stack: Stack) -> list[str]:
    files = stack.pki.files(Role.OPERATOR)
    return [
        "--hooks", stack.addr(stack.hooks), "--anchor", stack.addr(stack.anchor),
        "--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca,
    ]  # fmt: skip


async def status_becomes(stack: Stack, session_id: str, status: int) -> pb.Session:
    async def probe() -> pb.Session | None:
        view = await get_session(stack, session_id)
        return view if view.status == status else None

    return await eventually(probe, pb.SessionStatus.Name(status), 30)


@pytest.fixture
async def fixable(etcd_endpoint: str) -> AsyncIterator[Stack]:
    """A stack whose agent refuses to load sessions until the test fixes it
    (baton_runtime.owner.agents.fixture.LoadRefusal), with a restart budget of 1."""
    LoadRefusal.refusing = True
    stack = await start_stack(
        etcd_endpoint,
        agent="baton_runtime.owner.agents.fixture:build_refuse_load_until_fixed_agent",
        restart_budget=1,
    )
    try:
        yield stack
    finally:
        LoadRefusal.refusing = True
        await stop_stack(stack)


async def test_resume_runs_a_stalled_session_again_with_a_renewed_budget(
    fixable: Stack, tmp_path: Path
) -> None:
    stack = fixable
    env = env_of(tmp_path)
    sid = await stack.create()
    await stack.send(sid, "hello")
    stalled = await status_becomes(stack, sid, ST.SESSION_STATUS_STALLED)
    assert stalled.inbox_depth == 1 and stalled.status_reason.reason == "RESTART_BUDGET_SPENT"
    run = await baton("sessions", "get", sid, "-o", "json", *flags(stack), env=env)
    assert run.code == 0, run.err
    printed, asked = json.loads(run.out), as_json(await get_session(stack, sid))
    # The same view but for the age of the waiting command, which grows.
    assert printed.pop("oldest_unconsumed_age") and asked.pop("oldest_unconsumed_age")
    assert printed == asked and printed["status"] == "SESSION_STATUS_STALLED"
    # Resumed before the cause is fixed: the renewed budget is spent again
    # (a second stall, after a resume, on the stream).
    run = await baton("sessions", "resume", sid, "-o", "json", *operator_flags(stack), env=env)
    assert run.code == 0, run.err
    answer = json.loads(run.out)
    assert answer["resumed"] is True and answer["session_id"] == sid
    assert answer["deployment_id"] == stack.deployment_id
    assert answer["fence"]["owner_run_id"] == stalled.owner_run_id

    async def stalled_twice() -> list[s.Event] | None:
        events = await stack.events(sid, follow=False)
        kinds = [e.kind for e in events]
        return events if kinds.count(K.EVENT_KIND_SESSION_STALLED) == 2 else None

    events = await eventually(stalled_twice, "a second stall", 30)
    kinds = [e.kind for e in events]
    assert kinds.index(K.EVENT_KIND_SESSION_RESUMED) > kinds.index(K.EVENT_KIND_SESSION_STALLED)
    await status_becomes(stack, sid, ST.SESSION_STATUS_STALLED)
    # The cause fixed, a resume runs it: the message accepted before the
    # stalls is answered (the inbox was kept), and the session is idle.
    LoadRefusal.refusing = False
    run = await baton("sessions", "resume", sid, *operator_flags(stack), env=env)
    assert run.code == 0, run.err
    assert run.out.startswith(f"resumed: session {sid} runs again on ")
    idle = await status_becomes(stack, sid, ST.SESSION_STATUS_IDLE)
    assert idle.inbox_depth == 0 and idle.turn_count == 1
    answered = await stack.events(sid, follow=False)
    assert [e.text for e in answered if e.kind == K.EVENT_KIND_MESSAGE_COMPLETED] == ["echo: hello"]
    assert idle.last_failure.reason == "RESTART_BUDGET_SPENT"  # the last failure stays known
    # A session that is not stalled is left alone (a repeat is safe).
    run = await baton("sessions", "resume", sid, "-o", "json", *operator_flags(stack), env=env)
    assert run.code == 0, run.err
    assert json.loads(run.out)["resumed"] is False
    run = await baton("sessions", "resume", sid, *operator_flags(stack), env=env)
    assert run.code == 0 and "is not stalled" in run.out, run
    assert (await get_session(stack, sid)).stream_head == idle.stream_head


async def test_resume_errors_print_the_reason_with_their_exit_codes(
    stack: Stack, tmp_path: Path
) -> None:
    env = env_of(tmp_path)
    missing = "ses_" + "0" * 26
    run = await baton("sessions", "resume", missing, *operator_flags(stack), env=env)
    assert run.code == sessions.EXIT_NOT_FOUND and "SESSION_NOT_FOUND" in run.err, run
    run = await baton("sessions", "resume", "not-a-session", *operator_flags(stack), env=env)
    assert run.code == sessions.EXIT_REFUSED and "INVALID_SESSION_ID" in run.err, run
    run = await baton("deployments", "describe", "latest", *operator_flags(stack), env=env)
    assert run.code == sessions.EXIT_REFUSED and "INVALID_DEPLOYMENT_ID" in run.err, run
    # The instance owning the session is gone: retry (it is being taken over).
    other = await add_deployment(stack, "dep-b")
    sid = await other.create()
    await stop_deployment(other)  # its owner deregisters: its lease is revoked
    run = await baton("sessions", "resume", sid, *operator_flags(stack), env=env)
    assert run.code == sessions.EXIT_UNAVAILABLE and "which is not live" in run.err, run
    # No operator certificate: a usage error naming what to pass.
    run = await baton("sessions", "resume", missing, "--hooks", stack.addr(stack.hooks), env=env)
    assert run.code == sessions.EXIT_USAGE and "operator certificate" in run.err, run
    # Another role's certificate is refused by the services' role table.
    files = stack.pki.files(Role.INGRESS, stack.deployment_id)
    run = await baton(
        "deployments", "list", "--hooks", stack.addr(stack.hooks),
        "--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca, env=env,
    )  # fmt: skip
    assert run.code == sessions.EXIT_REFUSED and "ROLE_NOT_ALLOWED" in run.err, run


async def test_deployments_and_handoffs_while_a_drain_moves_the_sessions(
    stack: Stack, tmp_path: Path
) -> None:
    env = env_of(tmp_path)
    ops = operator_flags(stack)
    web = await stack.create(metadata=WEB)  # another channel's: operators see it too
    await stack.send(web, "hello", metadata=WEB)
    await stack.events(web, until=1, metadata=WEB)
    mine = [await idle_session(stack) for _ in range(2)]
    asking = await idle_session(stack, "ask my name")
    second = await add_deployment(stack, "dep-b", agent=FIXTURE_AGENT_V2)
    try:
        run = await baton("deployments", "list", "-o", "json", *ops, env=env)
        assert run.code == 0, run.err
        listed = {d["deployment_id"]: d for d in json.loads(run.out)}
        assert set(listed) == {"dep-a", "dep-b"}
        assert listed["dep-a"]["sessions"] == "4" and listed["dep-b"]["sessions"] == "0"
        assert {d["status"] for d in listed.values()} == {"DEPLOYMENT_STATUS_ACTIVE"}
        (instance,) = listed["dep-a"]["instances"]
        assert instance["instance"]["instance_id"] == "dep-a-i1"
        assert int(instance["lease_id"]) > 0 and instance["sessions"] == "4"
        # Each instance says which agent code it loaded.
        assert instance["instance"]["agent"] == {
            "spec": FIXTURE_AGENT,
            "name": "fixture",
            "version": "1",
        }
        assert listed["dep-b"]["instances"][0]["instance"]["agent"]["version"] == "2"
        assert 0 < int(instance["ttl_seconds"]) <= int(instance["granted_ttl_seconds"])
        run = await baton("deployments", "list", *ops, env=env)
        assert run.code == 0, run.err
        header, *rows = run.out.splitlines()
        assert header.split() == ["DEPLOYMENT", "STATUS", "INSTANCES", "SESSIONS", "ON_GONE"]
        assert [row.split() for row in rows] == [
            ["dep-a", "active", "1", "4", "0"],
            ["dep-b", "active", "1", "0", "0"],
        ]
        # describe: every channel's sessions, each as GetSession shows it.
        run = await baton("deployments", "describe", "dep-a", "-o", "json", *ops, env=env)
        assert run.code == 0, run.err
        described = json.loads(run.out)
        views = {v["session_id"]: v for v in described["sessions"]}
        assert set(views) == {web, asking, *mine}
        for sid in (asking, *mine):
            assert views[sid] == as_json(await get_session(stack, sid))
        assert views[web]["channel"] == "web"
        assert described["status_counts"] == {"idle": 3, "waiting_for_input": 1}
        assert described["sessions_total"] == 4 and described["sessions_listed"] == 4
        run = await baton("deployments", "describe", "dep-a", "--limit", "1", *ops, env=env)
        assert run.code == 0, run.err
        assert "dep-a-i1" in run.out and "... 3 more (--limit 0 lists all)" in run.out
        header = next(line for line in run.out.splitlines() if line.startswith("INSTANCE"))
        assert header.split()[-1] == "AGENT"
        assert f"fixture v1 ({FIXTURE_AGENT})" in run.out, run.out
        run = await baton("deployments", "describe", "dep-b", *ops, env=env)
        assert run.code == 0 and f"fixture v2 ({FIXTURE_AGENT_V2})" in run.out, run
        # A drain moves the idle ones; the waiting one stays, and says so.
        drain = ("deployments", "drain", "dep-a", "--to", "dep-b", "--wait", "0")
        run = await baton(*drain, "-o", "json", *ops, env=env)
        assert run.code == 3, run  # not all moved at the first report
        report = json.loads(run.out)
        assert (report["from"], report["to"], report["drained"]) == ("dep-a", "dep-b", False)
        (progress,) = report["instances"]
        assert progress["instance_id"] == "dep-a-i1" and progress["to_deployment_id"] == "dep-b"
        busy = {b["session_id"]: b["reason"] for b in progress["blockers"]}
        assert busy[asking] == "SESSION_BUSY"  # waits for input: not idle

        async def moved() -> dict[str, object] | None:
            run = await baton("deployments", "describe", "dep-b", "-o", "json", *ops, env=env)
            assert run.code == 0, run.err
            found = dict(json.loads(run.out))
            return found if found["sessions_total"] == 3 else None

        after = await eventually(moved, "the idle sessions on dep-b", 30)
        assert {v["session_id"] for v in after["sessions"]} == {web, *mine}  # type: ignore[attr-defined]
        assert after["status_counts"] == {"idle": 3}
        run = await baton(*drain, "-o", "jsonl", *ops, env=env)  # a repeat: the progress
        assert run.code == 3, run
        *changes, final = [json.loads(line) for line in run.out.splitlines()]
        assert changes == [{"moved": 3, "left": 1}]
        assert (final["moved"], final["left"]) == (3, 1)
        assert [b["session_id"] for b in final["instances"][0]["blockers"]] == [asking]
        run = await baton("deployments", "describe", "dep-a", *ops, env=env)
        assert run.code == 0, run.err
        assert f"{asking}  waiting_for_input  dep-a" in run.out
        # The handoff that moved one of them, by its id.
        handed = [
            e
            for e in await stack.events(mine[0], follow=False)
            if e.kind == K.EVENT_KIND_SESSION_HANDED_OFF
        ]
        assert len(handed) == 1
        handoff = handed[0].handoff_id
        run = await baton("handoffs", "get", handoff, "--session", mine[0], "-o", "json", *ops,
                          env=env)  # fmt: skip
        assert run.code == 0, run.err
        got = json.loads(run.out)
        assert got["handoff_id"] == handoff and got["reason"] == "TRANSFER_REASON_DRAIN"
        assert got["successor"]["deployment_id"] == "dep-b"
        assert got["fence"]["epoch"] == "2"
        assert got["successor"]["owner_run_id"] == (await get_session(stack, mine[0])).owner_run_id
        run = await baton("handoffs", "get", handoff, "--session", mine[0], *ops, env=env)
        assert run.code == 0, run.err
        assert "reason:      drain" in run.out and "deployment dep-b" in run.out
        run = await baton("handoffs", "get", "ho_nothing", "--session", mine[0], *ops, env=env)
        assert run.code == sessions.EXIT_NOT_FOUND and "TRANSFER_NOT_FOUND" in run.err, run
    finally:
        await stop_deployment(second)


async def test_operator_settings_from_the_profile(stack: Stack, tmp_path: Path) -> None:
    """`baton up`'s profile names hooks, anchor and the operator certificate:
    with it, operator commands need no flags."""
    from baton_runtime.cli.system import profile

    files = stack.pki.files(Role.OPERATOR)
    path = tmp_path / "profile.json"
    profile.write(
        path,
        profile.Profile(
            ingress=stack.addr(stack.ingress),
            ca_cert=files.ca,
            hooks=stack.addr(stack.hooks),
            anchor=stack.addr(stack.anchor),
            operator_cert=files.cert,
            operator_key=files.key,
            run_dir="x",
        ),
    )
    sid = await idle_session(stack)
    env = {"BATON_API_KEY": SLACK_KEY, "BATON_PROFILE": str(path)}
    run = await baton("deployments", "describe", stack.deployment_id, "-o", "json", env=env)
    assert run.code == 0, run.err
    assert [v["session_id"] for v in json.loads(run.out)["sessions"]] == [sid]
    run = await baton("sessions", "get", sid, "-o", "json", env=env)
    assert run.code == 0, run.err
    assert json.loads(run.out)["session_id"] == sid


async def test_the_documented_cli_block_runs_as_shown(etcd_endpoint: str, tmp_path: Path) -> None:
    """The commands of docs/cli.md's block, run verbatim and in
    order through bash (`baton` this checkout's CLI; the settings a `baton
    up` profile would give, as environment variables), against a stack of
    `baton up`'s default deployment id."""
    import asyncio
    import os
    import sys

    from tests.test_cli_sessions import CLI_TIMEOUT, ROOT, doc_section

    section = doc_section("cli.md")
    start = section.index("```sh\n") + len("```sh\n")
    block = section[start : section.index("```", start)]
    commands = [line for line in block.splitlines() if line.startswith("baton ")]
    assert len(commands) == 8, commands
    stack = await start_stack(etcd_endpoint, "dep-1")
    try:
        sid = await stack.create()
        files = stack.pki.files(Role.OPERATOR)
        env = {
            **os.environ,
            **env_of(tmp_path),
            "BATON_INGRESS_ADDR": stack.addr(stack.ingress),
            "BATON_HOOKS_ADDR": stack.addr(stack.hooks),
            "BATON_ANCHOR_ADDR": stack.addr(stack.anchor),
            "BATON_TLS_CA": files.ca,
            "BATON_TLS_CERT": files.cert,
            "BATON_TLS_KEY": files.key,
            "SESSION": sid,
        }
        outputs = []
        for command in commands:
            if "events $SESSION --from" in command:
                await stack.events(sid, until=1)  # the send above answered
            script = f'baton() {{ "{sys.executable}" -m baton_runtime.cli "$@"; }}; {command}'
            proc = await asyncio.create_subprocess_exec(
                "bash", "-c", script, cwd=ROOT, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT)
            assert proc.returncode == 0, (command, err.decode())
            outputs.append(out.decode())
        sent, replay, cancelled, resumed, listed, described, reset, followed = outputs
        assert sent.startswith(f"accepted: session {sid}, inbox seq 0, delivery order-17")
        texts = [json.loads(line).get("text") for line in replay.splitlines()]
        assert "calc 6*7" in texts and any("42" in str(text) for text in texts)
        assert cancelled.startswith(f"cancel accepted: session {sid}")
        assert "is not stalled" in resumed
        assert listed.splitlines()[1].split()[:3] == ["dep-1", "active", "1"]
        assert [v["session_id"] for v in json.loads(described)["sessions"]] == [sid]
        assert reset.startswith(f"reset accepted: session {sid}")
        assert "session.completed" in followed.splitlines()[-1]
    finally:
        await stop_stack(stack)


async def test_sessions_across_channels_for_an_operator_only(stack: Stack, tmp_path: Path) -> None:
    """`baton sessions list --all-channels` lists every channel's sessions,
    each as its own channel's GetSession shows it, filtered like
    ListSessions; hooks lists the whole index only for an operator."""
    import grpc

    from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as h
    from baton_runtime._proto.baton.hooks.v1 import hooks_pb2_grpc
    from baton_runtime.common.clients.channels import open_channel
    from baton_runtime.common.rpc.status_map import from_rpc_error
    from tests.test_introspection import get

    env = env_of(tmp_path)
    ops = operator_flags(stack)
    slack = sorted([await idle_session(stack) for _ in range(2)])
    asking = await idle_session(stack, "ask my name")
    web = await stack.create(metadata=WEB)
    run = await baton("sessions", "list", "--all-channels", "-o", "json", *ops, env=env)
    assert run.code == 0, run.err
    listed = json.loads(run.out)
    expected = [("slack", sid) for sid in sorted([*slack, asking])] + [("web", web)]
    assert [(v["channel"], v["session_id"]) for v in listed] == expected
    for view in listed:
        md = WEB if view["channel"] == "web" else None
        asked = (
            await get(stack, view["session_id"], md=md)
            if md
            else await get(stack, view["session_id"])
        )
        assert view == as_json(asked)
    run = await baton(
        "sessions", "list", "--all-channels", "--filter", "status = waiting_for_input",
        "-o", "jsonl", *ops, env=env,
    )  # fmt: skip
    assert run.code == 0, run.err
    assert [json.loads(line)["session_id"] for line in run.out.splitlines()] == [asking]
    run = await baton(
        "sessions", "list", "--all-channels", "--filter", "inbox_depth = 0",
        "--order-by", "oldest_unconsumed_age desc", "-o", "json", *ops, env=env,
    )  # fmt: skip
    assert run.code == 0, run.err  # nothing waits anywhere: ties, by channel and id
    assert [(v["channel"], v["session_id"]) for v in json.loads(run.out)] == expected
    run = await baton("sessions", "list", "--all-channels", "--order-by", "age", *ops, env=env)
    assert run.code == sessions.EXIT_REFUSED and "INVALID_FIELD" in run.err, run
    run = await baton("sessions", "list", "--all-channels", "--limit", "2", *ops, env=env)
    assert run.code == 0, run.err
    assert [row.split()[0] for row in run.out.splitlines()[1:]] == [v for _, v in expected[:2]]
    run = await baton("sessions", "list", "--all-channels", "--filter", "colour = red", *ops,
                      env=env)  # fmt: skip
    assert run.code == sessions.EXIT_REFUSED and "INVALID_FILTER" in run.err, run
    # Without --all-channels the same command is the tenant's view.
    run = await baton(
        "sessions", "list", "-o", "json", *flags(stack), env=env_of(tmp_path, WEB_KEY)
    )
    assert [v["session_id"] for v in json.loads(run.out)] == [web]
    # hooks: an ingress must name its tenant; after_channel needs no channel.
    for role, request, reason in (
        (Role.INGRESS, h.ListChannelSessionsRequest(limit=10), "MISSING_FIELD"),
        (
            Role.OPERATOR,
            h.ListChannelSessionsRequest(channel="slack", after_channel="web", limit=10),
            "INVALID_FIELD",
        ),
        (
            Role.OPERATOR,
            h.ListChannelSessionsRequest(after_channel="web", limit=10),
            "INVALID_FIELD",
        ),
    ):
        channel = open_channel(
            stack.addr(stack.hooks),
            stack.security(role, stack.deployment_id if role is Role.INGRESS else ""),
        )
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await hooks_pb2_grpc.HookRegistryServiceStub(channel).ListChannelSessions(
                    request, timeout=10
                )
        finally:
            await channel.close()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert from_rpc_error(info.value).reason == reason
