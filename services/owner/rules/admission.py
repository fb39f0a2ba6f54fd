"""Admission rules (docs/design.md §4), a layer of `SessionState` (turns.py):
what a command taken from the inbox means for an open turn at a model-call
boundary, and admitting those that join it. Pure: no I/O.

- a steer message (the default) or a background result joins the open turn
  at its next boundary, at most MAX_ADMITTED_PER_BOUNDARY at one boundary
  (the rest at the next); a queued message or input responses wait for the
  turn to end;
- while the open turn waits (for the user, or for children), a queued
  message waits for it to end and holds back the messages behind it; what
  answers or ends the wait is taken past it (`next_to_take`);
- cancel settles the turn as cancelled; reset and an own timeout end the
  session; a pushed one of these aborts the running step at once when
  everything ahead of it in the inbox can join the turn;
- a stale timeout or sign-in attempt is consumed and changes nothing; an
  unknown kind is consumed with a command.rejected event.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import limits
from baton_runtime.owner.rules.handles import ReportMeaning
from baton_runtime.owner.rules.step_rules import StepRules


class Admission(enum.Enum):
    """How a pending command joins an open turn at a model-call boundary."""

    ADMIT = "admit"  # a steer message or a background result: joins the open turn
    REPORT = "report"  # a child's report that only changes handles/the stream
    CANCEL = "cancel"  # settles the open turn as cancelled
    FINALIZE = "finalize"  # reset or own timeout: ends the session
    DROP = "drop"  # stale timeout or sign-in attempt: consumed, nothing else
    REJECT = "reject"  # unknown kind: consumed with an error event
    BLOCK = "block"  # waits until the turn settles


def principal(entry: s.InboxEntry) -> tuple[str, str]:
    return entry.command.delivery.channel, entry.command.delivery.caller


class AdmissionRules(StepRules):
    """How commands join an open turn (the layer under `SessionState`)."""

    def classify(self, entry: s.InboxEntry) -> Admission:
        """How a command joins an open turn at a model-call boundary."""
        command = entry.command
        kind = command.WhichOneof("kind")
        if kind == "send":
            send = command.send
            if self.refuses_message(entry):
                return Admission.REJECT
            if send.input_responses or send.turn_policy == s.TURN_POLICY_QUEUE:
                return Admission.BLOCK
            return Admission.ADMIT if send.text.strip() else Admission.REJECT
        if kind == "cancel":
            return Admission.CANCEL
        if kind == "reset":
            return Admission.FINALIZE
        if kind == "timeout":
            own = command.timeout.armed_by_owner_run_id == self.run_id
            return Admission.FINALIZE if own else Admission.DROP
        if kind == "authorization_callback":
            waiting = self.auth_wait(command.authorization_callback.attempt_id) is not None
            return Admission.BLOCK if waiting else Admission.DROP
        if kind == "task_result":
            meaning = self.read_report(entry).meaning
            if meaning is ReportMeaning.REJECT:
                return Admission.REJECT
            if meaning is ReportMeaning.ADMIT:
                return Admission.ADMIT
            if meaning is ReportMeaning.AWAITED:
                return Admission.BLOCK  # the run resumes the waiting turn with it
            return Admission.REPORT
        if kind is None:
            return Admission.REJECT
        return Admission.BLOCK

    def aborts_step(self, entry: s.InboxEntry, ahead: Sequence[s.InboxEntry]) -> bool:
        """A pushed command aborts the running step at once: cancel, reset or
        an own timeout, when every command ahead of it can join the turn."""
        if self.classify(entry) not in (Admission.CANCEL, Admission.FINALIZE):
            return False
        joinable = (Admission.ADMIT, Admission.DROP, Admission.REJECT, Admission.REPORT)
        return all(self.classify(e) in joinable for e in ahead)

    def take(self, pending: collections.deque[s.InboxEntry]) -> s.InboxEntry | None:
        """Take the command the run processes next out of `pending`
        (`next_to_take`); None when it takes none yet. The commands it
        passes stay in `pending`, set aside: what is consumed while they
        are is recorded as consumed ahead of the inbox position."""
        index = self.next_to_take(pending)
        if index is None:
            return None
        self.set_aside_from = pending[0].seq if index else None
        entry = pending[index]
        del pending[index]
        return entry

    def next_to_take(self, pending: Sequence[s.InboxEntry]) -> int | None:
        """The index in `pending` of the command the run takes next, None
        when it takes none yet. In inbox order, except while the open turn
        waits (for the user, or for children's results): a queued message
        then waits for the turn to end, and so does every message or result
        behind it that would join the turn; the commands behind them are
        taken (answers, callbacks, results, cancel, ...). Nothing set aside
        is consumed: a successor holds it again."""
        if not self.still_waiting():
            return 0 if pending else None
        holding = False
        for index, entry in enumerate(pending):
            if self.is_queued(entry):
                holding = True
            elif not (holding and self.classify(entry) is Admission.ADMIT):
                return index
        return None

    def is_queued(self, entry: s.InboxEntry) -> bool:
        """A message sent with the queue policy (not input responses)."""
        command = entry.command
        return (
            command.WhichOneof("kind") == "send"
            and not command.send.input_responses
            and self.classify(entry) is Admission.BLOCK
        )

    def steer_pending(self, pending: Sequence[s.InboxEntry]) -> bool:
        return bool(pending) and self.classify(pending[0]) is not Admission.BLOCK

    def admit(self, entry: s.InboxEntry, events: list[s.Event]) -> None:
        """Admit a steer message or a background result into the open turn."""
        if entry.command.WhichOneof("kind") == "task_result":
            self.apply_report(entry, events)
        else:
            self.admit_message(entry, events)

    def admit_message(self, entry: s.InboxEntry, events: list[s.Event]) -> None:
        send = entry.command.send
        text = send.text
        self.consume(entry)
        self.snapshot.open_turn.inbox_seqs.append(entry.seq)
        if send.parent_work and self.is_child:
            self.snapshot.parent.work = send.parent_work
        self.context.remember(s.ChatMessage(role=s.ROLE_USER, content=text))
        events.append(self.event(s.EVENT_KIND_MESSAGE_RECEIVED, entry, text=text))

    def admit_pending(
        self, pending: collections.deque[s.InboxEntry], events: list[s.Event]
    ) -> tuple[Admission, s.InboxEntry | None]:
        """At a model-call boundary: admit what may join the turn, in order;
        stop at a command that settles or ends it (returned, consumed)."""
        admitted = 0
        while pending:
            entry = pending[0]
            admission = self.classify(entry)
            if admission is Admission.BLOCK:
                break
            if admission is Admission.ADMIT:
                if admitted >= limits.MAX_ADMITTED_PER_BOUNDARY:
                    break  # the rest join at the next boundary
                admitted += 1
            pending.popleft()
            if admission is Admission.ADMIT:
                self.admit(entry, events)
            elif admission is Admission.REPORT:
                self.apply_report(entry, events)
            elif admission is Admission.DROP:
                self.consume(entry)
            elif admission is Admission.REJECT:
                self.consume(entry)
                events.append(self.rejection(entry))
            else:
                self.consume(entry)
                return admission, entry
        return Admission.BLOCK, None
