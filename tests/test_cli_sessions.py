"""`baton sessions list|get` as a process against a real in-process stack
(TLS, API key): text and JSON output, JSON that matches GetSession, errors
that print the reason with their exit codes, and connection settings from
flags, environment variables and the profile `baton up` writes.

The servers run in this test's event loop, so every CLI process is
awaited, never waited on synchronously."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import json_format

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands import sessions
from baton_runtime.cli.system import profile
from tests.stack import SLACK, SLACK_KEY, WEB_KEY, Stack


@pytest.fixture
def stack(stack_never_parks: Stack) -> Stack:
    """These tests compare statuses with `idle`: conftest's stack_never_parks."""
    return stack_never_parks


ROOT = Path(__file__).resolve().parent.parent
CLI_TIMEOUT = 60.0


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str


async def cli(*args: str, env: dict[str, str] | None = None) -> Run:
    """`baton sessions ARGS...` as a process."""
    return await baton("sessions", *args, env=env)


async def baton(*args: str, env: dict[str, str] | None = None) -> Run:
    """`baton ARGS...` as a process (this checkout's CLI), with no connection
    settings from this process's environment."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("BATON_INGRESS", "BATON_HOOKS", "BATON_ANCHOR", "BATON_TLS", "BATON_PLAINTEXT")
        )
        and not k.startswith(("BATON_API", "BATON_PROFILE"))
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "baton_runtime.cli",
        *args,
        cwd=ROOT,
        env={**base, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return Run(proc.returncode or 0, out.decode(), err.decode())


def as_json(session: pb.Session) -> dict[str, object]:
    """GetSession's answer in the proto3 JSON mapping, proto field names."""
    return json_format.MessageToDict(session, preserving_proto_field_name=True)


def flags(stack: Stack) -> list[str]:
    return ["--ingress", stack.addr(stack.ingress), "--ca-cert", str(stack.pki.ca_path)]


def env_of(tmp_path: Path, key: str = SLACK_KEY) -> dict[str, str]:
    # A profile path of this test's own: never the user's.
    return {"BATON_API_KEY": key, "BATON_PROFILE": str(tmp_path / "none.json")}


async def get_session(stack: Stack, session_id: str) -> pb.Session:
    response = await stack.ingress_stub.GetSession(
        pb.GetSessionRequest(session_id=session_id), metadata=SLACK, timeout=10
    )
    return response.session


async def idle_session(stack: Stack, text: str = "calc 6*7", **create: object) -> str:
    sid = await stack.create(**create)
    await stack.send(sid, text)
    await stack.events(sid, until=1)
    return sid


async def test_get_prints_json_that_matches_get_session_and_text(
    stack: Stack, tmp_path: Path
) -> None:
    sid = await idle_session(stack, aliases=["cli-1"])
    env = env_of(tmp_path)
    before = await get_session(stack, sid)
    run = await cli("get", sid, "-o", "json", *flags(stack), env=env)
    after = await get_session(stack, sid)
    assert run.code == 0, run.err
    assert before == after  # idle: nothing moved meanwhile
    printed = json.loads(run.out)
    assert printed == as_json(before)
    assert printed["status"] == "SESSION_STATUS_IDLE" and printed["session_id"] == sid
    # jsonl: the same, on one line; by alias too.
    run = await cli("get", "cli-1", "-o", "jsonl", *flags(stack), env=env)
    assert run.code == 0, run.err
    assert run.out.count("\n") == 1 and json.loads(run.out) == printed
    run = await cli("get", sid, *flags(stack), env=env)
    assert run.code == 0, run.err
    assert f"session:     {sid}" in run.out
    assert "status:      idle" in run.out
    assert f"deployment:  {stack.deployment_id}" in run.out
    assert "slack:cli-1" in run.out


