"""``vlfit demo``: the whole job on a built-in synthetic dataset, on the CPU, in a few minutes.

make-data (reused when already there) -> fine-tune the ``small-p8`` preset -> evaluate on the test split ->
print samples/s, recall@1 beside chance, and matching accuracy beside chance. ``--quick``: the same at a size
that takes about a minute on 2 cores (``QUICK``). SIGTERM or Ctrl-C during training saves a checkpoint and ends
with one line giving the command that resumes from it (exit 128 + the signal's number, as ``vlfit train``); at any
other point (data generation, the final evaluation) it stops at once, with one line saying what was kept and the
command that carries on (``vlfit.commands.demo_stops``).

``demo.json`` in ``--output_dir`` records the demo's flags when it starts and its results when it ends. Run again, a
finished demo says it is complete, where its results are and how to start again, and trains nothing; a stopped one
with the same flags resumes from its last checkpoint; a folder holding a demo with other flags, or anything but a
demo, is refused in one line before any work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import sys
from dataclasses import asdict, dataclass
from typing import Any

from transformers.trainer_utils import get_last_checkpoint

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.atomic_files import write_text_atomically
from vlfit.commands.demo_stops import StopSignals
from vlfit.commands.parsing import CommandParser
from vlfit.data.synthetic import SETTINGS_FILE, SyntheticConfig, make_dataset, save_dataset
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.logs import end_progress_bars
from vlfit.output_folders import DEMO, DEMO_RECORD
from vlfit.training.arguments import VlfitTrainingArguments
from vlfit.training.output_dir import FINAL_STATE_FILE
from vlfit.training.preemption import TrainingPreempted
from vlfit.training.run import run

# Flags that do not change what a demo computes: a rerun may change them and still resume or find it complete.
NEUTRAL_FLAGS = ("quick", "output_dir", "resume_from_checkpoint", "dataloader_num_workers")
# --quick: the same run with the tiny preset (0.5M parameters, some 50 times the samples/s of small-p8) on 500
# smaller images, 500 steps at batch 32, scored over pools of 50. small-p8 in the same minute (32 steps at batch 48)
# stayed at chance.
QUICK: dict[str, Any] = dict(
    output_dir="runs/demo-quick",
    num_samples=500,
    min_long_side=160,
    max_long_side=320,
    model_preset="tiny",
    num_train_epochs=40.0,
    per_device_train_batch_size=32,
    eval_pool_size=50,
)


@dataclass
class DemoArguments:
    """Flags of ``vlfit demo`` (defaults are the recipe the README's numbers come from)."""

    quick: bool = flag(
        False,
        "A first look in about a minute on 2 cores: the same run with the tiny preset on 500 smaller "
        "images (40 epochs at batch 32, pools of 50), into runs/demo-quick; flags given beside it still apply.",
    )
    output_dir: str = flag("runs/demo", "Where the data, model and metrics go.")
    num_samples: int = flag(3000, "Synthetic samples over all splits.")
    min_long_side: int = flag(320, "Synthetic images' smallest long side (px; small-p8 trains at 80 px).")
    max_long_side: int = flag(640, "Synthetic images' largest long side (px).")
    model_preset: str = flag("small-p8", "Preset to fine-tune from random init.")
    num_train_epochs: float = flag(6.0, "Training epochs.")
    per_device_train_batch_size: int = flag(48, "Batch size (the study's).")
    learning_rate: float = flag(5e-4, "Peak learning rate (warmup then cosine).")
    dataloader_num_workers: int = flag(1, "Loader worker processes.")
    eval_pool_size: int = flag(100, "Candidate pool for recall@k (chance = 1/pool).")
    image_pipeline: str = flag("fast", "CPU image pipeline: fast or reference.")
    hard_negatives: bool = flag(
        False,
        "Also score each training image against its caption's one-attribute edits "
        "(--hard_negative_column caption_choices) beside the batch's other captions.",
    )
    seed: int = flag(0, "Seed for data generation and training.")
    resume_from_checkpoint: str | None = flag(
        None, "Continue a demo that a signal stopped from the checkpoint it saved (the line it printed)."
    )


def ensure_synthetic_data(path: str, config: SyntheticConfig, stops: StopSignals | None = None) -> str:
    """Generate the synthetic dataset at ``path`` unless the same configuration is already there. It is written
    whole or not at all (``save_dataset``): a stop signal received meanwhile, in ``stops``, leaves no dataset that a
    rerun would reuse."""
    wanted = asdict(config)
    stamp = os.path.join(path, SETTINGS_FILE)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == wanted:
                print(f"reusing synthetic data in {path}")
                return path
    print(f"generating {config.num_samples} synthetic samples in {path} ...")
    dataset = make_dataset(config, num_proc=min(2, os.cpu_count() or 1))
    if stops is not None:
        stops.raise_if_received()
    save_dataset(dataset, path, format="arrow", settings=wanted)
    return path


def demo_flags(args: DemoArguments) -> dict[str, Any]:
    """The flags that decide what a demo computes (``NEUTRAL_FLAGS`` left out)."""
    return {name: value for name, value in asdict(args).items() if name not in NEUTRAL_FLAGS}


def finished_results(args: DemoArguments) -> dict[str, Any] | None:
    """The results of the demo in ``--output_dir`` when it is complete; None for a new folder or a stopped demo with
    these flags (this run carries it on).

    Raises:
        ConfigError: the folder is a file, holds anything but a demo, or a demo made with other flags.
    """
    DEMO.claim(args.output_dir)
    path = os.path.join(args.output_dir, DEMO_RECORD)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    saved, flags = record.get("flags", {}), demo_flags(args)
    differ = [f"--{name} {flags[name]!r} (was {saved.get(name)!r})" for name in flags if saved.get(name) != flags[name]]
    if differ:
        what = "finished" if record.get("results") else "stopped"
        raise ConfigError(
            f"--output_dir {args.output_dir} holds a {what} demo made with other flags ({'; '.join(differ)}): run it "
            "with its own flags, or start again in another --output_dir (or after removing that folder)"
        )
    return record.get("results")


def write_demo_record(args: DemoArguments, results: dict[str, Any] | None = None) -> None:
    """Record the demo's flags in ``--output_dir`` (``DEMO_RECORD``), with its results once it is complete."""
    os.makedirs(args.output_dir, exist_ok=True)
    numbers = {key: float(value) for key, value in (results or {}).items() if isinstance(value, (int, float))}
    record = {"flags": demo_flags(args), "results": numbers if results is not None else None}
    write_text_atomically(os.path.join(args.output_dir, DEMO_RECORD), json.dumps(record, indent=1) + "\n")


def complete_message(args: DemoArguments) -> str:
    """What a rerun of a finished demo says: where its results are, and how to start again."""
    return (
        f"vlfit demo: the demo in {args.output_dir} is complete, nothing trained (its results: "
        f"{os.path.join(args.output_dir, DEMO_RECORD)}, its model: {os.path.join(args.output_dir, 'model')}); to start "
        f"again, remove {args.output_dir} or pass another --output_dir"
    )


def recipe(
    args: DemoArguments, data_dir: str, training_overrides: dict[str, Any] | None = None
) -> tuple[ModelArguments, DataArguments, VlfitTrainingArguments]:
    """The demo's run as ``vlfit train`` arguments (``benchmarks/demo_recipe.py`` screens changes to it).

    Args:
        args: The demo's flags.
        data_dir: The synthetic dataset.
        training_overrides: ``TrainingArguments`` fields to set otherwise than the recipe does.
    """
    training_kwargs: dict[str, Any] = dict(
        output_dir=os.path.join(args.output_dir, "model"),
        resume_from_checkpoint=args.resume_from_checkpoint,
        do_train=True,
        do_eval=True,
        num_train_epochs=args.num_train_epochs,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=100,
        learning_rate=args.learning_rate,
        weight_decay=0.05,
        warmup_steps=0.05,
        lr_scheduler_type="cosine",
        dataloader_num_workers=args.dataloader_num_workers,
        dataloader_drop_last=True,
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
    )
    training_args = VlfitTrainingArguments(**{**training_kwargs, **(training_overrides or {})})
    data_args = DataArguments(
        dataset_name=data_dir,
        eval_split="test",
        eval_pool_size=args.eval_pool_size,
        image_pipeline=args.image_pipeline,
        hard_negative_column="caption_choices" if args.hard_negatives else None,
    )
    return ModelArguments(model_preset=args.model_preset), data_args, training_args


def synthetic_config(args: DemoArguments) -> SyntheticConfig:
    """The demo's synthetic dataset."""
    return SyntheticConfig(
        num_samples=args.num_samples,
        seed=args.seed,
        min_long_side=args.min_long_side,
        max_long_side=args.max_long_side,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit demo``.

    Returns 0, or ``128 + signal`` (143 for SIGTERM, 130 for SIGINT) when a signal stopped it: during training
    after saving a checkpoint, anywhere else at once.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_arguments(argv)
    if args.resume_from_checkpoint is not None and not os.path.isdir(args.resume_from_checkpoint):
        raise ConfigError(
            f"--resume_from_checkpoint {args.resume_from_checkpoint}: no such folder (give the checkpoint the "
            "stopped demo named, under <output_dir>/model)"
        )
    finished = finished_results(args)
    if finished is not None:  # a rerun of a finished demo: nothing to do
        print(complete_message(args))
        print(format_summary(finished, args))
        return 0
    model_dir = os.path.join(args.output_dir, "model")
    if args.resume_from_checkpoint is None and os.path.isfile(os.path.join(args.output_dir, DEMO_RECORD)):
        checkpoint = get_last_checkpoint(model_dir) if os.path.isdir(model_dir) else None
        if checkpoint is not None:  # a stopped demo with these flags: carry it on
            print(f"resuming the stopped demo from {checkpoint}")
            args = dataclasses.replace(args, resume_from_checkpoint=checkpoint)
    write_demo_record(args)
    data_dir = os.path.join(args.output_dir, "data")
    generated = False
    stops = StopSignals()
    try:
        with stops:
            ensure_synthetic_data(data_dir, synthetic_config(args), stops)
            generated = True
            model_args, data_args, training_args = recipe(args, data_dir)
            _forget_finished_training(training_args.output_dir)
            results = run(model_args, data_args, training_args)
            stops.raise_if_received()
    except TrainingPreempted as stop:
        end_progress_bars()
        print(f"vlfit demo: {stopped_message(stop, argv)}", file=sys.stderr)
        return stop.exit_code
    except BaseException:
        if stops.received is None:
            raise
        stops.end_children()
        end_progress_bars()
        print(f"vlfit demo: {stopped_outside_training(stops.received, args, argv, generated)}", file=sys.stderr)
        return stops.exit_code
    write_demo_record(args, results)
    print(format_summary(results, args))
    return 0


def _forget_finished_training(model_dir: str) -> None:
    """Remove the final state an earlier demo left in ``model_dir``: this run writes its own once its model is
    saved, which is how a stop during the final evaluation knows the model is there (``stopped_outside_training``)."""
    final_state = os.path.join(model_dir, FINAL_STATE_FILE)
    if os.path.isfile(final_state):
        os.remove(final_state)


def parse_arguments(argv: list[str]) -> DemoArguments:
    """The demo's flags; with ``--quick``, the ``QUICK`` sizes where no flag set them."""
    (args,), given = CommandParser(DemoArguments, prog="vlfit demo").parse(argv)
    return with_quick_sizes(args, given)


def with_quick_sizes(args: DemoArguments, given: frozenset[str]) -> DemoArguments:
    """``args`` with the ``QUICK`` sizes under ``--quick``, except for the flags in ``given`` (set by the user)."""
    if not args.quick:
        return args
    return dataclasses.replace(args, **{name: value for name, value in QUICK.items() if name not in given})


def stopped_message(stop: TrainingPreempted, argv: list[str]) -> str:
    """One line for a demo a signal stopped: where it stopped and the command that resumes it."""
    name = signal.Signals(stop.signum).name
    program = _program()
    if stop.checkpoint is None:
        return f"stopped by {name} before a checkpoint was saved; to start again: {shlex.join([*program, *argv])}"
    kept = _without_flag(argv, "--resume_from_checkpoint")
    resume = shlex.join([*program, *kept, "--resume_from_checkpoint", stop.checkpoint])
    return f"stopped by {name}, checkpoint saved in {stop.checkpoint}; to resume: {resume}"


def stopped_outside_training(signum: int, args: DemoArguments, argv: list[str], generated: bool) -> str:
    """One line for a demo a signal stopped outside training: what was kept, and the command that carries on.

    Args:
        signum: The signal.
        args: The demo's flags.
        argv: Its command line.
        generated: Whether the synthetic data was complete when the signal came.
    """
    name = signal.Signals(signum).name
    again = shlex.join([*_program(), *argv])
    if not generated:
        return f"stopped by {name} while generating the synthetic data (nothing kept); to start again: {again}"
    data_dir = os.path.join(args.output_dir, "data")
    model_dir = os.path.join(args.output_dir, "model")
    if not os.path.isfile(os.path.join(model_dir, FINAL_STATE_FILE)):
        return (
            f"stopped by {name} before training finished (the synthetic data in {data_dir} is kept); to start "
            f"again: {again}"
        )
    evaluate = [*_program("eval"), "--model_name_or_path", model_dir, "--dataset_name", data_dir, "--eval_split",
                "test", "--eval_pool_size", str(args.eval_pool_size)]  # fmt: skip
    if args.image_pipeline != DataArguments.image_pipeline:
        evaluate += ["--image_pipeline", args.image_pipeline]
    return (
        f"stopped by {name} during the final evaluation (the trained model is saved in {model_dir}); to evaluate "
        f"it: {shlex.join(evaluate)}"
    )


def _program(command: str = "demo") -> list[str]:
    """How to call vlfit's ``command`` again: ``vlfit`` when it is on PATH, else the script that runs now
    (``.venv/bin/vlfit``)."""
    script = sys.argv[0] if sys.argv else ""
    if shutil.which("vlfit") is None and os.path.basename(script) == "vlfit":
        relative = os.path.relpath(script)
        return [relative if not relative.startswith("..") else script, command]
    return ["vlfit", command]


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag VALUE`` or ``--flag=VALUE``, dashes or underscores)."""
    names = {flag, flag.replace("_", "-")}
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif arg.split("=", 1)[0] not in names:
            kept.append(arg)
    return kept


def format_summary(results: dict[str, float], args: DemoArguments) -> str:
    """The demo's closing lines: throughput, and what was learned compared with chance."""
    return "\n".join(
        [
            "",
            f"vlfit demo: preset {args.model_preset}, {args.num_samples} synthetic samples, "
            f"{args.num_train_epochs:g} epochs at batch {args.per_device_train_batch_size}, "
            f"{args.image_pipeline} pipeline{', hard negatives' if args.hard_negatives else ''}",
            f"  training throughput : {results['train_samples_per_second']:.1f} samples/s "
            f"(data wait {100 * results['train_data_wait_share']:.1f}% of step time)",
            f"  text->image recall@1: {results['eval_t2i_recall@1']:.3f}   "
            f"(chance {results['eval_chance_recall@1']:.3f}, pool of {int(results['eval_pool_size'])})",
            f"  image->text recall@1: {results['eval_i2t_recall@1']:.3f}",
            f"  text->image recall@5: {results['eval_t2i_recall@5']:.3f}",
            f"  matching accuracy   : {results.get('eval_matching_accuracy', float('nan')):.3f}   (chance 0.200)",
        ]
    )
