"""The etcd key schema, shared by hooks and anchor.

Every transaction stays inside one session's keys (plus, for claims and
disposal, the token-index entries pointing at that session):

    {root}s/{sid}/c/fence          "{epoch}/{owner_run_id}"   compared by every owner write
    {root}s/{sid}/c/in/{seq:020d}  InboxEntry                 the durable inbox (c/ = owner watch)
    {root}s/{sid}/owner            OwnerRecord JSON           who owns the session
    {root}s/{sid}/inhead           "{next inbox seq}"         the inbox head, compared by appends
    {root}s/{sid}/dlv/{delivery}   Receipt                    delivery-id deduplication
    {root}s/{sid}/hooks            JSON list of tokens        the session's own record of its claims
    {root}s/{sid}/ev/{seq:020d}    Event                      the public stream
    {root}s/{sid}/evm              "{last seq}"               commit marker, put last by a commit
    {root}s/{sid}/horizon          "{first seq kept}"         the stream's retention horizon: put by
                                                              the txn that deletes the events below
                                                              it (absent: nothing deleted yet)
    {root}s/{sid}/pg/{page:020d}   "{unix ms}"                when the stream page (64 seqs) began:
                                                              put by the commit writing its first
                                                              seq; dates the events before it
    {root}s/{sid}/snap             SessionSnapshot            the last committed snapshot
    {root}s/{sid}/h/{index:020d}   ChatMessage                model history, appended by commits
    {root}s/{sid}/xfer/{handoff}   Transfer JSON              the outcome of an applied handoff
    {root}s/{sid}/closed           "{terminal seq}"           present once the stream closed
    {root}t/{token}                TokenRecord JSON           token index: token -> session
    {root}ch/{channel}/{sid}       ChannelEntry JSON          channel index: written by the txn
                                                              that creates the session, deleted
                                                              with its token-index entries;
                                                              ListSessions pages through it
    {root}gc/{expires:015d}/{sid}  ""                         retention index: written by the
                                                              commit that closes the stream;
                                                              the session's keys are deleted
                                                              after `expires` (unix ms)
    {root}hx/{handoff}             "{sid}"                    handoff index: written by the
                                                              transfer txn beside the session's
                                                              `xfer/{handoff}` record, under the
                                                              same deduplication-window lease
                                                              (GetTransfer by handoff id alone)

Owner instances and their sessions (docs/design.md §5):

    {root}d/{deployment}/{instance}       InstanceRecord JSON  live owner instances; attached to
                                                               the instance's etcd lease, so the
                                                               key vanishes when the lease expires
    {root}i/{deployment}/{instance}/{sid} "{epoch}/{run}"      ownership index: written in the same
                                                               txn as every owner change (create,
                                                               takeover), so a dead instance's
                                                               sessions can be listed
    {root}bell/{instance}/{sid}           "{inbox head}"       "parked session has new input":
                                                               put by the inbox append txn while
                                                               the owner record says parked,
                                                               deleted when the session unparks

The owner record is `OwnerRecord` (canonical JSON, compared byte-exact by the
inbox append so that a bell is rung exactly while the session is parked).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

SEQ_WIDTH = 20


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def seq_suffix(seq: int) -> bytes:
    return str(seq).zfill(SEQ_WIDTH).encode()


@dataclass(frozen=True)
class Keys:
    """Key builder under one root prefix (tests use a unique root each)."""

    root: str = "/baton/"

    def _s(self, session_id: str, rest: str) -> bytes:
        return f"{self.root}s/{session_id}/{rest}".encode()

    def session_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "")

    def control_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "c/")

    def fence(self, session_id: str) -> bytes:
        return self._s(session_id, "c/fence")

    def inbox_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "c/in/")

    def inbox_entry(self, session_id: str, seq: int) -> bytes:
        return self.inbox_prefix(session_id) + seq_suffix(seq)

    def owner(self, session_id: str) -> bytes:
        return self._s(session_id, "owner")

    def inbox_head(self, session_id: str) -> bytes:
        return self._s(session_id, "inhead")

    def delivery(self, session_id: str, delivery_id: str) -> bytes:
        return self._s(session_id, f"dlv/{delivery_id}")

    def hooks(self, session_id: str) -> bytes:
        return self._s(session_id, "hooks")

    def events_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "ev/")

    def event(self, session_id: str, seq: int) -> bytes:
        return self.events_prefix(session_id) + seq_suffix(seq)

    def stream_prefix(self, session_id: str) -> bytes:
        """Events and the commit marker: what a live reader watches."""
        return self._s(session_id, "ev")

    def commit_marker(self, session_id: str) -> bytes:
        return self._s(session_id, "evm")

    def horizon(self, session_id: str) -> bytes:
        """First stream seq kept (outside `stream_prefix`: followers never
        see it)."""
        return self._s(session_id, "horizon")

    def stream_pages_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "pg/")

    def stream_page(self, session_id: str, page: int) -> bytes:
        return self.stream_pages_prefix(session_id) + seq_suffix(page)

    def transfer(self, session_id: str, handoff_id: str) -> bytes:
        return self._s(session_id, f"xfer/{handoff_id}")

    def snapshot(self, session_id: str) -> bytes:
        return self._s(session_id, "snap")

    def closed(self, session_id: str) -> bytes:
        return self._s(session_id, "closed")

    def history_prefix(self, session_id: str) -> bytes:
        return self._s(session_id, "h/")

    def history_entry(self, session_id: str, index: int) -> bytes:
        return self.history_prefix(session_id) + seq_suffix(index)

    def retention_prefix(self) -> bytes:
        return f"{self.root}gc/".encode()

    def retention(self, expires_ms: int, session_id: str) -> bytes:
        return f"{self.root}gc/{expires_ms:015d}/{session_id}".encode()

    def handoff(self, handoff_id: str) -> bytes:
        """The handoff index: which session a handoff id moved."""
        return f"{self.root}hx/{handoff_id}".encode()

    def token(self, token: str) -> bytes:
        return f"{self.root}t/{token}".encode()

    def channels_prefix(self) -> bytes:
        """The channel index of every tenant: one entry per session."""
        return f"{self.root}ch/".encode()

    def channel_prefix(self, channel: str) -> bytes:
        """The channel index of one tenant (its sessions in session id order)."""
        return f"{self.root}ch/{channel}/".encode()

    def channel_entry(self, channel: str, session_id: str) -> bytes:
        return self.channel_prefix(channel) + session_id.encode()

    def instances_prefix(self) -> bytes:
        """Every deployment's live instances (`instance` keys)."""
        return f"{self.root}d/".encode()

    def deployment_prefix(self, deployment_id: str) -> bytes:
        return f"{self.root}d/{deployment_id}/".encode()

    def instance(self, deployment_id: str, instance_id: str) -> bytes:
        return f"{self.root}d/{deployment_id}/{instance_id}".encode()

    def ownership_prefix(self) -> bytes:
        """Every deployment's ownership index."""
        return f"{self.root}i/".encode()

    def owned_prefix(self, deployment_id: str, instance_id: str = "") -> bytes:
        """The ownership index of a deployment, or of one of its instances."""
        if not instance_id:
            return f"{self.root}i/{deployment_id}/".encode()
        return f"{self.root}i/{deployment_id}/{instance_id}/".encode()

    def owned(self, deployment_id: str, instance_id: str, session_id: str) -> bytes:
        return self.owned_prefix(deployment_id, instance_id) + session_id.encode()

    def bell_prefix(self, instance_id: str) -> bytes:
        return f"{self.root}bell/{instance_id}/".encode()

    def bell(self, instance_id: str, session_id: str) -> bytes:
        return self.bell_prefix(instance_id) + session_id.encode()


