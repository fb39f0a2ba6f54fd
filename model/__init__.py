"""A model of Baton's protocol for one session, in plain Python with no I/O,
and a checker that explores it (docs/model.md).

- state.py: the state (etcd's keys of the session, the owner instances'
  memory, the gateways, the fault budgets), immutable and hashable;
- protocol.py: the steps (each an etcd transaction and what its caller does
  with the answer, or a process event), named as in docs/model.md;
- invariants.py: design §9's invariants, on every state and at quiescence;
- explore.py: breadth-first search of every reachable state (shortest
  traces), and random walks for larger bounds;
- options.py: the bounds, and the known-bad variants the checker must catch.

`python -m model` runs it from the command line.
"""
