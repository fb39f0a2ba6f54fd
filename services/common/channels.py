"""Client channels between Baton services: keepalive, bounded calls."""

from __future__ import annotations

import grpc

DEFAULT_CALL_TIMEOUT = 10.0

_OPTIONS = [
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
]


def open_channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=_OPTIONS)
