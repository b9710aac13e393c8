"""``vlfit prepare``: re-encode a dataset's images at training resolution into local parquet shards.

Reads the same data-location flags as ``vlfit train``; the output folder is then passed to ``vlfit train
--dataset_name <output_dir>`` with the same column flags.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from vlfit.arguments import DataLocationArguments
from vlfit.commands.parsing import CommandParser
from vlfit.data.bad_samples import BAD_SAMPLE_POLICIES
from vlfit.data.file_patterns import is_stream_spec, resolve_files
from vlfit.data.prepare import (
    DEFAULT_EXTRA_COLUMNS,
    DEFAULT_JPEG_QUALITY,
    DEFAULT_SHARD_SIZE,
    format_report,
    prepare_dataset,
    resolve_patch_budget,
    resolve_short_side,
)
from vlfit.data.sources.openers import open_splits
from vlfit.data.stream.urls import parse_sources
from vlfit.errors import ConfigError
from vlfit.flags import flag


def _default_num_proc() -> int:
    return min(2, os.cpu_count() or 1)


@dataclass
class PrepareArguments:
    """Flags of ``vlfit prepare`` besides the data location."""

    output_dir: str = flag(help="Folder for the parquet shards and vlfit_prepare.json (created; resumed if it exists).")
    short_side: int | None = flag(None, "Short side of the output images in pixels (or use --model_preset).")
    model_preset: str | None = flag(None, "Take the short side from this preset's image size (e.g. tiny: 64).")
    model_name_or_path: str | None = flag(None, "Take the short side from this checkpoint's vision_config.image_size.")
    model_revision: str = flag("main", "Checkpoint branch, tag or commit.")
    cache_dir: str | None = flag(None, "Where downloaded configs and datasets are cached.")
    token: str | None = flag(None, "Hub token for private models or datasets.")
    jpeg_quality: int = flag(DEFAULT_JPEG_QUALITY, "JPEG quality of the output, 1..100 (4:2:0 chroma).")
    shard_size: int = flag(DEFAULT_SHARD_SIZE, "Samples per parquet shard.")
    num_proc: int = flag(
        default_factory=_default_num_proc,
        help="Worker processes (one shard at a time each); the default is min(2, CPU count).",
    )
    splits: str | None = flag(None, "Comma-separated splits to prepare (default: every split of the data).")
    extra_columns: str = flag(
        ",".join(DEFAULT_EXTRA_COLUMNS), "Comma-separated columns copied along when present (evaluation reads these)."
    )
    bad_sample_policy: str = flag(
        "skip",
        "What to do with a sample whose record cannot be read, whose image cannot be decoded or whose "
        "caption is missing, empty or whitespace. skip: leave it out of the shards, count it per split in the "
        "report and the manifest, and list it in bad_samples.jsonl in --output_dir. raise: stop with an error "
        "naming the split and the sample.",
        choices=BAD_SAMPLE_POLICIES,
    )
    progress: bool = flag(True, "Show a progress bar.")


def _split_list(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _source_description(data: DataLocationArguments) -> dict[str, Any]:
    """What identifies the source, with local paths made absolute so a re-run from elsewhere compares equal (shard
    URLs are fetched to local copies by ``open_splits``; the description names the URLs)."""
    name = data.dataset_name
    description: dict[str, Any] = {
        "dataset_name": os.path.abspath(name) if name and os.path.exists(name) else name,
        "dataset_config_name": data.dataset_config_name,
        "dataset_revision": data.dataset_revision,
        "data_dir": data.data_dir,
    }
    for name in ("train_file", "validation_file", "test_file"):
        spec = getattr(data, name)
        if spec and is_stream_spec(spec):  # shard URLs: as written, one per shard
            description[name] = [url for source in parse_sources(spec, flag=f"--{name}") for url in source.urls]
        else:
            description[name] = [os.path.abspath(p) for p in resolve_files(spec)] if spec else None
    return description


def _check_output_dir(output_dir: str, data: DataLocationArguments) -> None:
    # A parquet folder is read recursively: shards written inside the source would join it on the next run.
    if data.dataset_name and os.path.isdir(data.dataset_name):
        source = os.path.realpath(data.dataset_name)
        target = os.path.realpath(output_dir)
        if target == source or target.startswith(source + os.sep):
            raise ConfigError(
                f"--output_dir {output_dir!r} is inside the source dataset {data.dataset_name!r}; "
                "pick a folder outside it"
            )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit prepare``: open the splits, re-encode them and print a report.

    Args:
        argv: Command-line arguments after ``prepare`` (``sys.argv[1:]`` when None).

    Returns:
        The exit status, 0 on success.

    Raises:
        ValueError: for a missing or ambiguous short side, an unknown split, a setting out of range, or an
            output folder holding other data (``ManifestMismatchError``).
        PrepareError: with ``--bad_sample_policy raise``, naming the split, the sample and the reason of the first
            bad sample.
    """
    parser = CommandParser(
        (PrepareArguments, DataLocationArguments),
        prog="vlfit prepare",
        description="Re-encode a dataset's images with their short side at the training resolution (no crop) into "
        "parquet shards, so training decodes several times fewer pixels. Resumable: re-run the same command to "
        "finish an interrupted run. Train on the result with `vlfit train --dataset_name <output_dir>`.",
    )
    args, data = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    short_side = resolve_short_side(
        args.short_side,
        args.model_preset,
        args.model_name_or_path,
        cache_dir=args.cache_dir,
        revision=args.model_revision,
        token=args.token,
    )
    # A NaFlex model's images are stored at their patch grid (--short_side does not apply to them).
    patch_budget = resolve_patch_budget(
        args.model_preset, args.model_name_or_path, cache_dir=args.cache_dir, revision=args.model_revision,
        token=args.token,
    )  # fmt: skip
    _check_output_dir(args.output_dir, data)
    extra_columns = _split_list(args.extra_columns)
    description = _source_description(data)
    splits = open_splits(
        **data.source_kwargs(), cache_dir=args.cache_dir, token=args.token, extra_columns=extra_columns
    )
    wanted = _split_list(args.splits) or list(splits)
    unknown = [s for s in wanted if s not in splits]
    if unknown:
        raise ConfigError(f"--splits: no split named {', '.join(unknown)}; the data has: {', '.join(splits)}")
    summary = prepare_dataset(
        {split: splits[split] for split in wanted},
        args.output_dir,
        short_side=short_side,
        jpeg_quality=args.jpeg_quality,
        shard_size=args.shard_size,
        num_proc=args.num_proc,
        image_column=data.image_column,
        caption_column=data.caption_column,
        id_column=data.id_column,
        extra_columns=extra_columns,
        image_id_column=data.image_id_column,
        source_description=description,
        bad_sample_policy=args.bad_sample_policy,
        progress=args.progress,
        patch_budget=patch_budget,
    )
    print(format_report(summary))
    print(f"train on it with: vlfit train --dataset_name {summary.output_dir} (and the same column flags)")
    return 0
