"""The pipelines a sweep compares, what each one is in ``vlfit train`` flags, and the rule that picks one.

The rule (``choose``): among the measured rows (train rows when there are any), take those within
``AUTO_TOLERANCE`` of the fastest, and of those the one that needs no separate preparation step, then the fewest
workers, then the smallest prefetch factor: extra processes and buffered batches cost memory and buy nothing
inside the noise. ``vlfit bench --auto`` prints the ``vlfit train`` flags of the choice (``recommend``);
``vlfit train --dataloader_num_workers auto`` applies the same rule to a short probe (``vlfit.bench.auto``).

This module works on plain result rows (dicts, as in ``bench.json``) and imports nothing else from the bench, so
every other bench module can use it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from vlfit.errors import ConfigError
from vlfit.training.itm_objective import CONTRASTIVE

# Rows within this fraction of the fastest count as equally fast.
AUTO_TOLERANCE = 0.05
WORKERS_FLAG = "--dataloader_num_workers"
# The recommendation takes the other of fp32 and bf16, or torch.compile, only when it measured at least this many
# times faster than the sweep's own setting: two readings of one step on a shared machine differ by some percent,
# and a precision (or minutes of compiling) is no reason to change for less.
PRECISION_MARGIN = 1.1
# The precision of vlfit train --bf16 --bf16_weights (bf16 weights, fp32 copies in the optimizer) in a recommendation.
BF16_WEIGHTS = "bf16_weights"
# The fields that name a configuration (and the measured rate), as the verdict and recommendation repeat them.
CONFIG_FIELDS: tuple[str, ...] = ("mode", "pipeline", "workers", "prefetch_factor", "samples_per_second")


@dataclass(frozen=True)
class PipelineSpec:
    """What one benchmark pipeline means for the loader and for ``vlfit train``.

    Args:
        name: The name used in flags and tables.
        image_pipeline: The worker-side transform (``--image_pipeline`` of ``vlfit train``).
        decode_on_device: Workers only read bytes; the device stage decodes (``--decode_on_device``).
        prepared: Images come from the ``prepare_dataset`` copy at the model's resolution (``vlfit prepare``).
        needs_cuda: Only meaningful with an NVIDIA GPU (nvJPEG).
    """

    name: str
    image_pipeline: str
    decode_on_device: bool = False
    prepared: bool = False
    needs_cuda: bool = False


PIPELINES: dict[str, PipelineSpec] = {
    "reference": PipelineSpec("reference", "reference"),
    "fast": PipelineSpec("fast", "fast"),
    "prepared": PipelineSpec("prepared", "fast", prepared=True),
    "device": PipelineSpec("device", "fast", decode_on_device=True, needs_cuda=True),
}


def get_pipeline(name: str) -> PipelineSpec:
    """Look a pipeline up by name.

    Raises:
        ValueError: naming the unknown pipeline and listing the valid ones.
    """
    try:
        return PIPELINES[name]
    except KeyError:
        raise ConfigError(f"unknown pipeline {name!r}; choose from: {', '.join(PIPELINES)}") from None


def samples_per_second(row: dict[str, Any]) -> float | None:
    """The row's median samples/s, or None for a row that failed."""
    return row.get("samples_per_second")


