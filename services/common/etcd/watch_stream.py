"""The one watch stream of an etcd client: aetcd 1.0's watcher with a
teardown that cannot deadlock and with each stream isolated from the next
(see `EtcdWatcher`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aetcd
from aetcd import rtypes
from aetcd import watcher as aetcd_watcher

from baton_runtime.common.observability import metrics


class EtcdWatcher(aetcd_watcher.Watcher):  # type: ignore[misc]  # aetcd is untyped: Any
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Unbounded (aetcd's holds 10): a cancel is queued under the lock,
        # also by the response reader itself. A full queue would stop that
        # reader; etcd, whose answers then pile up, stops reading requests,
        # and the queue never drains. At 10,000 watches opened and cancelled
        # that stalled every watch of hooks (docs/recovery.md). What it holds
        # is one small request per watch created or cancelled, sent on.
        self._request_queue = asyncio.Queue()

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
            self._request_queue = asyncio.Queue()  # (unbounded: see __init__)
            self._request_handler = None
        queue.put_nowait(None)  # ends the stream's requests
        if current is not None and current is not asyncio.current_task():
            current.cancel()  # never awaited: a cancelled grpc call may not end at once
        for callback in callbacks.values():
            await self._process_callback(callback, error)


async def _requests(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    while (request := await queue.get()) is not None:
        yield request
