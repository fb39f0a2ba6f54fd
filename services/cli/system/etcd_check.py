"""Baton's etcd consistency probe: do the members hold the same data?

Every member is asked for the hash of its key-value store at one common
revision (Maintenance.HashKV with the same revision on each, as `etcdctl
endpoint hashkv` does). The revision is the smallest current revision any
member reports, so each has it; a member that compacted past it makes the
round void and it is tried again at a newer one, and so does a round where
members answered with different compact revisions (a hash covers the
revisions after the compaction, so only equal ones compare). An idle
cluster compacted at its very revision (etcd refuses a hash at the
compaction point itself) has each member hash its latest instead, and say
which revision that was. The report
also names each member's release (and the known-bad table's verdict) and
every raised alarm.

`baton up --etcd-members N` runs it before saying it is ready;
`baton etcd check` prints it (exit 0 only when consistent and alarm-free);
tests call `members_consistent` (blocking) or `check_members` (async) at
the end of a chaos run. HashKV is an operator's call: give root's
certificate (or none, plaintext).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from aetcd import rpc

from baton_runtime.common.etcd.client import EtcdClient, make_client
from baton_runtime.common.etcd.members import (
    Member,
    MemberStatus,
    ask_member,
    describe,
    is_compacted,
    list_members,
    member_status,
)
from baton_runtime.common.security.tls import Security, TlsFiles

ROUNDS = 5


@dataclass(frozen=True)
class MemberHash:
    """One member in the report."""

    name: str
    member_id: int
    endpoint: str
    version: str = ""
    known_bad: str = ""  # the verdict's explanation for a known-bad release
    revision: int = 0  # its current revision when asked
    hash: int | None = None  # its KV hash at the report's revision
    compact_revision: int = 0
    error: str = ""  # why it gave no status or hash


@dataclass(frozen=True)
class ConsistencyReport:
    """What the probe found: each member's hash at `revision`, the alarms."""

    revision: int
    members: tuple[MemberHash, ...]
    alarms: tuple[tuple[int, str], ...] = ()  # (member id, alarm name)
    note: str = ""  # why no comparison was possible, if none was
    rounds: int = 1

    @property
    def consistent(self) -> bool:
        """Every member answered, at one compact revision, with one hash."""
        answered = [m for m in self.members if m.hash is not None and not m.error]
        return (
            bool(self.members)
            and len(answered) == len(self.members)
            and len({m.hash for m in answered}) == 1
            and len({m.compact_revision for m in answered}) == 1
        )

    @property
    def alarm_free(self) -> bool:
        return not self.alarms

    @property
    def ok(self) -> bool:
        return self.consistent and self.alarm_free

    def disagreeing(self) -> list[MemberHash]:
        """The members whose hash differs from the most common one (or who
        gave none)."""
        hashes = [m.hash for m in self.members if m.hash is not None]
        common = max(set(hashes), key=hashes.count) if hashes else None
        return [m for m in self.members if m.hash is None or m.hash != common]

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["alarms"] = [{"member_id": m, "alarm": a} for m, a in self.alarms]
        body |= {"consistent": self.consistent, "alarm_free": self.alarm_free, "ok": self.ok}
        return body

    def text(self) -> str:
        verdict = "consistent" if self.consistent else "NOT consistent"
        alarms = ", ".join(f"{a} on {m:x}" for m, a in self.alarms) or "none"
        lines = [f"etcd: {len(self.members)} members, {verdict} at revision {self.revision}"]
        if self.note:
            lines.append(f"  note: {self.note}")
        odd = {m.member_id for m in self.disagreeing()} if not self.consistent else set()
        for m in self.members:
            hashed = f"hash {m.hash:#010x}" if m.hash is not None else "no hash"
            mark = "  <- differs" if m.member_id in odd else ""
            line = (
                f"  {m.name} {m.member_id:x} {m.endpoint}: etcd {m.version or '?'}, "
                f"revision {m.revision}, {hashed} (compacted at {m.compact_revision}){mark}"
            )
            lines.append(line + (f"; error: {m.error}" if m.error else ""))
            if m.known_bad:
                lines.append(f"    WARNING: {m.known_bad}")
        lines.append(f"  alarms: {alarms}")
        return "\n".join(lines)


@dataclass
class _Round:
    statuses: list[MemberStatus]
    revision: int = 0
    hashes: dict[int, rpc.HashKVResponse] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    void: str = ""  # why this round cannot be compared


async def _hash_at(
    member: Member, security: Security | None, call_timeout: float, revision: int
) -> rpc.HashKVResponse:
    async def hash_kv(client: EtcdClient) -> rpc.HashKVResponse:
        request = rpc.HashKVRequest(revision=revision)
        return await client.maintenancestub.HashKV(request, timeout=call_timeout)

    return await ask_member(member, security, call_timeout, hash_kv)


