"""The model's state: what etcd holds of one session, what each owner
instance holds in memory, what each gateway knows, and the fault budgets
left. Every part is an immutable tuple (NamedTuples and plain tuples of
ints, strings and bools), so a state is hashable and two states are equal
exactly when every field is: the checker (explore.py) stores and compares
them as they are.

Names follow the code: `Store` is one session's keys (services/common/etcd/
keys.py), `Host` an owner instance (services/owner/host/host.py), `Run` a
`SessionRun` (services/owner/run/session.py), `Parked` a `ParkedSession`
(services/owner/host/parking.py), `Acceptance` an `AcceptHandoff` in
flight on the target (services/owner/handoff/acceptance.py).
"""

from __future__ import annotations

from typing import NamedTuple

# A run's program counter: where it is in services/owner/run/session.py.
IDLE = "idle"  # `_serve` waits for the next inbox entry (or continues an open turn)
FORCED = "forced"  # the entry at its inbox position is processed here, no trigger check
BEGIN = "begin"  # `_begin` of a run moved here without a trigger: handed_off first
UNSURE = "unsure"  # a commit's answer was lost: `_commit` retries the identical request
OFFERED = "offered"  # AcceptHandoff is in flight (`HandoffAttempts._offer`)
SETTLING = "settling"  # an uncertain handoff: `SessionRun._settle_uncertain`'s fenced commit

NOT_PARKED = -1


class Entry(NamedTuple):
    """An inbox entry (`s/{sid}/inbox/{seq}`; its seq is its index in the
    inbox): the delivery (message index), the deployment of the ingress
    that accepted it, and the fence epoch when it was appended (the inbox
    stream of a run fenced since delivers only what was appended before
    the fence moved: the watch yields in revision order)."""

    msg: int
    via: str
    epoch: int


class Event(NamedTuple):
    """A stream event (`s/{sid}/e/{seq}`): a step of the turn of one inbox
    entry, session.handed_off, or session.started; with the committing
    run's fence epoch and deployment."""

    seq: int
    kind: str  # "started" | "step" | "handed_off"
    inbox_seq: int  # the entry whose turn the step belongs to (-1: none)
    step: int  # 1.. within that turn (0: not a step)
    epoch: int
    deployment: str


class Snapshot(NamedTuple):
    """The committed snapshot (`s/{sid}/snapshot`), reduced to what the
    protocol reads: the consumed inbox position, the open turn, the next
    stream seq, the deployment that committed it, and its key's mod
    revision (a counter of snapshot writes: what commits and transfers
    compare)."""

    inbox_next: int
    open_steps: int  # steps committed of the open turn (0: no open turn)
    next_event_seq: int
    deployment: str
    revision: int


class Store(NamedTuple):
    """One session's keys in etcd.

    `epoch` and `holder` are the fence (`s/{sid}/c/fence` = "{epoch}/{run}")
    and the owner record's instance (the run is named by its instance: one
    instance makes one run per epoch); `holder` "" is nobody (only the
    release-then-claim variant writes it). `parked_at` is the owner
    record's parked flag with the consumed position its park recorded.
    `bells` are `bell/{instance}/{sid}` = inbox head. `handoffs` are the
    transfer records under their handoff ids: (id, epoch, successor).
    `audit` is a history variable, not a key: what the invariants must see
    of a transition (a commit accepted from a stale fence, a committed step
    run again, a session moved with a backlog), as (invariant, what
    happened), written where it happens."""

    epoch: int
    holder: str
    parked_at: int
    inbox: tuple[Entry, ...]
    bells: tuple[tuple[str, int], ...]
    snapshot: Snapshot
    events: tuple[Event, ...]
    handoffs: tuple[tuple[int, int, str], ...]
    audit: tuple[tuple[str, str], ...] = ()


class Run(NamedTuple):
    """A `SessionRun`: its fence epoch (its instance is its host's), the
    snapshot it last committed or loaded, and its program counter.
    OFFERED/SETTLING name the handoff (`handoff`, its target instance in
    `target`; `trigger` the entry it carries, -1 for a drain); UNSURE keeps
    the commit whose answer was lost (`pending`: the snapshot it wrote and
    its first event, for the replay check)."""

    epoch: int
    snap: Snapshot
    pc: str = IDLE
    handoff: int = -1
    target: str = ""
    trigger: int = -1
    pending: tuple[Snapshot, Event | None] | None = None
    tag: str = "run"  # (so that no two kinds of holding compare equal)


class Parked(NamedTuple):
    """A `ParkedSession`: the fence epoch and consumed position it was
    parked (or taken over parked) with; a bell above `inbox_next` wakes it."""

    epoch: int
    inbox_next: int
    tag: str = "parked"


class Activating(NamedTuple):
    """`HostedSessions._activate` pending: unpark first (a wake, a failed
    run's restart), then load the snapshot and run it with this epoch."""

    epoch: int
    unpark: bool
    tag: str = "activating"


class Claiming(NamedTuple):
    """A TakeOverSession whose answer was lost (`Restarts.take_over` retries
    it with the same successor run): from the fence (epoch, instance)."""

    epoch: int
    from_instance: str
    tag: str = "claiming"


Held = Run | Parked | Activating | Claiming


class Acceptance(NamedTuple):
    """An AcceptHandoff on its target (`HandoffAcceptance.offer`, driven by
    `OwnerHost._accept`): the handoff id, the old owner's fence, the
    trigger's inbox seq (-1: a drain) and the checkpoint it was offered.
    `replaying`: the Transfer's answer was lost; the identical request goes
    again (`HandoffAcceptance.transfer`)."""

    handoff: int
    from_epoch: int
    from_instance: str
    trigger: int
    checkpoint: Snapshot
    replaying: bool = False


class Host(NamedTuple):
    """An owner instance: its name, its process (up or not), its lease in
    the registry (`d/{deployment}/{instance}`), what it holds of the
    session, the handoffs it is accepting, and whether its join still has
    to take its own leftovers over (`FleetMembership._join`: the fence
    epoch it listed them at; 0: nothing to take)."""

    name: str
    up: bool
    lease: bool
    held: Held | None
    accepting: tuple[Acceptance, ...] = ()
    rejoin: int = 0


class Gateway(NamedTuple):
    """One message's gateway: the ingress it sends through ("" = not sent
    yet), whether its last append's answer was lost (it must send again,
    same delivery id), and the receipt's inbox seq it got (-1: none)."""

    via: str = ""
    retry: bool = False
    receipt: int = -1


class Budget(NamedTuple):
    """What is left of the faults and attempts the bounds allow."""

    crashes: int  # kill -9, or a pause past the lease
    lost: int  # replies (or calls) lost
    handoffs: int  # handoff ids: handoffs, drains and adoptions attempted


class State(NamedTuple):
    store: Store
    hosts: tuple[Host, ...]  # in `Bounds.instances` order
    gateways: tuple[Gateway, ...]  # by message
    budget: Budget
    draining: bool = False  # an operator drains deployment A to B
