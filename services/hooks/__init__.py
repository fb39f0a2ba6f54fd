"""hooks: the HookRegistry service.

Rooms, one floor each: `tokens` (the token index) and `sessions` (the
per-session heads/owner cache) at the bottom; `claims`, `inbox` (append and
streaming), `ownership` (takeover, parking), `instances` (owner leases, the
deployment registry, bells) and `transfer` (the handoff transaction) above
them; `rooms` builds them once, and the servicer calls each room itself.
"""
