"""anchor: the session journal (public stream and snapshot)."""
