"""``vlfit fewshot``: zero-shot, linear probe and SetFit compared on a labelled dataset, over shot counts and seeds."""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass, fields
from typing import Any

from vlfit.arguments import DataLocationArguments
from vlfit.commands.parsing import CommandParser
from vlfit.data.sources.labelled import DEFAULT_TEMPLATES, LabelledSplit, check_templates
from vlfit.errors import ConfigError
from vlfit.fewshot.experiment import METHODS, FewShotSettings
from vlfit.fewshot.setfit import SetFitSettings
from vlfit.flags import flag

# The data-location flags vlfit train and vlfit eval take, with their help: fewshot reads data as they do.
DATA_FLAGS = ("dataset_config_name", "dataset_revision", "data_dir", "train_file", "validation_file", "test_file",
              "cache_dir", "token")  # fmt: skip
_DATA_HELP = {f.name: f.metadata["help"] for f in fields(DataLocationArguments)}


@dataclass
class FewShotArguments:
    """Flags of ``vlfit fewshot``."""

    model_name_or_path: str = flag(help="A checkpoint folder (vlfit train's output, or its adapters).")
    label_column: str = flag(help="The class column (a ClassLabel or text).")
    output_dir: str = flag(help="Where fewshot.json, fewshot.md and fewshot.png go.")
    dataset_name: str | None = flag(
        None,
        "A dataset with a class column: a hub id, a folder, data files or tar shards, as vlfit train "
        "takes (or name the files of each split with --train_file, --validation_file, --test_file).",
    )
    dataset_config_name: str | None = flag(None, _DATA_HELP["dataset_config_name"])
    dataset_revision: str | None = flag(None, _DATA_HELP["dataset_revision"])
    data_dir: str | None = flag(None, _DATA_HELP["data_dir"])
    train_file: str | None = flag(None, "Files of split train (as vlfit train takes).")
    validation_file: str | None = flag(None, "Files of split validation, same forms.")
    test_file: str | None = flag(None, "Files of split test, same forms.")
    cache_dir: str | None = flag(None, "Where the datasets library caches downloads.")
    token: str | None = flag(None, "Hub token for private datasets.")
    image_column: str = flag("image", _DATA_HELP["image_column"])
    image_id_column: str | None = flag(
        None,
        "Column naming the image a row shows (e.g. COCO's image_id): rows with equal values are one "
        "image, drawn as one shot and measured once. Default: rows with identical image bytes are one image.",
    )
    train_split: str = flag("train", "The split the labelled shots are drawn from.")
    eval_split: str = flag("test", "The split accuracy is measured on.")
    max_eval_samples: int | None = flag(
        None, "Measure on the evaluation split's first N images (they are held at once)."
    )
    shots: str = flag("1,2,4,8,16", "Labelled images per class, comma-separated.")
    seeds: int = flag(5, "Seeds per shot count (each draws other images).")
    seed: int = flag(0, "The first seed.")
    methods: str = flag(",".join(METHODS), f"Comma-separated, from {', '.join(METHODS)}.")
    prompt_template: list[str] = flag(
        default_factory=lambda: list(DEFAULT_TEMPLATES),
        help="Zero-shot prompts, '{}' the class name; several are averaged.",
    )
    setfit_steps: int = flag(SetFitSettings.steps, "SetFit: fine-tuning steps.")
    setfit_learning_rate: float = flag(SetFitSettings.learning_rate, "SetFit: AdamW's.")
    setfit_batch_size: int = flag(SetFitSettings.batch_size, "SetFit: shots per step.")
    setfit_augment: bool = flag(True, "SetFit: two random crops/flips of each shot.")
    anchor_setfit_head: bool = flag(True, "SetFit: let cross-validation pick a head pulled toward the zero-shot head.")
    save_classifier: str | None = flag(None, "Keep the best method's model and head here (for vlfit classify).")
    batch_size: int = flag(64, "Images per forward pass when embedding.")
    dataloader_num_workers: int = flag(0, "Loader worker processes decoding images.")


def data_of(args: FewShotArguments) -> dict[str, Any]:
    """The data-location flags given, as ``vlfit.data.sources.open_splits`` keyword arguments."""
    return {name: getattr(args, name) for name in DATA_FLAGS if getattr(args, name) is not None}


def data_description(args: FewShotArguments) -> str:
    """What the data is called in reports and the classifier's card: the dataset, or the split files."""
    files = [getattr(args, f"{split}_file") for split in ("train", "validation", "test")]
    return ", ".join(name for name in (args.dataset_name, *files) if name)


def data_read(train: LabelledSplit, evaluation: LabelledSplit, train_split: str, eval_split: str) -> str:
    """What the run read, in images (rows that show one image are one) and rows of the data."""

    def read(split: LabelledSplit) -> str:
        return f"{len(split)} images ({split.num_rows} rows)"

    return f"shots from {read(train)} of {train_split!r}, accuracy on {read(evaluation)} of {eval_split!r}"


