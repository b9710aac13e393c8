"""The server's Prometheus metrics, in the text exposition format (``GET /metrics``).

``vlfit_requests_total{route, status}``, ``vlfit_request_seconds{route}`` (a latency histogram), the micro-batches'
sizes (``vlfit_search_batch_size``), and gauges of the served index (``vlfit_index_items``,
``vlfit_index_generation``). Routes are the app's route templates (``/api/image/{item}``), never raw paths, so a
client cannot grow the label set.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import defaultdict

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Histogram:
    """Cumulative-bucket histogram of observations (Prometheus ``histogram`` semantics)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        sep = "," if labels else ""
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {running}')
        label_part = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{label_part} {self.total:.6f}", f"{name}_count{label_part} {self.count}"]
        return out


class ServerMetrics:
    """Counters and histograms updated by the app; ``render`` gives the exposition text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency: dict[str, Histogram] = {}
        self.batch_sizes = Histogram(BATCH_BUCKETS)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(route, status)] += 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def observe_batch(self, size: int) -> None:
        with self._lock:
            self.batch_sizes.observe(size)

    def render(self, index_items: int, generation: int) -> str:
        with self._lock:
            lines = ["# HELP vlfit_requests_total HTTP requests answered, by route and status.",
                     "# TYPE vlfit_requests_total counter"]  # fmt: skip
            for (route, status), count in sorted(self.requests.items()):
                lines.append(f'vlfit_requests_total{{route="{route}",status="{status}"}} {count}')
            lines += ["# HELP vlfit_request_seconds Time to answer a request.",
                      "# TYPE vlfit_request_seconds histogram"]  # fmt: skip
            for route, histogram in sorted(self.latency.items()):
                lines += histogram.lines("vlfit_request_seconds", f'route="{route}"')
            lines += ["# HELP vlfit_search_batch_size Text queries per encoder batch.",
                      "# TYPE vlfit_search_batch_size histogram"]  # fmt: skip
            lines += self.batch_sizes.lines("vlfit_search_batch_size", "")
        lines += ["# HELP vlfit_index_items Items in the served index.", "# TYPE vlfit_index_items gauge",
                  f"vlfit_index_items {index_items}", "# HELP vlfit_index_generation Index snapshots served so far.",
                  "# TYPE vlfit_index_generation gauge", f"vlfit_index_generation {generation}"]  # fmt: skip
        return "\n".join(lines) + "\n"