def seq_of(key: bytes) -> int:
    """The seq encoded in an inbox, event, history or stream page key."""
    return int(key[-SEQ_WIDTH:])


def parse_retention(key: bytes) -> tuple[int, str]:
    """(expires unix ms, session id) of a retention-index key."""
    _, expires, session_id = key.decode().rsplit("/", 2)
    return int(expires), session_id


def fence_value(epoch: int, owner_run_id: str) -> bytes:
    """Canonical fence bytes; value compares are byte-exact."""
    return f"{epoch}/{owner_run_id}".encode()


def parse_fence(value: bytes) -> tuple[int, str]:
    epoch, _, run = value.decode().partition("/")
    return int(epoch), run


def canonical_json(data: object) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class TokenRecord:
    """What a token-index entry holds: the session and its tenant channel;
    for a child session, its parent link as created (a serialized
    `ParentLink`, base64 in the JSON; absent for other sessions)."""

    session_id: str
    channel: str
    parent: bytes = b""

    def encode(self) -> bytes:
        data = {"channel": self.channel, "session_id": self.session_id}
        if self.parent:
            data["parent"] = base64.b64encode(self.parent).decode()
        return canonical_json(data)

    @classmethod
    def decode(cls, value: bytes) -> TokenRecord:
        data = json.loads(value)
        parent = base64.b64decode(data["parent"]) if data.get("parent") else b""
        return cls(session_id=data["session_id"], channel=data["channel"], parent=parent)


