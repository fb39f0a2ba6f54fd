"""Prometheus metrics (docs/metrics.md): the names, types and labels each
service exposes; the endpoint; and, over real processes, a conversation with
a takeover (kill -9 of an owner), an upgrade (a send through another
deployment's ingress) and a refused send, after which each process's scrape
shows its counters moved by exactly what happened and every histogram has
observations."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.registry import Collector

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2_grpc
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.config import ConfigError, as_listen
from baton_runtime.common.observability import metrics
from baton_runtime.common.rpc.server import build_server
from baton_runtime.common.security.tls import Security
from tests.procs import SLACK, ProcessStack, eventually
from tests.scrape import Scrape, scrape, total
from tests.stack import public_channel

K = s.EventKind

_RPC = {
    "baton_rpc_server_handled_total": ("counter", {"method", "code"}),
    "baton_rpc_server_handling_seconds": ("histogram", {"method"}),
    "baton_rpc_client_handled_total": ("counter", {"target", "method", "code"}),
    "baton_rpc_server_stream_messages_sent_total": ("counter", {"method"}),
    "baton_rpc_client_streams_opened_total": ("counter", {"target", "method"}),
    "baton_rpc_client_stream_messages_received_total": ("counter", {"target", "method"}),
    "baton_rpc_client_stream_messages_sent_total": ("counter", {"target", "method"}),
    "baton_build_info": ("gauge", {"version", "deployment"}),
}
_STORE = {
    "baton_etcd_txn_seconds": ("histogram", {"op"}),
    "baton_etcd_errors_total": ("counter", {"reason"}),
    "baton_etcd_grouped_requests_total": ("counter", set()),
    "baton_etcd_grouped_txns_total": ("counter", set()),
    "baton_etcd_watches_created_total": ("counter", set()),
    "baton_etcd_watch_responses_total": ("counter", set()),
    "baton_etcd_watch_events_total": ("counter", set()),
    "baton_store_serving": ("gauge", set()),
}
# The list (issue 19), and the inbox age gauge added with it.
EXPECTED: dict[str, dict[str, tuple[str, set[str]]]] = {
    "hooks": {
        **_RPC,
        **_STORE,
        "baton_inbox_appends_total": ("counter", {"outcome"}),
        "baton_inbox_append_batch_size": ("histogram", set()),
        "baton_dedupe_leases_granted_total": ("counter", {"reason"}),
        "baton_transfers_total": ("counter", {"outcome"}),
        "baton_live_instances": ("gauge", {"deployment"}),
        "baton_oldest_unanswered_seconds": ("gauge", {"deployment"}),
    },
    "anchor": {
        **_RPC,
        **_STORE,
        "baton_commit_bytes": ("histogram", set()),
        "baton_stream_followers": ("gauge", set()),
        "baton_events_committed_total": ("counter", set()),
        "baton_stream_events_trimmed_total": ("counter", set()),
        "baton_stream_trim_batch_seconds": ("histogram", set()),
        "baton_inbox_entries_deleted_total": ("counter", set()),
        "baton_object_store_request_seconds": ("histogram", {"op"}),
        "baton_object_store_errors_total": ("counter", {"op"}),
        "baton_segments_sealed_total": ("counter", {"log"}),
        "baton_sealed_bytes_total": ("counter", {"log"}),
        "baton_sealing_stalled": ("gauge", set()),
        "baton_objects_corrupt_total": ("counter", {"log"}),
        "baton_orphan_objects_deleted_total": ("counter", set()),
    },
    "owner": {
        **_RPC,
        "baton_rpc_client_calls_in_flight": ("gauge", {"target"}),
        "baton_rpc_client_calls_waiting": ("gauge", {"target"}),
        "baton_rpc_client_slot_wait_seconds": ("histogram", {"target"}),
        "baton_turns_total": ("counter", {"outcome"}),
        "baton_turn_duration_seconds": ("histogram", set()),
        "baton_steps_total": ("counter", set()),
        "baton_model_call_seconds": ("histogram", set()),
        "baton_tool_call_seconds": ("histogram", {"outcome"}),
        "baton_inbox_wait_seconds": ("histogram", set()),
        "baton_sessions": ("gauge", {"state"}),
        "baton_inbox_oldest_unconsumed_seconds": ("gauge", set()),
        "baton_draining": ("gauge", set()),
        "baton_handoffs_total": ("counter", {"reason", "outcome"}),
        "baton_handoff_skips_total": ("counter", {"why"}),
        "baton_handoff_duration_seconds": ("histogram", set()),
        "baton_takeovers_total": ("counter", set()),
        "baton_parked_claims_total": ("counter", {"how"}),
        "baton_parked_unclaimed_sessions": ("gauge", set()),
        "baton_reconciled_sessions_total": ("counter", {"how"}),
        "baton_restarts_total": ("counter", set()),
        "baton_resumes_total": ("counter", set()),
        "baton_commits_total": ("counter", {"outcome"}),
    },
    "ingress": {
        **_RPC,
        "baton_sends_total": ("counter", {"outcome"}),
        "baton_limit_refusals_total": ("counter", {"limit"}),
    },
}
_COLLECTED = {  # computed at scrape time, not metric objects
    "baton_build_info",
    "baton_sessions",
    "baton_inbox_oldest_unconsumed_seconds",
    "baton_draining",
    "baton_parked_unclaimed_sessions",
}


def _family_name(name: str, kind: str) -> str:
    """prometheus-client names a counter's family without `_total`."""
    return name.removesuffix("_total") if kind == "counter" else name


