"""Calls and server streams multiplexed over one long-lived bidirectional stream between two
services: the server halves (multiplex, feeds) and the client halves (multiplex_client,
feed_client).
"""
