"""Scraping a Baton process's Prometheus endpoint: the samples of one
scrape, and sums over them by name and labels. Used by the benches and the
tests (tests/scrape.py adds what only tests need)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Scrape:
    """One scrape: every sample, and each family's declared type."""

    samples: list[Sample]
    types: dict[str, str]

    def total(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels`."""
        return sum(
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def label_sets(self, name: str) -> set[frozenset[str]]:
        """The label names `name`'s samples carry (without histogram `le`)."""
        return {frozenset(set(s.labels) - {"le"}) for s in self.samples if s.name == name}

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def parse(text: str) -> Scrape:
    samples: list[Sample] = []
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples.append(Sample(sample.name, dict(sample.labels), float(sample.value)))
    return Scrape(samples, types)


async def scrape(url: str) -> Scrape:
    """One scrape of `url` (an HTTP timeout of 10 s)."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(url)
    response.raise_for_status()
    if not response.headers["content-type"].startswith("text/plain"):
        raise ValueError(f"{url} is not a Prometheus text page: {response.headers}")
    return parse(response.text)
