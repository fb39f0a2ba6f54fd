"""The object store over S3 (issue 34): a real S3-protocol server (moto's
standalone server, started on loopback by the test) with anchor's endpoint
and credentials from the standard environment variables, as in production.

The store stopped under load: turns go on, reads of the tails go on, a
sealed segment answers UNAVAILABLE (retryable), `baton_sealing_stalled` says
sealing waits, and once the store is back sealing resumes by itself and
every event reads back. (30 s under the `slow` marker; a short outage by
default.)"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import aetcd
import boto3
import grpc
import pytest
from moto.server import ThreadedMotoServer

from baton_runtime.anchor.segments import index as ix
from baton_runtime.common.errors import Reason
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.observability import metrics
from baton_runtime.common.rpc.status_map import error_reason
from tests.procs import eventually
from tests.scrape import in_process
from tests.stack import Stack, start_stack, stop_stack
from tests.test_segments import (
    LiveFollower,
    corrupt_bytes,
    index_of,
    quiet,
    read_bytes,
)

BUCKET = "baton-test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Server:
    """moto's S3 server on a loopback port; stopped and started again on
    the same port it keeps its objects (they live in this process)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def client(self) -> object:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    try:
        server.client().create_bucket(Bucket=BUCKET)  # type: ignore[attr-defined]
        # What an operator sets (deploy/: the credentials secret): the
        # library reads them; nothing goes in the URL.
        for name, value in {
            "AWS_ENDPOINT_URL": server.endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }.items():
            monkeypatch.setenv(name, value)
        yield server
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def on_s3(etcd_endpoint: str, **anchor: object) -> AsyncIterator[Stack]:
    stack = await start_stack(
        etcd_endpoint,
        anchor_options={
            "object_store": f"s3://{BUCKET}/baton",
            "seal_idle_seconds": 0.3,
            "retention_sweep_seconds": 0.2,
            **anchor,
        },
        hooks_options={"dedupe_window_seconds": 1.0},
    )
    try:
        yield stack
    finally:
        await stop_stack(stack)


def listed(server: S3Server, sid: str) -> list[str]:
    found = server.client().list_objects_v2(Bucket=BUCKET, Prefix="baton/")  # type: ignore[attr-defined]
    return [o["Key"] for o in found.get("Contents", []) if f"/s/{sid}/" in o["Key"]]


async def test_sessions_seal_into_s3_and_read_back(
    etcd_endpoint: str, raw: aetcd.Client, s3: S3Server
) -> None:
    async with on_s3(etcd_endpoint) as stack:
        keys = Keys(stack.etcd.prefix)
        sid = await stack.create()
        follower = LiveFollower(stack, sid)
        try:
            for turn in range(1, 31):
                await stack.send(sid, f"turn {turn}")
                await follower.until_waits(turn)
            await quiet(raw, keys, sid)
            live = list(follower.events)
        finally:
            await follower.close()
        objects = listed(s3, sid)
        index = await index_of(raw, keys, sid, "ev")
        assert len([o for o in objects if "/ev/" in o]) == len(index.recent) >= 2
        assert any("/h/" in o for o in objects)
        assert await read_bytes(stack, sid) == live
        # A corrupt object in the bucket: DATA_LOSS, OBJECT_CORRUPT.
        first = sorted(o for o in objects if "/ev/" in o)[0]
        body = s3.client().get_object(Bucket=BUCKET, Key=first)["Body"].read()  # type: ignore[attr-defined]
        s3.client().put_object(Bucket=BUCKET, Key=first, Body=corrupt_bytes(body))  # type: ignore[attr-defined]
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await read_bytes(stack, sid)
        assert lost.value.code() == grpc.StatusCode.DATA_LOSS
        assert error_reason(lost.value) == Reason.OBJECT_CORRUPT


def stalled() -> float:
    return in_process(metrics.SEALING_STALLED, "baton_sealing_stalled")


@pytest.mark.parametrize("outage", [pytest.param(30.0, marks=pytest.mark.slow), 3.0])
async def test_the_store_stopped_under_load_pauses_sealing_and_it_resumes(
    etcd_endpoint: str, raw: aetcd.Client, s3: S3Server, outage: float
) -> None:
    async with on_s3(etcd_endpoint) as stack:
        keys = Keys(stack.etcd.prefix)
        sid = await stack.create()
        follower = LiveFollower(stack, sid)
        try:
            turn = 0
            for turn in range(1, 21):
                await stack.send(sid, f"turn {turn}")
                await follower.until_waits(turn)
            await quiet(raw, keys, sid)
            sealed_before = (await index_of(raw, keys, sid, "ev")).sealed_below
            s3.stop()
            stopped = asyncio.get_running_loop().time()
            # Turns go on while the store is down; sealing pauses and says so.
            while asyncio.get_running_loop().time() - stopped < outage or not stalled():
                turn += 1
                await stack.send(sid, f"turn {turn}")
                await follower.until_waits(turn)
                await asyncio.sleep(0.35)  # quiet long enough to be sealed
            assert stalled() == 1
            assert (await index_of(raw, keys, sid, "ev")).sealed_below == sealed_before
            # The tail reads; a sealed segment is UNAVAILABLE, retryable.
            head = len(follower.events)
            assert len(await read_bytes(stack, sid, sealed_before)) == head - sealed_before
            with pytest.raises(grpc.aio.AioRpcError) as down:
                await read_bytes(stack, sid, 0)
            assert down.value.code() == grpc.StatusCode.UNAVAILABLE
            assert error_reason(down.value) == Reason.OBJECT_STORE_UNAVAILABLE
            s3.start()

            async def resumed() -> bool:
                index = await index_of(raw, keys, sid, "ev")
                return not stalled() and index.sealed_below == head - 1

            await eventually(resumed, "sealing resumed after the outage", timeout=60)
            live = list(follower.events)
        finally:
            await follower.close()
        assert await read_bytes(stack, sid) == live
        assert ix.live(list((await index_of(raw, keys, sid, "ev")).recent), 0)
