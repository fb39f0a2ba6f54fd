"""The operator's commands: `baton sessions resume`, `baton sessions
get|list --all-channels`, `baton deployments list|describe`, `baton handoffs
get`. They talk to the internal services
with the operator certificate (every call is role-checked there:
services/common/security/access.py), not to the public ingress:

- hooks: ListDeployments / DescribeDeployment (each deployment's instances
  with their leases and session counts), ListInstanceSessions (a
  deployment's sessions), ListChannelSessions with no channel (every
  channel's index), GetOwner and ListInstances (where a session runs),
  GetTransfer (a handoff by id), DescribeSession;
- anchor: GetSnapshot and ReadEvents (a session's view, gathered by the same
  code as the public GetSession: services/ingress/introspection.py, across
  channels);
- the owner instance holding a stalled session: ResumeSession.

Output and exit codes are those of `baton_runtime.cli.commands.sessions` (0 done, 1
refused, 2 usage, 3 not found, 4 unavailable); JSON is the proto3 JSON
mapping with the proto's field names.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf import json_format

from baton_runtime._proto.baton.hooks.v1 import hooks_pb2 as hooks_pb
from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.cli.commands.sessions import EXIT_OK, render, status_name, table_of, to_json
from baton_runtime.common import ids
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.errors import NotFound, Reason, Unavailable
from baton_runtime.common.security.tls import Security
from baton_runtime.ingress import listing
from baton_runtime.ingress.introspection import (
    ANY_CHANNEL,
    LIST_CONCURRENCY,
    Gathered,
    SessionViews,
)

DEFAULT_HOOKS = "127.0.0.1:50052"
DEFAULT_ANCHOR = "127.0.0.1:50053"


@dataclass(frozen=True)
class OperatorConnection:
    """Where hooks and anchor are, and the operator's identity."""

    hooks: str
    anchor: str
    security: Security


def _dump(data: object, output: str) -> str:
    if output == "jsonl":
        return json.dumps(data, sort_keys=True)
    return json.dumps(data, indent=2, sort_keys=True)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    all_rows = [tuple(header), *[tuple(r) for r in rows]]
    widths = [max(len(row[i]) for row in all_rows) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in all_rows
    ]


def deployment_status_name(status: hooks_pb.DeploymentStatus.ValueType) -> str:
    """`DEPLOYMENT_STATUS_RETIRED` -> `retired`."""
    return hooks_pb.DeploymentStatus.Name(status).removeprefix("DEPLOYMENT_STATUS_").lower()


def agent_text(agent: hooks_pb.AgentInfo) -> str:
    """`fixture v2 (baton_runtime.owner.agents.fixture:build_agent_v2)`; `-`
    for an instance that registered none."""
    named = " ".join(filter(None, (agent.name, f"v{agent.version}" if agent.version else "")))
    if named and agent.spec:
        return f"{named} ({agent.spec})"
    return named or agent.spec or "-"


