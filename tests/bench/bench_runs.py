"""Helpers shared by the bench tests: tiny sweep flags, running ``vlfit bench`` in-process, made-up results."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from PIL import Image

from vlfit.cli import main

REPO = Path(__file__).resolve().parents[2]
# Few small images, batch 4, one warm-up and three timed steps: every code path, in seconds per configuration.
TINY = ["--model_preset", "tiny", "--num_samples", "8", "--synthetic_min_long_side", "160",
        "--synthetic_max_long_side", "320", "--per_device_train_batch_size", "4", "--steps", "3",
        "--warmup_steps", "1", "--repeats", "1", "--profile_batches", "1", "--num_proc", "1"]  # fmt: skip
# The quickest sweep that measures something: one pipeline, no profile.
QUICK = [*TINY, "--pipelines", "fast", "--steps", "2", "--profile_batches", "0"]


def run_bench(output_dir: Path, *flags: str) -> tuple[int, dict[str, Any] | None, str]:
    """``vlfit bench --output_dir output_dir flags...`` in this process: exit code, bench.json (None when not
    written) and what it printed."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", "--output_dir", str(output_dir), *flags])
    path = output_dir / "bench.json"
    return code, json.loads(path.read_text()) if path.exists() else None, stdout.getvalue()


def assert_png(path: Path) -> Image.Image:
    """``path`` is a PNG image Pillow can decode, with something drawn on it (not one flat colour)."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()
    image = Image.open(path).convert("RGB")
    assert image.width > 100 and image.height > 100
    low, high = zip(*image.getextrema(), strict=True)
    assert min(low) < max(high), "the chart is one flat colour"
    return image


def row(pipeline: str, workers: int, rate: float | None, mode: str = "train", prefetch: int | None = None) -> dict:
    """A measured (or, with rate None, failed) result row."""
    return {"mode": mode, "pipeline": pipeline, "workers": workers, "samples_per_second": rate,
            "prefetch_factor": prefetch if prefetch is not None else (2 if workers else None)}  # fmt: skip


def made_up_results(best: float, ceiling: float) -> dict[str, Any]:
    """Sweep results with a reference row at a quarter of ``best`` and a fast row at ``best``."""
    rows = [row("reference", 0, best / 4), row("fast", 1, best)]
    for r in rows:
        r.update(samples_per_second_min=r["samples_per_second"], samples_per_second_max=r["samples_per_second"],
                 data_wait_share=0.5, peak_host_rss_mib=100.0, peak_device_memory_mib=None, error=None)  # fmt: skip
    return {
        "settings": {"batch_size": 48, "precision": "bf16", "steps": 10, "warmup_steps": 3, "repeats": 1,
                     "prefetch_factors": [2], "model": "preset large", "model_flags": ["--model_preset", "large"]},
        "machine": {"cpu": "test", "cores": 2, "device_name": "cpu", "jpeg_decoder": "x", "torch": "x"},
        "compute": {"samples_per_second": ceiling, "step_ms": 1000 * 48 / ceiling, "precision": "bf16",
                    "readings": [ceiling]},
        "rows": rows,
        "stages": {},
        "complete": True,
    }  # fmt: skip
