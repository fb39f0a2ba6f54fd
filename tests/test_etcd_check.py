"""Baton's etcd consistency probe (services/cli/system/etcd_check.py) on a real
three-member cluster: the members' hashes at one common revision agree,
under writes and once the cluster is idle and compacted at its very
revision; a raised alarm makes the report (and `baton etcd check`'s exit
code) say not ok; the comparison itself names the member that differs."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import pytest
from aetcd import rpc

from baton_runtime.cli.__main__ import main
from baton_runtime.cli.system.etcd_check import (
    ConsistencyReport,
    MemberHash,
    check_members,
    members_consistent,
)
from baton_runtime.cli.system.etcd_process import EtcdCluster
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.ops import op_put
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.security.tls import Security
from tests import certs


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    running = certs.start_etcd_cluster(3)
    try:
        yield running
    finally:
        running.stop()


def root() -> Security:
    return Security(files=certs.etcd_tls().root)


async def write(cluster: EtcdCluster, count: int) -> None:
    store = Store(make_client(cluster.endpoint, 5, certs.etcd_security()), 5)
    await store.connect()
    prefix = f"{certs.TEST_PREFIX}check/{uuid.uuid4().hex}/"
    try:
        for i in range(count):
            await store.txn([], [op_put(f"{prefix}{i:04d}".encode(), b"v" * 100)])
    finally:
        await store.close()


def test_the_members_agree_and_the_report_says_so(cluster: EtcdCluster) -> None:
    asyncio.run(write(cluster, 50))
    report = members_consistent(cluster.endpoint, certs.etcd_tls().root)
    assert report.consistent and report.alarm_free and report.ok, report.text()
    assert len(report.members) == 3
    assert len({m.hash for m in report.members}) == 1
    assert {m.endpoint.removeprefix("https://") for m in report.members} == {
        m.endpoint for m in cluster.members
    }
    assert all(m.version and not m.known_bad for m in report.members), report.text()
    assert report.revision >= 50
    assert "consistent at revision" in report.text()


async def test_the_probe_runs_under_writes_and_inside_an_event_loop(cluster: EtcdCluster) -> None:
    writer = asyncio.create_task(write(cluster, 300))
    try:
        while not writer.done():
            report = await check_members(cluster.endpoint, root())
            assert report.consistent, report.text()
        # The blocking form, called from inside a running loop.
        assert members_consistent(cluster.endpoint, certs.etcd_tls().root).ok
    finally:
        await writer


async def test_an_idle_cluster_compacted_at_its_revision_still_compares(
    cluster: EtcdCluster,
) -> None:
    await write(cluster, 5)
    client = await certs.etcd_root_client(cluster.endpoint)
    try:
        status = await client.maintenancestub.Status(rpc.StatusRequest(), timeout=5)
        await client.compact(status.header.revision, physical=True)
    finally:
        await client.close()
    report = await check_members(cluster.endpoint, root())
    assert report.consistent, report.text()
    assert report.revision == status.header.revision
    assert {m.compact_revision for m in report.members} == {status.header.revision}


def run_cli(
    cluster: EtcdCluster, capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, object]]:
    tls = certs.etcd_tls().root
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "etcd",
                "check",
                "--etcd",
                cluster.members[1].endpoint,
                "--etcd-cert",
                tls.cert,
                "--etcd-key",
                tls.key,
                "--etcd-ca",
                tls.ca,
                "-o",
                "json",
            ]
        )
    code = exited.value.code
    assert isinstance(code, int)
    return code, json.loads(capsys.readouterr().out)


async def alarm(cluster: EtcdCluster, action: int) -> None:
    client = await certs.etcd_root_client(cluster.members[2].endpoint)
    try:
        status = await client.maintenancestub.Status(rpc.StatusRequest(), timeout=5)
        request = rpc.AlarmRequest(
            action=action, memberID=status.header.member_id, alarm=rpc.CORRUPT
        )
        await client.maintenancestub.Alarm(request, timeout=5)
    finally:
        await client.close()


def test_baton_etcd_check_exits_non_zero_while_an_alarm_is_raised(
    cluster: EtcdCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    code, body = run_cli(cluster, capsys)
    assert code == 0 and body["ok"] is True, body
    asyncio.run(alarm(cluster, rpc.AlarmRequest.ACTIVATE))
    try:
        code, body = run_cli(cluster, capsys)
        assert code == 1, body
        assert body["consistent"] is True and body["alarm_free"] is False
        assert [a["alarm"] for a in body["alarms"]] == ["CORRUPT"]  # type: ignore[union-attr]
    finally:
        asyncio.run(alarm(cluster, rpc.AlarmRequest.DEACTIVATE))
    code, _ = run_cli(cluster, capsys)
    assert code == 0


def test_baton_etcd_check_without_credentials_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("BATON_ETCD_CERT", "BATON_ETCD_KEY", "BATON_ETCD_CA"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["etcd", "check", "--etcd", "127.0.0.1:1"])
    assert exited.value.code == 2
    assert "root's etcd certificate" in capsys.readouterr().err


def member(name: str, hash_: int | None, compact: int = 10, error: str = "") -> MemberHash:
    return MemberHash(
        name, hash(name) & 0xFFFF, f"https://{name}:2379", "3.4.23", "", 20, hash_, compact, error
    )


def test_the_comparison_names_the_member_that_differs() -> None:
    agree = ConsistencyReport(20, (member("a", 1), member("b", 1), member("c", 1)))
    assert agree.consistent and agree.ok
    differ = ConsistencyReport(20, (member("a", 1), member("b", 7), member("c", 1)))
    assert not differ.consistent and not differ.ok
    assert [m.name for m in differ.disagreeing()] == ["b"]
    assert "b " in differ.text() and "<- differs" in differ.text()
    # A member that gave no hash, or hashes over different compactions, do not compare.
    silent = ConsistencyReport(20, (member("a", 1), member("b", None, error="UNAVAILABLE")))
    assert not silent.consistent
    skewed = ConsistencyReport(20, (member("a", 1, compact=10), member("b", 1, compact=12)))
    assert not skewed.consistent
    alarmed = ConsistencyReport(20, (member("a", 1),), alarms=((1, "NOSPACE"),))
    assert alarmed.consistent and not alarmed.ok
