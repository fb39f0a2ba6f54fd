"""Baton's services: hooks, anchor, owner, ingress, and their common package.

Importing the package sets one process-wide default first: gRPC's classic
poller instead of its EventEngine client and listener. Each message costs
0.77-0.81x the CPU there, and a one-step turn was 0.88x its latency in three
alternating pairs (bench/README.md, "gRPC's classic poller"). An explicit
`GRPC_EXPERIMENTS` in the environment wins (`GRPC_EXPERIMENTS=""`: the
EventEngine).
"""

import os

os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")
