"""The domain values Baton's typed clients answer with: frozen dataclasses
(or the stored `session_pb2` messages they hold), never a `…Response` proto,
so that a caller needs no generated module to read an answer."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.etcd.keys import NO_AGENT, AgentLabel


@dataclass
class LoadedSession:
    """A session as loaded to run it: snapshot, its revision, the context."""

    snapshot: s.SessionSnapshot
    revision: int
    context: list[s.ChatMessage]


@dataclass(frozen=True)
class OwnerInstance:
    """A live owner instance as the registry lists it: the agent code it
    loaded, and the deployment its drain hands sessions to ("" = none)."""

    deployment_id: str
    instance_id: str
    address: str
    agent: AgentLabel = NO_AGENT
    drain_to: str = ""


@dataclass(frozen=True)
class InstanceChange:
    """What a watch of a deployment's instances reports: the live ones, and
    the instances that died (their sessions are to be taken over)."""

    instances: tuple[OwnerInstance, ...]
    dead_instance_ids: tuple[str, ...]


@dataclass(frozen=True)
class OwnedSession:
    """A session with its current owner (and whether it is parked, as of the
    listing)."""

    fence: s.Fence
    owner: s.OwnerIdentity
    parked: bool
    input_waiting: bool = False  # parked, and its bell rang since (listing one instance)


@dataclass(frozen=True)
class CreatedSession:
    """A session hooks created (CreateSession): its first fence, every token
    it claimed (inbox token first), and the inbox entry its first command
    became (None without a first command)."""

    fence: s.Fence
    inbox_token: str
    hooks: tuple[str, ...]
    first_entry: s.InboxEntry | None


@dataclass(frozen=True)
class HookTarget:
    """What a token resolves to (LookupHook): the session, its channel and,
    for a child session, its parent link as created."""

    session_id: str
    channel: str
    parent: s.ParentLink | None


@dataclass(frozen=True)
class InstanceLease:
    """An owner instance's registration (RegisterInstance): the lease to keep
    alive and its granted TTL."""

    lease_id: int
    ttl_seconds: int


@dataclass(frozen=True)
class TakenOver:
    """A takeover's outcome (TakeOverSession): the successor's fence; whether
    the session stays parked under it, and the inbox head at the takeover
    (for a parked session, its consumed position); a parked session's
    lifetime deadline (unix seconds, 0 = none)."""

    fence: s.Fence
    parked: bool
    inbox_head: int
    timeout_deadline: int = 0


@dataclass(frozen=True)
class Moved:
    """A session moved to a successor (Transfer, AdoptSession): its fence,
    and whether this answers a replay of a move already applied."""

    fence: s.Fence
    replayed: bool


@dataclass(frozen=True)
class RecordedTransfer:
    """A transfer's outcome as hooks recorded it under its handoff id."""

    fence: s.Fence
    successor: s.OwnerIdentity
    trigger_seq: int
    reason: s.TransferReason.ValueType


@dataclass(frozen=True)
class SessionOwner:
    """Who owns a session now (GetOwner)."""

    fence: s.Fence
    owner: s.OwnerIdentity
    parked: bool
    inbox_head: int


@dataclass(frozen=True)
class SessionDescription:
    """What hooks stores of a session (DescribeSession)."""

    fence: s.Fence
    owner: s.OwnerIdentity
    parked: bool
    inbox_head: int
    channel: str
    hooks: tuple[str, ...]
    parent: s.ParentLink | None
    create_time: Timestamp | None
    oldest_unconsumed_seq: int | None
    oldest_unconsumed_accepted_at: Timestamp | None


@dataclass(frozen=True)
class ChannelSessions:
    """One page of a channel's index (ListChannelSessions)."""

    sessions: tuple[tuple[str, Timestamp], ...]
    more: bool


@dataclass(frozen=True)
class Committed:
    """A step committed (CommitStep): the etcd revision, and whether an
    identical earlier commit was found (a retried request)."""

    revision: int
    replayed: bool


@dataclass(frozen=True)
class StartedSession:
    """A session an owner started (StartSession), or found started."""

    session_id: str
    owner_run_id: str
    created: bool
    inbox_token: str
    first_command_appended: bool = False


@dataclass(frozen=True)
class HandoffAccepted:
    """A handoff the target accepted (AcceptHandoff): the successor run now
    holding the session, its fence, and whether this answers a repeat."""

    successor: s.OwnerIdentity
    fence: s.Fence
    replayed: bool


@dataclass(frozen=True)
class DrainBlocker:
    """A session a drain has not moved yet, and why."""

    session_id: str
    reason: str
    detail: str


@dataclass(frozen=True)
class Undrained:
    """An instance's stopped drain (UndrainSessions): the target it drained
    to ("" = it did not drain), the sessions it had moved there, and those
    it holds now."""

    deployment_id: str
    instance_id: str
    was_to_deployment_id: str
    moved: int
    held: int


@dataclass(frozen=True)
class DrainReport:
    """One owner instance's drain progress (DrainSessions)."""

    deployment_id: str
    instance_id: str
    to_deployment_id: str
    moved: int
    remaining: int
    blockers: tuple[DrainBlocker, ...]