async def test_list_in_text_json_and_jsonl_with_a_filter_and_a_limit(
    stack: Stack, tmp_path: Path
) -> None:
    idle = sorted([await idle_session(stack) for _ in range(3)])
    asking = await idle_session(stack, "ask my name")
    env = env_of(tmp_path)
    run = await cli("list", "-o", "json", *flags(stack), env=env)
    assert run.code == 0, run.err
    listed = json.loads(run.out)
    assert [v["session_id"] for v in listed] == sorted([*idle, asking])
    for view in listed:
        assert view == as_json(await get_session(stack, view["session_id"]))
    run = await cli(
        "list", "--filter", "status = idle", "--page-size", "1", "-o", "jsonl",
        *flags(stack), env=env,
    )  # fmt: skip
    assert run.code == 0, run.err
    assert [json.loads(line)["session_id"] for line in run.out.splitlines()] == idle
    run = await cli("list", "--limit", "2", *flags(stack), env=env)
    assert run.code == 0, run.err
    header, *rows = run.out.splitlines()
    assert header.split() == ["SESSION", "STATUS", "DEPLOYMENT", "TURNS", "INBOX", "UPDATED"]
    assert [row.split()[0] for row in rows] == sorted([*idle, asking])[:2]
    run = await cli("list", "--filter", "status = waiting_for_input", *flags(stack), env=env)
    assert [row.split()[:3] for row in run.out.splitlines()[1:]] == [
        [asking, "waiting_for_input", stack.deployment_id]
    ]
    # Another channel's key sees none of them.
    run = await cli("list", "-o", "json", *flags(stack), env=env_of(tmp_path, WEB_KEY))
    assert run.code == 0, run.err
    assert json.loads(run.out) == []


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_errors_print_the_reason_with_their_exit_codes(stack: Stack, tmp_path: Path) -> None:
    sid = await stack.create()
    env = env_of(tmp_path)
    run = await cli("get", "ses_" + "0" * 26, *flags(stack), env=env)
    assert run.code == sessions.EXIT_NOT_FOUND and "SESSION_NOT_FOUND" in run.err, run
    run = await cli("get", sid, *flags(stack), env=env_of(tmp_path, WEB_KEY))
    assert run.code == sessions.EXIT_NOT_FOUND and "SESSION_NOT_FOUND" in run.err, run
    run = await cli("list", "--filter", "colour = red", *flags(stack), env=env)
    assert run.code == sessions.EXIT_REFUSED and "INVALID_FILTER" in run.err, run
    assert "unknown field 'colour'" in run.err
    run = await cli("get", sid, *flags(stack), env=env_of(tmp_path, "wrong-key"))
    assert run.code == sessions.EXIT_REFUSED and "INVALID_API_KEY" in run.err, run
    run = await cli("get", sid, "--ingress", stack.addr(stack.ingress), env=env)
    assert run.code == sessions.EXIT_USAGE and "--ca-cert" in run.err, run
    run = await cli("list", "--ingress", f"127.0.0.1:{closed_port()}", "--ca-cert",
                    str(stack.pki.ca_path), env=env)  # fmt: skip
    assert run.code == sessions.EXIT_UNAVAILABLE and "UNAVAILABLE" in run.err.upper(), run
    run = await cli("list", "-o", "yaml", *flags(stack), env=env)
    assert run.code == 2 and "invalid choice" in run.err


async def test_settings_from_the_environment_and_from_the_profile(
    stack: Stack, tmp_path: Path
) -> None:
    sid = await idle_session(stack)
    # Environment variables instead of flags.
    env = {
        **env_of(tmp_path),
        "BATON_INGRESS_ADDR": stack.addr(stack.ingress),
        "BATON_TLS_CA": str(stack.pki.ca_path),
    }
    run = await cli("get", sid, "-o", "json", env=env)
    assert run.code == 0, run.err
    assert json.loads(run.out)["session_id"] == sid
    # No flags and no variables: the profile `baton up` writes.
    path = tmp_path / "profile.json"
    profile.write(
        path,
        profile.Profile(
            ingress=stack.addr(stack.ingress), ca_cert=str(stack.pki.ca_path), run_dir="x"
        ),
    )
    run = await cli(
        "list", "-o", "json", env={"BATON_API_KEY": SLACK_KEY, "BATON_PROFILE": str(path)}
    )
    assert run.code == 0, run.err
    assert [v["session_id"] for v in json.loads(run.out)] == [sid]
    # A flag beats the profile.
    run = await cli(
        "list", "--ingress", f"127.0.0.1:{closed_port()}",
        env={"BATON_API_KEY": SLACK_KEY, "BATON_PROFILE": str(path)},
    )  # fmt: skip
    assert run.code == sessions.EXIT_UNAVAILABLE, run
    # The profile is removed only by the `baton up` that wrote it.
    profile.remove_if_ours(path, "another run dir")
    assert path.exists()
    profile.remove_if_ours(path, "x")
    assert not path.exists()
    path.write_text("{not json")
    run = await cli("list", env={"BATON_API_KEY": SLACK_KEY, "BATON_PROFILE": str(path)})
    assert run.code == sessions.EXIT_USAGE and "cannot read the profile" in run.err, run


def doc_section(name: str) -> str:
    """The text of `docs/<name>`, where the README's sections moved."""
    return (ROOT / "docs" / name).read_text()


