"""The pure rules of child sessions (services/owner/rules/handles.py,
services/owner/rules/children.py, reports.py and their use in
services/owner/rules/turns.py):
handle states, what a child's report means for its parent, eligibility for a
handoff, budget roll-up, what a child reports to its parent. No etcd, no
gRPC, no event loop."""

from __future__ import annotations

import collections
import json

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids, limits
from baton_runtime.common.errors import Reason
from baton_runtime.owner.agents.api import AgentCatalog, ModelReply, RequestedCall, StepsModel
from baton_runtime.owner.agents.fixture import build_agent
from baton_runtime.owner.rules import (
    admission,
    children,
    departure_rules,
    reports,
    steps,
    turns,
    waits,
)
from baton_runtime.owner.rules.admission import Admission
from baton_runtime.owner.rules.children import ChildWork
from baton_runtime.owner.rules.handles import (
    Handles,
    Refusal,
    ReportMeaning,
    child_budget,
    child_control,
)
from baton_runtime.owner.rules.held import RunIdentity, SessionState
from baton_runtime.owner.rules.steps import Outcome, StepProgress
from baton_runtime.owner.run.snapshots import initial_snapshot

K = s.EventKind
SID = "ses_" + "a" * 26
PARENT = "ses_" + "p" * 26
IDENTITY = RunIdentity(s.Fence(session_id=SID, owner_run_id="run_1", epoch=1), "dep-a", "i1")
T = 1_000.0  # the time of every activation here (the rules read no clock)


def state(token_budget: int = 0, parent: s.ParentLink | None = None) -> SessionState:
    snapshot = initial_snapshot(SID, "slack", "dep-a", [], token_budget=token_budget, parent=parent)
    catalog = AgentCatalog(build_agent("dep-a"))
    return SessionState.hold(IDENTITY, snapshot, catalog.agent_for(parent), now=T)


def send(seq: int, text: str = "hi", caller: str = "u1", work: int = 0) -> s.InboxEntry:
    channel = "" if work else "slack"
    delivery = s.DeliveryMetadata(delivery_id=f"d{seq}", channel=channel, caller=caller)
    command = s.Command(delivery=delivery, send=s.SendCommand(text=text, parent_work=work))
    return s.InboxEntry(seq=seq, command=command)


def report(
    seq: int,
    child: str,
    status: int = s.TASK_STATUS_COMPLETED,
    work: int = 1,
    parent: str = SID,
    **fields: object,
) -> s.InboxEntry:
    result = s.TaskResultCommand(
        task_delivery_id=f"task:{child}:{work}",
        child_session_id=child,
        parent_session_id=parent,
        work=work,
        status=status,  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )
    delivery = s.DeliveryMetadata(delivery_id=result.task_delivery_id)
    return s.InboxEntry(seq=seq, command=s.Command(delivery=delivery, task_result=result))


def kinds(events: list[s.Event]) -> list[str]:
    return [K.Name(e.kind).removeprefix("EVENT_KIND_") for e in events]


def child_step(
    st: SessionState, name: str = "ask_subagent", background: bool = False, agent: str = "helper"
) -> tuple[str, Outcome, list[s.Event]]:
    """One step in which the model gives a subagent work (the I/O done)."""
    arguments: dict[str, object] = {"agent": agent, "prompt": "what is 1+1"}
    if background:
        arguments["background"] = True
    reply = ModelReply(tool_calls=[RequestedCall(name, arguments)], input_tokens=3)
    progress = StepProgress(reply=reply, calls=steps.tool_calls(st, reply))
    child = ids.child_session_id(SID, progress.calls[0].id)
    progress.children[0] = ChildWork(
        child, s.TASK_KIND_SUBAGENT, agent, "dep-a", "what is 1+1", background, False
    )
    events: list[s.Event] = []
    outcome = steps.apply_step(st, progress, events)
    return child, outcome, events


def open_turn(st: SessionState) -> None:
    turns.start_turn(st, send(0, "ask helper what is 1+1"), collections.deque())


# -- the parent's side -----------------------------------------------------------


