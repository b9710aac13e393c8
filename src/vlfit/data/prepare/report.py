"""What a ``vlfit prepare`` run did: the summary ``prepare_dataset`` returns and its human-readable report."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlfit.data.prepare.reencode import CHROMA_SUBSAMPLING
from vlfit.data.prepare.shards import ShardStats


@dataclass
class PrepareSummary:
    """What a ``prepare_dataset`` run did, over every shard of the requested splits (built now or before).

    Args:
        output_dir: The output folder.
        short_side: Output short side in pixels.
        jpeg_quality: Output JPEG quality.
        split_rows: Samples per split.
        totals: Counts over all shards of the requested splits.
        shards_total: Shards of the requested splits.
        shards_built: Shards written by this run.
        samples_built: Samples written by this run.
        elapsed_s: Wall time of this run in seconds.
        built_shards: File names of the shards written by this run.
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

    @property
    def samples(self) -> int:
        """Samples over all requested splits."""
        return self.totals.rows

    @property
    def byte_ratio(self) -> float:
        """Source image bytes / output file bytes."""
        return self.totals.input_bytes / max(self.totals.output_bytes, 1)

    @property
    def images_per_s(self) -> float:
        """Samples written by this run per second of its wall time."""
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
    splits = ", ".join(f"{split} {rows}" for split, rows in summary.split_rows.items())
    kept = summary.shards_total - summary.shards_built
    mb = 1e6
    ratio = summary.byte_ratio
    size_change = f"{ratio:.1f}x smaller" if ratio >= 1 else f"{1 / max(ratio, 1e-9):.1f}x larger"
    return "\n".join(
        [
            f"prepared {summary.samples} samples ({splits}) into {summary.output_dir}",
            f"  shards: {summary.shards_total} ({summary.shards_built} built now, {kept} kept from an earlier run)",
            f"  short side {summary.short_side} px, JPEG quality {summary.jpeg_quality} ({CHROMA_SUBSAMPLING}); "
            f"{t.small_images} images already at or below it kept their size (not upscaled)",
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
