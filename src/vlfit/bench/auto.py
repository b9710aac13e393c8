"""Pick the pipeline, worker count and prefetch factor for this machine, from a sweep or from a short probe.

The rule (``choose``): among the measured rows (train rows when there are any), take those within
``AUTO_TOLERANCE`` of the fastest, and of those the one that needs no separate preparation step, then the fewest
workers, then the smallest prefetch factor: extra processes and buffered batches cost memory and buy nothing
inside the noise. ``vlfit bench --auto`` prints the ``vlfit train`` flags of the choice;
``vlfit train --dataloader_num_workers auto`` runs ``probe_num_workers`` (the same measurement and the same rule,
on the user's data and model, over worker counts only) before training.
"""

from __future__ import annotations

import logging
import shlex
import tempfile
from typing import Any

from vlfit.bench.data import get_pipeline

logger = logging.getLogger(__name__)

# Rows within this fraction of the fastest count as equally fast.
AUTO_TOLERANCE = 0.05
# A probe stops adding workers once one more step up gains less than this.
PROBE_MIN_GAIN = 0.03
WORKERS_FLAG = "--dataloader_num_workers"


def _key(row: dict[str, Any]) -> tuple:
    return (get_pipeline(row["pipeline"]).prepared, row["workers"], row["prefetch_factor"] or 0)


def choose(rows: list[dict[str, Any]], tolerance: float = AUTO_TOLERANCE) -> dict[str, Any] | None:
    """The configuration to use (a row of ``rows``), or None when nothing was measured."""
    measured = [row for row in rows if row.get("samples_per_second")]
    trained = [row for row in measured if row["mode"] == "train"]
    pool = trained or measured
    if not pool:
        return None
    fastest = max(row["samples_per_second"] for row in pool)
    near = [row for row in pool if row["samples_per_second"] >= (1 - tolerance) * fastest]
    return min(near, key=lambda row: (*_key(row), -row["samples_per_second"]))


def train_flags(row: dict[str, Any], *, precision: str, batch_size: int) -> list[str]:
    """The ``vlfit train`` flags that reproduce a configuration."""
    spec = get_pipeline(row["pipeline"])
    flags = ["--image_pipeline", spec.image_pipeline]
    if spec.decode_on_device:
        flags.append("--decode_on_device")
    flags += [WORKERS_FLAG, str(row["workers"])]
    if row["workers"] and row.get("prefetch_factor"):
        flags += ["--dataloader_prefetch_factor", str(row["prefetch_factor"])]
    flags += ["--per_device_train_batch_size", str(batch_size)]
    if precision == "bf16":
        flags.append("--bf16")
    elif precision == "fp16":
        flags.append("--fp16")
    return flags


def recommend(results: dict[str, Any]) -> dict[str, Any] | None:
    """The chosen configuration of a sweep with its ``vlfit train`` flags and a printable text."""
    row = choose(results["rows"])
    if row is None:
        return None
    from vlfit.bench.report import describe

    settings = results["settings"]
    flags = train_flags(row, precision=settings["precision"], batch_size=settings["batch_size"])
    model = settings.get("model_flags") or ["--model_name_or_path", "MODEL"]
    data = ["--dataset_name", "DATA"]
    prepare = None
    if get_pipeline(row["pipeline"]).prepared:
        prepare = shlex.join(["vlfit", "prepare", *data, *model[:2], "--output_dir", "prepared/"])
        data = ["--dataset_name", "prepared/"]
    command = shlex.join(["vlfit", "train", *model, *data, *flags])
    rate = f"{row['samples_per_second']:.1f} samples/s in {row['mode']} mode"
    lines = [f"best for this machine: {describe(row)} ({rate})"]
    if prepare:
        lines.append(f"  {prepare}")
    lines.append(f"  {command}")
    return {
        "row": {k: row[k] for k in ("mode", "pipeline", "workers", "prefetch_factor", "samples_per_second")},
        "flags": flags,
        "command": command,
        "prepare_command": prepare,
        "text": "\n".join(lines),
    }


