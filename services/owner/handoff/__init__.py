"""Ingress-driven upgrade (docs/design.md §6): the old owner's attempt, the new owner's acceptance,
and the checkpoint a handoff carries.
"""
