"""Recording the RPC metrics (`RPC`, an `RpcMeter`) cheaply: only in a
process that serves metrics, with label children cached."""

from __future__ import annotations

from typing import Any

from baton_runtime.common.observability.metrics import (
    RPC_CLIENT_HANDLED,
    RPC_CLIENT_STREAM_RECEIVED,
    RPC_CLIENT_STREAM_SENT,
    RPC_CLIENT_STREAMS_OPENED,
    RPC_SERVER_HANDLED,
    RPC_SERVER_SECONDS,
    RPC_SERVER_STREAM_SENT,
)


class RpcMeter:
    """RPC metrics, recorded only in a process that serves them (a server
    with `--metrics-listen`): with metrics off the interceptor and the client
    base do one attribute check per call. Label children are cached, so a
    call costs a dict lookup and an increment (and an observation)."""

    def __init__(self) -> None:
        self.enabled = False
        self._served: dict[tuple[str, str], Any] = {}
        self._timed: dict[str, Any] = {}
        self._called: dict[tuple[str, str, str], Any] = {}
        self._sent: dict[str, Any] = {}
        self._received: dict[tuple[str, str], Any] = {}
        self._opened: dict[tuple[str, str], Any] = {}
        self._sent_on_stream: dict[tuple[str, str], Any] = {}

    def served(self, method: str, code: str, seconds: float) -> None:
        key = (method, code)
        counter = self._served.get(key)
        if counter is None:
            counter = self._served[key] = RPC_SERVER_HANDLED.labels(method, code)
        counter.inc()
        timer = self._timed.get(method)
        if timer is None:
            timer = self._timed[method] = RPC_SERVER_SECONDS.labels(method)
        timer.observe(seconds)

    def called(self, target: str, method: str, code: str) -> None:
        key = (target, method, code)
        counter = self._called.get(key)
        if counter is None:
            counter = self._called[key] = RPC_CLIENT_HANDLED.labels(target, method, code)
        counter.inc()

    def sent(self, method: str) -> None:
        """One message of a server stream sent."""
        counter = self._sent.get(method)
        if counter is None:
            counter = self._sent[method] = RPC_SERVER_STREAM_SENT.labels(method)
        counter.inc()

    def opened(self, target: str, method: str) -> None:
        """One server stream opened to `target`."""
        key = (target, method)
        counter = self._opened.get(key)
        if counter is None:
            counter = self._opened[key] = RPC_CLIENT_STREAMS_OPENED.labels(target, method)
        counter.inc()

    def received(self, target: str, method: str) -> None:
        """One message of a server stream received from `target`."""
        key = (target, method)
        counter = self._received.get(key)
        if counter is None:
            counter = self._received[key] = RPC_CLIENT_STREAM_RECEIVED.labels(target, method)
        counter.inc()

    def sent_on_stream(self, target: str, method: str) -> None:
        """One message sent to `target` on a bidirectional stream."""
        key = (target, method)
        counter = self._sent_on_stream.get(key)
        if counter is None:
            counter = self._sent_on_stream[key] = RPC_CLIENT_STREAM_SENT.labels(target, method)
        counter.inc()


RPC = RpcMeter()
