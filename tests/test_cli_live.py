"""`baton sessions events --follow` shows the running step's live items
(docs/design.md "Live items", docs/cli.md): in text the answer grows on a
`~    live.text` line while the step runs, then its committed
`message.completed` line follows; in jsonl a `{"live": LiveBatch}` line
beside the event lines; `--no-live` prints the committed events alone.

The CLI runs as a process against a real in-process stack; the fixture
model writes "stream <n> <ms>" as n deltas over ms milliseconds."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from google.protobuf import json_format

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from tests.stack import Stack
from tests.test_cli_sessions import CLI_TIMEOUT, ROOT, cli, env_of, flags

ANSWER = "".join(f"{i}," for i in range(40))  # what "stream 40 2000" answers


async def follower(
    stack: Stack, sid: str, head: int, tmp_path: Path, *extra: str
) -> asyncio.subprocess.Process:
    """`baton sessions events SID --follow EXTRA...` from the last event
    before `head`, once it has printed it (so it follows from then on)."""
    env = {**os.environ, **env_of(tmp_path)}
    env.pop("PYTHONUNBUFFERED", None)  # the CLI flushes what it prints itself
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton_runtime.cli", "sessions", "events", sid, "--follow",
        "--from", str(head - 1), *extra, *flags(stack),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), CLI_TIMEOUT)
    except BaseException:
        await stop(proc)
        raise
    assert "waiting" in line.decode().lower(), line
    return proc


async def read_until(proc: asyncio.subprocess.Process, marker: str, snapshots: list[str]) -> str:
    """Read what the process prints, as it comes, until `marker` is in it;
    `snapshots` gets the output so far after every read."""
    assert proc.stdout is not None
    out = ""
    async with asyncio.timeout(CLI_TIMEOUT):
        while marker not in out:
            chunk = await proc.stdout.read(4096)
            assert chunk, f"the follower ended early: {out!r}"
            out += chunk.decode()
            snapshots.append(out)
    return out


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def ready_session(stack: Stack) -> tuple[str, int]:
    """A session with one settled turn, and its stream head."""
    sid = await stack.create()
    await stack.send(sid, "hello")
    return sid, len(await stack.events(sid, until=1))


async def test_text_shows_the_answer_growing_then_its_commit(stack: Stack, tmp_path: Path) -> None:
    sid, head = await ready_session(stack)
    proc = await follower(stack, sid, head, tmp_path)
    try:
        send = await cli("send", sid, "stream 40 2000", *flags(stack), env=env_of(tmp_path))
        assert send.code == 0, send.err
        snapshots: list[str] = []
        out = await read_until(proc, "session.waiting", snapshots)
    finally:
        await stop(proc)
    lines = out.splitlines()
    # The step's start at once, the answer on one growing line, then the commit.
    starts = [i for i, line in enumerate(lines) if line.startswith("~    step.started")]
    [grown] = [i for i, line in enumerate(lines) if line.startswith("~    live.text")]
    [answer] = [i for i, line in enumerate(lines) if "message.completed" in line]
    assert starts and starts[0] < grown < answer, lines
    assert any(line.startswith("~    turn.started") for line in lines[: starts[0]]), lines
    text = lines[grown].split(maxsplit=2)[2]
    assert ANSWER.startswith(text) and len(text) > len(ANSWER) // 2, text
    assert json.dumps(ANSWER) in lines[answer]
    # It grew while the step ran: printed in parts before the commit was.
    partial = [
        snap for snap in snapshots if "~    live.text" in snap and "message.completed" not in snap
    ]
    assert len(partial) >= 2, snapshots
    assert not all(snap.endswith("\n") for snap in partial)  # the line still open


async def test_jsonl_prints_live_batches_as_their_own_lines(stack: Stack, tmp_path: Path) -> None:
    sid, head = await ready_session(stack)
    proc = await follower(stack, sid, head, tmp_path, "-o", "jsonl")
    try:
        send = await cli("send", sid, "stream 40 2000", *flags(stack), env=env_of(tmp_path))
        assert send.code == 0, send.err
        out = await read_until(proc, "EVENT_KIND_SESSION_WAITING", [])
    finally:
        await stop(proc)
    parsed = [json.loads(line) for line in out.splitlines()]
    batches = [json_format.ParseDict(p["live"], s.LiveBatch()) for p in parsed if "live" in p]
    events = [json_format.ParseDict(p, s.Event()) for p in parsed if "live" not in p]
    assert batches, parsed
    committed = await stack.events(sid, start_seq=head, follow=False)
    assert events == committed[: len(events)]
    assert {b.step.base_seq for b in batches} <= {e.seq for e in events}
    text = "".join(i.text for b in batches for i in b.items if i.kind == s.LIVE_KIND_TEXT)
    assert ANSWER.startswith(text) and len(text) > len(ANSWER) // 2, text
    first_answer_line = next(
        i for i, p in enumerate(parsed) if p.get("kind") == "EVENT_KIND_MESSAGE_COMPLETED"
    )
    assert all("live" not in p for p in parsed[first_answer_line:])  # superseded: none after
    offsets = [i.offset for b in batches for i in b.items]
    assert offsets == list(range(len(offsets)))


async def test_no_live_prints_the_committed_events_alone(stack: Stack, tmp_path: Path) -> None:
    sid, head = await ready_session(stack)
    proc = await follower(stack, sid, head, tmp_path, "-o", "jsonl", "--no-live")
    try:
        send = await cli("send", sid, "stream 20 500", *flags(stack), env=env_of(tmp_path))
        assert send.code == 0, send.err
        out = await read_until(proc, "EVENT_KIND_SESSION_WAITING", [])
    finally:
        await stop(proc)
    parsed = [json.loads(line) for line in out.splitlines()]
    assert all("live" not in p for p in parsed), parsed
    committed = await stack.events(sid, start_seq=head, follow=False)
    assert [json_format.ParseDict(p, s.Event()) for p in parsed] == committed[: len(parsed)]
