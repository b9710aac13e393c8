"""``vlfit bench``: input-pipeline throughput on this machine, the bottleneck, and the settings to train with.

Sweeps pipelines (reference, fast, prepared, device) x DataLoader workers in loader and/or train mode against the
compute ceiling, and writes a table, ``bench.json``, ``bench.md`` and ``bench.png`` to ``--output_dir``.
Partial results are written after every configuration, and an interrupted run (Ctrl-C, SIGTERM) writes what it
has before exiting.

The model and data-location flags are those of ``vlfit train`` (``--model_preset``, ``--model_name_or_path``,
``--dataset_name``, ``--train_file``, ``--id_column``, ...); without a model flag the bench builds the tiny preset
on a CPU and the large one on a GPU, and without data flags it generates synthetic New-Yorker-like JPEGs.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from vlfit.arguments import DataLocationArguments, ModelArguments
from vlfit.bench.data import dataset_source, source_key
from vlfit.bench.files import write_outputs
from vlfit.bench.fit import DoesNotFit, available_memory, check_fit, estimate_training_memory, memory_settings
from vlfit.bench.plan import (
    MODES,
    SweepPlan,
    compile_unavailable,
    default_pipelines,
    default_precision,
    default_workers,
)
from vlfit.bench.report import finalize, format_terminal
from vlfit.bench.selection import PIPELINES, get_pipeline
from vlfit.bench.session import BenchSession
from vlfit.bench.sweep import run_sweep
from vlfit.commands.parsing import CommandParser
from vlfit.data.sources.synthetic import synthetic_source
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.models.loading import ModelSpec, build_model, resolve_model
from vlfit.threads import available_cores
from vlfit.training.arguments import OBJECTIVES
from vlfit.training.itm_objective import CONTRASTIVE

logger = logging.getLogger(__name__)


@dataclass
class BenchArguments:
    """Flags of ``vlfit bench`` besides the model and data-location flags it shares with ``vlfit train``."""

    output_dir: str = flag("runs/bench", "Where bench.json, bench.md and bench.png go.")
    mode: str = flag(
        "train",
        "loader (data path and device stage only), train (forward, backward, optimizer step), or both: loader,train.",
    )
    pipelines: str | None = flag(
        None, f"Comma-separated, from {', '.join(PIPELINES)} (default: all this machine can run: device needs CUDA)."
    )
    workers: str | None = flag(
        None, "Comma-separated DataLoader worker counts (default: 0,1,2 then powers of two <= cores)."
    )
    prefetch_factors: str = flag("2", "Comma-separated DataLoader prefetch factors.")
    per_device_train_batch_size: int = flag(48, "Batch size (the study's 48).")
    steps: int = flag(10, "Timed steps per window.")
    warmup_steps: int = flag(3, "Steps excluded at the start of each window (throughput_warmup_steps).")
    repeats: int = flag(3, "Windows per configuration: median, min and max reported.")
    objective: str = flag(
        CONTRASTIVE,
        "What train mode's step optimizes, as vlfit train --objective: contrastive, or with BridgeTower "
        "contrastive+itm / itm, whose fused passes on hard negatives then count in samples/s, the compute "
        "ceiling, FLOPs per sample and MFU (the model gets a matching head when it has none).",
        choices=OBJECTIVES,
    )
    bf16: bool = flag(False, "bf16 autocast (the default on CUDA GPUs that support it).")
    fp32: bool = flag(False, "fp32 even on a GPU.")
    compare_bf16: bool = flag(
        False,
        "Also measure the compute ceiling in the other precision (fp32/bf16 ratio); --auto does it too, "
        "and the recommendation takes the faster one.",
    )
    compare_compile: bool = flag(
        False,
        "Also measure the compute ceiling with the model under torch.compile (eager vs compiled); --auto does it "
        "too in train mode, where torch.compile can run here (inductor on a CPU needs a C++ compiler).",
    )
    compare_attention: bool = flag(
        False, "Also measure the compute ceiling with eager and with fused (sdpa) attention."
    )
    torch_compile_backend: str = flag(
        "inductor", "torch.compile backend for --compare_compile (inductor, aot_eager, ...)."
    )
    auto: bool = flag(
        False,
        "Also try --auto_prefetch_factors on the best configuration, measure fp32 against bf16 and (in train "
        "mode) eager against torch.compile; print the vlfit train flags, with the faster of each.",
    )
    auto_prefetch_factors: str = flag("2,4", "Prefetch factors --auto tries.")
    split: str = flag("train", "Split of the data to read (with --dataset_name or files).")
    num_samples: int = flag(192, "Distinct samples (generated, or the first N of the split), served cyclically.")
    synthetic_min_long_side: int = flag(600, "Synthetic images: smallest long side.")
    synthetic_max_long_side: int = flag(1400, "Synthetic images: largest long side.")
    max_seq_length: int = flag(128, "Caption truncation length.")
    max_num_patches: int | None = flag(
        None,
        "NaFlex models (SigLIP 2): each image keeps its aspect ratio as at most this many patches, "
        "the token budget, as vlfit train's flag (default: the model's).",
    )
    profile_batches: int = flag(2, "Batches timed per stage (0: no stage breakdown).")
    max_config_seconds: float | None = flag(None, "Stop repeating a configuration after this many seconds.")
    device: str | None = flag(None, "cuda or cpu (default: cuda when available).")
    num_proc: int | None = flag(None, "Processes for generating and preparing data (default: min(cores, 8)).")
    seed: int = flag(0, "Seed for data, sampling order and model initialization.")
    png: bool = flag(True, "Write bench.png.")
    skip_fit_check: bool = flag(
        False,
        "Train mode checks first that the model, gradients, AdamW states and activations fit in the "
        "device's (or host's) memory, and stops with an error if they cannot; this skips the check.",
    )


def parser() -> CommandParser:
    """The flags of ``vlfit bench``: ``vlfit train``'s model and data-location flags, then the bench's own.

    ``--cache_dir`` is where downloads are cached, as in ``vlfit train``; the bench also keeps the prepared copy of
    the samples there for later runs (without it, in a temporary folder).
    """
    return CommandParser(
        (ModelArguments, DataLocationArguments, BenchArguments), prog="vlfit bench", description=__doc__
    )


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{flag} is empty")
    return values


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _compares_compile(args: BenchArguments, device: torch.device) -> bool:
    """``--compare_compile``; else, with ``--auto`` and a train mode, whether ``torch.compile`` can run here
    (``compile_unavailable``; where it cannot, one warning says why it is left out)."""
    if args.compare_compile:
        return True
    if not args.auto or "train" not in _names(args.mode):
        return False
    reason = compile_unavailable(device, args.torch_compile_backend)
    if reason is not None:
        logger.warning("--auto: torch.compile is not compared: %s", reason)
    return reason is None


def resolve_plan(args: BenchArguments, device: torch.device) -> SweepPlan:
    """The sweep the flags ask for on ``device``, with machine-dependent defaults filled in."""
    if args.bf16 and args.fp32:
        raise ConfigError("--bf16 and --fp32 exclude each other")
    for mode in _names(args.mode):
        if mode not in MODES:
            raise ConfigError(f"unknown --mode {mode!r}; choose from: {', '.join(MODES)}")
    if args.objective != CONTRASTIVE and "train" not in _names(args.mode):
        raise ConfigError(
            f"--objective {args.objective} changes what train mode's step computes, and --mode {args.mode} has no "
            "step: add train to --mode (e.g. --mode loader,train) or leave --objective out"
        )
    precision = "bf16" if args.bf16 else "fp32" if args.fp32 else default_precision(device)
    pipelines = _names(args.pipelines) if args.pipelines else default_pipelines(device)
    for name in pipelines:
        spec = get_pipeline(name)
        if spec.needs_cuda and device.type != "cuda":
            logger.warning("pipeline %s on %s: the device stage decodes on the CPU, in the main process", name, device)
    return SweepPlan(
        pipelines=pipelines,
        workers=_ints(args.workers, "--workers") if args.workers else default_workers(),
        prefetch_factors=_ints(args.prefetch_factors, "--prefetch_factors"),
        modes=_names(args.mode),
        batch_size=args.per_device_train_batch_size,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        repeats=args.repeats,
        precision=precision,
        objective=args.objective,
        profile_batches=args.profile_batches,
        compare_bf16=args.compare_bf16 or args.auto,  # --auto chooses the precision by measurement too
        compare_compile=_compares_compile(args, device),
        compare_attention=args.compare_attention,
        torch_compile_backend=args.torch_compile_backend,
        auto=args.auto,
        auto_prefetch_factors=_ints(args.auto_prefetch_factors, "--auto_prefetch_factors"),
        max_config_seconds=args.max_config_seconds,
        max_seq_length=args.max_seq_length,
        seed=args.seed,
    )


def _reads_files(data_args: DataLocationArguments) -> bool:
    return any((data_args.dataset_name, data_args.train_file, data_args.validation_file, data_args.test_file))


def open_source(
    args: BenchArguments, data_args: DataLocationArguments, model_args: ModelArguments, num_proc: int
) -> tuple[Any, dict[str, Any]]:
    """The distinct samples and a description of them (for the results and cache folder names)."""
    if _reads_files(data_args):
        location = data_args.source_kwargs()
        dataset = location["dataset_name"]
        description = {
            **location,
            "dataset_name": os.path.abspath(dataset) if dataset and os.path.exists(dataset) else dataset,
            "split": args.split,
            "num_samples": args.num_samples,
        }
        source = dataset_source(
            location,
            split=args.split,
            num_samples=args.num_samples,
            cache_dir=model_args.cache_dir,
            token=model_args.token,
        )
        return source, description
    source = synthetic_source(
        args.num_samples,
        seed=args.seed,
        min_long_side=args.synthetic_min_long_side,
        max_long_side=args.synthetic_max_long_side,
        num_proc=num_proc,
    )
    return source, {"synthetic": f"seed {args.seed}", "num_samples": args.num_samples,
                    "long_side": [args.synthetic_min_long_side, args.synthetic_max_long_side]}  # fmt: skip


def check_train_fits(
    blueprint: ModelSpec, model_args: ModelArguments, plan: SweepPlan, device: torch.device
) -> dict[str, Any]:
    """Stop before the sweep when train mode cannot fit in memory (see ``vlfit.bench.fit``).

    Returns:
        The estimate and the memory it was compared with, for the results' settings.

    Raises:
        DoesNotFit: naming the model, batch and estimate, with what to change.
    """
    estimate = estimate_training_memory(
        blueprint.family,
        blueprint.config,
        image_size=blueprint.inputs.image_size,
        max_seq_length=min(plan.max_seq_length, blueprint.inputs.max_seq_length),
        batch_size=plan.batch_size,
        precision=plan.precision,
        objective=plan.objective,
        freeze={
            "vision": model_args.freeze_vision_model,
            "text": model_args.freeze_text_model,
            "text_pooler": model_args.freeze_text_pooler,
        },
    )
    available, where = available_memory(device)
    logger.info("train mode needs at least %s; %s: %.1f GiB", estimate.describe(), where, available / 2**30)
    check_fit(
        estimate, available, where, model=blueprint.description, batch_size=plan.batch_size, precision=plan.precision
    )
    return memory_settings(estimate, available, where)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit bench``.

    Returns:
        0; 130 when interrupted (partial outputs are written); 2 when train mode cannot fit in memory (nothing is
        measured).
    """
    model_args, data_args, args = parser().parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plan = resolve_plan(args, device)
    if model_args.model_preset is None and model_args.model_name_or_path is None:
        model_args.model_preset = "large" if device.type == "cuda" else "tiny"
    num_proc = args.num_proc or max(1, min(available_cores(), 8))

    logger.info("sweep on %s: pipelines %s, workers %s, modes %s", device, plan.pipelines, plan.workers, plan.modes)
    source, description = open_source(args, data_args, model_args, num_proc)
    torch.manual_seed(args.seed)
    blueprint = resolve_model(
        **model_args.source_keywords(),
        captions=source.captions,
        max_seq_length=args.max_seq_length,
        max_num_patches=args.max_num_patches,
    )
    info: dict[str, Any] = {}
    if plan.trains and not args.skip_fit_check:
        try:
            info.update(check_train_fits(blueprint, model_args, plan, device))
        except DoesNotFit as err:
            print(f"vlfit bench: {err}", file=sys.stderr)
            return 2
    # Loader mode needs the input spec only: the model (4 GB for the large preset) is built for train mode alone.
    model = build_model(blueprint, **model_args.build_keywords()) if plan.trains else None
    output_dir = args.output_dir

    def write_partial(results: dict[str, Any]) -> None:
        write_outputs(finalize(copy.deepcopy(results)), output_dir, png=False)

    results: dict[str, Any] | None = None
    partial: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vlfit-bench-") as temp:
        # Prepares the model for --objective (refused in one line for a family it does not apply to).
        session = BenchSession(
            source,
            blueprint.inputs,
            device,
            plan,
            model=model,
            family=blueprint.family,
            cache_dir=model_args.cache_dir or temp,
            source_key=source_key(description),
            num_proc=num_proc,
        )
        del model
        # Counted as measured: with the matching head an ITM objective adds.
        trained = session.step.model if session.step is not None else None
        size = f"{sum(p.numel() for p in trained.parameters()) / 1e6:.1f}M parameters, " if trained is not None else ""
        preset, checkpoint = model_args.model_preset, model_args.model_name_or_path
        info = {
            "model": f"{blueprint.description} ({size}{blueprint.inputs.image_input})",
            "model_flags": ["--model_preset", preset] if preset else ["--model_name_or_path", checkpoint],
            "data": getattr(source, "name", None) or "; ".join(f"{k} {v}" for k, v in description.items() if v),
            "device": str(device),
            **info,
        }
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            results = run_sweep(session, info=info, on_progress=lambda r: (partial.update(r), write_partial(r)))
        except KeyboardInterrupt:
            logger.warning("interrupted: writing the results measured so far to %s", output_dir)
        finally:
            signal.signal(signal.SIGTERM, previous)
            session.close()
    measured = results if results is not None else partial
    if "compute" not in measured and not measured.get("rows"):
        logger.warning("interrupted before anything was measured")
        return 130
    final = finalize(measured)
    paths = write_outputs(final, output_dir, png=args.png)
    print(format_terminal(final))
    print("\nwrote " + ", ".join(paths.values()))
    return 0 if results is not None else 130
