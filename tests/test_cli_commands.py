"""`baton sessions events|send|cancel|reset` and `baton --version` as
processes against a real in-process stack (TLS, API key): text and JSON
output, JSON that is what the public API answers (StreamEvents, the
receipts, GetSession), a live view while following, and errors that print
the reason with their exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from google.protobuf import json_format

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands import sessions
from baton_runtime.common.observability import build_info
from tests.stack import SLACK_KEY, WEB_KEY, Stack
from tests.test_cli_sessions import (
    CLI_TIMEOUT,
    ROOT,
    as_json,
    baton,
    cli,
    env_of,
    flags,
    get_session,
    idle_session,
)

K = s.EventKind


def event_json(event: s.Event) -> dict[str, object]:
    return json_format.MessageToDict(event, preserving_proto_field_name=True)


async def test_events_replay_in_json_jsonl_and_text_from_a_cursor(
    stack: Stack, tmp_path: Path
) -> None:
    sid = await idle_session(stack, aliases=["ev-1"])
    streamed = await stack.events(sid, follow=False)
    env = env_of(tmp_path)
    run = await cli("events", sid, "-o", "json", *flags(stack), env=env)
    assert run.code == 0, run.err
    assert json.loads(run.out) == [event_json(e) for e in streamed]
    run = await cli("events", "ev-1", "--from", "2", "-o", "jsonl", *flags(stack), env=env)
    assert run.code == 0, run.err
    assert [json.loads(line) for line in run.out.splitlines()] == [
        event_json(e) for e in streamed[2:]
    ]
    run = await cli("events", sid, *flags(stack), env=env)
    assert run.code == 0, run.err
    lines = run.out.splitlines()
    assert len(lines) == len(streamed)
    assert lines[0].startswith("#0") and "session.started" in lines[0]
    assert any("calculator(" in line for line in lines)
    assert "session.waiting" in lines[-1]


async def test_following_prints_each_event_as_it_arrives_until_the_end(
    stack: Stack, tmp_path: Path
) -> None:
    """A follower started before the conversation prints the events as they
    are committed (it is read line by line while the session still runs) and
    exits 0 at the stream's terminal event, which a `reset` causes."""
    sid = await stack.create()
    env = {**os.environ, **env_of(tmp_path)}
    env.pop("PYTHONUNBUFFERED", None)  # each line is flushed by the CLI itself
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton_runtime.cli", "sessions", "events", sid, "--follow",
        "-o", "jsonl", *flags(stack),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:

        async def next_event() -> dict[str, object]:
            """The next event line (live item lines, tests/test_cli_live.py, skipped)."""
            assert proc.stdout is not None
            while True:
                line = await asyncio.wait_for(proc.stdout.readline(), CLI_TIMEOUT)
                assert line, "the follower ended early"
                if "live" not in (parsed := json.loads(line)):
                    return dict(parsed)

        first = await next_event()
        assert first["kind"] == "EVENT_KIND_SESSION_STARTED"
        send = await cli("send", sid, "hello there", *flags(stack), env=env_of(tmp_path))
        assert send.code == 0, send.err
        seen = [first]
        while seen[-1]["kind"] != "EVENT_KIND_SESSION_WAITING":
            seen.append(await next_event())  # printed while the session is live
        assert any(e.get("text") == "echo: hello there" for e in seen)
        reset = await cli("reset", sid, "--reason", "done", *flags(stack), env=env_of(tmp_path))
        assert reset.code == 0, reset.err
        while seen[-1]["kind"] != "EVENT_KIND_SESSION_COMPLETED":
            seen.append(await next_event())
        code = await asyncio.wait_for(proc.wait(), CLI_TIMEOUT)
        assert code == 0
        assert [int(str(e.get("seq", 0))) for e in seen] == list(range(len(seen)))  # gapless
        assert seen == [event_json(e) for e in await stack.events(sid, follow=False)]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_send_prints_the_receipt_and_a_repeat_is_not_delivered_twice(
    stack: Stack, tmp_path: Path
) -> None:
    sid = await stack.create(aliases=["send-1"])
    env = env_of(tmp_path)
    run = await cli(
        "send", sid, "calc 2+3", "--delivery-id", "dlv-cli-1", "-o", "json", *flags(stack), env=env
    )
    assert run.code == 0, run.err
    receipt = json.loads(run.out)
    assert receipt["delivery_id"] == "dlv-cli-1"
    assert receipt["receipt"]["session_id"] == sid
    assert receipt["accepted_deployment_id"] == stack.deployment_id
    again = await cli(
        "send", "send-1", "calc 2+3", "--delivery-id", "dlv-cli-1", "-o", "json",
        *flags(stack), env=env,
    )  # fmt: skip
    assert again.code == 0, again.err
    repeat = json.loads(again.out)
    assert repeat["receipt"].get("seq") == receipt["receipt"].get("seq")  # (0: omitted)
    assert repeat["receipt"]["duplicate"] is True
    await stack.events(sid, until=1)
    view = await get_session(stack, sid)
    assert view.turn_count == 1 and view.inbox_depth == 0  # delivered once
    run = await cli("send", sid, "hello", *flags(stack), env=env)
    assert run.code == 0, run.err
    assert run.out.startswith(f"accepted: session {sid}, inbox seq 1, delivery ")


