"""What a parent's model reads of its children (docs/design.md §11): the result
of a tool call that waited for a child, the immediate answer of a call that
gave one background work, a cancelled call, a background result as a
message. JSON with sorted keys, so the same report always reads the same.
Pure: no I/O; the handle rules are in handles.py.
"""

from __future__ import annotations

import json

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.owner.rules.handles import kind_name

STATUS_NAMES = {
    s.TASK_STATUS_COMPLETED: "completed",
    s.TASK_STATUS_FAILED: "failed",
    s.TASK_STATUS_CANCELLED: "cancelled",
    s.TASK_STATUS_FINALIZED: "failed",
}


def report_json(handle: s.ChildHandle, report: s.TaskResultCommand) -> dict[str, str]:
    """A report as the parent's model sees it."""
    body = {"handle": handle.child_session_id, "name": handle.name, "kind": kind_name(handle.kind)}
    body["status"] = STATUS_NAMES.get(report.status, "failed")
    if report.status == s.TASK_STATUS_COMPLETED:
        body["result"] = report.result
    else:
        error = report.error
        body["error"] = f"{error.reason}: {error.message}" if error.message else error.reason
    return body


def tool_output(handle: s.ChildHandle, report: s.TaskResultCommand) -> str:
    """The result of the tool call that waited for the child."""
    return json.dumps(report_json(handle, report), sort_keys=True)


def started_output(handle: s.ChildHandle) -> str:
    """The immediate result of a call that gave a child background work."""
    return json.dumps(
        {
            "handle": handle.child_session_id,
            "kind": kind_name(handle.kind),
            "name": handle.name,
            "status": "running",
        },
        sort_keys=True,
    )


def message_content(handle: s.ChildHandle, report: s.TaskResultCommand) -> str:
    """A background result as a message of the parent's conversation."""
    return json.dumps({"task_result": report_json(handle, report)}, sort_keys=True)


def cancelled_output(handle: s.ChildHandle) -> str:
    """The result of a call that waited for a child whose work was
    cancelled with the parent's turn."""
    return json.dumps(
        {"handle": handle.child_session_id, "name": handle.name, "status": "cancelled"},
        sort_keys=True,
    )