def test_a_foreground_subagent_makes_the_turn_wait_without_waiting_for_the_user() -> None:
    st = state()
    open_turn(st)
    child, outcome, events = child_step(st)
    assert outcome is Outcome.AWAITING
    step = ["STEP_STARTED", "TOOL_CALL_REQUESTED", "TASK_STARTED", "STEP_COMPLETED"]
    assert kinds(events) == step
    started = events[2]
    assert started.child_session_id == child and started.text == "what is 1+1"
    assert started.task.state == s.HANDLE_STATE_RUNNING and started.task.work == 1
    assert waits.still_waiting(st) and not waits.waiting_for_user(st)
    assert not departure_rules.idle_for_handoff(st)
    handle = Handles(st.snapshot).find(child)
    assert handle is not None and handle.tool_call_id == "call_1" and handle.turn_id == "turn_1"

    # The reply answers the waiting call; the turn goes on; the handle parks.
    usage = s.Usage(input_tokens=10, output_tokens=5, model_calls=2)
    reply = report(1, child, result="2", usage=usage, steps=2)
    assert admission.classify(st, reply) is Admission.BLOCK  # the run resumes the turn with it
    events = []
    assert children.apply_report(st, reply, events) is ReportMeaning.AWAITED
    assert kinds(events) == ["TASK_COMPLETED", "TOOL_CALL_RESULT"]
    assert events[0].text == "2" and events[0].usage == usage
    output = json.loads(events[1].tool_result.output)
    assert output == {
        "handle": child,
        "kind": "subagent",
        "name": "helper",
        "result": "2",
        "status": "completed",
    }
    assert events[1].tool_result.tool_call_id == "call_1"
    assert not waits.still_waiting(st)
    assert Handles(st.snapshot).find(child).state == s.HANDLE_STATE_PARKED  # type: ignore[union-attr]
    # Budget roll-up: the child's spending is the parent's, in the session and the turn.
    assert st.snapshot.usage.input_tokens == 3 + 10 and st.snapshot.usage.output_tokens == 5
    assert st.snapshot.open_turn.usage.model_calls == 1 + 2
    assert turns.steps_taken(st) == 1 + 2
    assert st.snapshot.inbox_next_seq == 2
    turns.close_turn(st, events, K.EVENT_KIND_TURN_COMPLETED)
    assert departure_rules.idle_for_handoff(st), "a parked handle is only an address"


def test_a_background_result_starts_a_turn_or_joins_the_open_one() -> None:
    st = state()
    open_turn(st)
    child, outcome, events = child_step(st, background=True)
    assert outcome is Outcome.CONTINUE  # the call got the handle at once
    assert kinds(events)[2:4] == ["TASK_STARTED", "TOOL_CALL_RESULT"]
    assert json.loads(events[3].tool_result.output)["status"] == "running"
    turns.close_turn(st, events, K.EVENT_KIND_TURN_COMPLETED)
    assert not departure_rules.idle_for_handoff(st), (
        "a running background task keeps the parent busy"
    )

    result = report(1, child, result="2")
    assert admission.classify(st, result) is Admission.ADMIT
    events = turns.start_turn(st, result, collections.deque())
    assert kinds(events) == ["TURN_STARTED", "TASK_COMPLETED"]
    assert st.turn_open and st.context.messages[-1].role == s.ROLE_USER
    assert json.loads(st.context.messages[-1].content)["task_result"]["result"] == "2"
    assert departure_rules.idle_for_handoff(st) is False  # the turn it started is open

    # Another background result at a boundary of the open turn joins it.
    _, _, _ = child_step(st, background=True)
    second = Handles(st.snapshot).running()[0].child_session_id
    events = []
    joined, stop = admission.admit_pending(
        st, collections.deque([report(2, second, result="3")]), events
    )
    assert (joined, stop) == (Admission.BLOCK, None)
    assert kinds(events) == ["TASK_COMPLETED"]
    assert st.snapshot.inbox_next_seq == 3


