"""vlfit's training step against a plain loop on a ready batch, fp32 and bf16, and where the difference goes.

For each ``--presets`` entry and each precision (fp32; bf16 with ``--bf16`` autocast), alternately ``--repeats``
times in one process (so drifts of a shared machine hit all alike):

- **ready batch**: ``vlfit bench --mode train``'s compute ceiling, the step (forward, backward, clipping at 1.0,
  fused AdamW, as ``VlfitTrainer`` runs it) on one model-ready batch again and again, no data path;
- **vlfit train**: a real ``vlfit train`` run on synthetic JPEGs of 160 to 320 pixels, the same preset, batch size
  and precision (``--dataloader_num_workers`` 1, no evaluation, no saving), its samples/s after
  ``--throughput_warmup_steps`` (``train_samples_per_second``: the run's own meter, data waits included, up to the
  end of its last step);
- **vlfit train, free data**: the same run on JPEGs already at the preset's input side (``input_side``: small to
  decode, never resized): the difference to the run above is what decoding and resizing cost on the same
  cores, and what is left against the ready batch is the step's own overhead plus the rest of the worker's work
  (reading rows, tokenizing, collating: ``free_data_worker_cpu_ms_per_batch``), which no data spares.

Each split holds enough pairs for the whole run in one epoch: a loader's worker is started again at every epoch
(the Trainer's default), which a real run's long epochs pay rarely. The worker's CPU seconds per batch (its user and
system time, from ``RUSAGE_CHILDREN``) say what the data path costs. The ratios of the medians are the step's
efficiency (goal: >= 0.9): ``ratio`` with the JPEG data, ``ratio_free_data`` without its cost. ``--parts`` also
runs one ``vlfit train`` of each precision with a clock around each part of the Trainer's step (``PARTS``: the
methods its loop calls for the batches, the forward and backward, clipping, the optimizer and scheduler, zero_grad,
callbacks and logging) and around the step as a whole (from one step's end to the next): the median milliseconds
of each after the warm-up, and the rest of the loop (the step less its parts). A clock costs about a microsecond a
call, so the split stands beside the unclocked ratios (a profiler's cost per Python call inflated the parts made of
many small calls). ``ready_batch_parts`` times the same parts of the ready batch's step on that run's last batch
and model: the difference, part by part, is what vlfit's step costs beyond it.

    python benchmarks/trainer_overhead.py [--presets tiny,clip-tiny] [--batch_size 16] [--steps 30] [--repeats 3]
        [--parts] [--results FILE.json]

On 2 CPU cores the tiny presets take about two minutes per repeat (more on shared cores: two torch threads beside
other work wait for each other at every operation).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers.trainer_callback import CallbackHandler

from vlfit.bench.measure import TrainStep
from vlfit.cli import main as vlfit
from vlfit.data.batch import Batch
from vlfit.efficiency.cpu import cpu_info
from vlfit.models.presets import get_preset
from vlfit.training.lean_step import ListedZeroGrad
from vlfit.training.trainer import VlfitTrainer

WARMUP_STEPS = 5
# The parts of the Trainer's step (--parts): each the methods its loop calls for it, (owner, name).
PARTS = {
    "batches (data wait, device stage)": ((VlfitTrainer, "get_batch_samples"),),
    "forward and backward": ((VlfitTrainer, "training_step"),),
    "clipping": ((VlfitTrainer, "_clip_grad_norm"), (VlfitTrainer, "_get_grad_norm")),
    "optimizer": ((AcceleratedOptimizer, "step"),),
    "scheduler": ((torch.optim.lr_scheduler.LRScheduler, "step"),),
    "zero_grad": ((torch.nn.Module, "zero_grad"), (ListedZeroGrad, "__call__")),
    "callbacks and logging": tuple((CallbackHandler, name) for name in ("on_step_begin", "on_pre_optimizer_step",
                                   "on_optimizer_step", "on_step_end")) + ((VlfitTrainer, "_maybe_log_save_evaluate"),),
}  # fmt: skip


def run_quietly(*argv: str) -> int:
    """``vlfit ARGV`` in this process with its output swallowed: its exit code."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return vlfit(list(argv))


def ready_batch_rate(data: str, preset: str, batch: int, steps: int, bf16: bool, out: str) -> float:
    """``vlfit bench``'s compute ceiling, samples/s."""
    code = run_quietly("bench", "--model_preset", preset, "--dataset_name", data, "--mode", "train", "--pipelines",
                       "fast", "--workers", "0", "--per_device_train_batch_size", str(batch), "--profile_batches", "0",
                       "--steps", str(steps), "--warmup_steps", str(WARMUP_STEPS), "--repeats", "1",
                       "--output_dir", out, *(["--bf16"] if bf16 else []))  # fmt: skip
    if code:
        sys.exit(f"vlfit bench exited {code}")
    with open(os.path.join(out, "bench.json"), encoding="utf-8") as f:
        return float(json.load(f)["compute"]["samples_per_second"])