async def test_cancel_stops_the_running_turn_and_reset_finalizes(
    stack: Stack, tmp_path: Path
) -> None:
    sid = await stack.create()
    env = env_of(tmp_path)
    # A model call that takes a minute: the cancel, accepted after it, is
    # pushed to the turn while the call runs.
    await stack.send(sid, "wait 60000")
    run = await cli("cancel", sid, "--reason", "too slow", "-o", "jsonl", *flags(stack), env=env)
    assert run.code == 0, run.err
    assert json.loads(run.out)["receipt"]["session_id"] == sid
    events = await stack.events(sid, until=1, timeout=CLI_TIMEOUT)
    assert any(e.kind == K.EVENT_KIND_TURN_CANCELLED for e in events)
    run = await cli("reset", sid, *flags(stack), env=env)
    assert run.code == 0, run.err
    assert run.out.startswith(f"reset accepted: session {sid}, inbox seq 2")
    closed = await stack.events(sid)
    assert closed[-1].kind == K.EVENT_KIND_SESSION_COMPLETED
    run = await cli("get", sid, "-o", "json", *flags(stack), env=env)
    assert run.code == 0, run.err
    printed = json.loads(run.out)
    assert printed["status"] == "SESSION_STATUS_FINALIZED"
    assert printed == as_json(await get_session(stack, sid))


async def test_errors_print_the_reason_with_their_exit_codes(stack: Stack, tmp_path: Path) -> None:
    sid = await stack.create()
    env = env_of(tmp_path)
    missing = "ses_" + "0" * 26
    for args in (("events", missing), ("send", missing, "hi"), ("cancel", missing)):
        run = await cli(*args, *flags(stack), env=env)
        assert run.code == sessions.EXIT_NOT_FOUND and "NOT_FOUND" in run.err, (args, run)
    # Another channel's session is as unknown as a missing one.
    run = await cli("send", sid, "hi", *flags(stack), env=env_of(tmp_path, WEB_KEY))
    assert run.code == sessions.EXIT_NOT_FOUND, run
    run = await cli("send", sid, "", *flags(stack), env=env)
    assert run.code == sessions.EXIT_REFUSED and "EMPTY_MESSAGE" in run.err, run
    run = await cli("events", sid, "--follow", "-o", "json", *flags(stack), env=env)
    assert run.code == sessions.EXIT_USAGE and "-o jsonl" in run.err, run
    run = await cli("events", sid, "--from", "-1", *flags(stack), env=env)
    assert run.code == 2 and "must not be negative" in run.err, run
    run = await cli("send", sid, "hi", "--ingress", stack.addr(stack.ingress), env=env)
    assert run.code == sessions.EXIT_USAGE and "--ca-cert" in run.err, run


