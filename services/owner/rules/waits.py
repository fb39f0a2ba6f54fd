"""Wait rules (docs/design.md §4), a layer of `SessionState` (turns.py): human
input and sign-in pause the turn (the session waits); responses and
callbacks resume it (the two-phase answers are decisions.py's); a steer
message while a turn waits abandons the waits (a queued one waits for the
turn to end: admission.py); a spent budget asks the user
(input kind SESSION_LIMIT): approving extends it. Also the command.rejected
event a refused command gets. Pure: no I/O.
"""

from __future__ import annotations

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import Reason
from baton_runtime.owner.rules.child_rules import ChildRules


class WaitRules(ChildRules):
    """Waits of the open turn: input requests and sign-in attempts."""

    def auth_wait(self, attempt_id: str) -> s.AuthorizationWait | None:
        if not self.turn_open:
            return None
        for wait in self.snapshot.open_turn.pending_authorizations:
            if (
                attempt_id in wait.expected_attempt_ids
                and attempt_id not in wait.reported_attempt_ids
            ):
                return wait
        return None

    def rejection(self, entry: s.InboxEntry, reason: str = "", message: str = "") -> s.Event:
        """The command.rejected event for `entry` (a default reason by kind)."""
        if not reason:
            kind = entry.command.WhichOneof("kind")
            if kind is None:
                reason = Reason.UNKNOWN_COMMAND
                message = (
                    f"deployment {self.identity.deployment_id} does not know this command kind"
                )
            elif kind == "send" and self.refuses_message(entry):
                parent = self.snapshot.parent.parent_session_id
                reason = Reason.CHILD_SESSION
                message = (
                    f"this is a child session of {parent}: it takes messages from its "
                    "parent only (input responses and controls are accepted)"
                )
            elif kind == "send":
                reason, message = Reason.EMPTY_MESSAGE, "the message is empty"
            elif kind == "task_result":
                reading = self.read_report(entry)
                reason, message = reading.reason, reading.message
            else:
                reason = Reason.UNSUPPORTED_COMMAND
                message = (
                    f"command kind {kind!r} is not supported by deployment "
                    f"{self.identity.deployment_id}"
                )
        return self.event(
            s.EVENT_KIND_COMMAND_REJECTED,
            entry,
            error=s.ErrorDetail(reason=reason, message=message),
        )

    def request_input(
        self,
        events: list[s.Event],
        kind: s.InputKind.ValueType,
        prompt: str,
        *,
        step: int = 0,
        tool_call: s.ToolCall | None = None,
    ) -> None:
        request = s.InputRequest(
            request_id=self.next_id("input"), kind=kind, prompt=prompt, tool_call=tool_call
        )
        self.snapshot.open_turn.pending_inputs.append(request)
        events.append(self.event(s.EVENT_KIND_INPUT_REQUESTED, step=step, input_request=request))
        self.report_wait(request=request)

    def ask_to_extend_budget(self, events: list[s.Event]) -> None:
        self.request_input(
            events, s.INPUT_KIND_SESSION_LIMIT, "The session budget is spent. Extend it?"
        )
        events.append(self.event(s.EVENT_KIND_SESSION_WAITING))

    def require_authorization(
        self, events: list[s.Event], call: s.ToolCall, attempts: int, step: int
    ) -> None:
        wait = s.AuthorizationWait(tool_call=call)
        for _ in range(attempts):
            attempt = self.next_id("attempt")
            wait.expected_attempt_ids.append(attempt)
            events.append(
                self.event(
                    s.EVENT_KIND_AUTHORIZATION_REQUIRED,
                    step=step,
                    tool_call=call,
                    attempt_id=attempt,
                )
            )
            self.report_wait(attempt_id=attempt)
        self.snapshot.open_turn.pending_authorizations.append(wait)

    def abandon_waits(self) -> list[s.Event]:
        """A steer message while the turn waits: pending waits are closed
        (approvals and sign-ins as not done) and the turn goes on."""
        events: list[s.Event] = []
        turn = self.snapshot.open_turn
        for request in turn.pending_inputs:
            if request.kind == s.INPUT_KIND_APPROVAL:
                message = "not approved: the user sent a new message"
                self.record_result(error_result(request.tool_call, message), events)
        for wait in turn.pending_authorizations:
            message = "sign-in abandoned: the user sent a new message"
            self.record_result(error_result(wait.tool_call, message), events)
        del turn.pending_inputs[:]
        del turn.pending_authorizations[:]
        return events

    def extend_budget(self) -> None:
        """The user approved a SESSION_LIMIT request."""
        snap = self.snapshot
        used = snap.usage.input_tokens + snap.usage.output_tokens
        snap.limits.token_budget = used + max(snap.limits.token_budget, 1)
        if snap.limits.cost_budget_micros:
            snap.limits.cost_budget_micros = snap.usage.cost_micros + snap.limits.cost_budget_micros

    def close_auth_wait(self, call: s.ToolCall) -> None:
        turn = self.snapshot.open_turn
        remaining = [w for w in turn.pending_authorizations if w.tool_call.id != call.id]
        del turn.pending_authorizations[:]
        turn.pending_authorizations.extend(remaining)

    def waiting_for_user(self) -> bool:
        turn = self.snapshot.open_turn
        return bool(turn.pending_inputs or turn.pending_authorizations)

    def still_waiting(self) -> bool:
        """The open turn waits: for the user, or for children's results."""
        return self.waiting_for_user() or bool(self.handles.awaited(self.turn_id))


def error_result(call: s.ToolCall, output: str) -> s.ToolResult:
    """A tool call's error result (it did not run, or it failed)."""
    return s.ToolResult(tool_call_id=call.id, name=call.name, output=output, is_error=True)
