"""Assembly of the anchor server."""

from __future__ import annotations

import structlog

from baton_runtime._proto.baton.anchor.v1 import anchor_pb2, anchor_pb2_grpc
from baton_runtime._proto.baton.anchor.v1 import segments_pb2 as spb
from baton_runtime.anchor.config import AnchorConfig
from baton_runtime.anchor.history import EtcdHistory, HistoryStore
from baton_runtime.anchor.horizon import StreamHorizon, StreamRetirement
from baton_runtime.anchor.journal import Journal
from baton_runtime.anchor.live import LiveHub
from baton_runtime.anchor.retention import Retention
from baton_runtime.anchor.segments.history import SegmentedHistory
from baton_runtime.anchor.segments.log import SegmentLog
from baton_runtime.anchor.segments.objects import open_store
from baton_runtime.anchor.segments.schedule import SealSchedule
from baton_runtime.anchor.segments.seal import LogSealer
from baton_runtime.anchor.segments.sweep import ObjectSweep
from baton_runtime.anchor.segments.trim import SegmentedStreamRetirement
from baton_runtime.anchor.servicer import AnchorServicer
from baton_runtime.common.etcd.health import StoreHealth
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.etcd.members import connect_checked
from baton_runtime.common.etcd.scope import DeploymentScope
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.rpc.server import GrpcServer, ServiceBinding, build_server

SERVICE_NAME = anchor_pb2.DESCRIPTOR.services_by_name["AnchorService"].full_name

log = structlog.get_logger("baton.anchor")


class _Sealed:
    """The object store's parts of one anchor (services/anchor/segments/)."""

    def __init__(self, config: AnchorConfig, store: Store, keys: Keys) -> None:
        objects = open_store(config.object_store)
        grace = config.object_grace_seconds
        self.events = SegmentLog(objects, keys, spb.SEGMENT_LOG_EVENTS)
        self.history_log = SegmentLog(objects, keys, spb.SEGMENT_LOG_HISTORY)
        self.schedule = SealSchedule(
            LogSealer(store, self.events, grace_seconds=grace),
            LogSealer(store, self.history_log, grace_seconds=grace),
            idle_seconds=config.seal_idle_seconds,
        )
        self.retirement = SegmentedStreamRetirement(store, keys, self.events)
        self.history = SegmentedHistory(EtcdHistory(store, keys), store, self.history_log)
        self.sweep = ObjectSweep(
            store, keys, objects, (self.events, self.history_log), grace_seconds=grace
        )
        # The URL holds no credential (check_url refuses one).
        log.info("sealing logs into the object store", url=objects.url)


async def create_server(config: AnchorConfig) -> GrpcServer:
    # An external cluster's members are judged too: refuse a known-bad release.
    store = await connect_checked(config.etcd)
    keys = Keys(config.etcd.prefix)
    sealed = _Sealed(config, store, keys) if config.object_store else None
    retirement: StreamRetirement | None = sealed.retirement if sealed else None
    history: HistoryStore | None = sealed.history if sealed else None
    horizon = StreamHorizon(
        store,
        keys,
        config.stream_policy,
        retirement,
        segments=sealed.events if sealed else None,
        swept=sealed.schedule.swept if sealed else None,
        interval_seconds=config.retention_sweep_seconds,
    )
    journal = Journal(
        store,
        keys,
        history,
        retention_seconds=config.retention_seconds,
        horizon=horizon,
        segments=sealed.events if sealed else None,
        sealer=sealed.schedule if sealed else None,
    )
    hub = LiveHub(config.live_follower_bytes)
    servicer = AnchorServicer(journal, DeploymentScope(store, keys), hub)
    server = build_server(
        config.listen,
        [
            ServiceBinding(
                SERVICE_NAME,
                lambda srv: anchor_pb2_grpc.add_AnchorServiceServicer_to_server(servicer, srv),
            )
        ],
        service="anchor",
        security=config.tls,
        capacity=config.capacity,
        health_listen=config.health_listen,
        metrics_listen=config.metrics_listen,
    )
    retention = Retention(
        store,
        keys,
        interval_seconds=config.retention_sweep_seconds,
        objects=sealed.sweep if sealed else None,
    )
    server.background += [StoreHealth(store, server.set_serving).run, retention.run, horizon.run]
    if sealed is not None:
        server.background += [sealed.schedule.run, sealed.sweep.run]
    else:
        log.info("no object store (--object-store): every log stays in etcd")
    server.app = journal
    server.on_stop.append(store.close)
    return server
