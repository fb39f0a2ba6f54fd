"""anchor configuration: flags, then env, then defaults."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baton_runtime.anchor.horizon import DEFAULT_KEEP_EVENTS, StreamPolicy
from baton_runtime.anchor.segments.objects import check_url
from baton_runtime.anchor.segments.schedule import DEFAULT_IDLE_SECONDS
from baton_runtime.anchor.segments.sweep import DEFAULT_GRACE_SECONDS
from baton_runtime.common.config import Setting, StoreServiceConfig, as_float, as_int
from baton_runtime.common.limits import LIVE_FOLLOWER_BYTES

WEEK = 7 * 24 * 3600


@dataclass(frozen=True)
class AnchorConfig(StoreServiceConfig):
    retention_seconds: float = float(WEEK)
    retention_sweep_seconds: float = 30.0
    # A live session's stream keeps at least this many events and every
    # event younger than this (services/anchor/horizon.py).
    stream_retention_events: int = DEFAULT_KEEP_EVENTS
    stream_retention_seconds: float = float(WEEK)
    # Where sealed segments of sessions' streams and histories go
    # (services/anchor/segments/); "": nowhere, every log stays in etcd.
    object_store: str = ""
    seal_idle_seconds: float = DEFAULT_IDLE_SECONDS
    object_grace_seconds: float = DEFAULT_GRACE_SECONDS
    # Bytes of live items one follower may have waiting before the oldest
    # are dropped (services/anchor/live.py); not a flag: tests set it lower.
    live_follower_bytes: int = LIVE_FOLLOWER_BYTES

    @property
    def stream_policy(self) -> StreamPolicy:
        return StreamPolicy(self.stream_retention_events, self.stream_retention_seconds)

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> AnchorConfig:
        listen = Setting(
            "--listen", "BATON_ANCHOR_LISTEN", "host:port to serve on", "127.0.0.1:50053"
        )
        retention = (
            Setting(
                "--finalized-retention",
                "BATON_FINALIZED_RETENTION",
                "seconds a finalized session's keys are kept before they are deleted",
                str(WEEK),
            ),
            Setting(
                "--retention-sweep",
                "BATON_RETENTION_SWEEP",
                "seconds between sweeps of the retention index, and between rounds of the "
                "sweep of live sessions' stream horizons",
                "30",
            ),
            Setting(
                "--stream-retention-events",
                "BATON_STREAM_RETENTION_EVENTS",
                "a live session's stream keeps at least its last N events (at least 1)",
                str(DEFAULT_KEEP_EVENTS),
            ),
            Setting(
                "--stream-retention",
                "BATON_STREAM_RETENTION",
                "a live session's stream keeps every event younger than this many seconds "
                "(0: the event count alone decides)",
                str(WEEK),
            ),
        )
        objects = (
            Setting(
                "--object-store",
                "BATON_OBJECT_STORE",
                "URL of the object store that sealed segments of sessions' streams and "
                "histories go to: s3://bucket/prefix, gs://, az://, file:///path; credentials "
                "and endpoint from the store's environment variables (AWS_ENDPOINT_URL, "
                "AWS_ACCESS_KEY_ID, ...), never in the URL. Empty: none, everything stays in etcd",
                "",
            ),
            Setting(
                "--seal-idle",
                "BATON_SEAL_IDLE",
                "seconds a session is quiet before its stream's and history's tails are sealed "
                "whole",
                str(DEFAULT_IDLE_SECONDS),
            ),
            Setting(
                "--object-orphan-grace",
                "BATON_OBJECT_ORPHAN_GRACE",
                "seconds an object nothing refers to is kept before the sweep deletes it "
                "(and how often the sweep walks the store)",
                str(DEFAULT_GRACE_SECONDS),
            ),
        )
        shared, values = cls.read(
            "baton_runtime.anchor", listen, (*retention, *objects), argv, environ
        )
        store = values["object_store"].strip()
        return cls(
            **shared,
            retention_seconds=as_float(values, "finalized_retention"),
            retention_sweep_seconds=as_float(values, "retention_sweep", minimum=0.05),
            stream_retention_events=as_int(values, "stream_retention_events", minimum=1),
            stream_retention_seconds=as_float(values, "stream_retention"),
            object_store=check_url(store) if store else "",
            seal_idle_seconds=as_float(values, "seal_idle", minimum=0.05),
            object_grace_seconds=as_float(values, "object_orphan_grace", minimum=1.0),
        )
