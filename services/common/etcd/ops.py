"""The raw pieces of an etcd transaction: compares, operations, and the
value of a one-key read (`txn.Txn` writes them as a sentence; `Store.txn`
takes them as they are)."""

from __future__ import annotations

from aetcd import rpc


def cmp_value(key: bytes, value: bytes) -> rpc.Compare:
    return rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.VALUE, value=value)


def cmp_absent(key: bytes) -> rpc.Compare:
    return rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, version=0)


def cmp_mod(key: bytes, revision: int) -> rpc.Compare:
    return rpc.Compare(
        key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, mod_revision=revision
    )


def cmp_none(key: bytes, range_end: bytes) -> rpc.Compare:
    """No key in [key, range_end) exists (etcd compares every key of a range,
    and an empty range as one absent key)."""
    return rpc.Compare(
        key=key,
        range_end=range_end,
        result=rpc.Compare.EQUAL,
        target=rpc.Compare.VERSION,
        version=0,
    )


def cmp_present(key: bytes) -> rpc.Compare:
    return rpc.Compare(key=key, result=rpc.Compare.GREATER, target=rpc.Compare.VERSION, version=0)


def op_put(key: bytes, value: bytes, lease: int = 0) -> rpc.RequestOp:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def op_get(
    key: bytes,
    range_end: bytes = b"",
    *,
    keys_only: bool = False,
    limit: int = 0,
    revision: int = 0,
    newest_first: bool = False,
) -> rpc.RequestOp:
    """A range read; `newest_first` sorts it by key, descending (with
    `limit`: the last keys of the range)."""
    request = rpc.RangeRequest(
        key=key, range_end=range_end, keys_only=keys_only, limit=limit, revision=revision
    )
    if newest_first:
        request.sort_order = rpc.RangeRequest.SortOrder.DESCEND
        request.sort_target = rpc.RangeRequest.SortTarget.KEY
    return rpc.RequestOp(request_range=request)


def op_delete(key: bytes, range_end: bytes = b"") -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, range_end=range_end))


def single_value(response: rpc.ResponseOp) -> bytes | None:
    """The value of a one-key get inside a txn, None when absent."""
    kvs = response.response_range.kvs
    return kvs[0].value if kvs else None
