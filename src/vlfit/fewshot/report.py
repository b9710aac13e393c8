"""``fewshot.json``, ``fewshot.md`` and ``fewshot.png``: accuracy against shots, one line per method."""

from __future__ import annotations

import json
import os
from typing import Any

from vlfit.atomic_files import replace_on_success, write_text_atomically

METHOD_LABELS = {"zeroshot": "zero-shot", "linear_probe": "linear probe", "setfit": "SetFit"}


def results_document(summary: dict[str, dict[int, dict[str, float]]], runs: list[dict], **context: Any) -> dict:
    """The JSON document: ``context`` (model, dataset, classes, settings...), every run, and the summary."""
    return {
        **context,
        "summary": {method: {str(shots): row for shots, row in rows.items()} for method, rows in summary.items()},
        "runs": runs,
    }


def markdown_table(summary: dict[str, dict[int, dict[str, float]]], shot_counts: list[int], chance: float) -> str:
    """Methods as rows, shot counts as columns, ``mean ± std`` over seeds; zero-shot (no shots) in every column."""
    header = "| method | " + " | ".join(f"{shots} shot{'s' if shots > 1 else ''}" for shots in shot_counts) + " |"
    lines = [header, "|---|" + "---:|" * len(shot_counts)]
    for method, rows in summary.items():
        cells = []
        for shots in shot_counts:
            row = rows.get(shots, rows.get(0))
            cells.append(f"{row['mean']:.3f} ± {row['std']:.3f}" if row else "")
        lines.append(f"| {METHOD_LABELS.get(method, method)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Accuracy on the evaluation split, mean ± standard deviation over seeds; chance {chance:.3f}.")
    return "\n".join(lines) + "\n"


def write_reports(output_dir: str, document: dict, markdown: str, shot_counts: list[int], chance: float) -> list[str]:
    """Write the three files into ``output_dir``; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, "fewshot.json")
    md_path = os.path.join(output_dir, "fewshot.md")
    png_path = os.path.join(output_dir, "fewshot.png")
    write_text_atomically(json_path, json.dumps(document, indent=1) + "\n")
    write_text_atomically(md_path, markdown)
    write_png(document["summary"], shot_counts, chance, png_path)
    return [json_path, md_path, png_path]


def write_png(
    summary: dict[str, dict[str, dict[str, float]]], shot_counts: list[int], chance: float, path: str
) -> None:
    """Accuracy against shots (log scale), a line with a ±std band per method; zero-shot dashed, chance dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for method, rows in summary.items():
        label = METHOD_LABELS.get(method, method)
        if set(rows) == {"0"}:
            ax.axhline(rows["0"]["mean"], linestyle="--", color="grey", label=label)
            continue
        xs = [s for s in shot_counts if str(s) in rows]
        means = [rows[str(s)]["mean"] for s in xs]
        stds = [rows[str(s)]["std"] for s in xs]
        (line,) = ax.plot(xs, means, marker="o", label=label)
        low = [m - d for m, d in zip(means, stds, strict=True)]
        high = [m + d for m, d in zip(means, stds, strict=True)]
        ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    ax.axhline(chance, linestyle=":", color="black", label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(shot_counts, [str(s) for s in shot_counts])
    ax.set_xlabel("labelled images per class")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with replace_on_success(path) as temp:
        fig.savefig(temp, format="png")
    plt.close(fig)
