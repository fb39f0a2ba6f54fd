"""Scraping a Baton process's Prometheus endpoint in tests: bench/scrape.py
(one scrape's samples, sums by name and labels), plus sums over several
processes (`total`) and over this process's own collectors (`in_process`)."""

from __future__ import annotations

from prometheus_client.registry import Collector

from bench.scrape import Sample, Scrape, parse, scrape

__all__ = ["Sample", "Scrape", "in_process", "parse", "scrape", "total"]


def in_process(collector: Collector, name: str, **labels: str) -> float:
    """`Scrape.total` of one of this process's own collectors (services
    run in the test process)."""
    samples = [
        Sample(sample.name, dict(sample.labels), float(sample.value))
        for family in collector.collect()
        for sample in family.samples
    ]
    return Scrape(samples, {}).total(name, **labels)


def total(scrapes: list[Scrape], name: str, **labels: str) -> float:
    """`name` summed over several processes' scrapes."""
    return sum(s.total(name, **labels) for s in scrapes)