def test_while_the_turn_waits_for_a_child_a_queued_message_waits_for_its_end() -> None:
    """Issue 32: the child's reply is taken past a queued message, and a
    background result behind the message (it would join the turn) waits with
    it; once the turn ended the message starts its turn, which the result
    then joins."""
    st = state()
    open_turn(st)
    background, _, events = child_step(st, background=True)
    turns.close_turn(st, events, K.EVENT_KIND_TURN_COMPLETED)
    turns.start_turn(st, send(1, "ask helper what is 1+1"), collections.deque())
    child, outcome, _ = child_step(st)
    assert outcome is Outcome.AWAITING and not waits.waiting_for_user(st)
    queued = send(2, "later")
    queued.command.send.turn_policy = s.TURN_POLICY_QUEUE
    finished, reply = report(3, background, result="bg"), report(4, child, result="2")
    assert admission.classify(st, finished) is Admission.ADMIT
    pending = collections.deque([queued, finished, reply])

    assert admission.take(st, pending) is reply
    events = []
    assert children.apply_report(
        st, reply, events
    ) is ReportMeaning.AWAITED and not waits.still_waiting(st)
    assert (st.snapshot.inbox_next_seq, list(st.snapshot.inbox_consumed_ahead)) == (2, [4])
    # The turn goes on: nothing behind the queued message joins it.
    assert admission.admit_pending(st, pending, events) == (Admission.BLOCK, None)
    assert list(pending) == [queued, finished]
    turns.close_turn(st, events, K.EVENT_KIND_TURN_COMPLETED)

    assert admission.take(st, pending) is queued
    assert kinds(turns.start_turn(st, queued, pending)) == ["TURN_STARTED", "MESSAGE_RECEIVED"]
    events = []
    assert admission.admit_pending(st, pending, events) == (Admission.BLOCK, None)
    assert kinds(events) == ["TASK_COMPLETED"] and not pending
    assert (st.snapshot.inbox_next_seq, list(st.snapshot.inbox_consumed_ahead)) == (5, [])


def test_bad_reports_change_nothing() -> None:
    st = state()
    open_turn(st)
    child, _, _ = child_step(st)
    before = st.snapshot.SerializeToString()
    cases = {
        Reason.UNKNOWN_TASK: report(1, "ses_" + "z" * 26),
        Reason.NOT_OUR_TASK: report(1, child, parent="ses_" + "q" * 26),
        Reason.TASK_NOT_RUNNING: report(1, child, work=7),
    }
    for reason, entry in cases.items():
        assert admission.classify(st, entry) is Admission.REJECT, reason
        event = admission.rejection(st, entry)
        assert event.error.reason == reason and event.error.message, reason
    assert st.snapshot.SerializeToString() == before
    # A settled child's repeated finalization, and work for a parked one.
    events: list[s.Event] = []
    children.apply_report(st, report(1, child, result="ok"), events)
    assert admission.classify(st, report(2, child, work=1)).name == "REJECT"
    handles = Handles(st.snapshot)
    assert handles.refuse_continue("ses_" + "z" * 26).reason == Reason.UNKNOWN_TASK  # type: ignore[union-attr]
    assert handles.refuse_continue(child) is None
    assert handles.refuse_continue(child, frozenset({child})).reason == Reason.TASK_RUNNING  # type: ignore[union-attr]


def test_cancel_detaches_and_cancels_the_turns_children() -> None:
    st = state()
    open_turn(st)
    child, _, _ = child_step(st)
    events: list[s.Event] = []
    turns.close_turn(st, events, K.EVENT_KIND_TURN_CANCELLED)
    assert kinds(events) == ["TOOL_CALL_RESULT", "TURN_CANCELLED", "SESSION_WAITING"]
    assert json.loads(events[0].tool_result.output)["status"] == "cancelled"
    [(to, command)] = st.outgoing
    assert to == child and command.WhichOneof("kind") == "cancel"
    assert command.delivery.delivery_id == f"cancel:{SID}:1"
    # Its late result is recorded, starts no turn; the handle parks.
    late = report(1, child, s.TASK_STATUS_CANCELLED, error=s.ErrorDetail(reason="CANCELLED"))
    assert admission.classify(st, late) is Admission.REPORT
    events = []
    assert children.apply_report(st, late, events) is ReportMeaning.RECORD
    assert kinds(events) == ["TASK_FAILED"] and not st.turn_open
    assert departure_rules.idle_for_handoff(st)


def test_finalizing_finalizes_every_child() -> None:
    st = state()
    open_turn(st)
    running, _, _ = child_step(st, background=True)
    parked, _, _ = child_step(st)
    children.apply_report(st, report(1, parked, result="ok"), [])
    events: list[s.Event] = []
    reset = s.InboxEntry(seq=2, command=s.Command(reset=s.ResetCommand()))
    turns.finalize(st, events, reset, None, now=T)
    # The open turn is cancelled first (its running child gets a cancel), then
    # every child that is not settled gets a reset.
    sent = [(c, cmd.WhichOneof("kind")) for c, cmd in st.outgoing]
    assert sent == [(running, "cancel"), (running, "reset"), (parked, "reset")]
    assert all(h.state == s.HANDLE_STATE_SETTLED for h in st.snapshot.handles)


