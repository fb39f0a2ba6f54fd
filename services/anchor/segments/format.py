"""The objects anchor writes, byte for byte, and their names.

An object is written once and never overwritten:

    b"BATONSG1"                 8 bytes, the format
    sha256(payload)             32 bytes
    payload                     a SegmentObject (protos/baton/anchor/v1/segments.proto)

A segment's payload holds its records (serialized events or history
entries, consecutive from `first`); a directory's holds the refs of older
segments. The ref etcd keeps of an object (`SegmentRef`) repeats its size
and checksum, so a reader checks the object against what was recorded, not
only against itself: missing, cut short, swapped or bit-flipped, it is
refused (`Corrupt`), never half-read.

Names: `{root}s/{sid}/{log}/{first:020d}-{nonce:016x}` for a segment and
`{root}s/{sid}/{log}/dir-{nonce:016x}` for a directory, `root` being the
etcd key prefix without its leading slash (so stacks sharing a bucket keep
apart), `log` "ev" or "h", and `nonce` random: a writer that crashed, or lost
a race, leaves an object nobody refers to, which the sweep collects.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from baton_runtime._proto.baton.anchor.v1 import segments_pb2 as pb

MAGIC = b"BATONSG1"
_HEADER = len(MAGIC) + 32

LOG_NAMES = {pb.SEGMENT_LOG_EVENTS: "ev", pb.SEGMENT_LOG_HISTORY: "h"}


class Corrupt(Exception):
    """An object that is not what its ref says (the message says how)."""


def new_nonce() -> int:
    return secrets.randbits(64)


def encode_object(payload: pb.SegmentObject) -> tuple[bytes, bytes]:
    """The object's bytes and the SHA-256 of its payload."""
    body = payload.SerializeToString()
    digest = hashlib.sha256(body).digest()
    return MAGIC + digest + body, digest


def segment_object(
    log: pb.SegmentLog.ValueType, session_id: str, first: int, records: Sequence[bytes]
) -> pb.SegmentObject:
    return pb.SegmentObject(log=log, session_id=session_id, first=first, records=records)


def directory_object(
    log: pb.SegmentLog.ValueType, session_id: str, refs: Sequence[pb.SegmentRef]
) -> pb.SegmentObject:
    return pb.SegmentObject(
        log=log, session_id=session_id, first=refs[0].first if refs else 0, segments=refs
    )


def decode_object(
    raw: bytes,
    ref: pb.SegmentRef,
    log: pb.SegmentLog.ValueType,
    session_id: str,
    *,
    directory: bool,
) -> pb.SegmentObject:
    """The payload of `raw`, checked against `ref` (size, checksum, log,
    session, range); Corrupt otherwise."""
    if len(raw) != ref.size:
        raise Corrupt(f"{len(raw)} bytes, {ref.size} recorded")
    if raw[: len(MAGIC)] != MAGIC:
        raise Corrupt("not a segment object (bad magic)")
    digest = raw[len(MAGIC) : _HEADER]
    body = raw[_HEADER:]
    if digest != ref.sha256 or hashlib.sha256(body).digest() != digest:
        raise Corrupt("checksum mismatch")
    payload = pb.SegmentObject()
    try:
        payload.ParseFromString(body)
    except DecodeError as exc:
        raise Corrupt("payload cannot be parsed") from exc
    if payload.log != log or payload.session_id != session_id or payload.first != ref.first:
        raise Corrupt("the object belongs to another log, session or range")
    if directory:
        if not payload.segments or payload.segments[-1].end != ref.end:
            raise Corrupt("the directory does not cover its recorded range")
    elif len(payload.records) != ref.end - ref.first:
        raise Corrupt(f"{len(payload.records)} records, {ref.end - ref.first} recorded")
    return payload


@dataclass(frozen=True)
class ObjectNames:
    """Object paths under one etcd key prefix."""

    root: str

    @classmethod
    def of(cls, etcd_prefix: str) -> ObjectNames:
        return cls(etcd_prefix.lstrip("/"))

    def sessions_prefix(self) -> str:
        return f"{self.root}s/"

    def session_prefix(self, session_id: str) -> str:
        return f"{self.root}s/{session_id}/"

    def segment(self, session_id: str, log: pb.SegmentLog.ValueType, ref: pb.SegmentRef) -> str:
        name = f"{ref.first:020d}-{ref.nonce:016x}"
        return f"{self.session_prefix(session_id)}{LOG_NAMES[log]}/{name}"

    def directory(self, session_id: str, log: pb.SegmentLog.ValueType, ref: pb.SegmentRef) -> str:
        return f"{self.session_prefix(session_id)}{LOG_NAMES[log]}/dir-{ref.nonce:016x}"

    def session_of(self, path: str) -> str | None:
        """The session id an object path belongs to (None: not one of ours)."""
        prefix = self.sessions_prefix()
        if not path.startswith(prefix):
            return None
        session_id, slash, _ = path[len(prefix) :].partition("/")
        return session_id if slash and session_id else None
