"""Live items: a running step's output as it forms (docs/design.md "Live
items"), and `LiveView`, which assembles them into each step's text.

A follower asked for live items (`client.follow(sid, live=True)`) yields
committed `Event`s and `LiveBatch`es: consecutive `LiveItem`s of one step
run (`LiveStep`). Live items are not events: they have no seq, are never
stored, and the step's commit supersedes them (the committed
`message.completed` holds the whole text). `LiveView` applies the rules
that say when to drop them:

- an event at or above a step run's `base_seq` supersedes its items;
- a step run of a higher epoch (a successor after an owner crash) voids
  the items of lower epochs at or above its own `base_seq`, and a higher
  attempt of the same run voids the lower one's;
- items arrive in offset order from 0; one seen before (a follower that
  reconnected gets the step in flight's items again) is skipped, and a
  gap (`LIVE_KIND_DROPPED`, or offsets missing) leaves the text incomplete
  until the commit (`LiveDraft.dropped`).

No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton_client._proto.baton.session.v1 import session_pb2 as session_pb
from baton_client.types import Event, LiveBatch, LiveKind, LiveStep

K = LiveKind

#: A step run's identity: its items, and only its, belong together.
RunKey = tuple[str, str, int, str, int, int, int]


def run_key(step: LiveStep) -> RunKey:
    """(session, owner run, epoch, turn, step, attempt, base_seq) of a step run."""
    return (
        step.session_id,
        step.owner_run_id,
        step.epoch,
        step.turn_id,
        step.step,
        step.attempt,
        step.base_seq,
    )


def voids(newer: LiveStep, older: LiveStep) -> bool:
    """Whether the items of step run `newer` make those of `older` void: a
    higher epoch from at or below `older`'s base_seq, or a higher attempt
    of the same owner run."""
    if run_key(newer) == run_key(older):
        return False
    if newer.epoch > older.epoch:
        return older.base_seq >= newer.base_seq
    same_run = (newer.owner_run_id, newer.epoch) == (older.owner_run_id, older.epoch)
    return same_run and newer.attempt > older.attempt and older.base_seq >= newer.base_seq


@dataclass
class LiveToolCall:
    """A tool call of a running step, as the model forms it."""

    #: Which call of the step (from 0).
    index: int
    #: The call's id and tool, once the model has named them.
    id: str = ""
    name: str = ""
    #: Its arguments so far (JSON, partial until the commit).
    arguments: str = ""


@dataclass
class LiveDraft:
    """One step run's live output so far: what a chat client shows while the
    step runs, and replaces with the committed events when they arrive."""

    #: The step run.
    step: LiveStep
    #: The model's text so far.
    text: str = ""
    #: The step's tool calls as they form, by index.
    tool_calls: dict[int, LiveToolCall] = field(default_factory=dict)
    #: The latest progress each running tool reported, by tool call id.
    progress: dict[str, str] = field(default_factory=dict)
    #: The message that started the turn, when this is its first step.
    turn_text: str = ""
    #: Items this follower never got (a slow reader, an overflowing
    #: buffer): while nonzero, `text` is incomplete (the commit is whole).
    dropped: int = 0
    #: The offset of the next item expected.
    next_offset: int = 0

    @property
    def complete(self) -> bool:
        """No item of the step run missed so far."""
        return self.dropped == 0

    def apply(self, item: session_pb.LiveItem) -> bool:
        """Take one item; False for one already taken (a replay)."""
        if item.offset < self.next_offset:
            return False
        if item.kind == K.LIVE_KIND_DROPPED:
            self.dropped += item.offset + item.dropped - self.next_offset
            self.next_offset = item.offset + item.dropped
            return True
        self.dropped += item.offset - self.next_offset  # a gap nobody announced
        self.next_offset = item.offset + 1
        if item.kind == K.LIVE_KIND_TEXT:
            self.text += item.text
        elif item.kind == K.LIVE_KIND_TOOL_CALL:
            call = self.tool_calls.setdefault(
                item.tool_call_index, LiveToolCall(item.tool_call_index)
            )
            call.id = item.tool_call_id or call.id
            call.name = item.tool_name or call.name
            call.arguments += item.text
        elif item.kind == K.LIVE_KIND_TOOL_PROGRESS:
            self.progress[item.tool_call_id] = item.text
        elif item.kind == K.LIVE_KIND_TURN_STARTED:
            self.turn_text = item.text
        return True


class LiveView:
    """The live drafts of a session's steps in flight, from a live
    follower's items (`update` each one, events too).

        view = LiveView()
        for item in client.follow(session_id, live=True):
            view.update(item)
            if isinstance(item, Event): ...       # committed: the truth
            elif view.current is not None:
                show(view.current.text)           # the answer so far

    A draft goes when its step commits (an event at or above its
    `base_seq`) or when a newer run of the step voids it; `update` says
    which drafts went (`LiveUpdate`)."""

    def __init__(self, next_seq: int = 0) -> None:
        self._drafts: dict[RunKey, LiveDraft] = {}
        #: The seq after the last committed event seen: live items of a
        #: step below it are already superseded.
        self.next_seq = next_seq

    @property
    def drafts(self) -> list[LiveDraft]:
        """The steps in flight, oldest first (usually one)."""
        return sorted(self._drafts.values(), key=lambda d: (d.step.base_seq, d.step.epoch))

    @property
    def current(self) -> LiveDraft | None:
        """The newest step in flight, or None between steps."""
        drafts = self.drafts
        return drafts[-1] if drafts else None

    @property
    def text(self) -> str:
        """The newest step in flight's text ("" between steps)."""
        current = self.current
        return current.text if current is not None else ""

    def update(self, item: Event | LiveBatch) -> LiveUpdate:
        """Take a committed event or a live batch from a follower."""
        if isinstance(item, LiveBatch):
            return self._live(item)
        self.next_seq = max(self.next_seq, item.seq + 1)
        gone = [d for d in self._drafts.values() if d.step.base_seq <= item.seq]
        for draft in gone:
            del self._drafts[run_key(draft.step)]
        return LiveUpdate(draft=None, superseded=gone, voided=[])

    def _live(self, batch: LiveBatch) -> LiveUpdate:
        step = batch.step
        if step.base_seq < self.next_seq or any(voids(d.step, step) for d in self._drafts.values()):
            return LiveUpdate(draft=None, superseded=[], voided=[])  # stale: ignored
        voided = [d for d in self._drafts.values() if voids(step, d.step)]
        for draft in voided:
            del self._drafts[run_key(draft.step)]
        key = run_key(step)
        if key not in self._drafts:
            self._drafts[key] = LiveDraft(step=step)
        draft = self._drafts[key]
        for item in batch.items:
            draft.apply(item)
        return LiveUpdate(draft=draft, superseded=[], voided=voided)


@dataclass(frozen=True)
class LiveUpdate:
    """What one `LiveView.update` changed."""

    #: The draft a live batch added to (None for an event, or a stale batch).
    draft: LiveDraft | None
    #: Drafts an event's commit replaced (their committed events follow).
    superseded: list[LiveDraft]
    #: Drafts a newer run of their step made void (never to be committed).
    voided: list[LiveDraft]