@pytest.mark.parametrize("service", sorted(EXPECTED))
def test_each_service_exposes_the_listed_names_with_their_types_and_labels(service: str) -> None:
    """Exactly the listed metrics, each once, with its type; the label names
    of every metric object as listed (none per session or delivery)."""
    expected = EXPECTED[service]
    registry = metrics.registry_for(service, "dep-x")
    found = {family.name: family.type for family in registry.collect()}
    collected = set(_COLLECTED) if service == "owner" else {"baton_build_info"}
    wanted = {
        _family_name(name, kind): kind
        for name, (kind, _) in expected.items()
        if name not in _COLLECTED or name in collected
    }
    if service == "owner":
        # The owner's collector is added by its server (services/owner/server.py).
        wanted = {n: k for n, k in wanted.items() if n not in _COLLECTED - {"baton_build_info"}}
    assert found == wanted
    for collector in metrics.SERVICE_METRICS[service]:
        name, labels = _declared(collector)
        kind, want = next(v for n, v in expected.items() if _family_name(n, v[0]) == name)
        assert set(labels) == want, name
        assert not set(labels) & {"session_id", "delivery_id", "run_id", "instance_id"}


def _declared(collector: Collector) -> tuple[str, tuple[str, ...]]:
    # The family name and label names a metric object was declared with
    # (prometheus-client keeps them in these attributes).
    return collector._name, collector._labelnames  # type: ignore[attr-defined]


def test_the_metrics_listen_setting_is_checked() -> None:
    assert as_listen({"metrics_listen": ""}, "metrics_listen") == ""
    assert as_listen({"metrics_listen": "0.0.0.0:9102"}, "metrics_listen") == "0.0.0.0:9102"
    for bad in ("9102", "host:", ":9102", "host:99999", "host:port"):
        with pytest.raises(ConfigError, match="metrics_listen must be host:port"):
            as_listen({"metrics_listen": bad}, "metrics_listen")