async def test_version_is_the_package_version() -> None:
    run = await baton("--version", env={"BATON_API_KEY": SLACK_KEY})
    assert run.code == 0, run.err
    assert run.out.strip() == f"baton {build_info.version()}"
    assert build_info.version() != "unknown"


async def test_a_broken_follow_says_where_to_continue(stack: Stack, tmp_path: Path) -> None:
    """The ingress goes away mid-follow: the follower exits 4 (retry), saying
    which --from continues the stream without a gap or a repeat."""
    sid = await idle_session(stack)
    head = len(await stack.events(sid, follow=False))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton_runtime.cli", "sessions", "events", sid, "--follow",
        *flags(stack),
        cwd=ROOT, env={**os.environ, **env_of(tmp_path)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        for _ in range(head):  # every committed event printed: now it waits live
            assert await asyncio.wait_for(proc.stdout.readline(), CLI_TIMEOUT)
        await stack.ingress.stop(grace=0)
        code = await asyncio.wait_for(proc.wait(), CLI_TIMEOUT)
        err = (await proc.stderr.read()).decode()
        assert code == sessions.EXIT_UNAVAILABLE, err
        assert f"(continue with --from {head})" in err, err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def event_texts(stack: Stack, session: str, env: dict[str, str]) -> list[str]:
    """`baton sessions events SESSION` (text): one line per event."""
    run = await cli("events", session, *flags(stack), env=env)
    assert run.code == 0, run.err
    return run.out.splitlines()


async def test_a_closed_pipe_ends_the_cli_quietly(stack: Stack, tmp_path: Path) -> None:
    """`baton sessions events ... -o jsonl | head -1` used to end in a
    BrokenPipeError traceback; now the CLI stops quietly (141, as a process
    that SIGPIPE ended), replaying or following. (The reader's end is
    closed before the CLI starts, so its first line meets a closed pipe.)"""
    sid = await idle_session(stack)
    env = {**os.environ, **env_of(tmp_path)}
    for extra in ([], ["--follow"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "baton_runtime.cli", "sessions", "events", sid, *extra,
                "-o", "jsonl", *flags(stack),
                cwd=ROOT, env=env, stdout=write_end, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        finally:
            os.close(write_end)
        _, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT)
        assert proc.returncode == 141, (extra, proc.returncode, err.decode())
        assert err.decode() == "", extra


async def test_a_cursor_beyond_the_head_is_a_clear_error(stack: Stack, tmp_path: Path) -> None:
    """Following from a seq no commit will write next used to wait for
    nothing; now it is OUT_OF_RANGE/BEYOND_HEAD naming the head (the
    cursor at the head itself waits for the next event, as before)."""
    import grpc

    from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
    from baton_runtime.common.rpc.status_map import from_rpc_error
    from tests.stack import SLACK

    sid = await idle_session(stack)
    head = (await get_session(stack, sid)).stream_head
    env = env_of(tmp_path)
    for follow in ([], ["--follow"]):
        run = await cli("events", sid, "--from", str(head + 1), *follow, *flags(stack), env=env)
        assert run.code == sessions.EXIT_REFUSED, run
        assert "BEYOND_HEAD" in run.err and f"the next event will be seq {head}" in run.err
    call = stack.ingress_stub.StreamEvents(
        pb.StreamEventsRequest(session_id=sid, start_seq=head + 5, follow=True),
        metadata=SLACK,
        timeout=10,
    )
    try:
        async for _ in call:
            raise AssertionError("no event beyond the head")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.OUT_OF_RANGE
        error = from_rpc_error(exc)
        assert error.reason == "BEYOND_HEAD" and error.metadata["next_seq"] == str(head)
    else:
        raise AssertionError("a follow beyond the head ended without an error")
    run = await cli("events", sid, "--from", str(head), *flags(stack), env=env)
    assert run.code == 0 and run.out == "", run  # at the head: nothing yet, no error
