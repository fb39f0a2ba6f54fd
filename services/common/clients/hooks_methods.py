"""What a client of hooks knows of each of its methods (`HooksClient`):
which gRPC may retry, and which a bound on calls in flight never holds back."""

from __future__ import annotations

HOOKS_IDEMPOTENT = frozenset(
    {
        # Reads.
        "LookupHook",
        "StreamInbox",
        "ListInstances",
        "ListInstanceSessions",
        "WatchBells",
        "WatchInstances",
        "GetTransfer",
        "GetOwner",
        "DescribeSession",
        "ListChannelSessions",
        "ListDeployments",
        "DescribeDeployment",
        # A repeat returns the first result: the same session and fence
        # (CreateSession), the same claim set (ClaimHooks, DisposeHooks), the
        # first receipt for a delivery id (ResumeHook; `HooksClient.resume`
        # gives every command one), the replayed takeover or transfer
        # (TakeOverSession, Transfer), the state already set (SetParked).
        "CreateSession",
        "ClaimHooks",
        "DisposeHooks",
        "ResumeHook",
        "TakeOverSession",
        "SetParked",
        "Transfer",
        # A lease refreshed or revoked twice is refreshed or revoked; a drain
        # target set twice is set.
        "KeepAliveInstance",
        "DeregisterInstance",
        "SetInstanceDrain",
    }
)

# An owner's membership: its lease must never wait behind its sessions' calls
# (call_slots.py), nor be refused by a busy hooks (config.Capacity.unmetered).
HOOKS_UNLIMITED = frozenset(
    {"RegisterInstance", "KeepAliveInstance", "SetInstanceDrain", "DeregisterInstance"}
)