def test_settled_handles_are_bounded() -> None:
    st = state()
    handles = Handles(st.snapshot)
    for n in range(limits.MAX_SETTLED_HANDLES + 5):
        handle = handles.start(f"ses_{n:026d}", s.TASK_KIND_SUBAGENT, "helper", "d", "t", "")
        handles.mark_finalized(handle)
    assert len(st.snapshot.handles) == limits.MAX_SETTLED_HANDLES
    assert handles.find(f"ses_{0:026d}") is None
    for n in range(limits.MAX_LIVE_HANDLES):
        handles.start(f"ses_{n:020d}zzzzzz", s.TASK_KIND_SUBAGENT, "helper", "d", "t", "")
    assert handles.refuse_start().reason == Reason.TOO_MANY_TASKS  # type: ignore[union-attr]


def test_an_idle_child_makes_room_least_recently_used_first() -> None:
    st = state()
    open_turn(st)
    made = []
    for _ in range(limits.MAX_LIVE_HANDLES):
        child, _, _ = child_step(st)
        children.apply_report(st, report(1, child, result="ok"), [])
        made.append(child)
    # The oldest is used again: the second oldest is now the least recent.
    st.handles.give_work(st.handles.find(made[0]), st.turn_id, "")  # type: ignore[arg-type]
    children.apply_report(st, report(2, made[0], work=2, result="again"), [])
    assert st.handles.refuse_start() is None
    newest, _, _ = child_step(st)
    [(evicted, command)] = st.outgoing
    assert evicted == made[1] and command.WhichOneof("kind") == "reset"
    assert st.handles.find(made[1]).state == s.HANDLE_STATE_SETTLED  # type: ignore[union-attr]
    assert st.handles.find(newest).state == s.HANDLE_STATE_RUNNING  # type: ignore[union-attr]
    live = [h for h in st.snapshot.handles if h.state != s.HANDLE_STATE_SETTLED]
    assert len(live) == limits.MAX_LIVE_HANDLES


def test_a_child_budget_is_what_the_parent_has_left() -> None:
    st = state(token_budget=100)
    st.snapshot.usage.input_tokens = 70
    assert child_budget(st.snapshot) == (30, 0)
    st.snapshot.usage.output_tokens = 40
    assert child_budget(st.snapshot) == (1, 0)
    assert child_budget(state().snapshot) == (0, 0)


def test_a_surfaced_wait_shows_on_the_parent_and_keeps_it_busy() -> None:
    st = state()
    open_turn(st)
    child, _, _ = child_step(st)
    request = s.InputRequest(request_id="input_1", kind=s.INPUT_KIND_QUESTION, prompt="Name?")
    wait = report(1, child, s.TASK_STATUS_WAITING, input_request=request, waiting_session_id=child)
    assert admission.classify(st, wait) is Admission.REPORT
    events: list[s.Event] = []
    assert children.apply_report(st, wait, events) is ReportMeaning.SURFACE
    assert kinds(events) == ["INPUT_REQUESTED"]
    assert events[0].child_session_id == child and events[0].input_request == request
    assert Handles(st.snapshot).find(child).waiting  # type: ignore[union-attr]
    assert (
        waits.still_waiting(st)
        and not waits.waiting_for_user(st)
        and not departure_rules.idle_for_handoff(st)
    )


# -- the child's side --------------------------------------------------------------


def link(kind: int = s.TASK_KIND_SUBAGENT, name: str = "helper") -> s.ParentLink:
    return s.ParentLink(parent_session_id=PARENT, kind=kind, name=name, depth=1)  # type: ignore[arg-type]


