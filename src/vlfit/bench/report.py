"""Turn sweep results into derived figures, a verdict, a terminal table, ``bench.json``, ``bench.md`` and ``bench.png``.

Derived per row: speedup against the ``reference, 0 workers`` row of the same mode, fraction of the compute
ceiling, and whether a train row sits above the ceiling by more than ``CEILING_TOLERANCE`` (which only noise can
cause: a train step does everything a ceiling step does, plus waiting for data).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# A train row may read up to this fraction above the compute ceiling before it counts as a measurement problem:
# both are medians of short windows on a machine that may be doing other work.
CEILING_TOLERANCE = 0.15
# Below this fraction of the compute ceiling, the best data path is what limits training.
DATA_BOUND_BELOW = 0.9

PUBLISHED: dict[str, Any] = {
    "label": "published figures (not measured here)",
    "setup": "BridgeTower-large (866M parameters), contrastive fine-tuning on the New Yorker Caption Contest, "
    "batch 48 per device, bf16, 8 devices; samples/s for dataloader_num_workers 0/1/2",
    "devices": 8,
    "rows": [
        {"device": "Gaudi2", "samples_per_second": {"0": 601.5, "1": 747.4, "2": 768.7}, "media_pipeline": 847.7},
        {"device": "H100", "samples_per_second": {"0": 336.5, "1": 580.1, "2": 602.1}},
        {"device": "A100", "samples_per_second": {"0": 227.5, "1": 339.7, "2": 345.4}},
    ],
}


def _rate(row: dict[str, Any]) -> float | None:
    return row.get("samples_per_second")


def finalize(results: dict[str, Any]) -> dict[str, Any]:
    """Add derived row fields, the verdict, the recommended configuration and the published figures (in place)."""
    from vlfit.bench.auto import recommend

    ceiling = results.get("compute", {}).get("samples_per_second")
    references = {
        row["mode"]: _rate(row)
        for row in results["rows"]
        if row["pipeline"] == "reference" and row["workers"] == 0 and _rate(row)
    }
    for row in results["rows"]:
        rate, reference = _rate(row), references.get(row["mode"])
        row["speedup_vs_reference"] = rate / reference if rate and reference else None
        row["fraction_of_compute"] = rate / ceiling if rate and ceiling else None
        row["above_ceiling"] = bool(
            row["mode"] == "train" and rate and ceiling and rate > ceiling * (1 + CEILING_TOLERANCE)
        )
    results["ceiling_tolerance"] = CEILING_TOLERANCE
    results["verdict"] = verdict(results)
    results["recommendation"] = recommend(results)
    results["published"] = PUBLISHED
    return results


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest measured row, taken from train mode when the sweep has any train rows."""
    measured = [row for row in rows if _rate(row)]
    trained = [row for row in measured if row["mode"] == "train"]
    pool = trained or measured
    return max(pool, key=lambda row: row["samples_per_second"]) if pool else None


def verdict(results: dict[str, Any]) -> dict[str, Any] | None:
    """``data-bound`` when the best data path reaches < 0.9 x the compute ceiling, else ``compute-bound``."""
    best = best_row(results["rows"])
    compute = results.get("compute")
    if best is None or not compute:
        return None
    ceiling = compute["samples_per_second"]
    fraction = best["samples_per_second"] / ceiling
    bound = "data-bound" if fraction < DATA_BOUND_BELOW else "compute-bound"
    lines = [
        f"{bound}: the best data path ({describe(best)}, {best['mode']} mode) reaches "
        f"{best['samples_per_second']:.1f} samples/s = {fraction:.2f} x the compute ceiling "
        f"({ceiling:.1f} samples/s, {compute['precision']}, {compute['step_ms']:.0f} ms/step); "
        f"threshold {DATA_BOUND_BELOW} x."
    ]
    if best["mode"] == "train" and best.get("data_wait_share") is not None:
        lines.append(f"It waits for data {100 * best['data_wait_share']:.0f}% of the time.")
    if best["mode"] == "loader":
        lines.append("(loader mode only: the data path alone, without the model competing for the machine)")
    if best.get("speedup_vs_reference"):
        lines.append(f"That is {best['speedup_vs_reference']:.2f}x the reference pipeline with 0 workers.")
    stages = results.get("stages", {}).get(best["pipeline"])
    if stages and stages["worker_ms"] > 0:
        name = stages["largest_worker_stage"]
        share = stages["stages_ms"][name] / stages["worker_ms"]
        lines.append(
            f"Per batch, the {best['pipeline']} pipeline's worker stages take {stages['worker_ms']:.0f} ms "
            f"(largest: {name}, {100 * share:.0f}%); main-process stages {stages['main_ms']:.0f} ms "
            f"(compute {stages['stages_ms']['compute']:.0f} ms)."
        )
    if bound == "data-bound":
        lines.append("More workers, a cheaper pipeline (prepared data, device decode) or more cores would help.")
    else:
        lines.append("The input pipeline keeps up: faster training has to come from the model side.")
    return {
        "bound": bound,
        "best": {key: best[key] for key in ("mode", "pipeline", "workers", "prefetch_factor", "samples_per_second")},
        "compute_ceiling": ceiling,
        "fraction_of_compute": fraction,
        "threshold": DATA_BOUND_BELOW,
        "text": " ".join(lines),
    }


