"""Every member of an etcd cluster, asked one by one: what release it runs,
its revision, its alarms, its KV hash at a revision.

A Baton client balances over the members (`etcd.make_client`), so a call
through it reaches whichever member is next. What is true of each member
(its version, its data) is asked of each: the member list names their
client URLs, as `etcdctl --cluster` finds them, and each gets a short-lived
client of its own. Used by hooks and anchor at startup (refuse a known-bad
release in an external cluster) and by the consistency probe
(services/cli/system/etcd_check.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aetcd
import structlog
from aetcd import rpc
from grpc.aio import AioRpcError

from baton_runtime.common.config import ConfigError, EtcdConfig
from baton_runtime.common.etcd.client import EtcdClient, make_client
from baton_runtime.common.etcd.failures import COMPACTED_DETAIL
from baton_runtime.common.etcd.releases import Verdict, judge, parse_version
from baton_runtime.common.etcd.store import Store
from baton_runtime.common.security.tls import Security

log = structlog.get_logger("baton.etcd_members")

_T = TypeVar("_T")


class UnsafeEtcd(ConfigError):
    """A member of the configured etcd runs a known-bad release and the risk
    was not accepted: the service does not start (the message says why)."""


@dataclass(frozen=True)
class Member:
    """One member as the member list names it."""

    member_id: int
    name: str
    endpoint: str  # its first client URL ("" for a member not started yet)


@dataclass(frozen=True)
class MemberStatus:
    """One member's own answer to Maintenance.Status, or why it gave none."""

    member: Member
    version: str = ""
    revision: int = 0
    leader: int = 0
    db_size: int = 0
    errors: tuple[str, ...] = ()
    error: str = ""  # could not be asked

    @property
    def verdict(self) -> Verdict:
        return judge(parse_version(self.version))


def describe(exc: BaseException) -> str:
    """An etcd call's failure in one line (the gRPC status, also when a
    client error carries it as its cause)."""
    if isinstance(exc, AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    cause = exc.__cause__
    if isinstance(cause, AioRpcError):
        return f"{cause.code().name}: {cause.details()}"
    return f"{type(exc).__name__}: {exc}"


async def list_members(client: EtcdClient, call_timeout: float) -> list[Member]:
    """The cluster's members (any member answers for all of them)."""
    response = await client.clusterstub.MemberList(rpc.MemberListRequest(), timeout=call_timeout)
    return [
        Member(int(m.ID), m.name, m.clientURLs[0] if m.clientURLs else "") for m in response.members
    ]


async def ask_member(
    member: Member,
    security: Security | None,
    call_timeout: float,
    call: Callable[[EtcdClient], Awaitable[_T]],
) -> _T:
    """`call` with a client of this member alone, closed afterwards."""
    try:
        client = make_client(member.endpoint, call_timeout, security)
    except ValueError as exc:  # a client URL Baton cannot dial (no port, unix://)
        raise OSError(f"cannot dial {member.endpoint!r}: {exc}") from exc
    try:
        await asyncio.wait_for(client.connect(), call_timeout)
        return await asyncio.wait_for(call(client), call_timeout)
    finally:
        await client.close()


async def member_status(
    member: Member, security: Security | None, call_timeout: float
) -> MemberStatus:
    if not member.endpoint:
        return MemberStatus(member, error="no client URL (not started yet)")

    async def status(client: EtcdClient) -> rpc.StatusResponse:
        return await client.maintenancestub.Status(rpc.StatusRequest(), timeout=call_timeout)

    try:
        answer = await ask_member(member, security, call_timeout, status)
    except (aetcd.ClientError, AioRpcError, OSError, TimeoutError) as exc:
        return MemberStatus(member, error=describe(exc))
    return MemberStatus(
        member,
        version=answer.version,
        revision=int(answer.header.revision),
        leader=int(answer.leader),
        db_size=int(answer.dbSize),
        errors=tuple(answer.errors),
    )


async def member_statuses(
    client: EtcdClient, security: Security | None, call_timeout: float
) -> list[MemberStatus]:
    """Every member's own status, asked of each at once."""
    members = await list_members(client, call_timeout)
    return list(await asyncio.gather(*(member_status(m, security, call_timeout) for m in members)))


async def connect_checked(config: EtcdConfig) -> Store:
    """hooks' and anchor's store: connected, with every member's release
    judged (a known-bad one refuses to start, see `check_member_releases`)."""
    store = Store(
        make_client(config.endpoint, config.timeout, config.security),
        config.timeout,
        group_commit=config.group_commit,
    )
    await store.connect()
    try:
        await check_member_releases(
            store.client, config.security, config.timeout, accept_risk=config.accept_risk
        )
    except UnsafeEtcd:
        await store.close()
        raise
    return store


async def check_member_releases(
    client: EtcdClient, security: Security | None, call_timeout: float, *, accept_risk: bool
) -> list[MemberStatus]:
    """Refuse (UnsafeEtcd) an etcd any member of which runs a known-bad
    release, unless `accept_risk` (then log it). A member that cannot be
    asked now is logged, not refused: it is judged when the service next
    starts, and etcd's own corruption checks watch it meanwhile."""
    try:
        statuses = await member_statuses(client, security, call_timeout)
    except (aetcd.ClientError, AioRpcError, OSError, TimeoutError) as exc:
        log.warning("etcd members not listed; releases unchecked", error=describe(exc))
        return []
    bad = []
    for status in statuses:
        if status.error:
            log.warning(
                "etcd member not asked; release unchecked",
                member=status.member.name,
                endpoint=status.member.endpoint,
                error=status.error,
            )
        elif not status.verdict.ok:
            bad.append(status)
    if bad:
        explanation = " ".join(
            s.verdict.explain(f"etcd member {s.member.name} ({s.member.endpoint})") for s in bad
        )
        if not accept_risk:
            raise UnsafeEtcd(explanation)
        log.error("running on a known-bad etcd (risk accepted)", detail=explanation)
    return statuses


def is_compacted(exc: BaseException) -> bool:
    """etcd said the revision asked for was compacted away."""
    for candidate in (exc, exc.__cause__):
        if isinstance(candidate, AioRpcError) and COMPACTED_DETAIL in (candidate.details() or ""):
            return True
    return False
