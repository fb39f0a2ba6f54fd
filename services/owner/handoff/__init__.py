"""Ingress-driven upgrade (docs/design.md §6): the old owner's attempt, the new owner's acceptance,
the checkpoint a handoff carries, and the peers a session or child is placed on.
"""