def describe(row: dict[str, Any]) -> str:
    """``fast, 2 workers, prefetch 2``."""
    text = f"{row['pipeline']}, {row['workers']} worker{'s' if row['workers'] != 1 else ''}"
    return text + (f", prefetch {row['prefetch_factor']}" if row.get("prefetch_factor") else "")


# -------------------------------------------------------------------------------------------------- tables


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


ROW_HEADERS = (
    "mode", "pipeline", "workers", "prefetch", "samples/s", "min-max", "data wait", "vs ref", "of ceiling",
    "host RSS MiB", "device MiB",
)  # fmt: skip


def row_cells(row: dict[str, Any]) -> list[str]:
    """The table cells of one row."""
    rate = _rate(row)
    if rate is None:
        return [row["mode"], row["pipeline"], str(row["workers"]), _fmt(row["prefetch_factor"], "d"),
                "failed", row.get("error") or "", "", "", "", "", ""]  # fmt: skip
    spread = f"{row['samples_per_second_min']:.1f}-{row['samples_per_second_max']:.1f}"
    flag = " (!)" if row.get("above_ceiling") else ""
    return [
        row["mode"],
        row["pipeline"],
        str(row["workers"]),
        _fmt(row["prefetch_factor"], "d"),
        f"{rate:.1f}{flag}",
        spread,
        _percent(row.get("data_wait_share")),
        _fmt(row.get("speedup_vs_reference"), ".2f", "-") + ("x" if row.get("speedup_vs_reference") else ""),
        _fmt(row.get("fraction_of_compute"), ".2f"),
        _fmt(row.get("peak_host_rss_mib"), ".0f"),
        _fmt(row.get("peak_device_memory_mib"), ".0f"),
    ]


