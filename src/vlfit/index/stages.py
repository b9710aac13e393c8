"""What each stage of a query costs: ``StageTimes`` adds up the wall time spent in each stage of one query (or one
batch of them), timed with ``time.perf_counter``, cheap enough to run on every request.

The stages, in the order a query passes them (``STAGES``):

- ``decode``: image bytes (or an image file) to the uint8 pixels the model takes (image queries);
- ``encode``: the model's forward over the texts or the pixels;
- ``search``: the index's ANN structure, or the exact scan;
- ``rerank``: the matching head re-scoring the candidates (their images read and resized included).

``vlfit retrieve query --timing`` prints them; ``vlfit serve`` observes them in ``vlfit_stage_seconds{stage}``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

STAGES = ("decode", "encode", "search", "rerank")


class StageTimes:
    """Seconds spent per stage (``seconds``: only the stages that ran, in the order first entered)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Adds the time the block takes to stage ``name`` (a block that raises is counted too)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def milliseconds(self) -> dict[str, float]:
        """Each stage that ran, in milliseconds (rounded to microseconds), in ``STAGES`` order after any other
        (``vlfit retrieve query``'s ``open``, in the order they ran)."""
        ordered = sorted(self.seconds, key=lambda name: STAGES.index(name) if name in STAGES else -1)
        return {name: round(1000 * self.seconds[name], 3) for name in ordered}


__all__ = ["STAGES", "StageTimes"]
