"""``bench.png``: samples/s per pipeline and worker count against the compute ceiling, beside the published figures.

Drawn with matplotlib (Agg) where it is installed; without it (a bare GPU machine), a plainer chart of the same
measured bars with Pillow, so that a sweep always leaves a picture.
"""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageDraw

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


def write_png(results: dict[str, Any], path: str) -> str:
    """Grouped bars (one group per pipeline, one bar per worker count) with the compute ceiling as a line.

    One panel per mode, plus the published figures per device. Uses matplotlib (Agg); without it, a plainer
    chart drawn with Pillow. The file is written as PNG whatever ``path`` ends with.

    Returns:
        The renderer used: ``matplotlib`` or ``pillow``.
    """
    try:
        import matplotlib  # optional: a bare GPU machine may lack it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_png_pillow(results, path)
        return "pillow"
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
    return "matplotlib"


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


def write_png_pillow(results: dict[str, Any], path: str) -> None:
    """The measured bars of one mode (train if measured, else loader) and the compute ceiling, drawn with Pillow."""

    mode = "train" if any(r["mode"] == "train" and samples_per_second(r) for r in results["rows"]) else "loader"
    pipelines, workers, rows = _chart_groups(results, mode)
    ceiling = results.get("compute", {}).get("samples_per_second") or 0.0
    top = max([ceiling, *(r["samples_per_second"] for r in rows.values())], default=1.0) * 1.15
    width, height, left, bottom, plot_top = 760, 420, 60, 360, 40
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    colours = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]
    group = (width - left - 20) / max(len(pipelines), 1)
    bar = group * 0.8 / max(len(workers), 1)
    draw.line([(left, plot_top), (left, bottom), (width - 20, bottom)], fill="black")
    for g, name in enumerate(pipelines):
        x0 = left + g * group + group * 0.1
        for i, w in enumerate(workers):
            row = rows.get((name, w))
            if row is None:
                continue
            y = bottom - (bottom - plot_top) * row["samples_per_second"] / top
            box = [x0 + i * bar, y, x0 + (i + 1) * bar - 2, bottom]
            draw.rectangle(box, fill=colours[i % len(colours)])
            draw.text((box[0], y - 12), f"{row['samples_per_second']:.0f}", fill="black")
        draw.text((x0, bottom + 6), name, fill="black")
    if ceiling:
        y = bottom - (bottom - plot_top) * ceiling / top
        draw.line([(left, y), (width - 20, y)], fill="black", width=1)
        draw.text((left + 4, y - 12), f"compute ceiling {ceiling:.0f} samples/s", fill="black")
    legend = "   ".join(workers_label(w) for w in workers)
    draw.text((left, 12), f"vlfit bench, {mode} mode, samples/s   bars: {legend}", fill="black")
    for i, w in enumerate(workers):
        draw.rectangle([left + i * 90, bottom + 26, left + i * 90 + 10, bottom + 36], fill=colours[i % len(colours)])
        draw.text((left + i * 90 + 14, bottom + 25), workers_label(w), fill="black")
    image.save(path, format="PNG")
