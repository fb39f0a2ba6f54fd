"""Approval links a person can click: the session, the request and the
verdict, signed with the gateway's secret (HMAC-SHA256), so that nobody
forges one for another session or request."""

from __future__ import annotations

import hashlib
import hmac


def signature(secret: bytes, session_id: str, request_id: str, verdict: str) -> str:
    message = f"{session_id}\0{request_id}\0{verdict}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def link(base_url: str, secret: bytes, session_id: str, request_id: str, verdict: str) -> str:
    """`{base}/decide/{session}/{request}/{approve|deny}?sig=...`"""
    sig = signature(secret, session_id, request_id, verdict)
    return f"{base_url}/decide/{session_id}/{request_id}/{verdict}?sig={sig}"


def valid(secret: bytes, session_id: str, request_id: str, verdict: str, sig: str) -> bool:
    return hmac.compare_digest(signature(secret, session_id, request_id, verdict), sig)
