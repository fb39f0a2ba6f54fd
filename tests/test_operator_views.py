"""Issue 18's operator views that the first CLI left short, against a real
stack (real etcd, real gRPC) with the CLI as a process, its JSON checked
against the RPC behind it:

- `baton handoffs get ID` finds a handoff by its id alone (hooks' handoff
  index, written by the transfer's own transaction under the record's
  deduplication-window lease); `--session` still works;
- `baton deployments list` (ListDeployments) shows every deployment the
  registry knows with its status, 0 counts included: a fleet with no session
  yet (active), one an operator drains (its instance announces the target:
  draining), one scaled to zero with sessions left on it (retired);
- `baton sessions get ID --all-channels`: an operator's view of any
  channel's session, as its channel's GetSession shows it;
- GetSession (and `baton sessions get`) reports the stream's retention
  horizon, `earliest_seq`, read with the snapshot."""

from __future__ import annotations

import json
from pathlib import Path

import aetcd
import grpc
import pytest
from google.protobuf import json_format

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands import sessions
from baton_runtime.common import ids
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.errors import InvalidArgument, NotFound
from baton_runtime.common.etcd.keys import Keys
from baton_runtime.common.security.identity import Role
from baton_runtime.hooks.fleet_views import FleetStatus, fleet_status
from tests.procs import eventually
from tests.stack import WEB, Stack, add_deployment, start_stack, stop_deployment, stop_stack
from tests.test_cli_operator import operator_flags
from tests.test_cli_sessions import as_json, baton, env_of, flags, get_session, idle_session
from tests.test_sdk import sdk
from tests.test_turns import follow_until, waits

K = s.EventKind


