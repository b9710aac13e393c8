"""The server's Prometheus metrics (``GET /metrics``), kept by ``prometheus_client``.

``vlfit_requests_total{route, status}``, ``vlfit_request_seconds{route}`` (a latency histogram), the micro-batches'
sizes (``vlfit_search_batch_size``), requests and connections refused at a limit (``vlfit_refused_total{limit}``:
``requests`` beyond ``--max_concurrency``, ``wait`` a search whose expected wait is over ``--max_queue_wait_ms``,
``connections`` beyond ``--max_connections``), and gauges of the served
index (``vlfit_index_items``, ``vlfit_index_generation``). Routes are the app's route templates
(``/api/image/{item}``), never raw paths, so a client cannot grow the label set.

With ``PROMETHEUS_MULTIPROC_DIR`` set (``vlfit serve --workers N`` sets it to a fresh folder before the workers
start), every worker writes its counts there and ``/metrics`` sums the folder (prometheus_client's multiprocess
mode): any worker answers with the counts of all of them. The index gauges are the answering worker's view of the
index (each worker loads and reloads the same folder).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's switch to its multiprocess mode
MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format generate_latest writes


class _IndexGauges:
    """A collector of the served index's size and generation, as given at collection time."""

    def __init__(self, items: int, generation: int) -> None:
        self.items, self.generation = items, generation

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("vlfit_index_items", "Items in the served index.", value=self.items)
        yield GaugeMetricFamily("vlfit_index_generation", "Index snapshots served so far.", value=self.generation)


class ServerMetrics:
    """The app's counters and histograms (a registry of its own, so that two apps in one process count apart);
    ``render`` gives the exposition text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # prometheus_client picks mmap'ed values at import when the variable is set: collect the same way.
        self.multiprocess = bool(os.environ.get(MULTIPROCESS_ENV))
        self.requests = Counter("vlfit_requests", "HTTP requests answered, by route and status.",
                                ["route", "status"], registry=self.registry)  # fmt: skip
        self.latency = Histogram("vlfit_request_seconds", "Time to answer a request.", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)  # fmt: skip
        self.batch_sizes = Histogram("vlfit_search_batch_size", "Text queries per encoder batch.",
                                     buckets=BATCH_BUCKETS, registry=self.registry)  # fmt: skip
        self.refused = Counter("vlfit_refused", "Requests (503) and connections refused at a limit, by limit.",
                               ["limit"], registry=self.registry)  # fmt: skip

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)

    def observe_refused(self, limit: str) -> None:
        """One refusal at ``limit`` (``requests``, ``wait`` or ``connections``)."""
        self.refused.labels(limit=limit).inc()

    def observe_batch(self, size: int) -> None:
        self.batch_sizes.observe(size)

    def render(self, index_items: int, generation: int) -> bytes:
        """The exposition text: this process's counts, or in multiprocess mode every worker's, summed."""
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        else:
            registry = self.registry
        gauges = CollectorRegistry()
        gauges.register(_IndexGauges(index_items, generation))
        return generate_latest(registry) + generate_latest(gauges)
