"""The server's Prometheus metrics (``GET /metrics``), kept by ``prometheus_client``.

``vlfit_requests_total{route, status}``, ``vlfit_request_seconds{route}`` (a latency histogram), the micro-batches'
sizes (``vlfit_search_batch_size``), requests and connections refused at a limit (``vlfit_refused_total{limit}``:
``requests`` beyond ``--max_concurrency``, ``client_requests`` beyond ``--max_concurrency_per_client``, ``wait`` a
search whose expected wait is over ``--max_queue_wait_ms``, ``connections`` beyond ``--max_connections``,
``client_connections`` beyond ``--max_connections_per_client``, ``client_uploads`` beyond ``--max_uploads_per_client``;
docs/serving.md's table of limits), what each stage of a search took (``vlfit_stage_seconds{stage}``: ``decode`` image
bytes to pixels, ``encode`` the model's forward, ``search`` the ANN structure or exact scan, ``rerank`` the matching
head; observed once per request, a batched text query observing its whole batch's time for each stage, what it waited
for), and gauges of the served index (``vlfit_index_items``, ``vlfit_index_generation``). Routes are the app's route
templates (``/api/image/{item}``), never raw paths, so a client cannot grow the label set.

With ``PROMETHEUS_MULTIPROC_DIR`` set (``vlfit serve --workers N`` sets it to a fresh folder before the workers
start), every worker writes its counts there and ``/metrics`` sums the folder (prometheus_client's multiprocess
mode): any worker answers with the counts of all of them. The index gauges are the answering worker's view of the
index (each worker loads and reloads the same folder).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

logger = logging.getLogger(__name__)

# A stage can take well under a millisecond (searching a small index), so its buckets start lower.
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's switch to its multiprocess mode
MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format generate_latest writes
STAGE_METRIC = "vlfit_stage_seconds"


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
        self.stages = Histogram(STAGE_METRIC, "Time of each stage of a search (decode, encode, search, "
                                "rerank), once per request: a batched query observes its batch's time.", ["stage"],
                                buckets=STAGE_BUCKETS, registry=self.registry)  # fmt: skip

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)

    def observe_refused(self, limit: str) -> None:
        """One refusal at ``limit`` (``requests``, ``wait`` or ``connections``)."""
        self.refused.labels(limit=limit).inc()

    def observe_batch(self, size: int) -> None:
        self.batch_sizes.observe(size)

    def observe_stages(self, seconds: Mapping[str, float], requests: int = 1) -> None:
        """Each stage's ``seconds``, observed once for each of ``requests`` (the queries of a batch waited for the
        whole of each stage). Never raises: a failure to count is logged, and the request is answered."""
        try:
            for stage, spent in seconds.items():
                child = self.stages.labels(stage=stage)
                for _ in range(requests):
                    child.observe(spent)
        except Exception:  # noqa: BLE001 - metrics must not fail a search
            logger.exception("observing the stage times %s failed", dict(seconds))

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


def stage_figures(exposition: str, since: str | None = None) -> dict[str, dict[str, float]]:
    """Each stage's count, mean and median in a ``GET /metrics`` text (the benchmarks' per-stage figures).

    Args:
        exposition: The text ``/metrics`` answered.
        since: An earlier answer of the same server: only what was observed after it is counted.

    Returns:
        ``{stage: {"requests", "mean_ms", "p50_ms"}}`` for each stage observed; the median is interpolated within
        its bucket, as Prometheus's ``histogram_quantile`` does.
    """
    now, before = _stage_buckets(exposition), _stage_buckets(since or "")
    figures = {}
    for stage, counts in now.items():
        earlier = before.get(stage, {})
        added = {key: value - earlier.get(key, 0.0) for key, value in counts.items()}
        requests, seconds = added.pop("count", 0.0), added.pop("sum", 0.0)
        if requests > 0:
            median = _bucket_quantile(0.5, {float(le): count for le, count in added.items()})
            figures[stage] = {"requests": int(requests), "mean_ms": round(1000 * seconds / requests, 3),
                              "p50_ms": round(1000 * median, 3)}  # fmt: skip
    return figures


def _stage_buckets(exposition: str) -> dict[str, dict[str, float]]:
    """``{stage: {le: cumulative count, "sum": seconds, "count": requests}}`` of the stage histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name != STAGE_METRIC:
            continue
        for sample in family.samples:
            suffix = sample.name[len(STAGE_METRIC) :]
            key = sample.labels.get("le") if suffix == "_bucket" else suffix[1:]
            if key in (None, "created"):
                continue
            found.setdefault(sample.labels["stage"], {})[key] = sample.value
    return found


def _bucket_quantile(q: float, buckets: dict[float, float]) -> float:
    """The ``q`` quantile of cumulative ``buckets`` ({upper bound: count}), linear within the bucket it falls in."""
    rank = q * buckets.get(math.inf, 0.0)
    lower, below = 0.0, 0.0
    for bound in sorted(buckets):
        count = buckets[bound]
        if count >= rank and count > below:
            return lower if math.isinf(bound) else lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