def listed_json(infos: list[hooks_pb.DeploymentInfo]) -> dict[str, dict[str, object]]:
    """ListDeployments' answer as the CLI prints it, by deployment, without
    what moves by itself (a lease's remaining TTL)."""
    out = {}
    for info in infos:
        data = json_format.MessageToDict(
            info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        for instance in data["instances"]:
            instance.pop("ttl_seconds", None)
        out[info.deployment_id] = data
    return out


def without_ttl(printed: str) -> dict[str, dict[str, object]]:
    out = {}
    for data in json.loads(printed):
        for instance in data["instances"]:
            instance.pop("ttl_seconds", None)
        out[data["deployment_id"]] = data
    return out


def test_a_deployments_status_follows_from_its_fleet_and_sessions() -> None:
    assert fleet_status(live_instances=2, sessions=5) == FleetStatus.ACTIVE
    assert fleet_status(live_instances=1, sessions=0) == FleetStatus.ACTIVE  # a new fleet
    assert fleet_status(live_instances=1, sessions=3, draining=True) == FleetStatus.DRAINING
    assert fleet_status(live_instances=1, sessions=0, draining=True) == FleetStatus.DRAINED
    assert fleet_status(live_instances=0, sessions=3) == FleetStatus.RETIRED
    assert fleet_status(live_instances=0, sessions=0) == FleetStatus.DRAINED


async def test_handoffs_by_id_alone_and_every_deployment_with_its_status(
    stack: Stack, raw: aetcd.Client, tmp_path: Path
) -> None:
    env = env_of(tmp_path)
    ops = operator_flags(stack)
    hooks = HooksClient(stack.addr(stack.hooks), security=stack.security(Role.OPERATOR))
    b = await add_deployment(stack, "dep-b")
    stopped = False
    try:
        await eventually(lambda: hooks.list_instances("dep-b"), "dep-b's owner registered")
        # A fleet with no session yet is listed with its zeros.
        run = await baton("deployments", "list", *ops, env=env)
        assert run.code == 0, run.err
        header, *rows = run.out.splitlines()
        assert header.split() == ["DEPLOYMENT", "STATUS", "INSTANCES", "SESSIONS", "ON_GONE"]
        assert ["dep-b", "active", "1", "0", "0"] in [row.split() for row in rows]

        # An idle session of dep-a moves to dep-b on a send through dep-b's ingress.
        sid = await idle_session(stack)
        receipt = await b.send(sid, "whoami")
        events = await follow_until(b, sid, waits(2))
        (handed,) = [e for e in events if e.kind == K.EVENT_KIND_SESSION_HANDED_OFF]
        handoff = handed.handoff_id

        # The RPC finds it by the id alone, as it does with the session.
        by_id = await hooks.get_transfer("", handoff)
        assert by_id == await hooks.get_transfer(sid, handoff)
        assert by_id.fence.session_id == sid and by_id.successor.deployment_id == "dep-b"
        assert by_id.trigger_seq == receipt.receipt.seq
        # The index points at the one session and expires with the record.
        keys = Keys(stack.etcd.prefix)
        index = await raw.get(keys.handoff(handoff))
        record = await raw.get(keys.transfer(sid, handoff))
        assert index is not None and record is not None
        assert index.value == sid.encode() and index.lease == record.lease != 0
        with pytest.raises(NotFound) as missing:
            await hooks.get_transfer("", "ho_nothing")
        assert missing.value.reason == "TRANSFER_NOT_FOUND"
        with pytest.raises(InvalidArgument):
            await hooks.get_transfer("", "")

        # The CLI: no --session needed; the JSON is the RPC's answer.
        run = await baton("handoffs", "get", handoff, "-o", "json", *ops, env=env)
        assert run.code == 0, run.err
        expected = hooks_pb.GetTransferResponse(
            fence=by_id.fence,
            successor=by_id.successor,
            trigger_seq=by_id.trigger_seq,
            reason=by_id.reason,
        )
        assert json.loads(run.out) == {
            "handoff_id": handoff,
            "session_id": sid,
            **json_format.MessageToDict(expected, preserving_proto_field_name=True),
        }
        run = await baton("handoffs", "get", handoff, *ops, env=env)
        assert run.code == 0, run.err
        assert f"session:     {sid}" in run.out and "reason:      trigger" in run.out
        run = await baton("handoffs", "get", handoff, "--session", sid, "-o", "jsonl", *ops,
                          env=env)  # fmt: skip
        assert run.code == 0, run.err
        assert json.loads(run.out)["session_id"] == sid
        run = await baton("handoffs", "get", "ho_nothing", *ops, env=env)
        assert run.code == sessions.EXIT_NOT_FOUND and "TRANSFER_NOT_FOUND" in run.err, run

        # An operator's drain of dep-a: its instance announces the target,
        # and dep-a is draining while a session (waiting for input) is left.
        asking = await idle_session(stack, "ask my name")
        owner = OwnerClient(stack.addr(stack.owner), security=stack.security(Role.OPERATOR))
        try:
            report = await owner.drain_sessions("dep-b")
        finally:
            await owner.close()
        assert report.remaining == 1 and report.blockers[0].session_id == asking

        async def draining() -> hooks_pb.DeploymentInfo | None:
            found = {i.deployment_id: i for i in await hooks.list_deployments()}
            a = found["dep-a"]
            return a if a.status == hooks_pb.DEPLOYMENT_STATUS_DRAINING else None

        drained_a = await eventually(draining, "dep-a draining (on its next keep-alive)")
        assert [i.drain_to_deployment_id for i in drained_a.instances] == ["dep-b"]
        run = await baton("deployments", "list", *ops, env=env)
        assert run.code == 0, run.err
        assert ["dep-a", "draining", "1", "1", "0"] in [r.split() for r in run.out.splitlines()]

        # dep-b scaled to zero with the session left on it: retired, listed.
        await stop_deployment(b)
        stopped = True

        async def gone() -> bool:
            return not await hooks.list_instances("dep-b")

        await eventually(gone, "dep-b's instance deregistered")
        infos = await hooks.list_deployments()
        statuses = {i.deployment_id: i.status for i in infos}
        assert statuses == {
            "dep-a": hooks_pb.DEPLOYMENT_STATUS_DRAINING,
            "dep-b": hooks_pb.DEPLOYMENT_STATUS_RETIRED,
        }
        retired = next(i for i in infos if i.deployment_id == "dep-b")
        assert (len(retired.instances), retired.sessions) == (0, 1)
        assert retired.sessions_of_gone_instances == 1
        run = await baton("deployments", "list", "-o", "json", *ops, env=env)
        assert run.code == 0, run.err
        assert without_ttl(run.out) == listed_json(infos)
        assert without_ttl(run.out)["dep-b"]["instances"] == []
        run = await baton("deployments", "list", *ops, env=env)
        assert run.code == 0, run.err
        assert ["dep-b", "retired", "0", "1", "1"] in [r.split() for r in run.out.splitlines()]
        # A deployment the registry holds nothing of is not found (a typo
        # used to be described as an empty, drained fleet, exit 0).
        with pytest.raises(NotFound) as unknown:
            await hooks.describe_deployment("dep-gone")
        assert unknown.value.reason == "DEPLOYMENT_NOT_FOUND"
        run = await baton("deployments", "describe", "dep-gone", *ops, env=env)
        assert run.code == sessions.EXIT_NOT_FOUND, run
        assert "DEPLOYMENT_NOT_FOUND" in run.err and "dep-gone is not known" in run.err, run
        assert run.out == ""
    finally:
        await hooks.close()
        if not stopped:
            await stop_deployment(b)


async def test_an_operator_gets_a_session_of_any_channel(stack: Stack, tmp_path: Path) -> None:
    env = env_of(tmp_path)
    ops = operator_flags(stack)
    web = await stack.create(metadata=WEB)
    await stack.send(web, "hello", metadata=WEB)
    await stack.events(web, until=1, metadata=WEB)
    response = await stack.ingress_stub.GetSession(
        pb.GetSessionRequest(session_id=web), metadata=WEB, timeout=10
    )
    run = await baton("sessions", "get", web, "--all-channels", "-o", "json", *ops, env=env)
    assert run.code == 0, run.err
    assert json.loads(run.out) == as_json(response.session)
    run = await baton("sessions", "get", web, "--all-channels", *ops, env=env)
    assert run.code == 0, run.err
    assert f"session:     {web}" in run.out and "channel:     web" in run.out
    # As the slack channel, through the ingress, it is unknown.
    run = await baton("sessions", "get", web, *flags(stack), env=env)
    assert run.code == sessions.EXIT_NOT_FOUND, run
    missing = ids.new_session_id()
    run = await baton("sessions", "get", missing, "--all-channels", *ops, env=env)
    assert run.code == sessions.EXIT_NOT_FOUND and "SESSION_NOT_FOUND" in run.err, run


async def test_get_session_reports_the_stream_retention_horizon(
    etcd_endpoint: str, raw: aetcd.Client, tmp_path: Path
) -> None:
    stack = await start_stack(
        etcd_endpoint,
        anchor_options={
            "stream_retention_events": 20,
            "stream_retention_seconds": 0.0,
            "retention_sweep_seconds": 0.2,
        },
    )
    env = env_of(tmp_path)
    try:
        fresh = await idle_session(stack)
        assert (await get_session(stack, fresh)).earliest_seq == 0  # nothing deleted yet
        sid = await stack.create()
        head = 0
        for i in range(8):
            await stack.send(sid, f"turn {i}")
            head = (await follow_until(stack, sid, waits(1), start_seq=head))[-1].seq + 1
        key = Keys(stack.etcd.prefix).horizon(sid)

        async def trimmed() -> int:
            # Retention moves the horizon in the background, in rounds: it
            # stays once it keeps exactly the last 20 (the session is idle).
            stored = await raw.get(key)
            if stored is None or int(stored.value) != head - 20:
                return 0
            return (await get_session(stack, sid)).earliest_seq

        earliest = await eventually(trimmed, "the stream trimmed to its last 20 events")
        assert earliest == head - 20
        view = await get_session(stack, sid)
        assert view.stream_head == head and view.earliest_seq == earliest
        async with sdk(stack) as client:  # the SDK's Session carries it too
            assert (await client.get_session(sid)).earliest_seq == earliest
        # What it names is what a read finds: from there gapless, below it refused.
        kept = await stack.events(sid, start_seq=earliest, follow=False)
        assert [e.seq for e in kept] == list(range(earliest, head))
        with pytest.raises(grpc.aio.AioRpcError) as below:
            await stack.events(sid, start_seq=earliest - 1, follow=False)
        assert below.value.code() == grpc.StatusCode.OUT_OF_RANGE
        # The CLI's JSON is GetSession's; its text says it.
        run = await baton("sessions", "get", sid, "-o", "json", *flags(stack), env=env)
        assert run.code == 0, run.err
        assert json.loads(run.out) == as_json(view)
        assert json.loads(run.out)["earliest_seq"] == str(earliest)
        run = await baton("sessions", "get", sid, *flags(stack), env=env)
        assert run.code == 0, run.err
        assert f"stream head: {head} (kept from seq {earliest})" in run.out
    finally:
        await stop_stack(stack)