def take_auto_workers(argv: list[str] | None) -> tuple[list[str] | None, bool]:
    """Replace ``--dataloader_num_workers auto`` (or ``=auto``) in ``argv`` by 0, so the flag parses as an int.

    Returns:
        The rewritten arguments and whether ``auto`` was asked for.
    """
    if argv is None:
        return argv, False
    out: list[str] = []
    found = False
    i = 0
    while i < len(argv):
        if argv[i] == WORKERS_FLAG and i + 1 < len(argv) and argv[i + 1] == "auto":
            out += [WORKERS_FLAG, "0"]
            found, i = True, i + 2
            continue
        if argv[i] == f"{WORKERS_FLAG}=auto":
            out.append(f"{WORKERS_FLAG}=0")
            found = True
        else:
            out.append(argv[i])
        i += 1
    return out, found


def probe_num_workers(
    source: Any,
    blueprint: Any,
    model_args: Any,
    training_args: Any,
    *,
    decode_on_device: bool = False,
    image_pipeline: str = "fast",
    candidates: list[int] | None = None,
    steps: int = 5,
    warmup_steps: int = 2,
) -> int:
    """Measure a few training steps with each worker count and return the one ``choose`` picks.

    Uses the run's training split, model blueprint (its tokenizer is reused, not trained again), pipeline, batch
    size, precision, prefetch factor and device; the model is built for the probe and freed before returning.
    Worker counts are tried in increasing order and the probe stops once adding workers stops paying
    (``PROBE_MIN_GAIN``).

    Args:
        source: The training split.
        blueprint: The model's ``vlfit.models.loading.ModelBlueprint``.
        model_args: ``vlfit.arguments.ModelArguments`` (to build the model the same way training will).
        training_args: ``vlfit.arguments.VlfitTrainingArguments``.
        decode_on_device: ``--decode_on_device``.
        image_pipeline: ``--image_pipeline``.
        candidates: Worker counts to try (default: 0, 1, 2, then powers of two up to the core count).
        steps: Timed steps per worker count.
        warmup_steps: Excluded steps per worker count.

    Returns:
        The worker count.
    """
    from vlfit.bench.sweep import BenchSession, SweepPlan, default_workers
    from vlfit.models.loading import build_model

    device = training_args.device
    pipeline = "device" if decode_on_device and device.type == "cuda" else image_pipeline
    prefetch = training_args.dataloader_prefetch_factor or 2
    candidates = sorted(set(candidates if candidates is not None else default_workers()))
    plan = SweepPlan(
        pipelines=[pipeline],
        workers=candidates,
        prefetch_factors=[prefetch],
        batch_size=training_args.per_device_train_batch_size,
        steps=steps,
        warmup_steps=warmup_steps,
        repeats=1,
        precision="bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32",
        profile_batches=0,
        max_seq_length=blueprint.inputs.max_seq_length,
        seed=training_args.seed,
    )
    # A few batches' worth of distinct samples, served cyclically: decoding them again costs the same.
    source = source.select(range(min(len(source), 4 * plan.batch_size)))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vlfit-probe-") as cache_dir:
        session = BenchSession(
            source,
            blueprint.inputs,
            device,
            plan,
            model=build_model(blueprint, model_args),
            family=blueprint.family,
            cache_dir=cache_dir,
            source_key="probe",
        )
        try:
            for workers in candidates:
                row = session.measure("train", pipeline, workers, prefetch if workers else None)
                rows.append(row)
                logger.info("probe: %d workers -> %.1f samples/s", workers, row["samples_per_second"])
                best_before = max((r["samples_per_second"] for r in rows[:-1]), default=0.0)
                if workers >= 2 and row["samples_per_second"] < (1 + PROBE_MIN_GAIN) * best_before:
                    break
        finally:
            session.close()
    chosen = choose(rows)
    assert chosen is not None
    summary = ", ".join(f"{r['workers']}: {r['samples_per_second']:.1f}" for r in rows)
    logger.info(
        "--dataloader_num_workers auto -> %d (%s pipeline, batch %d; samples/s by worker count: %s)",
        chosen["workers"],
        pipeline,
        plan.batch_size,
        summary,
    )
    return int(chosen["workers"])
