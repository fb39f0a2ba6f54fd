"""Which build a process runs: its version (the installed distribution's)
and `baton_build_info{version,deployment} 1`, which every scrape shows."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

BUILD_INFO = "baton_build_info"
DISTRIBUTION = "baton-runtime"  # the servers' distribution (pyproject.toml)


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class BuildInfo(Collector):
    """`baton_build_info{version,deployment} 1`: which build (and, for owner
    and ingress, which deployment id) a scraped process runs."""

    def __init__(self, deployment_id: str) -> None:
        self._labels = [version(), deployment_id]

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            BUILD_INFO,
            "The running build's version and deployment id (empty for hooks and anchor)",
            labels=["version", "deployment"],
        )
        family.add_metric(self._labels, 1)
        yield family
