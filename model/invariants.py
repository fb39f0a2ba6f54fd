"""What must hold: design §9's invariants on every reachable state, and
what must be true once the system has nothing left to do (quiescence).

Each check returns None when it holds, or a sentence saying what is wrong.
Most read only what etcd holds (`STORED`: checks of a `Store`, which many
states share, so the checker runs them once per store); the others read
the processes and gateways too (`SAFETY`, `QUIESCENT`). The names are the
ones a violation reports.
"""

from __future__ import annotations

from collections.abc import Callable

from model.options import deployment_of
from model.state import NOT_PARKED, Parked, Run, State, Store

StoreCheck = Callable[[Store], str | None]
Check = Callable[[State], str | None]


# -- what etcd holds, on every state ------------------------------------------------------


def _audited(st: Store, invariant: str) -> str | None:
    """What the transitions noted for `invariant` (the store's audit)."""
    return "; ".join(what for name, what in st.audit if name == invariant) or None


def fenced_commits(st: Store) -> str | None:
    """§9.1 every commit is fenced: no commit is accepted from a run whose
    fence is not the session's (noted by the commit where it happens)."""
    return _audited(st, "fenced_commits")


def steps_once(st: Store) -> str | None:
    """§9.3 no committed step runs again: the session's owner never runs a
    step whose commit is on the stream (`Model(strict_step_once=True)`: no
    run does, a stale one included)."""
    return _audited(st, "steps_once")


def idle_moves(st: Store) -> str | None:
    """§6 a session moves only idle, and a backlog never moves: a trigger
    is the last arrival, a drain leaves nothing unprocessed, no turn is
    open (noted by the transfer)."""
    return _audited(st, "idle_moves")


def gapless_stream(st: Store) -> str | None:
    """§7 the stream is gapless from 0, and the snapshot names its head."""
    for seq, event in enumerate(st.events):
        if event.seq != seq:
            return f"stream seq {event.seq} at position {seq}"
    if st.snapshot.next_event_seq != len(st.events):
        return f"the snapshot says the stream head is {st.snapshot.next_event_seq}"
    return None


def inbox_once_in_order(st: Store) -> str | None:
    """§9.2 inbox entries are processed once each, in inbox order: the turns
    on the stream start at inbox seqs 0, 1, 2, ... and the snapshot's
    consumed position is where they stopped."""
    started = [e.inbox_seq for e in st.events if e.kind == "step" and e.step == 1]
    if started != list(range(len(started))):
        return f"turns started for inbox seqs {started}"
    if st.snapshot.inbox_next != len(started) or st.snapshot.inbox_next > len(st.inbox):
        return f"consumed position {st.snapshot.inbox_next} after {len(started)} turns"
    return None


def deliveries_once(st: Store) -> str | None:
    """§3 a delivery id is appended once (a repeat answers the first
    receipt), so each message is processed at most once."""
    msgs = [e.msg for e in st.inbox]
    repeated = sorted({m for m in msgs if msgs.count(m) > 1})
    if repeated:
        names = ", ".join(f"m{m}" for m in repeated)
        return f"deliveries appended more than once: {names}"
    return None


def runs_not_interleaved(st: Store) -> str | None:
    """§9.1/§7 owner runs follow one another on the stream: its fence
    epochs never go back."""
    epochs = [e.epoch for e in st.events]
    if any(b < a for a, b in zip(epochs, epochs[1:], strict=False)):
        return f"stream epochs {epochs}"
    return None


def handed_off_marks(st: Store) -> str | None:
    """§6/§9.7 the first event of a deployment's runs after another's is
    session.handed_off, and it appears nowhere else; §9.4 the events of the
    session's owner name its deployment."""
    previous = ""
    for event in st.events:
        changed = bool(previous) and event.deployment != previous
        if changed != (event.kind == "handed_off"):
            return f"event {event.seq} ({event.kind}) on {event.deployment} after {previous}"
        previous = event.deployment
    last = st.events[-1]
    if st.holder and last.epoch == st.epoch and last.deployment != deployment_of(st.holder):
        return f"the owner {st.holder}'s events name deployment {last.deployment}"
    return None


def bells_cover_arrivals(st: Store) -> str | None:
    """§5 a wake-up is never lost: while the owner record says parked at a
    position, every arrival since rang its instance's bell (the append's own
    transaction rings it), so the inbox head is that position or the bell
    names it."""
    if st.parked_at == NOT_PARKED or len(st.inbox) == st.parked_at:
        return None
    bell = dict(st.bells).get(st.holder)
    if bell != len(st.inbox):
        return f"parked at {st.parked_at} with the inbox at {len(st.inbox)}, bell {bell}"
    return None


STORED: dict[str, StoreCheck] = {
    "fenced_commits": fenced_commits,
    "steps_once": steps_once,
    "idle_moves": idle_moves,
    "gapless_stream": gapless_stream,
    "inbox_once_in_order": inbox_once_in_order,
    "deliveries_once": deliveries_once,
    "runs_not_interleaved": runs_not_interleaved,
    "handed_off_marks": handed_off_marks,
    "bells_cover_arrivals": bells_cover_arrivals,
}


# -- processes and gateways, on every state ---------------------------------------------


def one_owner(s: State) -> str | None:
    """§9.1 at most one owner is active: one run (in a live process) holds
    the session's fence."""
    st = s.store
    owners = [
        h.name
        for h in s.hosts
        if h.up and isinstance(h.held, Run) and (h.held.epoch, h.name) == (st.epoch, st.holder)
    ]
    if len(owners) > 1:
        return f"runs of {owners} hold the fence {st.epoch}/{st.holder}"
    return None


def receipts(s: State) -> str | None:
    """§3 accepted means durably written: a receipt names the inbox seq
    where its delivery is."""
    inbox = s.store.inbox
    for m, gateway in enumerate(s.gateways):
        seq = gateway.receipt
        if seq >= 0 and (seq >= len(inbox) or inbox[seq].msg != m):
            return f"m{m}'s receipt names inbox seq {seq}, which holds something else"
    return None


SAFETY: dict[str, Check] = {
    "one_owner": one_owner,
    "receipts": receipts,
}


# -- at quiescence: nothing the system does is enabled -----------------------------------


def all_processed(s: State) -> str | None:
    """§9.2 every accepted command processed (exactly once, in order, with
    the safety checks): nothing left in the inbox, no open turn."""
    st = s.store
    left = len(st.inbox) - st.snapshot.inbox_next
    if left or st.snapshot.open_steps:
        turn = f", a turn open ({st.snapshot.open_steps} steps)" if st.snapshot.open_steps else ""
        return f"{left} accepted command(s) never processed{turn}; {_where(s)}"
    return None


def someone_owns(s: State) -> str | None:
    """§5 the session has an owner that holds it (running or parked): a
    session indexed under an instance that holds nothing would not see its
    next command."""
    holder = s.store.holder
    if not holder:
        return "nobody owns the session (released, never claimed)"
    h = next(h for h in s.hosts if h.name == holder)
    if not (h.up and isinstance(h.held, Run | Parked) and h.held.epoch == s.store.epoch):
        return f"the owner record names {holder}, which holds {h.held!r}"
    return None


QUIESCENT: dict[str, Check] = {
    "all_processed": all_processed,
    "someone_owns": someone_owns,
}


def _where(s: State) -> str:
    st = s.store
    holder = st.holder or "nobody"
    bells = ", ".join(f"{i}={h}" for i, h in st.bells) or "none"
    parked = f"parked at {st.parked_at}" if st.parked_at >= 0 else "not parked"
    return f"owner {holder} (epoch {st.epoch}, {parked}), bells: {bells}"
