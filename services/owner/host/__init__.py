"""One owner instance and the sessions it holds: the host, hosted sessions' lifecycle, fleet
membership, parking and bells, reconciliation, restarts and takeovers, claims of dead instances'
sessions, adoption and drains.
"""
