"""Baton's services: hooks, anchor, owner, ingress, and their common package."""
