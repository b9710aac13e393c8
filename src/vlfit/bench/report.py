"""Turn sweep results into derived figures, a verdict, and the text of the terminal table and ``bench.md``.

Derived per row: speedup against the ``reference, 0 workers`` row of the same mode, fraction of the compute
ceiling, and whether a train row sits above the ceiling by more than ``CEILING_TOLERANCE`` (which only noise can
cause: a train step does everything a ceiling step does, plus waiting for data).
"""

from __future__ import annotations

from typing import Any

from vlfit.bench.published import citation, per_device, published_figures
from vlfit.bench.selection import CONFIG_FIELDS, best_row, describe, recommend, samples_per_second, workers_label
from vlfit.training.itm_objective import CONTRASTIVE

# A train row may read up to this fraction above the compute ceiling before it counts as a measurement problem:
# both are medians of short windows on a machine that may be doing other work.
CEILING_TOLERANCE = 0.15
# Below this fraction of the compute ceiling, the best data path is what limits training.
DATA_BOUND_BELOW = 0.9
# A train-mode row that waits for data less than this share of its time is not held back by its data, however far
# below the compute ceiling it runs: the gap is the step's own overhead (the Trainer's loop, logging, the loss).
DATA_WAIT_BOUND = 0.05


def finalize(results: dict[str, Any]) -> dict[str, Any]:
    """Add derived row fields, the verdict, the recommended configuration and the published figures (in place)."""
    ceiling = results.get("compute", {}).get("samples_per_second")
    flops, peak = results.get("flops_per_sample"), (results.get("peak") or {}).get("peak_tflops")
    references = {
        row["mode"]: samples_per_second(row)
        for row in results["rows"]
        if row["pipeline"] == "reference" and row["workers"] == 0 and samples_per_second(row)
    }
    for row in results["rows"]:
        rate, reference = samples_per_second(row), references.get(row["mode"])
        row["speedup_vs_reference"] = rate / reference if rate and reference else None
        row["fraction_of_compute"] = rate / ceiling if rate and ceiling else None
        row["above_ceiling"] = bool(
            row["mode"] == "train" and rate and ceiling and rate > ceiling * (1 + CEILING_TOLERANCE)
        )
        # Compute efficiency of a train row: the model's matrix work at this rate, against the device's peak.
        trains = row["mode"] == "train" and rate and flops
        row["tflops_per_second"] = rate * flops / 1e12 if trains else None
        row["mfu"] = row["tflops_per_second"] / peak if trains and peak else None
    results["ceiling_tolerance"] = CEILING_TOLERANCE
    results["verdict"] = verdict(results)
    results["recommendation"] = recommend(results)
    results["published"] = published_figures()
    return results


def verdict(results: dict[str, Any]) -> dict[str, Any] | None:
    """``data-bound`` when the best data path reaches < 0.9 x the compute ceiling and (in train mode) waits for
    data ``DATA_WAIT_BOUND`` of its time or more, else ``compute-bound``."""
    best = best_row(results["rows"])
    compute = results.get("compute")
    if best is None or not compute:
        return None
    ceiling = compute["samples_per_second"]
    fraction = best["samples_per_second"] / ceiling
    wait = best.get("data_wait_share") if best["mode"] == "train" else None
    waits = wait is None or wait >= DATA_WAIT_BOUND
    bound = "data-bound" if fraction < DATA_BOUND_BELOW and waits else "compute-bound"
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
    elif fraction < DATA_BOUND_BELOW:
        lines.append(
            f"Below the ceiling without waiting for data (under {100 * DATA_WAIT_BOUND:.0f}% of the time): the gap is "
            "the training step's own overhead beyond the model's forward, backward and optimizer step, not the input "
            "pipeline."
        )
    else:
        lines.append("The input pipeline keeps up: faster training has to come from the model side.")
    return {
        "bound": bound,
        "best": {key: best[key] for key in CONFIG_FIELDS},
        "compute_ceiling": ceiling,
        "fraction_of_compute": fraction,
        "threshold": DATA_BOUND_BELOW,
        "text": " ".join(lines),
    }


# -------------------------------------------------------------------------------------------------- tables


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


ROW_HEADERS = (
    "mode", "pipeline", "workers", "prefetch", "samples/s", "min-max", "data wait", "vs ref", "of ceiling",
    "TFLOP/s", "MFU", "host RSS MiB", "device MiB",
)  # fmt: skip


def row_cells(row: dict[str, Any]) -> list[str]:
    """The table cells of one row."""
    rate = samples_per_second(row)
    if rate is None:
        error = " ".join((row.get("error") or "").split())  # one line, whatever the exception's message holds
        return [row["mode"], row["pipeline"], str(row["workers"]), _fmt(row["prefetch_factor"], "d"),
                "failed", error, "", "", "", "", "", "", ""]  # fmt: skip
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
        _fmt(row.get("tflops_per_second"), ".3g"),
        _percent_one_decimal(row.get("mfu")),
        _fmt(row.get("peak_host_rss_mib"), ".0f"),
        _fmt(row.get("peak_device_memory_mib"), ".0f"),
    ]


