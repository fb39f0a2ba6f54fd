"""The session's rules, decided without I/O: one session state (held), and functions over it by
concern — what a child owes its parent (reports), a parent's children (children), waits, steps,
admission, turns — what a run does next (decisions), when it may leave (departure_rules), and
what the model sees (context, child_outputs).
"""
