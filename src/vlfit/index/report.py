"""What one run of indexing did (``vlfit.index.job.index_collection``'s answer): shown as lines or JSON, then turned
into an error where something was lost (tar shards that could not be fetched, or every item left out), once it has
been shown."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlfit.errors import DataError

# What the report tells of the ANN structure (the manifest's "ann" holds all of it).
ANN_SUMMARY = ("type", "factory", "search_params", "rerank", "recall_at_10", "bytes_per_vector", "query_latency_ms",
               "extended")  # fmt: skip


@dataclass(frozen=True)
class IndexReport:
    """What ``index_collection`` did (rank 0's account; other ranks' ``lead`` is False and they report nothing).

    Attributes:
        index: The index folder.
        model: The model that embedded it, as its encoder describes itself.
        items: Items in the index now.
        added: Items this run added.
        bad_samples: Items (or tar shards) left out, ``{"id", "reason"}``.
        removed: Items indexed earlier whose files are gone from their folder.
        ann: The ANN structure (``ANN_SUMMARY``'s keys).
        lead: This process wrote the manifest and reports (rank 0).
        lost_shards: Tar shards at URLs that could not be indexed (among ``bad_samples``).
        shards: How many tar shards the collection has (0 for other collections).
    """

    index: str
    model: str
    items: int = 0
    added: int = 0
    bad_samples: list[dict[str, str]] = field(default_factory=list)
    removed: int = 0
    ann: dict[str, Any] = field(default_factory=dict)
    lead: bool = True
    lost_shards: list[dict[str, str]] = field(default_factory=list)
    shards: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The report as ``vlfit retrieve index --json`` prints it."""
        return {"index": self.index, "model": self.model, "items": self.items, "added": self.added,
                "bad_samples": self.bad_samples, "removed": self.removed, "ann": self.ann}  # fmt: skip

    def lines(self) -> list[str]:
        """The report as lines of text: what was left out (ten at most), then what was written."""
        lines = [f"left out {bad['id']}: {bad['reason']}" for bad in self.bad_samples[:10]]
        if len(self.bad_samples) > 10:
            lines.append(f"... and {len(self.bad_samples) - 10} more left out (the index manifest lists them all)")
        recall = self.ann.get("recall_at_10")
        shown = f", recall@10 {recall:.3f}" if recall is not None else ""
        counts = f"{self.added} added, {len(self.bad_samples)} left out, {self.removed} removed"
        lines.append(f"wrote {self.index}: {self.items} items ({counts}) embedded by {self.model}; "
                     f"ANN {self.ann.get('type')}{shown}")  # fmt: skip
        return lines

    def raise_for_failures(self) -> None:
        """Raises ``DataError`` when tar shards could not be indexed (the index keeps what was embedded, and the same
        build run again tries them again), or when the build left out every item, so the index holds none (a folder
        of files that are no images)."""
        lost = self.lost_shards
        if lost:
            raise DataError(
                f"{len(lost)} of {self.shards} shards could not be indexed: "
                + "; ".join(f"{bad['id']} ({bad['reason']})" for bad in lost[:5])
                + ("; ..." if len(lost) > 5 else "")
                + ". Rerun the same command to try them again (the index keeps what was embedded)."
            )
        if self.lead and not self.items and self.bad_samples:
            first = self.bad_samples[0]
            raise DataError(f"{self.index}: every item was left out ({len(self.bad_samples)}; the first: "
                            f"{first['id']}: {first['reason']}), so the index holds none: make them readable images, "
                            "then run the same command again")  # fmt: skip


__all__ = ["ANN_SUMMARY", "IndexReport"]
