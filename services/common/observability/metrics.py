"""Every Prometheus metric Baton exposes, defined once, and which ones each
service exposes (`SERVICE_METRICS`, `registry_for`; docs/metrics.md).

Conventions (Prometheus'): base units in the name (`_seconds`, `_bytes`),
counters end in `_total`, histograms rather than summaries (they aggregate
across replicas), and no label takes a per-session, per-run or per-delivery
value: every label below has a small fixed set of values (an RPC method, a
status code, an outcome, a deployment id).

The metric objects live in this module and are shared by every server of a
process; `SERVICE_METRICS` says which ones each service exposes, so a hooks
scrape shows no owner metrics. Gauges that are a view of state held
elsewhere (the owner's sessions, the live instances in etcd) are computed at
scrape time by a collector or a refresh hook, never kept up to date by hand.
`rpc_metrics` records the RPC metrics; `metrics_endpoint` serves them all;
`build_info` is the one gauge of the build itself.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.registry import Collector

from baton_runtime.common.observability.build_info import BuildInfo

# No `_created` series next to every counter and histogram: they double the
# series count and say only when the process started.
disable_created_metrics()  # type: ignore[no-untyped-call]  # (untyped in prometheus-client)

# Seconds: from a fast RPC (sub-millisecond) to a long model call or stream.
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

# -- every server and client (services/common/rpc/interceptor.py, rpc_client.py) ---

RPC_SERVER_HANDLED = Counter(
    "baton_rpc_server_handled_total",
    "RPCs this server finished, by full method name and status code",
    ["method", "code"],
    registry=None,
)
RPC_SERVER_SECONDS = Histogram(
    "baton_rpc_server_handling_seconds",
    "Time from a call's admission to its end (a server stream: its whole life)",
    ["method"],
    buckets=_SECONDS,
    registry=None,
)
RPC_CLIENT_HANDLED = Counter(
    "baton_rpc_client_handled_total",
    "RPCs this process made to another Baton service, by target service, method and code",
    ["target", "method", "code"],
    registry=None,
)
RPC_SERVER_STREAM_SENT = Counter(
    "baton_rpc_server_stream_messages_sent_total",
    "Messages this server sent on server-streaming RPCs, by full method name "
    "(a unary call is one message each way and is counted by handled_total)",
    ["method"],
    registry=None,
)
RPC_CLIENT_STREAMS_OPENED = Counter(
    "baton_rpc_client_streams_opened_total",
    "Server-streaming RPCs this process opened to another Baton service, by target service "
    "and method (handled_total counts them when they end)",
    ["target", "method"],
    registry=None,
)
RPC_CLIENT_STREAM_RECEIVED = Counter(
    "baton_rpc_client_stream_messages_received_total",
    "Messages this process received on server-streaming RPCs of another Baton service, "
    "by target service and method",
    ["target", "method"],
    registry=None,
)
RPC_CLIENT_STREAM_SENT = Counter(
    "baton_rpc_client_stream_messages_sent_total",
    "Messages this process sent on bidirectional streams to another Baton service "
    "(multiplexed calls, several per message when batched), by target service and method",
    ["target", "method"],
    registry=None,
)
_SLOTS = "of the client's in-flight bound (call_slots.py), by target service"
RPC_CLIENT_IN_FLIGHT = Gauge(
    "baton_rpc_client_calls_in_flight", f"Calls in flight {_SLOTS}", ["target"], registry=None
)
RPC_CLIENT_WAITING = Gauge(
    "baton_rpc_client_calls_waiting",
    f"Calls waiting, unsent, for a slot {_SLOTS}",
    ["target"],
    registry=None,
)
RPC_CLIENT_SLOT_WAIT_SECONDS = Histogram(
    "baton_rpc_client_slot_wait_seconds",
    f"How long a call that had to wait for a slot waited, {_SLOTS}",
    ["target"],
    buckets=_SECONDS,
    registry=None,
)

# -- hooks and anchor: etcd (services/common/etcd_*.py, store_health.py) -------

ETCD_TXN_SECONDS = Histogram(
    "baton_etcd_txn_seconds",
    "etcd calls, by operation (txn_read, txn_write, lease_grant, lease_keepalive, "
    "lease_revoke, alarm), failures included",
    ["op"],
    buckets=_SECONDS,
    registry=None,
)
ETCD_ERRORS = Counter(
    "baton_etcd_errors_total",
    "etcd calls that failed, by the reason they were mapped to "
    "(STORE_UNAVAILABLE, STORE_FULL, ...)",
    ["reason"],
    registry=None,
)
ETCD_GROUPED_REQUESTS = Counter(
    "baton_etcd_grouped_requests_total",
    "etcd requests that carried several write transactions as nested ones (group commit, "
    "--etcd-group-commit)",
    registry=None,
)
ETCD_GROUPED_TXNS = Counter(
    "baton_etcd_grouped_txns_total",
    "Write transactions that rode a grouped request (each also counted in "
    "baton_etcd_txn_seconds{op=txn_write})",
    registry=None,
)
ETCD_WATCHES_CREATED = Counter(
    "baton_etcd_watches_created_total",
    "etcd watches this process created (each one request and one answer on the watch stream)",
    registry=None,
)
ETCD_WATCH_RESPONSES = Counter(
    "baton_etcd_watch_responses_total",
    "Watch responses from etcd that carried events (etcd may batch several events, "
    "always whole revisions, into one)",
    registry=None,
)
ETCD_WATCH_EVENTS = Counter(
    "baton_etcd_watch_events_total",
    "Events received on this process's etcd watches (one per key put or deleted)",
    registry=None,
)
STORE_SERVING = Gauge(
    "baton_store_serving",
    "1 while etcd takes writes (health SERVING), 0 while it is unreachable or full",
    registry=None,
)

# -- hooks (services/hooks/) ------------------------------------------------------

INBOX_APPENDS = Counter(
    "baton_inbox_appends_total",
    "Commands offered to an inbox (ResumeHook), by outcome: accepted, duplicate "
    "(a delivery id seen before), refused",
    ["outcome"],
    registry=None,
)
INBOX_APPEND_BATCH = Histogram(
    "baton_inbox_append_batch_size",
    "Commands appended to one session's inbox by one etcd transaction",
    buckets=(1, 2, 4, 8, 16, 32, 64),
    registry=None,
)
DEDUPE_LEASES_GRANTED = Counter(
    "baton_dedupe_leases_granted_total",
    "etcd leases granted for the deduplication window (delivery ids, handoff records), "
    "by reason: rotated (a new time bucket), missing (etcd no longer knew the last one)",
    ["reason"],
    registry=None,
)
TRANSFERS = Counter(
    "baton_transfers_total",
    "Transfer calls (handoff, drain, adoption moves), by outcome: moved, replayed, refused",
    ["outcome"],
    registry=None,
)
LIVE_INSTANCES = Gauge(
    "baton_live_instances",
    "Owner instances with a live lease, by deployment (read from etcd at scrape "
    "time: every hooks replica reports the same numbers, aggregate with max)",
    ["deployment"],
    registry=None,
)
OLDEST_UNANSWERED = Gauge(
    "baton_oldest_unanswered_seconds",
    "How long the oldest message (command) not consumed yet has waited, over every session "
    "of a deployment (its ownership index), whoever holds it: running, stalled, parked or "
    "on an instance that died; 0 when none waits. Read from the inboxes every 15 s "
    "(services/hooks/unanswered.py): every hooks replica reports the same, aggregate with max",
    ["deployment"],
    registry=None,
)

# -- anchor (services/anchor/journal.py) -------------------------------------------

COMMIT_BYTES = Histogram(
    "baton_commit_bytes",
    "Size of a committed step: snapshot, events and history entries",
    buckets=(256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304),
    registry=None,
)
STREAM_FOLLOWERS = Gauge(
    "baton_stream_followers",
    "ReadEvents calls following a stream live right now",
    registry=None,
)
EVENTS_COMMITTED = Counter(
    "baton_events_committed_total",
    "Stream events committed (replayed commits not counted again)",
    registry=None,
)
STREAM_EVENTS_TRIMMED = Counter(
    "baton_stream_events_trimmed_total",
    "Stream events of live sessions deleted below their retention horizon "
    "(services/anchor/horizon.py)",
    registry=None,
)
STREAM_TRIM_BATCH_SECONDS = Histogram(
    "baton_stream_trim_batch_seconds",
    "One trim transaction (at most 512 events below a session's horizon), failures included",
    buckets=_SECONDS,
    registry=None,
)
INBOX_ENTRIES_DELETED = Counter(
    "baton_inbox_entries_deleted_total",
    "Consumed inbox entries deleted by the commits that consumed them",
    registry=None,
)

# -- anchor's object store (services/anchor/segments/) ----------------------------

OBJECT_STORE_SECONDS = Histogram(
    "baton_object_store_request_seconds",
    "One object store request (put, get, delete, list), failures included",
    ["op"],
    buckets=_SECONDS,
    registry=None,
)
OBJECT_STORE_ERRORS = Counter(
    "baton_object_store_errors_total",
    "Object store requests that failed (the store unreachable or refusing), by op",
    ["op"],
    registry=None,
)
SEGMENTS_SEALED = Counter(
    "baton_segments_sealed_total",
    "Segments of sessions' logs sealed into the object store, by log (events, history)",
    ["log"],
    registry=None,
)
SEALED_BYTES = Counter(
    "baton_sealed_bytes_total",
    "Bytes of records sealed into the object store, by log",
    ["log"],
    registry=None,
)
SEALING_STALLED = Gauge(
    "baton_sealing_stalled",
    "1 while sealing is paused because the object store fails (the tails in etcd grow), else 0",
    registry=None,
)
OBJECTS_CORRUPT = Counter(
    "baton_objects_corrupt_total",
    "Reads that found a sealed object missing or failing its checksum (DATA_LOSS), by log",
    ["log"],
    registry=None,
)
ORPHANS_DELETED = Counter(
    "baton_orphan_objects_deleted_total",
    "Objects no session refers to (a writer crashed before recording them, a session "
    "deleted) deleted by the sweep after the grace period",
    registry=None,
)

# -- owner (services/owner/) ------------------------------------------------------

TURNS = Counter(
    "baton_turns_total",
    "Turns settled and committed by this instance, by outcome: completed, cancelled, failed",
    ["outcome"],
    registry=None,
)
TURN_SECONDS = Histogram(
    "baton_turn_duration_seconds",
    "From a turn's start to its settling, for turns that started on this instance",
    buckets=_SECONDS,
    registry=None,
)
STEPS = Counter(
    "baton_steps_total",
    "Steps run (one model call and the tools it asked for)",
    registry=None,
)
MODEL_CALL_SECONDS = Histogram(
    "baton_model_call_seconds",
    "Model calls, failures included",
    buckets=_SECONDS,
    registry=None,
)
TOOL_CALL_SECONDS = Histogram(
    "baton_tool_call_seconds",
    "Tool calls run in the step, by outcome: ok, error (the tool raised), unknown (no such tool)",
    ["outcome"],
    buckets=_SECONDS,
    registry=None,
)
INBOX_WAIT_SECONDS = Histogram(
    "baton_inbox_wait_seconds",
    "From a command's acceptance by hooks (accepted_at) to its run dispatching it",
    buckets=_SECONDS,
    registry=None,
)
SESSIONS = "baton_sessions"
INBOX_OLDEST_UNCONSUMED = "baton_inbox_oldest_unconsumed_seconds"
DRAINING = "baton_draining"
HANDOFFS = Counter(
    "baton_handoffs_total",
    "Attempts to move a session to another deployment, by reason (trigger, drain) and "
    "outcome: moved, refused, uncertain (then settled), skipped (no checkpoint revision, "
    "no live target instance, registry lookup failed)",
    ["reason", "outcome"],
    registry=None,
)
HANDOFF_SKIPS = Counter(
    "baton_handoff_skips_total",
    "Handoff and drain attempts skipped before asking the target, by why: target_draining "
    "(an operator drains the target deployment: it takes no sessions), no_live_instance, "
    "registry_unavailable, revision_unknown",
    ["why"],
    registry=None,
)
HANDOFF_SECONDS = Histogram(
    "baton_handoff_duration_seconds",
    "From choosing the target instance to its answer (moved, refused or uncertain)",
    buckets=_SECONDS,
    registry=None,
)
TAKEOVERS = Counter(
    "baton_takeovers_total",
    "Sessions this instance took over: from a dead instance of its deployment, or from itself "
    "(a restarted process, or the reconciler finding a session no run holds)",
    registry=None,
)
RECONCILED = Counter(
    "baton_reconciled_sessions_total",
    "Sessions the reconciler found stuck under this instance and set going again: taken "
    "over from itself (taken_over: no run held it) or woken (woken: held parked while its "
    "bell had rung); each one is a lost wake-up, worth an alert",
    ["how"],
    registry=None,
)
for _how in ("taken_over", "woken"):
    RECONCILED.labels(_how)  # exposed at 0, so increase() sees the first one
PARKED_CLAIMS = Counter(
    "baton_parked_claims_total",
    "Quiet parked sessions of a dead instance (or of this instance's earlier process) "
    "taken over lazily, after the active ones: by the paced sweep (swept) or at once "
    "because input arrived for one (woken)",
    ["how"],
    registry=None,
)
PARKED_UNCLAIMED = "baton_parked_unclaimed_sessions"
RESTARTS = Counter(
    "baton_restarts_total",
    "Failed runs restarted (transient or deterministic failures; not the stalls)",
    registry=None,
)
RESUMES = Counter(
    "baton_resumes_total",
    "Stalled sessions an operator resumed (OwnerService.ResumeSession)",
    registry=None,
)
COMMITS = Counter(
    "baton_commits_total",
    "Step commits through anchor, by outcome: ok, fenced (another run owns the "
    "session), refused (invalid or over a limit)",
    ["outcome"],
    registry=None,
)

# -- ingress (services/ingress/) --------------------------------------------------

SENDS = Counter(
    "baton_sends_total",
    "Commands (messages and controls) delivered through this ingress, by outcome: "
    "accepted, duplicate, refused (a limit, or hooks said no)",
    ["outcome"],
    registry=None,
)
LIMIT_REFUSALS = Counter(
    "baton_limit_refusals_total",
    "Calls refused by a channel limit: sends_per_second, sessions_per_minute, follow_streams",
    ["limit"],
    registry=None,
)

_RPC = (
    RPC_SERVER_HANDLED,
    RPC_SERVER_SECONDS,
    RPC_CLIENT_HANDLED,
    RPC_SERVER_STREAM_SENT,
    RPC_CLIENT_STREAMS_OPENED,
    RPC_CLIENT_STREAM_RECEIVED,
    RPC_CLIENT_STREAM_SENT,
)
_CALL_SLOTS = (RPC_CLIENT_IN_FLIGHT, RPC_CLIENT_WAITING, RPC_CLIENT_SLOT_WAIT_SECONDS)
_STORE = (
    ETCD_TXN_SECONDS,
    ETCD_ERRORS,
    ETCD_GROUPED_REQUESTS,
    ETCD_GROUPED_TXNS,
    ETCD_WATCHES_CREATED,
    ETCD_WATCH_RESPONSES,
    ETCD_WATCH_EVENTS,
    STORE_SERVING,
)
SERVICE_METRICS: dict[str, tuple[Collector, ...]] = {
    "hooks": (
        *_RPC,
        *_STORE,
        INBOX_APPENDS,
        INBOX_APPEND_BATCH,
        DEDUPE_LEASES_GRANTED,
        TRANSFERS,
        LIVE_INSTANCES,
        OLDEST_UNANSWERED,
    ),
    "anchor": (
        *_RPC,
        *_STORE,
        COMMIT_BYTES,
        STREAM_FOLLOWERS,
        EVENTS_COMMITTED,
        STREAM_EVENTS_TRIMMED,
        STREAM_TRIM_BATCH_SECONDS,
        INBOX_ENTRIES_DELETED,
        OBJECT_STORE_SECONDS,
        OBJECT_STORE_ERRORS,
        SEGMENTS_SEALED,
        SEALED_BYTES,
        SEALING_STALLED,
        OBJECTS_CORRUPT,
        ORPHANS_DELETED,
    ),
    "owner": (
        *_RPC,
        *_CALL_SLOTS,
        TURNS,
        TURN_SECONDS,
        STEPS,
        MODEL_CALL_SECONDS,
        TOOL_CALL_SECONDS,
        INBOX_WAIT_SECONDS,
        HANDOFFS,
        HANDOFF_SKIPS,
        HANDOFF_SECONDS,
        TAKEOVERS,
        PARKED_CLAIMS,
        RECONCILED,
        RESTARTS,
        RESUMES,
        COMMITS,
    ),
    "ingress": (*_RPC, SENDS, LIMIT_REFUSALS),
}


def registry_for(service: str, deployment_id: str = "") -> CollectorRegistry:
    """A registry with what `service` exposes (see SERVICE_METRICS; a server
    of another name, e.g. a test's, exposes the RPC metrics)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(BuildInfo(deployment_id))
    for collector in SERVICE_METRICS.get(service, _RPC):
        registry.register(collector)
    return registry
