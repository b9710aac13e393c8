"""What a ``vlfit prepare`` run did: the summary ``prepare_dataset`` returns, its human-readable report, and the
list of bad samples left out (``bad_samples.jsonl``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from vlfit.atomic_files import write_text_atomically
from vlfit.data.prepare.reencode import CHROMA_SUBSAMPLING, GRID_SUBSAMPLING
from vlfit.data.prepare.shards import ShardStats, SkippedSample


@dataclass
class PrepareSummary:
    """What a ``prepare_dataset`` run did, over every shard of the requested splits (built now or before).

    Args:
        output_dir: The output folder.
        short_side: Output short side in pixels.
        jpeg_quality: Output JPEG quality.
        split_rows: Source samples per split.
        totals: Counts over all shards of the requested splits.
        shards_total: Shards of the requested splits.
        shards_built: Shards written by this run.
        samples_built: Source samples processed by this run (written, or left out as bad).
        elapsed_s: Wall time of this run in seconds.
        built_shards: File names of the shards written by this run.
        bad_samples: Bad samples left out per split, over all shards of the requested splits.
        bad_samples_path: The file listing every bad sample left out of the folder, one JSON line each.
        patch_budget: A NaFlex model's ``(patch_size, max_num_patches)`` the images were stored at the grids of.
    """

    output_dir: str
    short_side: int
    jpeg_quality: int
    split_rows: dict[str, int]
    totals: ShardStats
    shards_total: int
    shards_built: int
    samples_built: int
    elapsed_s: float
    built_shards: list[str] = field(default_factory=list)
    bad_samples: dict[str, int] = field(default_factory=dict)
    bad_samples_path: str = ""
    patch_budget: tuple[int, int] | None = None

    @property
    def samples(self) -> int:
        """Samples written over all requested splits."""
        return self.totals.rows

    @property
    def skipped(self) -> int:
        """Bad samples left out over all requested splits."""
        return self.totals.skipped

    @property
    def byte_ratio(self) -> float:
        """Source image bytes / output file bytes."""
        return self.totals.input_bytes / max(self.totals.output_bytes, 1)

    @property
    def images_per_s(self) -> float:
        """Source samples processed by this run per second of its wall time."""
        return self.samples_built / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def pixel_reduction(self) -> float:
        """Pixels the fast pipeline decodes from the source (DCT-scaled) / pixels it decodes from the output."""
        return self.totals.decoded_pixels / max(self.totals.output_pixels, 1)

    @property
    def full_size_pixel_reduction(self) -> float:
        """Full-size source pixels / output pixels."""
        return self.totals.source_pixels / max(self.totals.output_pixels, 1)


def format_report(summary: PrepareSummary) -> str:
    """A human-readable report of a run: sizes, speed and the decoded-pixel reduction.

    Args:
        summary: What ``prepare_dataset`` returned.

    Returns:
        Several lines of text.
    """
    t = summary.totals
    written = {split: rows - summary.bad_samples.get(split, 0) for split, rows in summary.split_rows.items()}
    splits = ", ".join(f"{split} {rows}" for split, rows in written.items())
    kept = summary.shards_total - summary.shards_built
    mb = 1e6
    ratio = summary.byte_ratio
    size_change = f"{ratio:.1f}x smaller" if ratio >= 1 else f"{1 / max(ratio, 1e-9):.1f}x larger"
    return "\n".join(
        [
            f"prepared {summary.samples} samples ({splits}) into {summary.output_dir}",
            f"  shards: {summary.shards_total} ({summary.shards_built} built now, {kept} kept from an earlier run)",
            _bad_samples_line(summary),
            _size_line(summary),
            f"  bytes: input {t.input_bytes / mb:.2f} MB (source images) -> output {t.output_bytes / mb:.2f} MB "
            f"(parquet files), ratio {summary.byte_ratio:.2f} ({size_change})",
            f"  time: {summary.elapsed_s:.1f} s for {summary.samples_built} samples built now, "
            f"{summary.images_per_s:.1f} images/s",
            f"  decoded pixels per epoch: {t.decoded_pixels / mb:.2f} M from the source with DCT scaling (what the "
            f"fast pipeline decodes) -> {t.output_pixels / mb:.2f} M from the output, "
            f"{summary.pixel_reduction:.1f}x fewer ({t.source_pixels / mb:.2f} M at full source size, "
            f"{summary.full_size_pixel_reduction:.1f}x)",
        ]
    )


def _size_line(summary: PrepareSummary) -> str:
    if summary.patch_budget is not None:
        patch, budget = summary.patch_budget
        return (f"  each image at its patch grid (at most {budget} patches of {patch} px), JPEG quality "
                f"{summary.jpeg_quality} ({GRID_SUBSAMPLING[0]}:{GRID_SUBSAMPLING[1]}:{GRID_SUBSAMPLING[2]}); "
                f"{summary.totals.small_images} images upscaled to their grid")  # fmt: skip
    return (f"  short side {summary.short_side} px, JPEG quality {summary.jpeg_quality} ({CHROMA_SUBSAMPLING}); "
            f"{summary.totals.small_images} images already at or below it kept their size (not upscaled)")  # fmt: skip


def _bad_samples_line(summary: PrepareSummary) -> str:
    if not summary.skipped:
        return "  bad samples: none"
    per_split = ", ".join(f"{split} {count}" for split, count in summary.bad_samples.items() if count)
    return (
        f"  bad samples: {summary.skipped} left out ({per_split}); each with its reason in {summary.bad_samples_path}"
    )


def write_bad_samples(path: str, skipped: Iterable[SkippedSample]) -> None:
    """Write one JSON line ``{"split", "id", "reason"}`` per bad sample to ``path`` (replaced atomically).

    Args:
        path: The file, ``bad_samples.jsonl`` in the output folder.
        skipped: The bad samples, in the order to list them.
    """
    write_text_atomically(path, "".join(json.dumps(asdict(s), ensure_ascii=False) + "\n" for s in skipped))