def train_argv(data: str, preset: str, batch: int, steps: int, bf16: bool, out: str) -> list[str]:
    return ["train", "--model_preset", preset, "--dataset_name", data, "--output_dir", out, "--overwrite_output_dir",
            "--max_steps", str(steps + WARMUP_STEPS), "--throughput_warmup_steps", str(WARMUP_STEPS),
            "--per_device_train_batch_size", str(batch), "--dataloader_num_workers", "1", "--eval_strategy", "no",
            "--save_strategy", "no", "--logging_steps", "10", "--report_to", "none", "--seed", "0",
            *(["--bf16"] if bf16 else [])]  # fmt: skip


def input_side(preset: str) -> int:
    """The side of the square images a preset's model takes (its image processor's size)."""
    size = get_preset(preset).image_processor["size"]
    return int(size.get("shortest_edge") or size["height"])


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def trainer_rate(data: str, preset: str, batch: int, steps: int, bf16: bool, out: str) -> tuple[float, float]:
    """A ``vlfit train`` run's samples/s after its warm-up, and its loader worker's CPU milliseconds per batch
    (the worker is a child of this process, counted once it has exited)."""
    before = _children_cpu_seconds()
    if run_quietly(*train_argv(data, preset, batch, steps, bf16, out)):
        sys.exit("vlfit train failed")
    worker_ms = 1000 * (_children_cpu_seconds() - before) / (steps + WARMUP_STEPS)
    with open(os.path.join(out, "all_results.json"), encoding="utf-8") as f:
        return float(json.load(f)["train_samples_per_second"]), worker_ms