def _percent_one_decimal(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


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


def _published_table(published: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    media_heading = f"media pipeline, {workers_label(published['media_pipeline_workers'])} (decode on device)"
    headers = ["device", *(workers_label(w) for w in published["workers"]), media_heading]
    rows = []
    for entry in published["rows"]:
        figures = [entry["samples_per_second"][w] for w in published["workers"]]
        media = entry.get("media_pipeline")
        cells = [f"{value:.1f} ({per_device(value, published):.1f})" for value in figures]
        cells.append("-" if media is None else f"{media:.1f} ({per_device(media, published):.1f})")
        rows.append([entry["device"], *cells])
    return headers, rows


def _published_line(published: dict[str, Any]) -> str:
    entries = []
    for entry in published["rows"]:
        figures = "/".join(f"{per_device(entry['samples_per_second'][w], published):.1f}" for w in published["workers"])
        media = entry.get("media_pipeline")
        entries.append(
            f"{entry['device']} {figures}" + (f" (media pipeline {per_device(media, published):.1f})" if media else "")
        )
    workers = "/".join(published["workers"])
    return f"{published['label']}, BridgeTower-large, samples/s per device for {workers} workers: {'; '.join(entries)}"


def _summary_lines(results: dict[str, Any]) -> list[str]:
    s, m, c = results["settings"], results["machine"], results.get("compute")
    lines = [
        f"model {s.get('model', '?')}, batch {s['batch_size']}, {s['precision']}, objective "
        f"{s.get('objective', CONTRASTIVE)}; per configuration {s['steps']} "
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
    peak = results.get("peak")
    if results.get("flops_per_sample") and peak:
        lines.append(
            f"compute efficiency: {results['flops_per_sample'] / 1e9:.3g} GFLOPs per sample (forward and backward, "
            f"counted on a training step of objective {s.get('objective', CONTRASTIVE)}); MFU against "
            f"{peak['peak_tflops']:.4g} TFLOP/s {peak['peak_precision']} ({peak['peak_device']}; {peak['peak_source']})"
        )
    comparison = results.get("bf16_comparison")
    if comparison:
        line = (
            f"fp32 vs bf16 compute: fp32 {comparison['fp32_samples_per_second']:.1f}, bf16 "
            f"{comparison['bf16_samples_per_second']:.1f} samples/s, fp32/bf16 = {comparison['fp32_over_bf16']:.2f}"
        )
        if "bf16_weights_samples_per_second" in comparison:
            weights = comparison["bf16_weights_samples_per_second"]
            line += f"; bf16 weights with fp32 copies (--bf16_weights) {weights:.1f} samples/s"
        elif "bf16_weights_error" in comparison:
            line += f"; bf16 weights with fp32 copies (--bf16_weights) failed: {comparison['bf16_weights_error']}"
        lines.append(line)
    for key, name in (("attention_comparison", "attention kernel"), ("compile_comparison", "torch.compile")):
        if results.get(key, {}).get("error"):
            lines.append(f"{name} comparison failed: {results[key]['error']}")
    attention = results.get("attention_comparison")
    if attention and "error" not in attention:
        lines.append(
            f"attention kernel compute: eager {attention['eager_samples_per_second']:.1f}, sdpa "
            f"{attention['sdpa_samples_per_second']:.1f} samples/s = {attention['sdpa_speedup']:.2f}x"
        )
    compiled = results.get("compile_comparison")
    if compiled and "error" not in compiled:
        lines.append(
            f"torch.compile ({compiled['backend']}) compute: "
            + "; ".join(
                f"{precision} eager {figures['eager_samples_per_second']:.1f}, compiled "
                f"{figures['compiled_samples_per_second']:.1f} samples/s = {figures['compiled_speedup']:.2f}x "
                f"(first compiled step {figures['first_compiled_step_seconds']:.0f} s)"
                # A bench.json from before the comparison covered both precisions has the sweep's own only.
                for precision, figures in (compiled.get("by_precision") or {s["precision"]: compiled}).items()
            )
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
    parts.append(_published_line(published_figures()))
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
        "against the compute ceiling (the same model trained on one ready batch again and again). TFLOP/s and MFU "
        "(train rows): the model's matrix FLOPs per sample times samples/s, and that against the device's peak. "
        "Host RSS: main process plus loader workers (shared pages counted per process)."
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
    published = published_figures()
    parts += [
        "## Published figures",
        f"{published['label']}: {published['setup']}. Per device (/{published['devices']}) in brackets.",
        _md_table(*_published_table(published)),
        f"Source: {citation(published)}; figures from {published['source']['figures_from']}.",
    ]
    return "\n\n".join(parts) + "\n"
