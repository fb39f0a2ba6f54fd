"""Size limits every service agrees on (docs/design.md §4: nothing a session
stores grows with its age inside one value or one transaction).

etcd refuses a request over ~1.5 MiB and, by default, a txn of more than 128
operations (Baton's etcd runs with --max-txn-ops 1024). A commit holds one
step's events, the history entries the step appended and the bounded
snapshot, so these bound it whatever the session's age.
"""

from __future__ import annotations

MAX_COMMAND_BYTES = 256 * 1024
"""One inbox command, serialized (hooks refuses a larger one: every inbox
entry is bounded by it, whoever appends)."""

MAX_MESSAGE_TEXT_BYTES = MAX_COMMAND_BYTES - 32 * 1024
"""The largest ingress' --max-message-bytes may be: a message's text and
input responses within it leave its command room for the labels (8 KiB),
the responses' ids and the delivery metadata, so hooks accepts it."""

MAX_HISTORY_ENTRY_BYTES = 256 * 1024
"""One model-history entry (a message, a tool result), serialized."""

MAX_EVENT_BYTES = 320 * 1024
"""One stream event, serialized (it may quote one history entry)."""

MAX_SNAPSHOT_BYTES = 512 * 1024
"""The snapshot: bounded state (hooks, open turn, limits, agent state)."""

MAX_COMMIT_BYTES = 1400 * 1024
"""Events + history entries + snapshot of one commit."""

MAX_EVENTS_PER_COMMIT = 100
MAX_HISTORY_PER_COMMIT = 64

MAX_ADMITTED_PER_BOUNDARY = 24
"""Steer messages admitted into a turn at one model-call boundary; the rest
wait for the next boundary (each costs an event and a history entry)."""

READ_PAGE_EVENTS = 64
"""Stream events per etcd range read (64 x MAX_EVENT_BYTES < 32 MiB)."""

READ_PAGE_ENTRIES = 64
"""History entries per etcd range read, at first and at least
(64 x MAX_HISTORY_ENTRY_BYTES = 16 MiB)."""

READ_PAGE_MAX_ENTRIES = 160
"""160 x MAX_HISTORY_ENTRY_BYTES = 40 MiB: under the etcd client's 48 MiB."""
READ_PAGE_BYTES = 4 * 1024 * 1024
"""History pages grow while their entries are small, up to about this."""

MAX_PAGE_BYTES = 1024 * 1024
"""An inbox or event page sent in one gRPC message (services/common/streams/pages.py):
entries are added while the page stays within this; one larger entry goes
alone (none is: MAX_EVENT_BYTES, MAX_COMMAND_BYTES). A feed's message
batches pages up to the same bytes (services/common/streams/feeds.py), so a message
stays far below gRPC's 4 MiB limit, whatever the entries."""

STREAM_PAGE_EVENTS = 64
"""Stream seqs per page of the retention horizon's age rule: the commit that
writes a page's first seq stamps the page (`s/{sid}/pg/{page}`), which dates
every event before it."""

TRIM_BATCH = 512
"""Stream events deleted per transaction below the retention horizon."""

TRIM_ROUND_BATCHES = 8
"""Trim transactions for one session in one go; a longer backlog waits its
turn behind the other sessions due."""

RETIRE_BATCH = 256
"""History entries deleted per transaction."""

DELETE_BATCH = 512
"""Keys deleted per transaction when a finalized session expires."""

MAX_LIVE_HANDLES = 64
"""Child sessions a session may hold that are not settled (running, parked,
available). Starting another finalizes the least recently used parked or
available one; with every one running it is refused (TOO_MANY_TASKS)."""

MAX_SETTLED_HANDLES = 16
"""Settled handles kept in a snapshot (the latest); older ones are forgotten."""

MAX_TASK_RESULT_BYTES = 32 * 1024
"""A child's result as reported to its parent (its full answer stays on the
child's own stream); a larger one is reported as failed
(TASK_RESULT_TOO_LARGE)."""

MAX_CHILD_DEPTH = 4
"""How deep child sessions nest (a child of a root session is at depth 1)."""

# Live items of running steps (docs/design.md "Live items"): in memory only,
# bounded where they enter (the owner, anchor's PublishLive).
LIVE_MAX_TEXT_BYTES = 4 * 1024
"""An item's text: longer is cut (anchor marks it truncated)."""
LIVE_MAX_ITEMS_PER_BATCH = 64
LIVE_MAX_BATCHES = 64
"""Batches in one PublishLive message."""
LIVE_MAX_MESSAGE_BYTES = 256 * 1024
"""One PublishLive message, serialized."""
LIVE_BUFFER_ITEMS = 256
LIVE_BUFFER_BYTES = 256 * 1024
"""The step in flight's items an anchor replica keeps for followers that
connect mid-step (then the oldest are dropped, with a marker)."""
LIVE_FOLLOWER_BYTES = 64 * 1024
"""Items one follower may have waiting (it reads too slowly: the oldest are
dropped, with a marker)."""
LIVE_BATCHES_PER_SECOND = 100
"""A session's batches an anchor takes per second (a burst of twice that)."""
LIVE_COALESCE_SECONDS = 0.05
"""The owner sends deltas every 50 ms (or at LIVE_MAX_TEXT_BYTES)."""
LIVE_PROGRESS_BYTES = 1024
LIVE_PROGRESS_PER_SECOND = 20
"""A tool's progress reports: each cut to 1 KiB, at most 20 a second per
call (more are dropped)."""