async def test_the_endpoint_serves_metrics_at_slash_metrics_and_nothing_else() -> None:
    server = build_server(
        "127.0.0.1:0",
        [],
        service="anchor",
        security=Security.plaintext(),
        metrics_listen="127.0.0.1:0",
    )
    await server.start()
    try:
        assert server.metrics_port > 0
        base = f"http://127.0.0.1:{server.metrics_port}"
        scraped = await scrape(f"{base}/metrics")
        assert scraped.total("baton_build_info", deployment="") == 1
        assert "baton_store_serving" in scraped.names()
        assert "baton_turns_total" not in scraped.names()  # an owner metric
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(f"{base}/")).status_code == 404
            assert (await client.post(f"{base}/metrics")).status_code == 404
    finally:
        await server.stop(0.1)
    with pytest.raises(httpx.ConnectError):
        await scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")


class _Gateway:
    """A gateway's client of one ingress process."""

    def __init__(self, address: str) -> None:
        self.channel = public_channel(address)
        self.stub = ingress_pb2_grpc.IngressServiceStub(self.channel)

    async def create(self) -> str:
        response = await self.stub.CreateSession(
            ingress_pb.CreateSessionRequest(), metadata=SLACK, timeout=20
        )
        return str(response.session_id)

    async def send(
        self, session_id: str, text: str, delivery_id: str = ""
    ) -> ingress_pb.SendMessageResponse:
        return await self.stub.SendMessage(
            ingress_pb.SendMessageRequest(
                session_id=session_id, text=text, delivery_id=delivery_id
            ),
            metadata=SLACK,
            timeout=20,
        )


HISTOGRAMS = {
    "owner": [
        "baton_rpc_server_handling_seconds",
        "baton_turn_duration_seconds",
        "baton_model_call_seconds",
        "baton_tool_call_seconds",
        "baton_inbox_wait_seconds",
        "baton_handoff_duration_seconds",
    ],
    "hooks": [
        "baton_rpc_server_handling_seconds",
        "baton_etcd_txn_seconds",
        "baton_inbox_append_batch_size",
    ],
    "anchor": [
        "baton_rpc_server_handling_seconds",
        "baton_etcd_txn_seconds",
        "baton_commit_bytes",
    ],
    "ingress": ["baton_rpc_server_handling_seconds"],
}
SEND = "/baton.ingress.v1.IngressService/SendMessage"
RESUME = "/baton.hooks.v1.HookRegistryService/ResumeHook"


