"""``vlfit train --dataloader_num_workers auto``: a short probe of the run's own data and model that picks the
worker count with ``vlfit.bench.selection.choose``, the rule ``vlfit bench --auto`` applies to a whole sweep.
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

from vlfit.bench.plan import SweepPlan, default_workers
from vlfit.bench.selection import WORKERS_FLAG, choose
from vlfit.bench.session import BenchSession
from vlfit.models.loading import ModelSpec, build_model

logger = logging.getLogger(__name__)

# A probe stops adding workers once one more step up gains less than this.
PROBE_MIN_GAIN = 0.03


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
    blueprint: ModelSpec,
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
        blueprint: The model's ``vlfit.models.loading.ModelSpec``.
        model_args: ``vlfit.arguments.ModelArguments`` (to build the model the same way training will).
        training_args: ``vlfit.training.arguments.VlfitTrainingArguments``.
        decode_on_device: ``--decode_on_device``.
        image_pipeline: ``--image_pipeline``.
        candidates: Worker counts to try (default: 0, 1, 2, then powers of two up to the core count).
        steps: Timed steps per worker count.
        warmup_steps: Excluded steps per worker count.

    Returns:
        The worker count.
    """
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
            model=build_model(blueprint, **model_args.build_keywords()),
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