async def test_the_documented_examples_run_as_shown(stack: Stack, tmp_path: Path) -> None:
    """The commands of docs/introspection.md, run verbatim through
    bash (with `baton` the CLI of this checkout and the settings a
    `baton up` profile would give), print what the section says."""
    section = doc_section("introspection.md").replace("\\\n", "")  # continued lines joined
    commands = [line for line in section.splitlines() if line.startswith("baton sessions ")]
    assert len(commands) == 4, commands
    header = next(line for line in section.splitlines() if line.startswith("SESSION "))
    sid = await idle_session(stack)
    asking = await idle_session(stack, "ask my name")
    env = {
        **env_of(tmp_path),
        "BATON_INGRESS_ADDR": stack.addr(stack.ingress),
        "BATON_TLS_CA": str(stack.pki.ca_path),
        "SESSION": sid,
    }
    outputs = []
    for command in commands:
        script = f'baton() {{ "{sys.executable}" -m baton_runtime.cli "$@"; }}; {command}'
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", script, cwd=ROOT, env={**os.environ, **env},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT)
        assert proc.returncode == 0, (command, err.decode())
        outputs.append(out.decode())
    table = outputs[0].splitlines()
    assert table[0].split() == header.split()
    assert sorted(row.split()[0] for row in table[1:]) == sorted([sid, asking])
    assert [json.loads(line)["session_id"] for line in outputs[1].splitlines()] == [asking]
    assert json.loads(outputs[2]) == as_json(await get_session(stack, sid))
    assert "--order-by 'oldest_unconsumed_age desc'" in commands[3]
    assert [row.split()[0] for row in outputs[3].splitlines()[1:]] == []  # nothing waits


async def test_create_makes_a_session_and_a_repeat_finds_it(stack: Stack, tmp_path: Path) -> None:
    env = env_of(tmp_path)
    run = await cli("create", "--alias", "ticket-9", "--request-id", "cr-1", *flags(stack), env=env)
    assert run.code == 0, run.err
    words = run.out.split()
    assert words[:2] == ["created:", "session"] and words[-1] == stack.deployment_id, run.out
    sid = words[2]
    view = await get_session(stack, sid)
    assert view.session_id == sid and "slack:ticket-9" in view.aliases
    run = await cli("create", "--request-id", "cr-1", "-o", "json", *flags(stack), env=env)
    assert run.code == 0, run.err
    assert json.loads(run.out) == {
        "session_id": sid,
        "created": False,
        "deployment_id": stack.deployment_id,
    }
    run = await cli("create", "--timeout", "-1", *flags(stack), env=env)
    assert run.code == sessions.EXIT_USAGE, run


async def test_answer_approves_denies_and_answers_a_question(stack: Stack, tmp_path: Path) -> None:
    """The request id and the prompt are on the input.requested line of
    `sessions events`; `sessions answer` approves, refuses or answers it."""
    from tests.procs import eventually
    from tests.test_cli_commands import event_texts

    env = env_of(tmp_path)
    sid = await stack.create()

    async def requested(text: str) -> str:
        """Send `text`; the id of the input request it leads to."""
        await stack.send(sid, text)

        async def pending() -> str | None:
            view = await get_session(stack, sid)
            return str(view.pending_inputs[0].request_id) if view.pending_inputs else None

        return await eventually(pending, f"an input request after {text!r}", 30)

    async def found(what: str, test: Callable[[s.Event], bool]) -> None:
        async def probe() -> bool:
            return any(test(e) for e in await stack.events(sid, follow=False))

        await eventually(probe, what, 30)

    request = await requested("transfer 5")
    lines = await event_texts(stack, sid, env)
    (asked,) = [line for line in lines if "input.requested" in line]
    assert f"approval {request}" in asked and 'for transfer({"amount":"5"})' in asked, asked
    run = await cli("answer", sid, request, "--approve", *flags(stack), env=env)
    assert run.code == 0, run.err
    assert run.out.startswith(f"approval of {request} accepted: session {sid}, inbox seq 1")
    await found("the approved transfer", lambda e: e.text == "The result is transferred 5.")

    request = await requested("transfer 7")
    run = await cli("answer", sid, request, "--deny", "-o", "json", *flags(stack), env=env)
    assert run.code == 0, run.err
    assert json.loads(run.out)["receipt"]["session_id"] == sid
    await found(
        "the refused transfer",
        lambda e: e.tool_result.name == "transfer" and e.tool_result.is_error,
    )

    request = await requested("ask my name")
    lines = await event_texts(stack, sid, env)
    assert any(f'question {request} "What is your name?"' in line for line in lines), lines
    run = await cli("answer", sid, request, "--text", "Ada", *flags(stack), env=env)
    assert run.code == 0, run.err
    assert run.out.startswith(f"answer of {request} accepted")
    await found("the answered question", lambda e: e.text == "Nice to meet you, Ada.")

    run = await cli("answer", sid, request, *flags(stack), env=env)  # no verdict, no text
    assert run.code == sessions.EXIT_USAGE and "--approve, --deny or --text" in run.err, run
    run = await cli("answer", sid, request, "--approve", "--deny", *flags(stack), env=env)
    assert run.code == sessions.EXIT_USAGE, run
