"""Watching a prefix of etcd: creating a watch (bounded, never abandoned
half-way), opening it before the read a follower starts from
(`watch_then_read`), and following a range across etcd failures
(`follow_range`, docs/etcd.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aetcd
import structlog
from aetcd import rtypes

from baton_runtime.common import retry
from baton_runtime.common.errors import (
    Reason,
    Unavailable,
)
from baton_runtime.common.etcd.client import EtcdClient
from baton_runtime.common.etcd.failures import store_unavailable
from baton_runtime.common.observability import metrics
from baton_runtime.common.tasks import mark_retrieved

log = structlog.get_logger("baton.etcd")


async def open_watch(client: EtcdClient, prefix: bytes, *, puts_only: bool = False) -> Any:
    """A watch of `prefix` from the current revision on. Open it *before*
    reading the range a follower starts from, and hand it to `follow_range`:
    etcd serves a watch created at a past revision from its "unsynced" group,
    caught up by a loop every 100 ms, so a watch opened after the read (at
    read revision + 1, with writes in between) can stall new events for up to
    that long. This one is in sync from the start; the read covers the rest. With
    `puts_only`, etcd leaves deletions out (see `_filters`)."""
    try:
        return await create_watch(client, prefix, **_filters(puts_only))
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

    def __init__(self, client: EtcdClient, prefix: bytes, watch: Any, *, puts_only: bool) -> None:
        self._client = client
        self._prefix = prefix
        self._puts_only = puts_only
        self.watch: Any = watch

    def events(self, start_revision: int) -> AsyncIterator[Any]:
        """Events from `start_revision` (the read's revision + 1) on; the
        watch belongs to the returned generator from now."""
        watch, self.watch = self.watch, None
        return follow_range(
            self._client, self._prefix, start_revision, first_watch=watch, puts_only=self._puts_only
        )


@contextlib.asynccontextmanager
async def watch_then_read(
    client: EtcdClient, prefix: bytes, *, puts_only: bool = False
) -> AsyncIterator[Follower]:
    """Open a watch of `prefix` now (see `open_watch`); the body reads its
    range, then follows with `follower.events(read revision + 1)`. A watch the
    body never followed is cancelled on the way out."""
    watch = await open_watch(client, prefix, puts_only=puts_only)
    follower = Follower(client, prefix, watch, puts_only=puts_only)
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
    puts_only: bool = False,
) -> AsyncIterator[Any]:
    """Watch `prefix` from `start_revision`, resuming after etcd failures.

    Yields raw watch events in revision order, never one twice: a resumed watch
    starts at the last delivered event's mod_revision + 1, and etcd never splits
    one revision across responses. `first_watch` (from `open_watch`, opened
    before the read that ended at `start_revision` - 1) is used first; its
    events the read already covered are skipped. It belongs to this generator
    from then on. A compacted resume point raises Unavailable so the caller
    re-reads from its own cursor. `puts_only`: no deletions (`_filters`).
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
                watch = await create_watch(
                    client, prefix, start_revision=next_revision, **_filters(puts_only)
                )
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


def _filters(puts_only: bool) -> dict[str, Any]:
    """etcd's NODELETE filter for `puts_only`: etcd leaves deletions out, and
    sends no response whose events were all deletions. For followers to whom
    a deleted key means nothing, such as an inbox whose consumed entries each
    commit deletes."""
    return {"kind": rtypes.EventKind.PUT} if puts_only else {}
