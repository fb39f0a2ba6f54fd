"""Secrets rotate while sessions run: certificates (a whole CA rotation) and
channel API keys (SIGHUP). No session loses a command, established streams
carry on, and what was retired stops working."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import Reason
from baton_runtime.common.rpc.status_map import from_rpc_error
from baton_runtime.common.security.identity import Role
from baton_runtime.common.security.pki import LocalPki
from baton_runtime.common.security.tls import load_material
from baton_runtime.ingress.api_keys import ApiKeys
from tests.procs import ProcessStack, answered, check_history, eventually
from tests.stack import SLACK, Stack, start_stack, stop_stack

K = s.EventKind
# Clients of the stack check their certificate files this often.
CHECK_EVERY = 0.2
# Long enough for every client to have re-read its files.
SETTLE = CHECK_EVERY * 4


async def follow(stack: Stack, session_id: str, out: list[s.Event]) -> None:
    """One StreamEvents call for the whole test (never reopened)."""
    call = stack.ingress_stub.StreamEvents(
        ingress_pb.StreamEventsRequest(session_id=session_id, follow=True), metadata=SLACK
    )
    try:
        async for response in call:
            out.extend(response.events)
    finally:
        call.cancel()


def gateway(address: str, ca: bytes) -> ingress_pb2_grpc.IngressServiceStub:
    return ingress_pb2_grpc.IngressServiceStub(
        grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca))
    )


async def health(address: str, material: tuple[bytes, bytes, bytes]) -> None:
    ca, key, cert = material
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    async with grpc.aio.secure_channel(address, credentials) as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


async def test_a_ca_rotation_while_sessions_run_loses_nothing(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    pki = LocalPki(tmp_path / "pki", check_every=CHECK_EVERY)
    stack = await start_stack(etcd_endpoint, pki=pki, park_after=None)
    seen: list[s.Event] = []
    follower: asyncio.Task[None] | None = None
    try:
        old = load_material(pki.files(Role.OPERATOR))
        session_id = await stack.create()
        follower = asyncio.create_task(follow(stack, session_id, seen))
        receipts = []

        async def send_and_wait(text: str) -> None:
            receipts.append((await stack.send(session_id, text)).receipt.seq)

            async def done() -> bool:
                return answered(seen, len(receipts))

            await eventually(done, f"{text!r} answered", 20)

        await send_and_wait("before")

        pki.trust_new_ca()  # 1. everyone trusts old and new
        await asyncio.sleep(SETTLE)
        await send_and_wait("trusting both")
        pki.reissue()  # 2. every certificate from the new CA
        await asyncio.sleep(SETTLE)
        await send_and_wait("new certificates")
        pki.retire_old_ca()  # 3. the old CA is no longer trusted
        await asyncio.sleep(SETTLE)
        await send_and_wait("old CA retired")

        new = load_material(pki.files(Role.OPERATOR))
        # Servers picked the new files up for new connections...
        await health(stack.addr(stack.hooks), (new.ca, new.key, new.cert))
        created = await gateway(stack.addr(stack.ingress), new.ca).CreateSession(
            ingress_pb.CreateSessionRequest(), metadata=SLACK, timeout=10
        )
        # ... a whole new session went through every hop (owner -> hooks,
        # owner -> anchor, ingress -> owner) on reloaded client channels ...
        assert created.created
        fresh = await stack.send(created.session_id, "on fresh channels")
        assert fresh.receipt.seq == 0
        # ... and what was retired is refused: the old CA's client
        # certificate, a gateway that trusts only the old CA.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health(stack.addr(stack.hooks), (new.ca, old.key, old.cert))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as untrusted:
            await gateway(stack.addr(stack.ingress), old.ca).CreateSession(
                ingress_pb.CreateSessionRequest(), metadata=SLACK, timeout=5
            )
        assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE

        # The follower's one call (opened before the rotation) saw every
        # command processed once, in order; it never ended.
        assert not follower.done()
        check_history(seen, receipts)
        texts = [e.text for e in seen if e.kind == K.EVENT_KIND_MESSAGE_RECEIVED]
        assert texts == ["before", "trusting both", "new certificates", "old CA retired"]
    finally:
        if follower is not None:
            follower.cancel()
        await stop_stack(stack)


def test_a_half_written_rotation_keeps_the_previous_certificate(tmp_path: Path) -> None:
    """A watcher that sees a certificate without its key (or a key of
    another certificate) keeps what it has until the pair matches."""
    from baton_runtime.common.security.tls import CertificateWatcher

    pki = LocalPki(tmp_path / "pki")
    files = pki.files(Role.HOOKS)
    watcher = CertificateWatcher(files, check_every=0.0)
    before = watcher.material
    other = LocalPki(tmp_path / "other").files(Role.HOOKS)
    Path(files.cert).write_bytes(Path(other.cert).read_bytes())  # cert updated, key not yet
    assert not watcher.refresh()
    assert watcher.material == before
    Path(files.key).write_bytes(Path(other.key).read_bytes())
    assert watcher.refresh()
    assert watcher.material.cert == Path(other.cert).read_bytes()


# -- API keys -------------------------------------------------------------------------

OLD_KEY = "slack-old-key-0001-Hq8r"
NEW_KEY = "slack-new-key-0002-Tb5m"


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def test_api_keys_rotate_on_sighup_while_sessions_run(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    """The ingress process re-reads its key file on SIGHUP: the new key works,
    the old one stops at once, a broken file keeps the current keys, and every
    command accepted meanwhile is processed once, in order."""
    stack = ProcessStack(etcd_endpoint, tmp_path, lease_ttl=5)
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"slack={OLD_KEY}\n")
    stack.workdir.mkdir(parents=True, exist_ok=True)
    stack.start(owners=1)
    # The stack's ingress reads tmp_path/api-keys (ProcessStack's key file).
    assert (tmp_path / "api-keys") == key_file
    c = stack.clients()
    try:
        created = await c.ingress.CreateSession(
            ingress_pb.CreateSessionRequest(), metadata=bearer(OLD_KEY), timeout=10
        )
        sid = created.session_id
        receipts = []
        for i in range(3):
            sent = await c.ingress.SendMessage(
                ingress_pb.SendMessageRequest(session_id=sid, text=f"old {i}"),
                metadata=bearer(OLD_KEY),
                timeout=10,
            )
            receipts.append(sent.receipt.seq)

        key_file.write_text(f"slack=sha256:{_sha(NEW_KEY)}  # rotated\n")
        assert stack.ingress is not None
        os.kill(stack.ingress.pid, signal.SIGHUP)

        async def old_refused() -> bool:
            try:
                await c.ingress.SendMessage(
                    ingress_pb.SendMessageRequest(session_id=sid, text="probe"),
                    metadata=bearer(OLD_KEY),
                    timeout=5,
                )
            except grpc.aio.AioRpcError as exc:
                return from_rpc_error(exc).reason == Reason.INVALID_API_KEY
            receipts.append(-1)  # accepted before the reload: counted below
            return False

        await eventually(old_refused, "the old key refused", 20)
        for i in range(3):
            sent = await c.ingress.SendMessage(
                ingress_pb.SendMessageRequest(session_id=sid, text=f"new {i}"),
                metadata=bearer(NEW_KEY),
                timeout=10,
            )
            receipts.append(sent.receipt.seq)

        key_file.write_text("this is not a key file\n")  # a broken rotation
        os.kill(stack.ingress.pid, signal.SIGHUP)
        await asyncio.sleep(0.5)
        sent = await c.ingress.SendMessage(
            ingress_pb.SendMessageRequest(session_id=sid, text="still new"),
            metadata=bearer(NEW_KEY),
            timeout=10,
        )
        receipts.append(sent.receipt.seq)

        accepted = len(receipts)
        events = await c.wait_events(sid, lambda ev: answered(ev, accepted), "all answered")
        check_history(events, list(range(accepted)))
        log = (tmp_path / "ingress.log").read_text()
        assert "API keys reloaded" in log and "keeping the previous keys" in log
        assert OLD_KEY not in log and NEW_KEY not in log  # never logged
    finally:
        await c.close()
        stack.stop()


async def test_an_api_key_file_replaced_in_place_is_reloaded_without_sighup(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    """A Kubernetes secret volume swaps its files (a symlink to a new
    directory) and nothing sends SIGHUP: ingress notices the change at its
    certificate check interval. A broken replacement keeps the keys."""
    secret = tmp_path / "secret"
    (secret / "v1").mkdir(parents=True)
    (secret / "v1" / "api-keys").write_text(f"slack={OLD_KEY}\n")
    (secret / "..data").symlink_to("v1")
    (secret / "api-keys").symlink_to("..data/api-keys")
    stack = await start_stack(etcd_endpoint, api_keys=ApiKeys(str(secret / "api-keys")))

    def swap(version: str, text: str) -> None:
        (secret / version).mkdir()
        (secret / version / "api-keys").write_text(text)
        (secret / "..data.new").symlink_to(version)
        os.replace(secret / "..data.new", secret / "..data")

    async def works(key: str) -> bool:
        try:
            await stack.ingress_stub.CreateSession(
                ingress_pb.CreateSessionRequest(), metadata=bearer(key), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            assert from_rpc_error(exc).reason == Reason.INVALID_API_KEY
            return False
        return True

    try:
        assert await works(OLD_KEY) and not await works(NEW_KEY)
        swap("v2", f"slack=sha256:{_sha(NEW_KEY)}\n")

        async def rotated() -> bool:
            return await works(NEW_KEY) and not await works(OLD_KEY)

        await eventually(rotated, "the new key file read without SIGHUP", 20)
        swap("v3", "not a key file\n")
        await asyncio.sleep(SETTLE)
        assert await works(NEW_KEY)
    finally:
        await stop_stack(stack)


def _sha(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


def test_key_files_hold_hashes_or_strong_keys() -> None:
    from baton_runtime.common.config import ConfigError
    from baton_runtime.ingress.api_keys import hash_line, parse_key_lines

    good = parse_key_lines(f"# comment\nslack={OLD_KEY}\nweb=sha256:{_sha(NEW_KEY)}\n")
    assert set(good.values()) == {"slack", "web"}
    keys = ApiKeys(keys=good)
    assert keys.channel_of(OLD_KEY) == "slack" and keys.channel_of(NEW_KEY) == "web"
    assert keys.channel_of(OLD_KEY[:-1]) is None
    assert hash_line("web", NEW_KEY) == f"web=sha256:{_sha(NEW_KEY)}"
    for bad, why in [
        ("slack=short-key-1", "at least 20"),
        ("slack=aaaaaaaaaaaaaaaaaaaaaaaaaaaa", "random"),
        ("slack=0000000000111111111122222", "random"),
        ("Slack=" + OLD_KEY, "channel"),
        ("slack", "expected"),
        (f"slack={OLD_KEY}\nweb={OLD_KEY}", "already granted"),
        ("# nothing", "grants no API key"),
    ]:
        with pytest.raises(ConfigError, match=why) as info:
            parse_key_lines(bad, "keys")
        # A refusal names the line, never the key.
        assert OLD_KEY not in str(info.value)


def test_hash_key_reads_the_key_from_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`baton hash-key CHANNEL < key` prints the key file line (never takes
    the key from argv)."""
    import io

    from baton_runtime.cli.__main__ import main as baton_main

    monkeypatch.setattr("sys.stdin", io.StringIO(NEW_KEY + "\n"))
    with pytest.raises(SystemExit) as exited:
        baton_main(["hash-key", "web"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"web=sha256:{_sha(NEW_KEY)}"
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    with pytest.raises(SystemExit) as refused:
        baton_main(["hash-key", "web"])
    assert refused.value.code == 2
