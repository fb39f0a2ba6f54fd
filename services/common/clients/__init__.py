"""The typed clients between Baton services: what every client shares (base: deadlines, retries,
the feed-or-call choice), one client per service (anchor, hooks, owner), the values they answer
with (answers), channels and the bound on calls in flight.
"""