def test_a_child_reports_the_outcome_of_its_parents_work() -> None:
    st = state(parent=link())
    assert not departure_rules.idle_for_handoff(st), "a child never moves"
    # The channel may answer its questions, not talk to it.
    assert admission.classify(st, send(0, "hello")) is Admission.REJECT
    assert admission.rejection(st, send(0, "hello")).error.reason == Reason.CHILD_SESSION
    events = turns.start_turn(st, send(0, "what is 2+2", caller="", work=3), collections.deque())
    assert st.snapshot.parent.work == 3
    steps.apply_step(st, StepProgress(reply=ModelReply(text="4", input_tokens=2)), events)
    turns.close_turn(st, events, K.EVENT_KIND_TURN_COMPLETED)
    [out] = st.snapshot.parent.outbox
    assert out.status == s.TASK_STATUS_COMPLETED and out.result == "4" and out.work == 3
    assert out.task_delivery_id == f"task:{SID}:3" and out.parent_session_id == PARENT
    assert out.usage.input_tokens == 2 and out.steps == 1 and out.deployment_id == "dep-a"
    assert st.snapshot.parent.work == 0


def test_a_child_reports_a_descendants_wait_further_up() -> None:
    st = state(parent=link())
    st.snapshot.parent.work = 2
    grandchild = "ses_" + "g" * 26
    request = s.InputRequest(request_id="input_7", kind=s.INPUT_KIND_QUESTION, prompt="Name?")
    waits = s.TaskResultCommand(status=s.TASK_STATUS_WAITING, input_request=request)
    reports.report_descendant_wait(st, waits, grandchild)
    [up] = st.snapshot.parent.outbox
    assert up.status == s.TASK_STATUS_WAITING and up.waiting_session_id == grandchild
    assert up.task_delivery_id == f"wait:{SID}:{grandchild}:input_7"
    assert up.input_request == request and up.work == 2 and up.parent_session_id == PARENT
    sign_in = s.TaskResultCommand(status=s.TASK_STATUS_WAITING, attempt_id="att_1")
    reports.report_descendant_wait(st, sign_in, grandchild)
    assert st.snapshot.parent.outbox[-1].task_delivery_id == f"wait:{SID}:{grandchild}:att_1"
    assert st.snapshot.parent.outbox[-1].attempt_id == "att_1"


def test_a_child_reports_waits_cancels_and_its_finalization() -> None:
    st = state(parent=link())
    events = turns.start_turn(st, send(0, "ask my name", caller="", work=1), collections.deque())
    steps.apply_step(st, StepProgress(reply=ModelReply(question="Name?")), events)
    [wait] = st.snapshot.parent.outbox
    assert wait.status == s.TASK_STATUS_WAITING and wait.waiting_session_id == SID
    assert wait.input_request.prompt == "Name?" and wait.work == 1
    cancel = s.InboxEntry(seq=1, command=s.Command(cancel=s.CancelCommand()))
    turns.close_turn(st, events, K.EVENT_KIND_TURN_CANCELLED, entry=cancel)
    assert st.snapshot.parent.outbox[-1].status == s.TASK_STATUS_CANCELLED
    turns.finalize(
        st, events, s.InboxEntry(seq=2, command=s.Command(reset=s.ResetCommand())), None, now=T
    )
    final = st.snapshot.parent.outbox[-1]
    assert final.status == s.TASK_STATUS_FINALIZED and final.task_delivery_id == f"final:{SID}"
    assert final.error.reason == Reason.RESET


def test_a_refused_commit_reports_a_failure_instead_of_its_answer() -> None:
    st = state(parent=link())
    events = turns.start_turn(st, send(0, "go", caller="", work=1), collections.deque())
    steps.apply_step(st, StepProgress(reply=ModelReply(text="answer")), events)
    turns.close_turn(st, events, K.EVENT_KIND_TURN_COMPLETED)
    assert st.snapshot.parent.outbox[-1].status == s.TASK_STATUS_COMPLETED
    error = s.ErrorDetail(reason=Reason.COMMIT_TOO_LARGE, message="too large")
    turns.refused(st, events, False, error, now=T)
    [out] = st.snapshot.parent.outbox
    assert out.status == s.TASK_STATUS_FAILED and out.error.reason == Reason.COMMIT_TOO_LARGE


