"""``bench.png``: samples/s per pipeline and worker count against the compute ceiling, beside the published figures.

Drawn with matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from typing import Any

from vlfit.bench.published import per_device, published_figures
from vlfit.bench.selection import samples_per_second, workers_label


def _chart_groups(results: dict[str, Any], mode: str) -> tuple[list[str], list[int], dict[tuple[str, int], dict]]:
    prefetch = (results["settings"].get("prefetch_factors") or [2])[0]
    rows = {
        (r["pipeline"], r["workers"]): r
        for r in results["rows"]
        if r["mode"] == mode and samples_per_second(r) and (r["workers"] == 0 or r["prefetch_factor"] == prefetch)
    }
    pipelines = list(dict.fromkeys(p for p, _ in rows))
    workers = sorted({w for _, w in rows})
    return pipelines, workers, rows


def write_png(results: dict[str, Any], path: str) -> None:
    """Grouped bars (one group per pipeline, one bar per worker count) with the compute ceiling as a line.

    One panel per mode, plus the published figures per device. The file is written as PNG whatever ``path`` ends
    with.
    """
    import matplotlib  # here, not at import: choosing the backend is a process-wide setting, and it takes a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("train", "loader") if any(r["mode"] == m and samples_per_second(r) for r in results["rows"])]
    panels = len(modes) + 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4), squeeze=False)
    ceiling = results.get("compute", {}).get("samples_per_second")
    for ax, mode in zip(axes[0], modes, strict=False):
        pipelines, workers, rows = _chart_groups(results, mode)
        width = 0.8 / max(len(workers), 1)
        for i, w in enumerate(workers):
            xs = [p + (i - (len(workers) - 1) / 2) * width for p in range(len(pipelines))]
            present = [rows.get((name, w)) for name in pipelines]
            values = [row["samples_per_second"] if row else 0.0 for row in present]
            low = [row["samples_per_second"] - row["samples_per_second_min"] if row else 0.0 for row in present]
            high = [row["samples_per_second_max"] - row["samples_per_second"] if row else 0.0 for row in present]
            bars = ax.bar(xs, values, width, yerr=[low, high], capsize=2, label=workers_label(w))
            ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        if ceiling:
            ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, label=f"compute ceiling {ceiling:.0f}")
        ax.set_xticks(range(len(pipelines)), pipelines)
        ax.set_ylabel("samples/s")
        ax.set_title(f"{mode} mode, this machine")
        ax.legend(fontsize=7)
    _published_panel(axes[0][-1], published_figures())
    settings = results["settings"]
    fig.suptitle(f"vlfit bench: {settings.get('model', '?')}, batch {settings['batch_size']}, {settings['precision']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _published_panel(ax: Any, published: dict[str, Any]) -> None:
    devices = [entry["device"] for entry in published["rows"]]
    bars = len(published["workers"]) + 1  # one per worker count, then the media pipeline
    width = 0.8 / bars
    for i, w in enumerate(published["workers"]):
        values = [per_device(entry["samples_per_second"][w], published) for entry in published["rows"]]
        offset = (i - (bars - 1) / 2) * width
        ax.bar([d + offset for d in range(len(devices))], values, width, label=workers_label(w))
    media = [entry.get("media_pipeline") for entry in published["rows"]]
    ax.bar(
        [d + (bars - 1) / 2 * width for d in range(len(devices)) if media[d]],
        [per_device(m, published) for m in media if m],
        width,
        label=f"media pipeline, {workers_label(published['media_pipeline_workers'])}",
    )
    ax.set_xticks(range(len(devices)), devices)
    ax.set_ylabel("samples/s per device")
    n = published["devices"]
    ax.set_title(f"published figures ({n} devices / {n}), BridgeTower-large", fontsize=9)
    ax.legend(fontsize=7)
