"""The session's rules, decided without I/O: the session state and what commands, steps, waits and
children do to it, what a run does next (decisions), when it may leave (departure_rules), and
what the model sees (context, compaction, child_outputs).
"""
