"""``vlfit classify``: the label of each image (files, folders or a dataset split) by a saved classifier."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from vlfit.arguments.runtime import runtime_arguments
from vlfit.atomic_files import replace_on_success
from vlfit.commands.parsing import CommandParser
from vlfit.errors import ConfigError
from vlfit.flags import flag


@dataclass
class ClassifyArguments(runtime_arguments("num_threads")):
    """Flags of ``vlfit classify`` (image files and folders are given as positional arguments)."""

    model: str = flag(help="A classifier folder (vlfit fewshot --save_classifier).")
    dataset_name: str | None = flag(None, "Or a dataset to classify a split of.")
    split: str = flag("test", "Split of --dataset_name.")
    image_column: str = flag("image", "Image column of --dataset_name.")
    label_column: str | None = flag(None, "A class column of --dataset_name: also print the accuracy against it.")
    output: str | None = flag(None, "Also write the predictions here, one JSON per line.")
    batch_size: int = flag(32, "Images per forward pass.")
    dataloader_num_workers: int = flag(
        default_factory=lambda: min(2, os.cpu_count() or 1), help="Loader worker processes."
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit classify``."""
    parser = CommandParser(
        ClassifyArguments,
        prog="vlfit classify",
        description="Print each image's label and its probability. Images that do not decode are skipped and listed.",
    )
    parser.add_argument("images", nargs="*", help="Image files and folders (searched recursively).")
    args, extra = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    paths: list[str] = extra.images
    if bool(paths) == (args.dataset_name is not None):
        raise ConfigError("give image files or folders, or --dataset_name (with --split), not both and not neither")
    if args.batch_size < 1:
        raise ConfigError(f"--batch_size must be at least 1, got {args.batch_size}")
    from vlfit.data.sources.images import ImageFilesSource
    from vlfit.data.sources.openers import open_split
    from vlfit.fewshot.classifier import Classifier

    if paths:
        source = ImageFilesSource(paths)
    else:
        source = open_split(
            args.dataset_name,
            args.split,
            image_column=args.image_column,
            caption_column=args.label_column,
            caption_role="label",
        )
    classifier = Classifier(args.model, args.settings())
    truths = source.captions() if args.label_column else None
    predictions, bad, correct = [], [], 0
    batches = classifier.image_batches(source, batch_size=args.batch_size, num_workers=args.dataloader_num_workers)
    for batch, images in batches:
        bad.extend(batch.bad_samples)
        if images is None:
            continue
        for prediction, position in zip(classifier.predict(images, batch.sample_ids), batch.positions, strict=True):
            predictions.append(prediction)
            truth = truths[position] if truths is not None else None
            correct += int(truth == prediction.label)
            print(f"{prediction.id}\t{prediction.label}\t{prediction.probability:.4f}")
    if args.output:
        with replace_on_success(args.output) as temp, open(temp, "w", encoding="utf-8") as f:
            for prediction in predictions:
                f.write(json.dumps(prediction.to_dict()) + "\n")
    if bad:
        print(f"skipped {len(bad)} images that do not decode:", file=sys.stderr)
        for sample in bad:
            print(f"  {sample.id}: {sample.reason}", file=sys.stderr)
    if truths is not None and predictions:
        print(
            f"accuracy against {args.label_column!r}: {correct / len(predictions):.4f} ({correct}/{len(predictions)})"
        )
    if not predictions:
        raise ConfigError(f"no image could be classified ({len(bad)} do not decode)")
    return 0