def _shot_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError:
        raise ConfigError(f"--shots takes comma-separated whole numbers (1,2,4,8,16), got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ConfigError(f"--shots takes positive counts of images per class, got {text!r}")
    return counts


def settings_of(args: FewShotArguments) -> FewShotSettings:
    """The experiment's settings; raises ``ValueError`` naming the flag for a bad one."""
    if args.seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {args.seeds}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch_size must be at least 1, got {args.batch_size}")
    if args.max_eval_samples is not None and args.max_eval_samples < 1:
        raise ConfigError(f"--max_eval_samples must be at least 1, got {args.max_eval_samples}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    check_templates(args.prompt_template)
    setfit = SetFitSettings(
        steps=args.setfit_steps,
        learning_rate=args.setfit_learning_rate,
        batch_size=args.setfit_batch_size,
        augment=args.setfit_augment,
    )
    return FewShotSettings(
        shot_counts=_shot_counts(args.shots),
        seeds=list(range(args.seed, args.seed + args.seeds)),
        methods=methods,
        templates=list(args.prompt_template),
        setfit=setfit,
        anchor_setfit_head=args.anchor_setfit_head,
        batch_size=args.batch_size,
        num_workers=args.dataloader_num_workers,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit fewshot``."""
    parser = CommandParser(
        FewShotArguments,
        prog="vlfit fewshot",
        description="Compare zero-shot, a linear probe and SetFit's recipe on a labelled dataset at several shot "
        "counts and seeds (the same images for every method); write fewshot.json/.md/.png.",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    settings = settings_of(args)
    from vlfit.data.sources.openers import labelled_splits
    from vlfit.fewshot.classifier import ClassifierInfo, save_classifier
    from vlfit.fewshot.experiment import run_fewshot
    from vlfit.fewshot.report import markdown_table, results_document, write_reports
    from vlfit.fewshot.shots import check_shot_counts
    from vlfit.inference.backends import TorchEncoder
    from vlfit.inference.runtime import ModelRuntime
    from vlfit.inference.runtime_settings import RuntimeSettings

    train, evaluation = labelled_splits(
        args.dataset_name,
        train_split=args.train_split,
        eval_split=args.eval_split,
        label_column=args.label_column,
        image_column=args.image_column,
        image_id_column=args.image_id_column,
        data=data_of(args),
    )
    if args.max_eval_samples is not None:
        evaluation = evaluation.first(args.max_eval_samples)
    check_shot_counts(train, settings.shot_counts)  # before the model loads
    started = time.perf_counter()
    loaded = ModelRuntime.open(args.model_name_or_path, RuntimeSettings(backend="torch"), flag="--model_name_or_path",
                               kinds=("checkpoint", "adapters")).encoder  # fmt: skip
    assert isinstance(loaded, TorchEncoder)  # a checkpoint runs on torch
    print(f"{len(train.class_names)} classes ({', '.join(train.class_names)}); "
          f"{data_read(train, evaluation, args.train_split, args.eval_split)}")  # fmt: skip
    results = run_fewshot(loaded, train, evaluation, settings, keep_largest=args.save_classifier is not None)
    summary = results.summary()
    chance = evaluation.majority_share()
    document = results_document(
        summary,
        [run.to_dict() for run in results.runs],
        model=args.model_name_or_path,
        dataset=data_description(args),
        label_column=args.label_column,
        classes=train.class_names,
        train_split=args.train_split,
        eval_split=args.eval_split,
        eval_images=results.eval_count,
        chance=chance,
        shots=list(settings.shot_counts),
        seeds=list(settings.seeds),
        templates=list(settings.templates),
        setfit={k: getattr(settings.setfit, k) for k in ("steps", "learning_rate", "batch_size", "augment")},
        bad_samples=results.bad_samples,
        seconds=round(time.perf_counter() - started, 1),
    )
    markdown = markdown_table(summary, list(settings.shot_counts), chance)
    paths = write_reports(args.output_dir, document, markdown, list(settings.shot_counts), chance)
    print("\n" + markdown)
    if results.bad_samples:
        print(f"{len(results.bad_samples)} images left out (they do not decode):")
        for bad in results.bad_samples:
            print(f"  {bad['id']}: {bad['reason']}")
    print(f"wrote {', '.join(paths)}")
    if args.save_classifier:
        best = results.best()
        kept = results.kept[(best.method, best.shots, best.seed)]
        if kept.image_weights is not None:  # SetFit's tuned image tower goes into the saved checkpoint
            kept.image_weights.restore()
        info = ClassifierInfo(
            method=best.method,
            class_names=train.class_names,
            label_column=args.label_column,
            shots=best.shots,
            seed=best.seed,
            head=best.head,
            accuracy=best.accuracy,
            templates=list(settings.templates),
            source_model=os.path.abspath(args.model_name_or_path),
        )
        save_classifier(
            args.save_classifier, loaded.save, kept.head, info, dataset=data_description(args),
            command_line=shlex.join(["vlfit", "fewshot", *argv]),
        )  # fmt: skip
        print(f"saved the {best.method} classifier ({best.shots} shots, seed {best.seed}) to {args.save_classifier}")
    return 0