def _text_table(headers: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _md_table(headers: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


STAGE_HEADERS_PREFIX = ("pipeline",)


def _stage_table(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    stages = results.get("stages") or {}
    if not stages:
        return [], []
    names = list(next(iter(stages.values()))["stages_ms"])
    headers = ["pipeline (ms/batch)", *names, "workers total", "main total"]
    rows = [
        [pipeline, *(f"{profile['stages_ms'][n]:.1f}" for n in names)]
        + [f"{profile['worker_ms']:.1f}", f"{profile['main_ms']:.1f}"]
        for pipeline, profile in stages.items()
    ]
    return headers, rows


def _published_rows() -> list[list[str]]:
    rows = []
    devices = PUBLISHED["devices"]
    for entry in PUBLISHED["rows"]:
        figures = entry["samples_per_second"]
        cells = [f"{figures[w]:.1f} ({figures[w] / devices:.1f})" for w in ("0", "1", "2")]
        media = entry.get("media_pipeline")
        cells.append("-" if media is None else f"{media:.1f} ({media / devices:.1f})")
        rows.append([entry["device"], *cells])
    return rows


PUBLISHED_HEADERS = ("device", "0 workers", "1 worker", "2 workers", "media pipeline (decode on device)")


def _summary_lines(results: dict[str, Any]) -> list[str]:
    s, m, c = results["settings"], results["machine"], results.get("compute")
    lines = [
        f"model {s.get('model', '?')}, batch {s['batch_size']}, {s['precision']}; per configuration {s['steps']} "
        f"timed steps after {s['warmup_steps']} warm-up, median of {s['repeats']}",
        f"data: {s.get('data', '?')}",
        f"machine: {m['cpu']}, {m['cores']} cores; device {m['device_name']}; JPEG decoder {m['jpeg_decoder']}; "
        f"torch {m['torch']}",
    ]
    loads = [m.get("load_average_start"), m.get("load_average_end")]
    if loads[0] is not None:
        busy = " (other work was running: expect noise)" if loads[0] >= m["cores"] else ""
        end = f", end {loads[1]:.1f}" if loads[1] is not None else ""
        lines.append(f"load average (1 min): start {loads[0]:.1f}{end} on {m['cores']} cores{busy}")
    if c:
        readings = c.get("readings", [])
        lines.append(
            f"compute ceiling: {c['samples_per_second']:.1f} samples/s ({c['step_ms']:.1f} ms/step, {c['precision']}; "
            f"highest of {len(readings)} readings, lowest {min(readings, default=0):.1f})"
        )
    comparison = results.get("bf16_comparison")
    if comparison:
        lines.append(
            f"fp32 vs bf16 compute: fp32 {comparison['fp32_samples_per_second']:.1f}, bf16 "
            f"{comparison['bf16_samples_per_second']:.1f} samples/s, fp32/bf16 = {comparison['fp32_over_bf16']:.2f}"
        )
    return lines


def format_terminal(results: dict[str, Any]) -> str:
    """The table, stage breakdown, verdict and recommendation as plain text."""
    parts = ["\n".join(_summary_lines(results)), _text_table(ROW_HEADERS, [row_cells(r) for r in results["rows"]])]
    if any(r.get("above_ceiling") for r in results["rows"]):
        parts.append(f"(!) above the compute ceiling by more than {100 * CEILING_TOLERANCE:.0f}%: measurement noise")
    headers, rows = _stage_table(results)
    if rows:
        parts.append("per-stage time, one batch (approximation: stages timed alone in the main process)\n"
                     + _text_table(headers, rows))  # fmt: skip
    if results.get("verdict"):
        parts.append("verdict: " + results["verdict"]["text"])
    recommendation = results.get("recommendation")
    if recommendation:
        parts.append(recommendation["text"])
    devices = PUBLISHED["devices"]
    published = []
    for entry in PUBLISHED["rows"]:
        figures = "/".join(f"{value / devices:.1f}" for value in entry["samples_per_second"].values())
        media = entry.get("media_pipeline")
        published.append(f"{entry['device']} {figures}" + (f" (media pipeline {media / devices:.1f})" if media else ""))
    label = f"{PUBLISHED['label']}, BridgeTower-large, samples/s per device for 0/1/2 workers"
    parts.append(f"{label}: {'; '.join(published)}")
    return "\n\n".join(parts)


def format_markdown(results: dict[str, Any], png_name: str | None = "bench.png") -> str:
    """``bench.md``: settings, table, chart, stage breakdown, verdict, recommendation, published figures."""
    parts = ["# vlfit bench", "\n".join(f"- {line}" for line in _summary_lines(results))]
    if not results.get("complete", True):
        parts.append("**Partial results: the sweep did not finish.**")
    parts.append(_md_table(ROW_HEADERS, [row_cells(r) for r in results["rows"]]))
    parts.append(
        "samples/s: median of the repeats (min-max beside it); data wait: share of the timed window spent blocked "
        "waiting for the next batch; vs ref: against `reference` with 0 workers in the same mode; of ceiling: "
        "against the compute ceiling (the same model trained on one ready batch again and again). Host RSS: main "
        "process plus loader workers (shared pages counted per process)."
    )
    if png_name:
        parts.append(f"![samples/s per pipeline and worker count]({png_name})")
    headers, rows = _stage_table(results)
    if rows:
        parts += ["## Where a batch's time goes", _md_table(headers, rows),
                  "Each stage timed alone on a few batches in the main process (worker stages with one thread, as in "
                  "a worker); an approximation, since in a run they overlap and share cores."]  # fmt: skip
    if results.get("verdict"):
        parts += ["## Verdict", results["verdict"]["text"]]
    recommendation = results.get("recommendation")
    if recommendation:
        parts += ["## Settings for this machine", "```\n" + recommendation["text"] + "\n```"]
    parts += [
        "## Published figures",
        f"{PUBLISHED['label']}: {PUBLISHED['setup']}. Per device (/{PUBLISHED['devices']}) in brackets.",
        _md_table(PUBLISHED_HEADERS, _published_rows()),
    ]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------- chart


def _chart_groups(results: dict[str, Any], mode: str) -> tuple[list[str], list[int], dict[tuple[str, int], dict]]:
    prefetch = (results["settings"].get("prefetch_factors") or [2])[0]
    rows = {
        (r["pipeline"], r["workers"]): r
        for r in results["rows"]
        if r["mode"] == mode and _rate(r) and (r["workers"] == 0 or r["prefetch_factor"] == prefetch)
    }
    pipelines = list(dict.fromkeys(p for p, _ in rows))
    workers = sorted({w for _, w in rows})
    return pipelines, workers, rows


def _workers_label(workers: int | str) -> str:
    return f"{workers} worker{'' if int(workers) == 1 else 's'}"


def write_png(results: dict[str, Any], path: str) -> str:
    """Grouped bars (one group per pipeline, one bar per worker count) with the compute ceiling as a line.

    One panel per mode, plus the published figures per device. Uses matplotlib (Agg); without it, a plainer
    chart drawn with Pillow.

    Returns:
        The renderer used: ``matplotlib`` or ``pillow``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _write_png_pillow(results, path)
        return "pillow"
    modes = [m for m in ("train", "loader") if any(r["mode"] == m and _rate(r) for r in results["rows"])]
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
            bars = ax.bar(xs, values, width, yerr=[low, high], capsize=2, label=_workers_label(w))
            ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        if ceiling:
            ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, label=f"compute ceiling {ceiling:.0f}")
        ax.set_xticks(range(len(pipelines)), pipelines)
        ax.set_ylabel("samples/s")
        ax.set_title(f"{mode} mode, this machine")
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    devices = [entry["device"] for entry in PUBLISHED["rows"]]
    width = 0.2
    for i, w in enumerate(("0", "1", "2")):
        values = [entry["samples_per_second"][w] / PUBLISHED["devices"] for entry in PUBLISHED["rows"]]
        ax.bar([d + (i - 1.5) * width for d in range(len(devices))], values, width, label=_workers_label(w))
    media = [entry.get("media_pipeline") for entry in PUBLISHED["rows"]]
    ax.bar([d + 1.5 * width for d in range(len(devices)) if media[d]],
           [m / PUBLISHED["devices"] for m in media if m], width, label="media pipeline")  # fmt: skip
    ax.set_xticks(range(len(devices)), devices)
    ax.set_ylabel("samples/s per device")
    ax.set_title("published figures (8 devices / 8), BridgeTower-large", fontsize=9)
    ax.legend(fontsize=7)
    settings = results["settings"]
    fig.suptitle(f"vlfit bench: {settings.get('model', '?')}, batch {settings['batch_size']}, {settings['precision']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def _write_png_pillow(results: dict[str, Any], path: str) -> None:
    from PIL import Image, ImageDraw

    mode = "train" if any(r["mode"] == "train" and _rate(r) for r in results["rows"]) else "loader"
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
    legend = "   ".join(_workers_label(w) for w in workers)
    draw.text((left, 12), f"vlfit bench, {mode} mode, samples/s   bars: {legend}", fill="black")
    for i, w in enumerate(workers):
        draw.rectangle([left + i * 90, bottom + 26, left + i * 90 + 10, bottom + 36], fill=colours[i % len(colours)])
        draw.text((left + i * 90 + 14, bottom + 25), _workers_label(w), fill="black")
    image.save(path)


# ---------------------------------------------------------------------------------------------------- files


def write_outputs(results: dict[str, Any], output_dir: str, *, png: bool = True) -> dict[str, str]:
    """Write ``bench.json``, ``bench.md`` and (when ``png``) ``bench.png`` into ``output_dir``.

    Returns:
        Kind -> path of each file written.
    """
    os.makedirs(output_dir, exist_ok=True)
    paths = {"json": os.path.join(output_dir, "bench.json"), "md": os.path.join(output_dir, "bench.md")}
    if png:
        path = os.path.join(output_dir, "bench.png")
        try:
            results.setdefault("settings", {})["chart_renderer"] = write_png(results, path)
            paths["png"] = path
        except Exception:  # a chart is not worth losing the numbers over (fonts, backends, ...)
            logger.exception("could not draw %s; bench.json and bench.md are written anyway", path)
            png = False
    temp = paths["json"] + ".tmp"
    try:
        with open(temp, "w") as f:
            json.dump(results, f, indent=1, allow_nan=False)
        os.replace(temp, paths["json"])  # a reader never sees half a file, even if the run is killed
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    with open(paths["md"], "w") as f:
        f.write(format_markdown(results, "bench.png" if png else None))
    return paths
