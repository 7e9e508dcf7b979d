"""The service's Prometheus metrics."""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from itertools import accumulate

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The service's Prometheus metrics, in a registry of its own (one per Service).

    Requests, latency, errors and proposal counts are tallied in plain dicts and turned into metric
    families only when scraped: prometheus_client's own metrics take a lock per update, and a proposal
    made five updates. Every tally is written and read on the event loop (the /metrics route is async),
    so needs no lock."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status)
        self.latency: dict[str, list[float]] = {}  # endpoint: a count per bucket, then the sum
        self.errors: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, code)
        self.contexts: dict[str, int] = defaultdict(int)  # store
        self.nodes: dict[str, int] = defaultdict(int)  # store
        self.enrollments: dict[str, int] = defaultdict(int)  # store
        gauges = (("tokens", "Tokens in the general store"), ("utterances", "Utterances in the general store"),
                  ("speakers", "Enrolled speakers"), ("exact_bytes", "Bytes of all exact stores"),
                  ("faiss_bytes", "Bytes of the FAISS store"))
        self.store = {field: Gauge(f"echospec_store_{field}", help_, ["store"], registry=self.registry)
                      for field, help_ in gauges}
        self.registry.register(self)  # collect() below

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests[endpoint, str(status)] += 1
        counts = self.latency.get(endpoint)
        if counts is None:
            counts = self.latency[endpoint] = [0] * (len(LATENCY_BUCKETS) + 1) + [0.0]
        counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        counts[-1] += seconds

    def set_store(self, name: str, info: dict) -> None:
        values = {**info, "speakers": len(info.get("speakers", {}))}
        for field, gauge in self.store.items():
            gauge.labels(name).set(values.get(field) or 0)

    def collect(self):
        """The tallies as metric families (prometheus_client's Collector protocol)."""
        yield _counter("echospec_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                       self.requests)
        latency = HistogramMetricFamily("echospec_request_seconds",
                                        "Request latency, request read to answer written", labels=["endpoint"])
        bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        for endpoint, counts in self.latency.items():
            latency.add_metric([endpoint], list(zip(bounds, accumulate(counts[:-1]))), counts[-1])
        yield latency
        yield _counter("echospec_errors", "Error responses by endpoint and error code", ["endpoint", "code"],
                       self.errors)
        yield _counter("echospec_proposed_contexts", "Contexts answered by propose", ["store"], self.contexts)
        yield _counter("echospec_proposed_nodes", "Tree nodes returned by propose", ["store"], self.nodes)
        yield _counter("echospec_enrollments", "Acknowledged enrollments", ["store"], self.enrollments)


def _counter(name: str, help_: str, labels: list[str], tally: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_, labels=labels)
    for key, value in tally.items():
        family.add_metric(key if isinstance(key, tuple) else (key,), value)
    return family