async def _one_round(
    members: list[Member], security: Security | None, call_timeout: float
) -> _Round:
    statuses = list(
        await asyncio.gather(*(member_status(m, security, call_timeout) for m in members))
    )
    round_ = _Round(statuses)
    live = [s for s in statuses if not s.error]
    if not live:
        round_.void = "no member answered"
        return round_
    round_.revision = min(s.revision for s in live)
    answers = await _hashes(live, security, call_timeout, round_.revision)
    if len({s.revision for s in live}) == 1 and any(
        isinstance(a, BaseException) and is_compacted(a) for a in answers
    ):
        # An idle cluster compacted at its very revision: etcd refuses a
        # hash *at* the compaction point, so each hashes its latest, and
        # says (in the header) which revision that was.
        answers = await _hashes(live, security, call_timeout, 0)
        latest = True
    else:
        latest = False
    for status, answer in zip(live, answers, strict=True):
        if isinstance(answer, BaseException):
            if is_compacted(answer):
                round_.void = f"revision {round_.revision} was compacted meanwhile"
            round_.errors[status.member.member_id] = describe(answer)
        elif latest and answer.header.revision != round_.revision:
            round_.void = "a member's revision moved while it was hashed"
            round_.errors[status.member.member_id] = (
                f"hashed revision {answer.header.revision}, not {round_.revision}"
            )
        else:
            round_.hashes[status.member.member_id] = answer
    if len({h.compact_revision for h in round_.hashes.values()}) > 1:
        round_.void = "members answered at different compact revisions"
    return round_


async def _hashes(
    live: list[MemberStatus], security: Security | None, call_timeout: float, revision: int
) -> list[rpc.HashKVResponse | BaseException]:
    return list(
        await asyncio.gather(
            *(_hash_at(s.member, security, call_timeout, revision) for s in live),
            return_exceptions=True,
        )
    )


def _report(round_: _Round, rounds: int) -> ConsistencyReport:
    members = []
    for status in round_.statuses:
        member_id = status.member.member_id
        answer = round_.hashes.get(member_id)
        verdict = status.verdict
        members.append(
            MemberHash(
                name=status.member.name,
                member_id=member_id,
                endpoint=status.member.endpoint,
                version=status.version,
                known_bad="" if status.error or verdict.ok else verdict.explain("this member"),
                revision=status.revision,
                hash=int(answer.hash) if answer is not None else None,
                compact_revision=int(answer.compact_revision) if answer is not None else 0,
                error=status.error or round_.errors.get(member_id, ""),
            )
        )
    return ConsistencyReport(round_.revision, tuple(members), note=round_.void, rounds=rounds)


async def check_members(
    endpoints: str,
    security: Security | None = None,
    *,
    call_timeout: float = 5.0,
    rounds: int = ROUNDS,
) -> ConsistencyReport:
    """The probe, async. `endpoints`: any member's (or several, comma-
    separated, or a dns:/// target); every member of its member list is
    asked. Raises aetcd.ClientError / AioRpcError only when no member can
    even list the members."""
    client = make_client(endpoints, call_timeout, security)
    try:
        await client.connect()
        members = await list_members(client, call_timeout)
        round_ = await _one_round(members, security, call_timeout)
        done = 1
        while round_.void and done < rounds and round_.void != "no member answered":
            round_ = await _one_round(members, security, call_timeout)
            done += 1
        alarms = await client.maintenancestub.Alarm(
            rpc.AlarmRequest(action=rpc.AlarmRequest.GET, memberID=0, alarm=rpc.NONE),
            timeout=call_timeout,
        )
    finally:
        await client.close()
    report = _report(round_, done)
    raised = tuple((int(a.memberID), rpc.AlarmType.Name(a.alarm)) for a in alarms.alarms)
    return ConsistencyReport(report.revision, report.members, raised, report.note, report.rounds)


def members_consistent(
    endpoints: str, tls_files: TlsFiles | None = None, *, call_timeout: float = 5.0
) -> ConsistencyReport:
    """The probe, blocking (from sync code, or from inside a running event
    loop: it then runs on a loop of its own in a worker thread, since an
    etcd client is bound to the loop that made it). `tls_files`: root's
    certificate, None for a plaintext etcd. Check `report.ok` (consistent
    and alarm-free) or `report.consistent`."""
    security = Security(files=tls_files) if tls_files is not None else None
    probe = check_members(endpoints, security, call_timeout=call_timeout)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(probe)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, probe).result()


def render(report: ConsistencyReport, output: str) -> str:
    if output == "json":
        return json.dumps(report.to_json(), indent=2)
    return report.text()
