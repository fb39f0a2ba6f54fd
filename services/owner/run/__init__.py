"""One owner run of one session, the imperative shell (session) and its I/O rooms: the inbox
buffer, a step's model and tool calls, compaction's model call, commits through anchor, upkeep,
child-session I/O, departures, spans, the run's meters, and the terms between a run and the host.
"""
