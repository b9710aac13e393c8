"""Screen one change to `vlfit demo`'s recipe: train, evaluate, and say which attributes matching still confuses.

Each run is the demo's own run (``vlfit.commands.demo.recipe``: same data, steps and evaluation) with the flags
given here changed: any ``vlfit demo`` flag (``--quick`` screens at the quick demo's sizes, as ``vlfit demo --quick``
runs), plus fields of the preset (``--preset_overrides``) and of ``TrainingArguments`` (``--training_overrides``) as
JSON. Runs are deterministic, so the metrics do not depend on the machine's load, only the times do. One JSON line
per run is appended to ``--results``. A run is timed whole, so it always starts over: ``--resume_from_checkpoint``
is refused, and a SIGTERM or Ctrl-C ends it in one line giving the command that runs it again.

``--diagnose`` then scores the trained model's matching on the test split pair by pair: for each wrong choice, the
attributes (kind, colour, count, region) in which it differs from the right caption, and how often the model
scored that choice at least as high as the right one (0.5 = no better than a coin). That says what the image and
text towers have not learned yet.

    python benchmarks/demo_recipe.py --name baseline [--hard_negatives false] \\
        [--preset_overrides '{"patch_size": 8, "image_size": 96}'] [--training_overrides '{"learning_rate": 1e-3}'] \\
        [--diagnose] [--output_dir runs/demo-recipe] [--results runs/demo-recipe/results.jsonl]

The data (3000 samples) is generated once into ``<output_dir>/data`` and reused: about 2 minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from vlfit.commands.demo import DemoArguments, ensure_synthetic_data, recipe, synthetic_config, with_quick_sizes
from vlfit.commands.demo_stops import StopSignals
from vlfit.commands.parsing import CommandParser
from vlfit.data.pipeline import InputPipeline, PipelineOptions
from vlfit.data.records import EVAL_COLUMNS
from vlfit.data.sources import open_splits
from vlfit.data.synthetic.scenes import differing_attributes, parse_caption
from vlfit.errors import ConfigError, UserError
from vlfit.evaluation.retrieval import embed_split
from vlfit.models.loading import load_model
from vlfit.models.presets import PRESET_FOLDER
from vlfit.training.preemption import TrainingPreempted
from vlfit.training.run import run

PROG = "benchmarks/demo_recipe.py"


@dataclass
class ScreenArguments:
    name: str = field(metadata={"help": "Name of the run (its folder and its results row)."})
    preset_overrides: str = field(
        default="{}",
        metadata={
            "help": "JSON of preset settings to change: patch_size, image_size (the vision tower and the image "
            "processor), vision_position_init, tokenizer_vocab_size, or any other key of the preset's config."
        },
    )
    training_overrides: str = field(default="{}", metadata={"help": "JSON of TrainingArguments fields to change."})
    diagnose: bool = field(default=False, metadata={"help": "Per-attribute matching errors of the trained model."})
    results: str | None = field(default=None, metadata={"help": "JSONL file to append to (default: in output_dir)."})


def matching_errors(model_dir: str, data_dir: str, split: str = "test") -> dict[str, dict[str, float]]:
    """Pairwise matching errors of a trained model, by the attributes a wrong choice changes (see module doc)."""
    loaded = load_model(model_name_or_path=model_dir)
    model, spec = loaded.model.eval(), loaded.spec
    source = open_splits(dataset_name=data_dir, extra_columns=EVAL_COLUMNS)[split]
    pipeline = InputPipeline(spec.inputs, PipelineOptions(), torch.device("cpu"))
    batches = pipeline.feed(pipeline.loader(pipeline.dataset(source, train=False), batch_size=100), torch.float32,
                            train=False)  # fmt: skip
    part = embed_split(spec.family, model, batches, tokenizer=spec.inputs.tokenizer,
                       max_seq_length=spec.inputs.max_seq_length, device=torch.device("cpu"))  # fmt: skip
    images, choices, labels = torch.cat(part.images), torch.cat(part.choices), torch.cat(part.labels)
    scores = torch.einsum("nd,nkd->nk", images, choices)
    records = [source[position] for position in part.positions]
    pairs, wrong = Counter(), Counter()
    for row, record in enumerate(records):
        texts, answer = record.extra["caption_choices"], int(labels[row])
        truth = parse_caption(texts[answer])
        for other, text in enumerate(texts):
            if other == answer:
                continue
            # No attribute changed overall: the same values bound to other groups.
            changed = "+".join(differing_attributes(parse_caption(text), truth)) or "binding"
            pairs[changed] += 1
            wrong[changed] += bool(scores[row, other] >= scores[row, answer])
    return {
        changed: {"pairs": count, "wrong": round(wrong[changed] / count, 3)} for changed, count in pairs.most_common()
    }


def write_preset(demo: DemoArguments, name: str, overrides: dict) -> str:
    """A copy of the demo's preset file with ``overrides`` applied, beside the run; its path (``--model_preset``
    takes a preset file)."""
    with open(PRESET_FOLDER / f"{demo.model_preset}.json", encoding="utf-8") as f:
        preset = json.load(f)
    for key, value in overrides.items():
        if key in ("vision_position_init", "tokenizer_vocab_size"):
            preset[key] = value
        elif key in ("patch_size", "image_size"):
            preset["config"]["vision_config"][key] = value
            if key == "image_size":
                for size in ("size", "crop_size"):
                    preset["image_processor"][size] = {"shortest_edge": value}
        else:
            preset["config"][key] = value
    os.makedirs(demo.output_dir, exist_ok=True)
    path = os.path.join(demo.output_dir, f"{name}-preset.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(preset, f, indent=2)
    return path


def parse_arguments(argv: list[str]) -> tuple[ScreenArguments, DemoArguments]:
    """The screen's flags and the demo's, with the quick demo's sizes under ``--quick`` as ``vlfit demo`` takes them.

    Raises:
        ConfigError: for ``--resume_from_checkpoint``: a screened run is timed whole.
    """
    (screen, demo), given = CommandParser((ScreenArguments, DemoArguments), prog=PROG).parse(argv)
    if demo.resume_from_checkpoint is not None:
        raise ConfigError(
            "--resume_from_checkpoint: a screened run is timed whole, so each one starts over (resumed, its seconds "
            "and samples/s would count only the rest): drop the flag, or resume with vlfit demo"
        )
    return screen, with_quick_sizes(demo, given)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        screen, demo = parse_arguments(argv)
    except UserError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    stops = StopSignals()
    try:
        with stops:
            return screen_run(screen, demo)
    except TrainingPreempted as stop:
        signum = stop.signum
    except BaseException:
        if stops.received is None:
            raise
        stops.end_children()
        signum = stops.received
    again = shlex.join(["python", PROG, *argv])
    print(f"{PROG}: stopped by {signal.Signals(signum).name}; a screened run starts over: {again}", file=sys.stderr)
    return 128 + signum


def screen_run(screen: ScreenArguments, demo: DemoArguments) -> int:
    """Train and evaluate one run of the screen, print its results row and append it to the results file."""
    preset = json.loads(screen.preset_overrides)
    if preset:
        demo = dataclasses.replace(demo, model_preset=write_preset(demo, screen.name, preset))
    data_dir = ensure_synthetic_data(os.path.join(demo.output_dir, "data"), synthetic_config(demo))
    overrides = json.loads(screen.training_overrides)
    model_args, data_args, training_args = recipe(
        dataclasses.replace(demo, output_dir=os.path.join(demo.output_dir, screen.name)), data_dir, overrides
    )
    shutil.rmtree(training_args.output_dir, ignore_errors=True)  # a rerun starts over instead of resuming
    start = time.perf_counter()
    results = run(model_args, data_args, training_args)
    row = {
        "name": screen.name,
        "preset_overrides": preset,
        "training_overrides": overrides,
        "hard_negatives": demo.hard_negatives,
        "seconds": round(time.perf_counter() - start),
        "samples_per_second": round(results["train_samples_per_second"], 1),
        "flops_per_sample": results.get("train_flops_per_sample"),
        **{key: round(results[key], 3) for key in sorted(results) if key.startswith("eval_") and "recall@" in key},
        "eval_matching_accuracy": round(results.get("eval_matching_accuracy", float("nan")), 3),
    }
    if screen.diagnose:
        row["matching_errors"] = matching_errors(training_args.output_dir, data_dir)
    line = json.dumps(row)
    print(line)
    path = screen.results or os.path.join(demo.output_dir, "results.jsonl")
    with open(path, "a") as f:
        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