@contextlib.contextmanager
def replaced(owner: type, name: str, replacement: Callable[..., object]) -> Iterator[None]:
    """``owner.name`` replaced by ``replacement`` for the duration (an inherited one is inherited again after)."""
    own = owner.__dict__.get(name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


def clocked(owner: type, name: str, seconds: list[float]) -> contextlib.AbstractContextManager[None]:
    """``owner.name`` with each call's wall time appended to ``seconds``, for the duration."""
    method = getattr(owner, name)

    @functools.wraps(method)
    def wrapper(*args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    return replaced(owner, name, wrapper)


def parts_split(data: str, preset: str, batch: int, steps: int, bf16: bool, out: str) -> dict[str, object]:
    """One ``vlfit train`` with each of ``PARTS`` clocked: the median ms a step of the step and of each part after
    the warm-up, and the rest; then the ready batch's step in parts on the run's last batch and model."""
    calls: dict[str, list[float]] = defaultdict(list)
    ends: list[float] = []
    kept: dict[str, object] = {}
    real_step_end = CallbackHandler.on_step_end
    real_training_step = VlfitTrainer.training_step

    def step_end(handler: CallbackHandler, *args: object, **kwargs: object) -> object:
        ends.append(time.perf_counter())
        return real_step_end(handler, *args, **kwargs)

    def training_step(trainer: VlfitTrainer, model: torch.nn.Module, inputs: object, *args: object) -> object:
        kept.update(trainer=trainer, model=model, batch=inputs)
        return real_training_step(trainer, model, inputs, *args)

    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(CallbackHandler, "on_step_end", step_end))
        stack.enter_context(replaced(VlfitTrainer, "training_step", training_step))
        for part, methods in PARTS.items():
            for owner, name in methods:
                stack.enter_context(clocked(owner, name, calls[f"{part}: {name}"]))
        if run_quietly(*train_argv(data, preset, batch, steps, bf16, out)):
            sys.exit("vlfit train failed")
    steps_timed = [b - a for a, b in zip(ends, ends[1:], strict=False)][WARMUP_STEPS:]
    split = {"step": round(1000 * statistics.median(steps_timed), 3)}
    for part, methods in PARTS.items():
        # Each method's calls after the warm-up's (the same count a step for all but the first step's extras).
        split[part] = round(sum(1000 * statistics.median(calls[f"{part}: {name}"][WARMUP_STEPS:] or [0.0])
                                for _, name in methods), 3)  # fmt: skip
    split["the rest of the loop"] = round(split["step"] - sum(v for k, v in split.items() if k != "step"), 3)
    return {"vlfit_train_ms": split, "ready_batch_ms": ready_batch_parts(kept, bf16)}


def ready_batch_parts(kept: dict[str, object], bf16: bool, steps: int = 30) -> dict[str, float]:
    """The ready batch's step (``vlfit bench``'s ``TrainStep``: the loss under autocast, backward, clipping at 1.0,
    fused AdamW, zero_grad over the parameters it lists) in parts, on the run's last batch and model: median ms."""
    trainer, model, batch = kept["trainer"], kept["model"], kept["batch"]
    assert isinstance(trainer, VlfitTrainer) and isinstance(model, torch.nn.Module) and isinstance(batch, Batch)
    step = TrainStep(model, trainer.family, trainer.args.device, "bf16" if bf16 else "fp32")
    seconds: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps + WARMUP_STEPS):
        marks = [time.perf_counter()]
        with step.autocast():
            loss = step.loss(batch)
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(step.parameters, 1.0)
        marks.append(time.perf_counter())
        step.optimizer.step()
        marks.append(time.perf_counter())
        step.optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        for part, (start, end) in zip(("forward and backward", "clipping", "optimizer", "zero_grad"),
                                      zip(marks, marks[1:], strict=False), strict=True):  # fmt: skip
            seconds[part].append(end - start)
        seconds["step"].append(marks[-1] - marks[0])
    return {part: round(1000 * statistics.median(values[WARMUP_STEPS:]), 3) for part, values in seconds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,clip-tiny")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="Measured steps (after the warm-up's).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", action="store_true", help="Also time the step's parts in one run of each precision.")
    parser.add_argument("--results", default=None, help="Write the figures here as JSON too.")
    args = parser.parse_args()
    rows = []
    load_before = os.getloadavg()[0]
    # One epoch covers the run: 80% of the rows are the training split (make-data's default fractions).
    rows_needed = str(int(1.25 * args.batch_size * (args.steps + WARMUP_STEPS)) + args.batch_size)
    with tempfile.TemporaryDirectory(prefix="vlfit-overhead-") as folder:
        data = os.path.join(folder, "data")
        presets = args.presets.split(",")
        splits = {data: (160, 320), **{os.path.join(folder, f"free-data-{input_side(p)}"): (input_side(p),) * 2
                                       for p in presets}}  # fmt: skip
        for split, sides in splits.items():
            low, high = (str(side) for side in sides)
            if run_quietly("make-data", "--output_dir", split, "--num_samples", rows_needed, "--min_long_side", low,
                           "--max_long_side", high):  # fmt: skip
                sys.exit("vlfit make-data failed")
        for preset in presets:
            free_data = os.path.join(folder, f"free-data-{input_side(preset)}")
            for bf16 in (False, True):
                ready, trained, free, worker_ms, free_worker_ms = [], [], [], [], []
                for repeat in range(args.repeats):
                    out = os.path.join(folder, f"{preset}-{bf16}-{repeat}")
                    ready.append(ready_batch_rate(data, preset, args.batch_size, args.steps, bf16, out + "-bench"))
                    rate, ms = trainer_rate(data, preset, args.batch_size, args.steps, bf16, out + "-train")
                    trained.append(rate)
                    worker_ms.append(ms)
                    rate, ms = trainer_rate(free_data, preset, args.batch_size, args.steps, bf16, out + "-free")
                    free.append(rate)
                    free_worker_ms.append(ms)
                row = {"preset": preset, "precision": "bf16" if bf16 else "fp32", "batch_size": args.batch_size,
                       "ready_batch_samples_per_s": round(statistics.median(ready), 1),
                       "vlfit_train_samples_per_s": round(statistics.median(trained), 1),
                       "vlfit_train_free_data_samples_per_s": round(statistics.median(free), 1),
                       "worker_cpu_ms_per_batch": round(statistics.median(worker_ms), 1),
                       "free_data_worker_cpu_ms_per_batch": round(statistics.median(free_worker_ms), 1)}  # fmt: skip
                row["runs"] = {"ready_batch": ready, "vlfit_train": trained, "vlfit_train_free_data": free}
                row["ratio"] = round(row["vlfit_train_samples_per_s"] / row["ready_batch_samples_per_s"], 3)
                row["ratio_free_data"] = round(
                    row["vlfit_train_free_data_samples_per_s"] / row["ready_batch_samples_per_s"], 3
                )
                if args.parts:
                    row["parts"] = parts_split(data, preset, args.batch_size, args.steps, bf16, out + "-parts")
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    # Runnable processes on the machine (1-minute averages) at the start and the end: above the core count, the
    # cores were shared with other work.
    result = {**cpu_info().record(), "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    result["torch_threads"] = torch.get_num_threads()  # the main process's (each loader worker runs on 1)
    result["rows"] = rows
    if args.results:
        with open(args.results, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
