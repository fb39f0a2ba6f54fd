"""The console's settings and the framing of its live parts, without a
browser or a stack (tests/test_console.py drives both)."""

from __future__ import annotations

import pytest

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime.common.config import ConfigError
from baton_runtime.console.app import offered_actions, sse
from baton_runtime.console.config import ConsoleConfig

TOKEN = "t" * 24


def test_loopback_needs_nothing_else() -> None:
    for listen in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080"):
        assert ConsoleConfig(listen=listen).listen == listen


def test_listening_elsewhere_needs_the_setting_and_a_token() -> None:
    with pytest.raises(ConfigError, match="--allow-remote"):
        ConsoleConfig(listen="0.0.0.0:8080", token=TOKEN)
    with pytest.raises(ConfigError, match="BATON_CONSOLE_TOKEN"):
        ConsoleConfig(listen="0.0.0.0:8080", allow_remote=True)
    with pytest.raises(ConfigError, match="at least 16"):
        ConsoleConfig(listen="0.0.0.0:8080", allow_remote=True, token="short")
    assert ConsoleConfig(listen="0.0.0.0:8080", allow_remote=True, token=TOKEN).allow_remote


def test_secrets_come_from_the_environment_only() -> None:
    environ = {
        "BATON_PLAINTEXT": "1",
        "BATON_CONSOLE_TOKEN": TOKEN,
        "BATON_API_KEY": "key",
        "BATON_CONSOLE_INGRESSES": "dep-1=127.0.0.1:1,dep-2=127.0.0.1:2",
    }
    config = ConsoleConfig.load(["--listen", "127.0.0.1:9"], environ)
    assert (config.token, config.api_key) == (TOKEN, "key")
    assert config.ingresses == {"dep-1": "127.0.0.1:1", "dep-2": "127.0.0.1:2"}
    with pytest.raises(SystemExit):  # no such flag
        ConsoleConfig.load(["--token", TOKEN], environ)
    with pytest.raises(ConfigError, match="DEP=host:port"):
        ConsoleConfig.load([], {**environ, "BATON_CONSOLE_INGRESSES": "127.0.0.1:1"})


def test_server_sent_events_carry_multi_line_data() -> None:
    assert sse("events", "<li>a</li>\n<li>b</li>", "7") == (
        "event: events\nid: 7\ndata: <li>a</li>\ndata: <li>b</li>\n\n"
    )
    assert sse("end", "") == "event: end\ndata: \n\n"


def test_a_session_page_offers_what_its_status_allows() -> None:
    assert offered_actions(pb.SESSION_STATUS_IDLE) == ["reset"]
    assert offered_actions(pb.SESSION_STATUS_RUNNING) == ["cancel", "reset"]
    assert offered_actions(pb.SESSION_STATUS_STALLED) == ["resume", "reset"]
    assert offered_actions(pb.SESSION_STATUS_FINALIZED) == []
