"""``vlfit make-data``: write the deterministic synthetic caption matching dataset (or, with ``--task vqa``, its
questions) to disk."""

from __future__ import annotations

import io
import os
import sys
from dataclasses import dataclass
from typing import Literal

from PIL import Image

from vlfit.commands.parsing import CommandParser
from vlfit.data.synthetic import SPLITS, SyntheticConfig, claim_dataset_folder, make_dataset, save_dataset
from vlfit.data.synthetic.questions import make_question_dataset
from vlfit.errors import ConfigError
from vlfit.flags import flag


def _default_num_proc() -> int:
    return min(2, os.cpu_count() or 1)


@dataclass
class MakeDataArguments:
    """Flags of ``vlfit make-data``."""

    output_dir: str = flag(help="Folder to write the dataset to (created if missing).")
    num_samples: int = flag(3000, "Total number of rows over all splits (at least 3).")
    seed: int = flag(0, "Base seed; each row is generated from (seed, row index).")
    validation_fraction: float = flag(0.1, "Share of rows in the validation split.")
    test_fraction: float = flag(0.1, "Share of rows in the test split.")
    min_long_side: int = flag(600, "Smallest image long side in pixels (at least 32).")
    max_long_side: int = flag(1400, "Largest image long side in pixels.")
    jpeg_quality: int = flag(90, "JPEG quality, 1..100 (4:2:0 chroma subsampling).")
    format: Literal["arrow", "parquet"] = flag(
        "arrow",
        "'arrow': a save_to_disk folder (read with datasets.load_from_disk); "
        "'parquet': one {split}.parquet file per split.",
    )
    labels: str | None = flag(
        None,
        "A labelled set for vlfit fewshot: 'kind' (one shape kind per scene, 4 classes), 'colour' "
        "(one colour per scene, 6 classes) or 'region' (one group per scene, 5 classes), as a class column of "
        "that name.",
    )
    background: Literal["light", "dark"] = flag(
        "light", "'light' (grey to light textured backgrounds) or 'dark' (the same textures near black)."
    )
    caption_grammar: Literal["regions", "no_regions", "long"] = flag(
        "regions",
        "'regions' (\"two red circles on the left and ...\") or 'no_regions' (\"a picture of two red "
        "circles and ...\"): with --background, a shifted distribution of the same scenes. 'long': the "
        "regions caption after about 100 words every image shares, so captions differ only past a CLIP text "
        "tower's 77 tokens (for training with a longer --max_seq_length).",
    )
    task: Literal["captions", "vqa"] = flag(
        "captions",
        "'captions' (the caption matching set) or 'vqa' (one question about each scene, with 10 "
        "annotator answers, in the VQAv2 layout: question, answers, multiple_choice_answer, answer_type, "
        "question_type, question_id, image_id; for vlfit train --task vqa).",
    )
    num_proc: int = flag(
        default_factory=_default_num_proc, help="Worker processes for generation; the default is min(2, CPU count)."
    )


def main(argv: list[str] | None = None) -> int:
    """Generate the synthetic dataset, write it and print a summary per split.

    Args:
        argv: Command-line arguments after ``make-data`` (``sys.argv[1:]`` when None).

    Returns:
        The exit status, 0 on success.

    Raises:
        ValueError: naming the flag when a setting is out of range.
    """
    parser = CommandParser(
        MakeDataArguments,
        prog="vlfit make-data",
        description="Write a deterministic synthetic dataset with the schema of the New Yorker Caption Contest "
        "'matching' config (image, image_description, caption_choices, label, instance_id).",
    )
    (args,) = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    if args.num_proc < 1:
        raise ConfigError(f"--num_proc must be at least 1, got {args.num_proc}")
    # Validates every range (naming the flag) before any image is generated.
    config = SyntheticConfig(
        num_samples=args.num_samples,
        validation_fraction=args.validation_fraction,
        test_fraction=args.test_fraction,
        seed=args.seed,
        min_long_side=args.min_long_side,
        max_long_side=args.max_long_side,
        jpeg_quality=args.jpeg_quality,
        labels=args.labels,
        background=args.background,
        caption_grammar=args.caption_grammar,
    )
    claim_dataset_folder(args.output_dir)  # a folder of the user's own files is refused before any image is made
    if args.task == "vqa":
        dataset_dict = make_question_dataset(config, num_proc=args.num_proc)
    else:
        dataset_dict = make_dataset(config, num_proc=args.num_proc)
    paths = save_dataset(dataset_dict, args.output_dir, format=args.format)
    for name in SPLITS:
        # Read the stored bytes straight from Arrow: going through the Image feature would decode every image.
        blobs = dataset_dict[name].data.column("image").combine_chunks().field("bytes").to_pylist()
        total_mb = sum(len(blob) for blob in blobs) / 1e6
        long_sides = [max(Image.open(io.BytesIO(blob)).size) for blob in blobs]  # header only, no decode
        mean_long = sum(long_sides) / len(long_sides) if long_sides else 0.0
        if not blobs:
            print(f"{name}: no rows (not written)")
            continue
        print(f"{name}: {len(blobs)} rows, {total_mb:.1f} MB of JPEG, mean long side {mean_long:.0f} px")
    print(f"wrote {args.format} dataset to {', '.join(paths)}")
    return 0