def _candidates(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    measured = [row for row in rows if samples_per_second(row)]
    trained = [row for row in measured if row["mode"] == "train"]
    return trained or measured


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest measured row, taken from train mode when the sweep has any train rows."""
    pool = _candidates(rows)
    return max(pool, key=lambda row: row["samples_per_second"]) if pool else None


def _cost(row: dict[str, Any]) -> tuple[bool, int, int]:
    return (get_pipeline(row["pipeline"]).prepared, row["workers"], row["prefetch_factor"] or 0)


def choose(rows: list[dict[str, Any]], tolerance: float = AUTO_TOLERANCE) -> dict[str, Any] | None:
    """The configuration to use (a row of ``rows``), or None when nothing was measured."""
    pool = _candidates(rows)
    if not pool:
        return None
    fastest = max(row["samples_per_second"] for row in pool)
    near = [row for row in pool if row["samples_per_second"] >= (1 - tolerance) * fastest]
    return min(near, key=lambda row: (*_cost(row), -row["samples_per_second"]))


def workers_label(workers: int | str) -> str:
    """``1 worker``, ``2 workers``."""
    return f"{workers} worker{'' if int(workers) == 1 else 's'}"


def describe(row: dict[str, Any]) -> str:
    """``fast, 2 workers, prefetch 2``."""
    text = f"{row['pipeline']}, {workers_label(row['workers'])}"
    return text + (f", prefetch {row['prefetch_factor']}" if row.get("prefetch_factor") else "")


def train_flags(
    row: dict[str, Any],
    *,
    precision: str,
    batch_size: int,
    objective: str = CONTRASTIVE,
    torch_compile_backend: str | None = None,
) -> list[str]:
    """The ``vlfit train`` flags that reproduce a configuration (``--objective`` when it is not the default,
    ``--torch_compile`` with a ``torch_compile_backend``)."""
    spec = get_pipeline(row["pipeline"])
    flags = ["--image_pipeline", spec.image_pipeline]
    if spec.decode_on_device:
        flags.append("--decode_on_device")
    flags += [WORKERS_FLAG, str(row["workers"])]
    if row["workers"] and row.get("prefetch_factor"):
        flags += ["--dataloader_prefetch_factor", str(row["prefetch_factor"])]
    flags += ["--per_device_train_batch_size", str(batch_size)]
    if precision in ("bf16", BF16_WEIGHTS):
        flags.append("--bf16")
        if precision == BF16_WEIGHTS:
            flags.append("--bf16_weights")
    elif precision == "fp16":
        flags.append("--fp16")
    if objective != CONTRASTIVE:
        flags += ["--objective", objective]
    if torch_compile_backend is not None:
        flags += ["--torch_compile", "true"]
        if torch_compile_backend != "inductor":  # the Trainer's default backend
            flags += ["--torch_compile_backend", torch_compile_backend]
    return flags


def fastest_compute(results: dict[str, Any]) -> tuple[str, str | None, str]:
    """The precision and ``torch.compile`` backend (None: eager) to train with, and why (a clause for the
    recommendation's line; empty without a comparison).

    The sweep's own precision, eager, unless its comparisons measured another setting at least
    ``PRECISION_MARGIN`` times faster: first the other of fp32 and bf16 (``bf16_comparison``), then bf16 weights
    with fp32 copies in the optimizer (``--bf16 --bf16_weights``, measured with the comparison) against that choice,
    then fp32 or bf16 under ``torch.compile`` against that one (``compile_comparison``, each precision's compiled
    speedup over its own eager reading)."""
    own = results["settings"]["precision"]
    relative: dict[tuple[str, str | None], float] = {(own, None): 1.0}  # rates relative to the sweep's own
    comparison = results.get("bf16_comparison")
    if comparison and own in ("fp32", "bf16"):
        speedup = comparison["bf16_speedup"]
        relative[("bf16" if own == "fp32" else "fp32", None)] = speedup if own == "fp32" else 1 / speedup
        if "bf16_weights_speedup" in comparison:  # over fp32, as bf16_speedup
            relative[(BF16_WEIGHTS, None)] = comparison["bf16_weights_speedup"] / (1.0 if own == "fp32" else speedup)
    compiled = results.get("compile_comparison") or {}
    backend = compiled.get("backend")
    for precision, figures in (compiled.get("by_precision") or {}).items():
        if (precision, None) in relative:
            relative[(precision, backend)] = relative[(precision, None)] * figures["compiled_speedup"]
    choice = (own, None)
    # Each change (the precision, then bf16 weights, then compiling) has to pay the margin over the choice so far.
    for tier in ("precision", BF16_WEIGHTS, "compiled"):
        candidates = [key for key in relative if _tier(key) == tier]
        best = max(candidates, key=relative.get, default=None)
        if best is not None and relative[best] >= PRECISION_MARGIN * relative[choice]:
            choice = best
    precision, chosen_backend = choice
    why = ""
    if comparison and own in ("fp32", "bf16"):
        cpu = results.get("machine", {}).get("cpu_features")
        on = f" on a CPU with {', '.join(cpu[:3])}" if cpu else ""
        why = f"; {precision}: bf16 ran {comparison['bf16_speedup']:.2f}x fp32's compute here{on}"
        if "bf16_weights_speedup" in comparison:
            why += f", bf16 weights with fp32 copies (--bf16_weights) {comparison['bf16_weights_speedup']:.2f}x"
    if backend is not None and (precision, backend) in relative:
        figures = compiled["by_precision"][precision]
        verdict = "torch.compile" if chosen_backend else "eager"
        why += (
            f"; {verdict}: {precision} under torch.compile ({backend}) ran {figures['compiled_speedup']:.2f}x its "
            f"eager compute (after a first step of {figures['first_compiled_step_seconds']:.0f} s)"
        )
    return precision, chosen_backend, why


def _tier(key: tuple[str, str | None]) -> str:
    """Which change from the sweep's own setting a (precision, compile backend) pair is (``fastest_compute``)."""
    if key[1] is not None:
        return "compiled"
    return BF16_WEIGHTS if key[0] == BF16_WEIGHTS else "precision"


def recommend(results: dict[str, Any]) -> dict[str, Any] | None:
    """The chosen configuration of a sweep with its ``vlfit train`` flags and a printable text."""
    row = choose(results["rows"])
    if row is None:
        return None
    settings = results["settings"]
    precision, backend, why = fastest_compute(results)
    flags = train_flags(row, precision=precision, batch_size=settings["batch_size"],
                        objective=settings.get("objective", CONTRASTIVE), torch_compile_backend=backend)  # fmt: skip
    model = settings.get("model_flags") or ["--model_name_or_path", "MODEL"]
    data = ["--dataset_name", "DATA"]
    prepare = None
    if get_pipeline(row["pipeline"]).prepared:
        prepare = shlex.join(["vlfit", "prepare", *data, *model[:2], "--output_dir", "prepared/"])
        data = ["--dataset_name", "prepared/"]
    command = shlex.join(["vlfit", "train", *model, *data, *flags])
    rate = f"{row['samples_per_second']:.1f} samples/s in {row['mode']} mode"
    lines = [f"best for this machine: {describe(row)} ({rate}){why}"]
    if prepare:
        lines.append(f"  {prepare}")
    lines.append(f"  {command}")
    return {
        "row": {key: row[key] for key in CONFIG_FIELDS},
        "flags": flags,
        "command": command,
        "prepare_command": prepare,
        "text": "\n".join(lines),
    }