@dataclass(frozen=True)
class ChannelEntry:
    """What a channel-index entry (`ch/{channel}/{sid}`) holds: when the
    session was created (unix ms)."""

    created_ms: int

    def encode(self) -> bytes:
        return canonical_json({"created_ms": self.created_ms})

    @classmethod
    def decode(cls, value: bytes) -> ChannelEntry:
        try:
            return cls(created_ms=int(json.loads(value).get("created_ms", 0)))
        except (ValueError, AttributeError):
            return cls(created_ms=0)


@dataclass(frozen=True)
class OwnerRecord:
    """Who owns a session (`s/{sid}/owner`) and whether it is parked.

    What its owner gave up when it parked the session stays here, so that
    whoever holds it next needs no snapshot to know it: the consumed inbox
    position it parked at (`parked_inbox_next_seq`, a takeover's answer to a
    successor that keeps it parked, replays included) and its lifetime
    deadline (`timeout_deadline`, unix seconds, 0 = none: the successor
    arms its wake-up, and hooks refuses appends after it). The deadline
    stays after a wake (the session's deadline moves only with a handoff
    to another deployment, whose transfer writes a new record).

    Canonical JSON, keys sorted: every key sorts after `epoch`, so a record
    begins with its deployment and epoch (`scope.owner_record_start`)."""

    owner_run_id: str
    deployment_id: str
    instance_id: str
    epoch: int
    parked: bool = False
    parked_inbox_next_seq: int = 0  # while parked (0 in a record of an older build)
    timeout_deadline: int = 0

    def encode(self) -> bytes:
        data: dict[str, object] = {
            "deployment_id": self.deployment_id,
            "epoch": self.epoch,
            "instance_id": self.instance_id,
            "owner_run_id": self.owner_run_id,
            "parked": self.parked,
        }
        if self.parked:
            data["parked_inbox_next_seq"] = self.parked_inbox_next_seq
        if self.timeout_deadline:
            data["timeout_deadline"] = self.timeout_deadline
        return canonical_json(data)

    @classmethod
    def decode(cls, value: bytes) -> OwnerRecord:
        data = json.loads(value)
        return cls(
            owner_run_id=str(data.get("owner_run_id", "")),
            deployment_id=str(data.get("deployment_id", "")),
            instance_id=str(data.get("instance_id", "")),
            epoch=int(data.get("epoch", 0)),
            parked=bool(data.get("parked", False)),
            parked_inbox_next_seq=int(data.get("parked_inbox_next_seq", 0)),
            timeout_deadline=int(data.get("timeout_deadline", 0)),
        )

    def past_deadline(self, now: float) -> bool:
        """The session's lifetime deadline, as this record knows it, passed."""
        return 0 < self.timeout_deadline <= now

    @property
    def fence(self) -> bytes:
        return fence_value(self.epoch, self.owner_run_id)


@dataclass(frozen=True)
class Bell:
    """A parked session has input up to `inbox_head` (`bell/{instance}/{session}`,
    rung by the append that passed the head the session parked at)."""

    session_id: str
    inbox_head: int


@dataclass(frozen=True)
class AgentLabel:
    """Which authored agent code an owner instance loaded: its `module:factory`
    spec, the root agent's name and the author's version ("" when unset)."""

    spec: str = ""
    name: str = ""
    version: str = ""

    def as_dict(self) -> dict[str, str]:
        parts = (("name", self.name), ("spec", self.spec), ("version", self.version))
        return {key: value for key, value in parts if value}


NO_AGENT = AgentLabel()


@dataclass(frozen=True)
class InstanceRecord:
    """A live owner instance (`d/{deployment}/{instance}`, under its lease);
    `agent`: the agent code it loaded; `drain_to`: the deployment an
    operator's drain hands its sessions to, as the instance announced it
    ("" = not draining)."""

    deployment_id: str
    instance_id: str
    address: str
    drain_to: str = ""
    agent: AgentLabel = NO_AGENT

    def encode(self) -> bytes:
        data: dict[str, object] = {
            "address": self.address,
            "deployment_id": self.deployment_id,
            "instance_id": self.instance_id,
        }
        if self.drain_to:
            data["drain_to"] = self.drain_to
        if self.agent.as_dict():
            data["agent"] = self.agent.as_dict()
        return canonical_json(data)

    @classmethod
    def decode(cls, value: bytes) -> InstanceRecord:
        data = json.loads(value)
        agent = data.get("agent")
        agent = agent if isinstance(agent, dict) else {}
        return cls(
            deployment_id=str(data.get("deployment_id", "")),
            instance_id=str(data.get("instance_id", "")),
            address=str(data.get("address", "")),
            drain_to=str(data.get("drain_to", "")),
            agent=AgentLabel(
                spec=str(agent.get("spec", "")),
                name=str(agent.get("name", "")),
                version=str(agent.get("version", "")),
            ),
        )