def deployment_json(info: hooks_pb.DeploymentInfo) -> dict[str, object]:
    return json_format.MessageToDict(
        info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


async def resume(
    connection: OperatorConnection,
    session_id: str,
    output: str,
    write: Callable[[str], None] = print,
) -> int:
    """`baton sessions resume ID`: find the instance that holds the session
    (hooks' owner record and live instances) and ask it to run the session
    again with a renewed restart budget."""
    ids.validate_session_id(session_id)
    hooks = HooksClient(connection.hooks, security=connection.security)
    try:
        owner = await hooks.get_owner(session_id)
        instances = await hooks.list_instances(owner.owner.deployment_id)
    finally:
        await hooks.close()
    holder = next((i for i in instances if i.instance_id == owner.owner.instance_id), None)
    if holder is None:  # retryable: once taken over, a resume finds it running
        raise Unavailable(
            Reason.UPSTREAM_UNAVAILABLE,
            f"session {session_id} is owned by instance {owner.owner.instance_id} of "
            f"{owner.owner.deployment_id}, which is not live: another instance of the "
            "deployment takes it over and runs it with a fresh restart budget",
        )
    client = OwnerClient(holder.address, security=connection.security)
    try:
        resumed, fence = await client.resume_session(session_id)
    finally:
        await client.close()
    if output != "text":
        data = {
            "session_id": session_id,
            "resumed": resumed,
            "deployment_id": holder.deployment_id,
            "instance_id": holder.instance_id,
            "fence": json_format.MessageToDict(fence, preserving_proto_field_name=True),
        }
        write(_dump(data, output))
    elif resumed:
        write(
            f"resumed: session {session_id} runs again on {holder.instance_id} "
            f"({holder.deployment_id}) with a renewed restart budget; its inbox is kept"
        )
    else:
        write(f"session {session_id} is not stalled on {holder.instance_id}: nothing to resume")
    return EXIT_OK


async def session_any_channel(
    connection: OperatorConnection,
    session_id: str,
    output: str,
    write: Callable[[str], None] = print,
) -> int:
    """`baton sessions get ID --all-channels`: one session of whichever
    channel, as its channel's GetSession shows it (the same gathering code,
    across channels)."""
    ids.validate_session_id(session_id)
    hooks = HooksClient(connection.hooks, security=connection.security)
    anchor = AnchorClient(connection.anchor, security=connection.security)
    try:
        gathered = await SessionViews(hooks, anchor).gather(ANY_CHANNEL, session_id)
    finally:
        await hooks.close()
        await anchor.close()
    for line in render([gathered.session], output, single=True):
        write(line)
    return EXIT_OK


INDEX_PAGE = 200
"""Index entries read per call while listing across channels."""


async def sessions_all_channels(
    connection: OperatorConnection,
    output: str,
    *,
    filter_text: str = "",
    order_by: str = "",
    limit: int = 100,
    write: Callable[[str], None] = print,
) -> int:
    """`baton sessions list --all-channels`: every channel's sessions in
    (channel, session id) order, each as GetSession reports it, filtered as
    ListSessions filters (the same AIP-160 subset, checked before any call),
    up to `limit` (0: all). With `order_by` (as ListSessions'), every
    channel's sessions are gathered, sorted, then cut to `limit`."""
    wanted = listing.parse_filter(filter_text)
    order = listing.parse_order(order_by)
    if order is not None:
        return await _sessions_all_channels_ordered(connection, output, wanted, order, limit, write)
    hooks = HooksClient(connection.hooks, security=connection.security)
    anchor = AnchorClient(connection.anchor, security=connection.security)
    views = SessionViews(hooks, anchor)
    slots = asyncio.Semaphore(LIST_CONCURRENCY)
    found: list[pb.Session] = []

    async def one(session_id: str) -> Gathered | None:
        async with slots:
            try:
                return await views.gather(ANY_CHANNEL, session_id)
            except NotFound:  # gone (retention) since the index was read
                return None

    try:
        after = ("", "")
        while not limit or len(found) < limit:
            page, more = await hooks.list_all_sessions(*after, INDEX_PAGE)
            gathered = await asyncio.gather(*(one(sid) for _, sid in page))
            listed = [g.session for g in gathered if g is not None and wanted.matches(g.fields)]
            listed = listed[: limit - len(found)] if limit else listed
            found.extend(listed)
            if output == "jsonl":  # streamed as pages arrive
                for line in render(listed, output, single=False):
                    write(line)
            if not more or not page:
                break
            after = page[-1]
    finally:
        await hooks.close()
        await anchor.close()
    if output != "jsonl":
        for line in render(found, output, single=False):
            write(line)
    return EXIT_OK


async def _sessions_all_channels_ordered(
    connection: OperatorConnection,
    output: str,
    wanted: listing.Filter,
    order: listing.Order,
    limit: int,
    write: Callable[[str], None],
) -> int:
    """Every channel's matching sessions, sorted by `order` (then channel
    and session id), the first `limit` (0: all)."""
    hooks = HooksClient(connection.hooks, security=connection.security)
    anchor = AnchorClient(connection.anchor, security=connection.security)
    views = SessionViews(hooks, anchor)
    slots = asyncio.Semaphore(LIST_CONCURRENCY)

    async def one(session_id: str) -> Gathered | None:
        async with slots:
            try:
                return await views.gather(ANY_CHANNEL, session_id)
            except NotFound:  # gone (retention) since the index was read
                return None

    ranked: list[tuple[tuple[int, str], str, pb.Session]] = []
    try:
        after = ("", "")
        while True:
            page, more = await hooks.list_all_sessions(*after, INDEX_PAGE)
            gathered = await asyncio.gather(*(one(sid) for _, sid in page))
            for (channel, sid), found in zip(page, gathered, strict=True):
                if found is not None and wanted.matches(found.fields):
                    ranked.append((order.key(found.fields, sid), channel, found.session))
            if not more or not page:
                break
            after = page[-1]
    finally:
        await hooks.close()
        await anchor.close()
    ranked.sort(key=lambda item: (item[0][0], item[1], item[0][1]))
    listed = [session for _, _, session in (ranked[:limit] if limit else ranked)]
    for line in render(listed, output, single=False):
        write(line)
    return EXIT_OK


async def deployments_list(
    connection: OperatorConnection, output: str, write: Callable[[str], None] = print
) -> int:
    """`baton deployments list`: every deployment the registry knows, with
    its status and its instance and session counts (0 included)."""
    hooks = HooksClient(connection.hooks, security=connection.security)
    try:
        found = await hooks.list_deployments()
    finally:
        await hooks.close()
    if output == "json":
        write(_dump([deployment_json(d) for d in found], output))
    elif output == "jsonl":
        for info in found:
            write(_dump(deployment_json(info), output))
    else:
        rows = [
            (
                d.deployment_id,
                deployment_status_name(d.status),
                str(len(d.instances)),
                str(d.sessions),
                str(d.sessions_of_gone_instances),
            )
            for d in found
        ]
        header = ("DEPLOYMENT", "STATUS", "INSTANCES", "SESSIONS", "ON_GONE")
        for line in _table(header, rows):
            write(line)
    return EXIT_OK


async def deployment_sessions(
    hooks: HooksClient, anchor: AnchorClient, deployment_id: str, limit: int
) -> tuple[list[pb.Session], int]:
    """Up to `limit` (0: all) sessions of a deployment's ownership index, in
    session id order, each as GetSession reports it (across channels), and
    how many the index holds."""
    owned = await hooks.list_instance_sessions(deployment_id, "")
    wanted = sorted({o.fence.session_id for o in owned})
    views = SessionViews(hooks, anchor)
    slots = asyncio.Semaphore(LIST_CONCURRENCY)

    async def one(session_id: str) -> pb.Session | None:
        async with slots:
            try:
                return (await views.gather(ANY_CHANNEL, session_id)).session
            except NotFound:  # gone (retention) since the index was read
                return None

    chosen = wanted[:limit] if limit else wanted
    gathered = await asyncio.gather(*(one(sid) for sid in chosen))
    return [v for v in gathered if v is not None], len(wanted)


async def deployments_describe(
    connection: OperatorConnection,
    deployment_id: str,
    output: str,
    *,
    limit: int = 100,
    write: Callable[[str], None] = print,
) -> int:
    """`baton deployments describe DEP`: its instances with their leases and
    session counts, and its sessions with their statuses (to watch a
    drain)."""
    deployment_id = ids.validate_deployment_id(deployment_id)
    hooks = HooksClient(connection.hooks, security=connection.security)
    anchor = AnchorClient(connection.anchor, security=connection.security)
    try:
        info = await hooks.describe_deployment(deployment_id)
        sessions, total = await deployment_sessions(hooks, anchor, deployment_id, limit)
    finally:
        await hooks.close()
        await anchor.close()
    statuses = Counter(status_name(v.status) for v in sessions)
    if output != "text":
        data = {
            "deployment": deployment_json(info),
            "sessions": [to_json(v) for v in sessions],
            "sessions_listed": len(sessions),
            "sessions_total": total,
            "status_counts": dict(sorted(statuses.items())),
        }
        write(_dump(data, output))
        return EXIT_OK
    for line in _described(deployment_id, info, sessions, total, statuses):
        write(line)
    return EXIT_OK


def _described(
    deployment_id: str,
    info: hooks_pb.DeploymentInfo,
    sessions: list[pb.Session],
    total: int,
    statuses: Counter[str],
) -> list[str]:
    """`deployments describe` as text: the counts, the instances, the sessions."""
    lines = [
        f"deployment:  {deployment_id}",
        f"status:      {deployment_status_name(info.status)}",
        f"sessions:    {info.sessions} ({info.sessions_of_gone_instances} on instances that "
        "are gone)",
        f"statuses:    {', '.join(f'{k} {n}' for k, n in sorted(statuses.items())) or '-'}",
        "",
    ]
    rows = [
        (
            i.instance.instance_id,
            i.instance.address,
            str(i.lease_id),
            f"{i.ttl_seconds}/{i.granted_ttl_seconds}s",
            str(i.sessions),
            agent_text(i.instance.agent),
        )
        for i in info.instances
    ]
    lines += _table(("INSTANCE", "ADDRESS", "LEASE", "TTL", "SESSIONS", "AGENT"), rows)
    lines.append("")
    lines += table_of(sessions)
    if len(sessions) < total:
        lines.append(f"... {total - len(sessions)} more (--limit 0 lists all)")
    return lines


_REASONS = {
    s.TRANSFER_REASON_UNSPECIFIED: "trigger",
}


def reason_name(reason: s.TransferReason.ValueType) -> str:
    if reason in _REASONS:
        return _REASONS[reason]
    return s.TransferReason.Name(reason).removeprefix("TRANSFER_REASON_").lower()


async def handoff_get(
    connection: OperatorConnection,
    session_id: str,
    handoff_id: str,
    output: str,
    write: Callable[[str], None] = print,
) -> int:
    """`baton handoffs get HANDOFF_ID [--session ID]`: a recorded transfer
    (the handoff id is on the session's `session.handed_off` event); without
    a session, hooks finds it through its handoff index."""
    if session_id:
        ids.validate_session_id(session_id)
    ids.validate_id(handoff_id, "handoff_id")
    hooks = HooksClient(connection.hooks, security=connection.security)
    try:
        found = await hooks.get_transfer(session_id, handoff_id)
    finally:
        await hooks.close()
    session_id = found.fence.session_id
    response = hooks_pb.GetTransferResponse(
        fence=found.fence,
        successor=found.successor,
        trigger_seq=found.trigger_seq,
        reason=found.reason,
    )
    if output != "text":
        data = {
            "handoff_id": handoff_id,
            "session_id": session_id,
            **json_format.MessageToDict(response, preserving_proto_field_name=True),
        }
        write(_dump(data, output))
        return EXIT_OK
    write(f"handoff:     {handoff_id}")
    write(f"session:     {session_id}")
    write(f"reason:      {reason_name(found.reason)}")
    write(
        f"successor:   run {found.successor.owner_run_id}, deployment "
        f"{found.successor.deployment_id}, instance {found.successor.instance_id}"
    )
    write(f"epoch:       {found.fence.epoch}")
    write(f"trigger seq: {found.trigger_seq}")
    return EXIT_OK
