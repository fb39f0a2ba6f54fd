"""Identifiers and their validation: sessions, runs, tokens, deployments."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import time

from baton_runtime.common.errors import InvalidArgument, Reason

SESSION_PREFIX = "ses_"
INBOX_NAMESPACE = "session"
MAX_HOOKS_PER_SESSION = 256

_SESSION_RE = re.compile(r"^ses_[0-9a-z]{26}$")
_CHANNEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_RAW_TOKEN_RE = re.compile(r"^[A-Za-z0-9._@+=-]{1,200}$")
_ID_RE = re.compile(r"^[A-Za-z0-9._:@+=-]{1,128}$")
_DEPLOYMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


BRIEF_CHARS = 40


def brief(value: str, limit: int = BRIEF_CHARS) -> str:
    """A bad value as an error message may quote it: its repr, cut to a short
    prefix (and its length) so a refusal never echoes an oversize input."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def _b32(data: bytes) -> str:
    return base64.b32encode(data).decode().lower().rstrip("=")


def _ulid_like() -> str:
    millis = int(time.time() * 1000).to_bytes(6, "big")
    return _b32(millis + os.urandom(10))[:26]


def new_session_id() -> str:
    return SESSION_PREFIX + _ulid_like()


def session_id_for_request(channel: str, request_id: str) -> str:
    """A stable session id for an idempotent create: same key, same session."""
    digest = hashlib.sha256(f"{channel}\0{request_id}".encode()).digest()
    return SESSION_PREFIX + _b32(digest)[:26]


def new_run_id() -> str:
    return "run_" + _ulid_like()


def run_id_for(key: str) -> str:
    """A run id derived from a unique key (e.g. a handoff id): a retried
    request names the same run."""
    return "run_" + _b32(hashlib.sha256(key.encode()).digest())[:26]


def child_session_id(parent_session_id: str, tool_call_id: str) -> str:
    """The child session a parent's tool call starts: derived, so a step run
    again (its owner died before committing it) finds the same child."""
    digest = hashlib.sha256(f"child\0{parent_session_id}\0{tool_call_id}".encode()).digest()
    return SESSION_PREFIX + _b32(digest)[:26]


def new_handoff_id() -> str:
    return "ho_" + _ulid_like()


def new_delivery_id() -> str:
    return "dlv_" + _ulid_like()


def new_request_id() -> str:
    return "req_" + _ulid_like()


def inbox_token(session_id: str) -> str:
    """The stable inbox token, derived from the session id."""
    return f"{INBOX_NAMESPACE}:{session_id}"


def alias_token(channel: str, raw: str) -> str:
    return f"{channel}:{raw}"


def validate_session_id(session_id: str) -> str:
    if not _SESSION_RE.match(session_id):
        raise InvalidArgument(
            Reason.INVALID_SESSION_ID,
            f"session id {brief(session_id)} is not of the form ses_<26 base32 chars>",
        )
    return session_id


def validate_channel(channel: str) -> str:
    if not _CHANNEL_RE.match(channel) or channel == INBOX_NAMESPACE:
        raise InvalidArgument(
            Reason.INVALID_FIELD, f"channel {brief(channel)} must match {_CHANNEL_RE.pattern}"
        )
    return channel


def validate_raw_token(raw: str) -> str:
    if not _RAW_TOKEN_RE.match(raw):
        raise InvalidArgument(
            Reason.INVALID_TOKEN,
            f"token {brief(raw)} must be 1-200 characters of [A-Za-z0-9._@+=-]",
        )
    return raw


def split_token(token: str) -> tuple[str, str]:
    """Split and validate `<namespace>:<raw>`; the inbox namespace is `session`."""
    namespace, sep, raw = token.partition(":")
    if not sep or not _CHANNEL_RE.match(namespace):
        raise InvalidArgument(
            Reason.INVALID_TOKEN, f"token {brief(token)} must be <namespace>:<raw token>"
        )
    if namespace == INBOX_NAMESPACE:
        validate_session_id(raw)
    else:
        validate_raw_token(raw)
    return namespace, raw


def validate_id(value: str, field: str) -> str:
    if not _ID_RE.match(value):
        raise InvalidArgument(
            Reason.INVALID_FIELD,
            f"{field} {brief(value)} must be 1-128 characters of [A-Za-z0-9._:@+=-]",
        )
    return value


def validate_deployment_id(deployment_id: str) -> str:
    """Exact build identity. Empty and `latest` are refused everywhere."""
    if not deployment_id:
        raise InvalidArgument(Reason.INVALID_DEPLOYMENT_ID, "deployment id is required")
    if deployment_id.lower() == "latest":
        raise InvalidArgument(
            Reason.INVALID_DEPLOYMENT_ID,
            "deployment id 'latest' is refused: name an exact deployment",
        )
    if not _DEPLOYMENT_RE.match(deployment_id):
        raise InvalidArgument(
            Reason.INVALID_DEPLOYMENT_ID,
            f"deployment id {brief(deployment_id)} must match {_DEPLOYMENT_RE.pattern}",
        )
    return deployment_id