def test_steps_model_runs_a_workflow_one_step_at_a_time() -> None:
    import asyncio

    model = StepsModel(["fetch", "store"])
    history = [s.ChatMessage(role=s.ROLE_USER, content='{"text": "x"}')]
    first = asyncio.run(model.complete("", history, ()))
    assert [c.name for c in first.tool_calls] == ["fetch"] and first.model_calls == 0
    assert first.tool_calls[0].arguments == {"text": "x", "previous": ""}
    history.append(s.ChatMessage(role=s.ROLE_TOOL, content="fetched x"))
    second = asyncio.run(model.complete("", history, ()))
    assert second.tool_calls[0].arguments["previous"] == "fetched x"
    history.append(s.ChatMessage(role=s.ROLE_TOOL, content="stored fetched x"))
    done = asyncio.run(model.complete("", history, ()))
    assert done.text == "stored fetched x" and not done.tool_calls


def test_the_catalog_names_the_code_of_each_child() -> None:
    catalog = AgentCatalog(build_agent("dep-a"))
    assert catalog.agent_for(None).name == "fixture"
    assert catalog.agent_for(link()).name == "helper"
    task = catalog.agent_for(link(s.TASK_KIND_WORKFLOW, "pipeline"))
    assert [t.name for t in task.tools] == ["fetch", "transform", "store"]
    assert task.fail_on_tool_error
    for bad in (link(name="nobody"), link(s.TASK_KIND_BACKGROUND, "calculator")):
        try:
            catalog.agent_for(bad)
        except LookupError:
            continue
        raise AssertionError(f"{bad} resolved")


def test_planning_child_work() -> None:
    st = state(token_budget=100)
    open_turn(st)
    [call] = steps.tool_calls(
        st,
        ModelReply(tool_calls=[RequestedCall("ask_subagent", {"agent": "helper", "prompt": "hi"})]),
    )
    step = s.Usage(input_tokens=20, output_tokens=5)
    plan = children.plan_child_work(st, call, frozenset(), step, frozenset({"helper"}))
    assert not isinstance(plan, Refusal)
    child = ids.child_session_id(SID, call.id)
    assert plan.work.child_session_id == child and not plan.work.resumed
    assert plan.command.delivery.delivery_id == f"work:{SID}:1"
    assert plan.command.send.parent_work == 1 and plan.command.send.text == "hi"
    assert plan.link is not None and plan.link.depth == 1
    assert plan.link.limits.token_budget == 100 - 25, "the running step's spending counts"

    def refused(name: str, arguments: dict[str, object]) -> str:
        [bad] = steps.tool_calls(st, ModelReply(tool_calls=[RequestedCall(name, arguments)]))
        result = children.plan_child_work(st, bad, frozenset(), s.Usage(), frozenset({"helper"}))
        assert isinstance(result, Refusal), result
        return result.reason

    assert refused("ask_subagent", {"agent": "nobody", "prompt": "x"}) == Reason.UNKNOWN_SUBAGENT
    assert refused("ask_subagent", {"agent": "helper", "prompt": " "}) == Reason.EMPTY_MESSAGE
    assert refused("continue_task", {"handle": child, "message": "x"}) == Reason.UNKNOWN_TASK
    deep = state(
        parent=s.ParentLink(
            parent_session_id=PARENT,
            kind=s.TASK_KIND_SUBAGENT,
            name="planner",
            depth=limits.MAX_CHILD_DEPTH,
        )
    )
    turns.start_turn(deep, send(0, "x", caller="", work=1), collections.deque())
    [call] = steps.tool_calls(
        deep,
        ModelReply(tool_calls=[RequestedCall("ask_subagent", {"agent": "helper", "prompt": "hi"})]),
    )
    nested = children.plan_child_work(deep, call, frozenset(), s.Usage(), frozenset({"helper"}))
    assert isinstance(nested, Refusal) and nested.reason == Reason.TOO_MANY_TASKS


def test_child_controls_are_built_once_with_derived_delivery_ids() -> None:
    # A reset is one per parent (a repeat is deduplicated by the child's
    # inbox); a cancel names the work it cancels.
    reset = child_control(SID, "its parent session finalized")
    assert reset.WhichOneof("kind") == "reset"
    assert reset.delivery.delivery_id == f"reset:{SID}"
    assert reset.reset.reason == "its parent session finalized"
    cancel = child_control(SID, "the turn was cancelled", cancel_work=3)
    assert cancel.WhichOneof("kind") == "cancel"
    assert cancel.delivery.delivery_id == f"cancel:{SID}:3"
    assert cancel.cancel.reason == "the turn was cancelled"