async def test_a_conversation_with_a_takeover_an_upgrade_and_a_refused_send(
    etcd_endpoint: str, tmp_path: Path, stacks: list[ProcessStack]
) -> None:
    """dep-a (owners a1, a2; ingress ing-a) and dep-b (owner b1; ingress
    ing-b, allowed one send a long while). Turn 1 ("calc", two steps) on a1,
    its delivery sent twice; a1 is killed (kill -9) and a2 takes the session
    over; turn 2 on a2; a send through ing-b moves the session to b1 (turn 3,
    "whoami", two steps); the next send through ing-b is over its limit."""
    stack = ProcessStack(etcd_endpoint, tmp_path, deployment_id="dep-a", serve_metrics=True)
    stacks.append(stack)
    stack.start_deployments(
        owners={"a1": ("dep-a", ""), "a2": ("dep-a", "")},
        ingresses={"ing-a": ("dep-a", "a1")},
    )
    stack.start_owner("b1", deployment_id="dep-b")
    stack.start_ingress("ing-b", "dep-b", ["b1"], env={"BATON_MAX_SENDS_PER_SECOND": "0.001"})
    hooks = HooksClient(stack.addr("hooks"), timeout=5, security=stack.probe)
    anchor_client = AnchorClient(stack.addr("anchor"), timeout=5, security=stack.probe)
    a, b = _Gateway(stack.addr("ing-a")), _Gateway(stack.addr("ing-b"))
    try:
        for deployment, instances in (("dep-a", {"a1", "a2"}), ("dep-b", {"b1"})):

            async def registered(d: str = deployment, want: set[str] = instances) -> bool:
                return want <= {i.instance_id for i in await hooks.list_instances(d)}

            await eventually(registered, f"{deployment}'s owners registered")

        async def completed_turns(sid: str, count: int) -> None:
            async def done() -> bool:
                events = [e async for page in anchor_client.read_events(sid) for e in page]
                return sum(e.kind == K.EVENT_KIND_TURN_COMPLETED for e in events) >= count

            await eventually(done, f"{count} turns completed")

        sid = await a.create()
        first = await a.send(sid, "calc 2+3", delivery_id="dlv_metrics_1")
        assert (await a.send(sid, "calc 2+3", delivery_id="dlv_metrics_1")).receipt.duplicate
        assert first.receipt.owner_deployment_id == "dep-a"
        await completed_turns(sid, 1)
        a1 = await _settled(stack, "a1", "baton_turns_total", 1)
        assert (await hooks.get_owner(sid)).owner.instance_id == "a1"

        stack.kill("a1")

        async def taken_over() -> bool:
            return (await hooks.get_owner(sid)).owner.instance_id == "a2"

        await eventually(taken_over, "a2 took the session over")
        await a.send(sid, "hello")
        await completed_turns(sid, 2)
        upgrade = await b.send(sid, "whoami")
        assert upgrade.accepted_deployment_id == "dep-b"
        await completed_turns(sid, 3)
        assert (await hooks.get_owner(sid)).owner.instance_id == "b1"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await b.send(sid, "one more")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        a2 = await _settled(stack, "a2", "baton_handoffs_total", 1)
        b1 = await _settled(stack, "b1", "baton_turns_total", 1)
        owners = [a1, a2, b1]
        hooks_scrape = await _settled(stack, "hooks", "baton_transfers_total", 1)
        anchor = await scrape(stack.metrics_url("anchor"))
        ing_a = await scrape(stack.metrics_url("ing-a"))
        ing_b = await scrape(stack.metrics_url("ing-b"))

        # Owners: three turns, one where each ran; five steps (calc and
        # whoami call a tool first); one takeover, one handoff; no commit
        # fenced or refused.
        assert [o.total("baton_turns_total", outcome="completed") for o in owners] == [1, 1, 1]
        assert total(owners, "baton_turns_total") == 3
        assert total(owners, "baton_steps_total") == 5
        assert total(owners, "baton_model_call_seconds_count") == 5
        assert total(owners, "baton_tool_call_seconds_count", outcome="ok") == 2
        assert total(owners, "baton_turn_duration_seconds_count") == 3
        waits = [o.total("baton_inbox_wait_seconds_count") for o in owners]
        assert waits == [1, 1, 1], waits
        assert [o.total("baton_takeovers_total") for o in owners] == [0, 1, 0]
        assert a2.total("baton_handoffs_total", reason="trigger", outcome="moved") == 1
        assert total(owners, "baton_handoffs_total") == 1
        assert a2.total("baton_handoff_duration_seconds_count") == 1
        assert total(owners, "baton_commits_total", outcome="fenced") == 0
        assert total(owners, "baton_commits_total", outcome="refused") == 0
        assert total(owners, "baton_commits_total", outcome="ok") >= 3
        assert (
            b1.total("baton_sessions", state="running") + b1.total("baton_sessions", state="parked")
            == 1
        )
        assert total(owners, "baton_sessions", state="stalled") == 0
        assert "baton_inbox_oldest_unconsumed_seconds" in b1.names()
        assert total(owners, "baton_draining") == 0
        assert b1.total("baton_build_info", deployment="dep-b") == 1
        assert a2.total("baton_build_info", deployment="dep-a") == 1
        # Commits ride the multiplexed CommitSteps stream: its messages,
        # not unary calls (each commit's outcome is baton_commits_total's).
        commits = "/baton.anchor.v1.AnchorService/CommitSteps"
        assert b1.total("baton_rpc_client_stream_messages_sent_total", method=commits) >= 1
        assert b1.total("baton_rpc_client_stream_messages_received_total", method=commits) >= 1
        assert b1.total("baton_rpc_client_handled_total", method=commits[:-1]) == 0

        # hooks: three commands accepted, one duplicate, one transfer; the
        # live instances as etcd has them now.
        assert hooks_scrape.total("baton_inbox_appends_total", outcome="accepted") == 3
        assert hooks_scrape.total("baton_inbox_appends_total", outcome="duplicate") == 1
        assert hooks_scrape.total("baton_inbox_appends_total", outcome="refused") == 0
        assert hooks_scrape.total("baton_transfers_total", outcome="moved") == 1
        assert hooks_scrape.total("baton_transfers_total") == 1
        assert hooks_scrape.total("baton_live_instances", deployment="dep-b") == 1
        assert hooks_scrape.total("baton_rpc_server_handled_total", method=RESUME) == 4
        for store in (hooks_scrape, anchor):
            assert store.total("baton_store_serving") == 1
            assert store.total("baton_etcd_txn_seconds_count", op="txn_write") > 0

        # anchor: the steps' commits and their events.
        assert anchor.total("baton_commit_bytes_count") >= 3
        # ... and anchor counts each commit they carried as a CommitStep call.
        served = "/baton.anchor.v1.AnchorService/CommitStep"
        assert anchor.total("baton_rpc_server_handled_total", method=served, code="OK") >= 3
        assert anchor.total("baton_events_committed_total") > 0
        assert "baton_stream_followers" in anchor.names()

        # ingress: what each accepted, the duplicate, the refusal by the limit.
        assert ing_a.total("baton_sends_total", outcome="accepted") == 2
        assert ing_a.total("baton_sends_total", outcome="duplicate") == 1
        assert ing_b.total("baton_sends_total", outcome="accepted") == 1
        assert ing_b.total("baton_sends_total", outcome="refused") == 1
        assert ing_b.total("baton_limit_refusals_total", limit="sends_per_second") == 1
        assert ing_b.total("baton_rpc_server_handled_total", method=SEND, code="OK") == 1
        assert (
            ing_b.total("baton_rpc_server_handled_total", method=SEND, code="RESOURCE_EXHAUSTED")
            == 1
        )
        # ing-a's three sends rode its ResumeHooks stream; hooks counts each
        # append as a ResumeHook call.
        streamed = RESUME + "s"
        assert ing_a.total("baton_rpc_client_handled_total", method=RESUME) == 0
        assert 1 <= ing_a.total("baton_rpc_client_stream_messages_sent_total", method=streamed) <= 3
        assert hooks_scrape.total("baton_rpc_server_handled_total", method=RESUME, code="OK") >= 4

        # Every histogram listed has observations; labels are the listed ones.
        scrapes = {"owner": owners, "hooks": [hooks_scrape], "anchor": [anchor]}
        scrapes["ingress"] = [ing_a, ing_b]
        for service, names in HISTOGRAMS.items():
            for name in names:
                assert total(scrapes[service], f"{name}_count") > 0, (service, name)
        for service, listed in EXPECTED.items():
            for one in scrapes[service]:
                for name, (kind, labels) in listed.items():
                    sample = f"{name}_count" if kind == "histogram" else name
                    for found in one.label_sets(sample):
                        assert found == labels, (service, name, found)
    finally:
        await hooks.close()
        await anchor_client.close()
        await a.channel.close()
        await b.channel.close()


async def _settled(stack: ProcessStack, name: str, metric: str, at_least: float) -> Scrape:
    """A scrape of `name` once `metric` reached `at_least`: a counter moves
    just after the effect it counts is visible (the commit lands, then the
    owner counts it)."""

    async def probe() -> Scrape | None:
        scraped = await scrape(stack.metrics_url(name))
        return scraped if scraped.total(metric) >= at_least else None

    return await eventually(probe, f"{name}: {metric} >= {at_least}")
