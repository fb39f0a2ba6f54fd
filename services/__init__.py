"""Baton's services. Importing this package first sets process-wide defaults.

gRPC's EventEngine-based client and listener cost ~18 % more CPU per turn than
the classic poller on the 2-core machines Baton is benchmarked on (see
bench/README.md); an explicit GRPC_EXPERIMENTS in the environment wins.
"""

import os

os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")
