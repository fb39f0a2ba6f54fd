"""What etcd's failures mean to Baton: the details etcd answers with, and
the one mapping of a failed etcd call onto Baton's domain errors
(docs/etcd.md)."""

from __future__ import annotations

import grpc
from grpc.aio import AioRpcError

from baton_runtime.common.errors import (
    Aborted,
    BatonError,
    Internal,
    Reason,
    ResourceExhausted,
    Unavailable,
)

_TRANSIENT = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN,
)

NOSPACE_DETAIL = "database space exceeded"
"""What etcd says (RESOURCE_EXHAUSTED) to every write while its NOSPACE alarm
is raised: the backend reached --quota-backend-bytes."""

COMPACTED_DETAIL = "required revision has been compacted"

LEASE_NOT_FOUND_DETAIL = "requested lease not found"
"""What etcd says (NOT_FOUND) to a txn whose taken branch puts a key under a
lease it does not know (expired, revoked, or lost with a restored backup)."""

CORRUPT_DETAIL = "corrupt cluster"
"""What etcd says (DATA_LOSS, "etcdserver: corrupt cluster") to every write
while its CORRUPT alarm is raised: a corruption check found members whose
data differ (reads are still served)."""


def store_full() -> ResourceExhausted:
    return ResourceExhausted(
        Reason.STORE_FULL,
        "etcd's database is full (NOSPACE alarm); writes resume once an operator has "
        "compacted, defragmented and disarmed the alarm (docs/storage.md, etcd space)",
    )


def store_corrupt() -> Unavailable:
    """Unavailable, not a kind of its own: nothing was accepted, and the
    same write succeeds once the operator has repaired etcd, so callers that
    wait out an unavailable store (an owner's commit, an activation) wait
    this out too instead of failing the session; the reason says why."""
    return Unavailable(
        Reason.STORE_CORRUPT,
        "etcd reports corrupt data (CORRUPT alarm) and refuses every write; they resume once "
        "an operator has replaced the bad member from a healthy one and disarmed the alarm "
        "(docs/etcd.md: corruption)",
    )


def map_rpc_error(exc: AioRpcError) -> BatonError:
    """The domain error for an etcd call that failed."""
    details = exc.details() or ""
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and NOSPACE_DETAIL in details:
        return store_full()
    if exc.code() == grpc.StatusCode.DATA_LOSS:  # CORRUPT_DETAIL; any data loss is that
        return store_corrupt()
    if exc.code() == grpc.StatusCode.NOT_FOUND and LEASE_NOT_FOUND_DETAIL in details:
        # Nothing was written; the caller grants a new lease and retries.
        return Aborted(Reason.LEASE_NOT_FOUND, "etcd does not know the lease a key was put under")
    if exc.code() == grpc.StatusCode.OUT_OF_RANGE and COMPACTED_DETAIL in details:
        return Aborted(Reason.REVISION_COMPACTED, "the read revision was compacted; read again")
    if exc.code() in _TRANSIENT:
        return store_unavailable(exc)
    return Internal(Reason.STORE_REJECTED, f"etcd refused the transaction: {details[:200]}")


def store_unavailable(exc: BaseException) -> Unavailable:
    return Unavailable(Reason.STORE_UNAVAILABLE, f"etcd unavailable: {type(exc).__name__}")
