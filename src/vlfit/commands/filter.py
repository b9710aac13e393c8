"""``vlfit filter``: score every image-text pair of a dataset's splits with a model (the cosine of the pair's two
embeddings, DataComp's CLIP score) and write the splits without the lowest-scoring pairs, the score as a column.

The output folder (parquet shards as ``vlfit prepare`` writes them, ``scores.png``, ``filter_report.json`` and the
bad samples' ``bad_samples.jsonl``) is written whole or not at all (``vlfit.atomic_files.staged_folder``), and reads
back with ``vlfit train --dataset_name OUTPUT``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlfit.arguments import DataArguments, DataLocationArguments
from vlfit.arguments.runtime import flags_of, runtime_arguments
from vlfit.arguments.sizes import check_sizes
from vlfit.commands.parsing import CommandParser
from vlfit.data.filtering import DEFAULT_SCORE_COLUMN, HISTOGRAM_NAME, Cut, FilteredSplit
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.output_folders import FILTER, FILTER_REPORT

if TYPE_CHECKING:
    from vlfit.data.sources.base import ImageTextSource
    from vlfit.inference.runtime import ModelRuntime

_DoorFlags = flags_of(DataArguments, ("bad_sample_policy",), base=runtime_arguments())


@dataclass(kw_only=True)
class SplitModelArguments(_DoorFlags):
    """The flags of a command that runs a model over a dataset's splits (``vlfit filter``, ``vlfit mine``) besides
    the data location and its own."""

    model: str = flag(
        help="The model that embeds the pairs: a checkpoint folder (vlfit train's) or a folder vlfit export wrote."
    )
    batch_size: int = flag(64, "Pairs per forward pass of each tower.")
    dataloader_num_workers: int = flag(
        default_factory=lambda: min(2, os.cpu_count() or 1),
        help="Loader workers decoding and resizing the images (the default is min(2, CPU count)).",
    )
    cache_dir: str | None = flag(None, "Where downloaded datasets are cached.")
    token: str | None = flag(None, "Hub token for private datasets.")


@dataclass
class FilterArguments(SplitModelArguments):
    """Flags of ``vlfit filter`` besides the data location."""

    output_dir: str = flag(
        help="The folder to write the kept pairs into (parquet shards per split), with scores.png and "
        f"{FILTER_REPORT}: written whole once complete; a folder of an earlier vlfit filter is replaced."
    )
    drop_fraction: float | None = flag(None, "Drop this fraction of each split's pairs, the lowest-scoring (e.g. 0.3).")
    min_score: float | None = flag(None, "Or drop the pairs scoring below this cosine (e.g. 0.25).")
    split: str | None = flag(None, "Comma-separated splits to filter (default: every split of the data).")
    score_column: str = flag(DEFAULT_SCORE_COLUMN, "The column the scores are written to.")

    def __post_init__(self) -> None:
        check_sizes(self)
        self.cut()

    def cut(self) -> Cut:
        """``--drop_fraction`` or ``--min_score`` as a ``Cut`` (refused in one line for both, neither or a bad one)."""
        return Cut(self.drop_fraction, self.min_score)


def filter_splits(
    runtime: ModelRuntime,
    sources: Mapping[str, ImageTextSource],
    output_dir: str,
    cut: Cut,
    *,
    score_column: str = DEFAULT_SCORE_COLUMN,
    batch_size: int = 64,
    num_workers: int = 0,
    bad_sample_policy: str = "skip",
    columns: Mapping[str, Any] | None = None,
) -> list[FilteredSplit]:
    """Score each split of ``sources`` with ``runtime``, and write what ``cut`` keeps into ``output_dir`` (whole or
    not at all), with the histogram, the report and the bad samples.

    Args:
        runtime: The model (``vlfit.inference.runtime.ModelRuntime``).
        sources: Split name -> source (``open_splits``).
        output_dir: The folder to write (``FILTER``'s claim: new, empty or an earlier filter's).
        cut: What is dropped.
        score_column: The scores' column.
        batch_size: Pairs per forward.
        num_workers: Loader workers.
        bad_sample_policy: ``skip`` (leave bad samples out, counted and listed) or ``raise``.
        columns: The column keywords of ``write_split`` (``image_column`` ...), as the sources were opened with.

    Raises:
        ConfigError: for an output folder another command wrote, or a score column the data has already.
        BadSampleError: under ``raise``, at the first bad sample.
    """
    import datasets

    from vlfit.atomic_files import staged_folder
    from vlfit.data.filtering import filter_report, write_histogram
    from vlfit.data.split_copy import AddedColumn, write_bad_samples, write_split
    from vlfit.inference.pair_scores import embed_pairs

    FILTER.claim(output_dir)  # before any scoring
    done: list[FilteredSplit] = []
    bad_samples = {}
    with staged_folder(output_dir, FILTER.command, what="the filtered dataset", record_name=FILTER_REPORT) as stage:
        for split, source in sources.items():
            pairs = embed_pairs(runtime, source, batch_size=batch_size, num_workers=num_workers,
                                bad_sample_policy=bad_sample_policy)  # fmt: skip
            scores = pairs.scores()
            kept = cut.keep(scores)
            score = AddedColumn(score_column, datasets.Value("float32"), scores[kept].tolist(), "--score_column")
            write_split(stage, split, source, pairs.positions[kept], [score], **(columns or {}))
            done.append(FilteredSplit(split, len(source), scores, kept, len(pairs.bad_samples)))
            bad_samples[split] = pairs.bad_samples
        write_bad_samples(stage, bad_samples)
        model = {"path": runtime.path, "runtime": runtime.encoder.description}
        write_histogram(os.path.join(stage, HISTOGRAM_NAME), done, cut, runtime.path)
        with open(os.path.join(stage, FILTER_REPORT), "w", encoding="utf-8") as f:
            f.write(filter_report(done, cut, model, score_column))
    return done


def _chosen(splits: Sequence[str], asked: str | None) -> list[str]:
    wanted = [part.strip() for part in (asked or "").split(",") if part.strip()] or list(splits)
    unknown = [s for s in wanted if s not in splits]
    if unknown:
        raise ConfigError(f"--split: no split named {', '.join(unknown)}; the data has: {', '.join(splits)}")
    return wanted


def open_model_and_splits(
    args: SplitModelArguments, data: DataLocationArguments, split: str | None
) -> tuple[ModelRuntime, dict[str, ImageTextSource], dict[str, Any]]:
    """The runtime of ``--model``, the ``split`` splits of the data (comma-separated; every split for None) with
    the evaluation columns, and the column keywords a copy of them is written with (``write_split``).

    Raises:
        ConfigError: for a split the data does not have, naming those it has.
    """
    from vlfit.data.prepare import DEFAULT_EXTRA_COLUMNS
    from vlfit.data.sources.openers import open_splits
    from vlfit.inference.backends import FOLDER_KINDS
    from vlfit.inference.runtime import ModelRuntime

    runtime = ModelRuntime.open(args.model, args.settings(), kinds=FOLDER_KINDS)
    splits = open_splits(**data.source_kwargs(), cache_dir=args.cache_dir, token=args.token,
                         extra_columns=DEFAULT_EXTRA_COLUMNS)  # fmt: skip
    columns = {"image_column": data.image_column, "caption_column": data.caption_column, "id_column": data.id_column,
               "image_id_column": data.image_id_column, "extra_columns": DEFAULT_EXTRA_COLUMNS}  # fmt: skip
    return runtime, {s: splits[s] for s in _chosen(list(splits), split)}, columns


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit filter``: open the model and the splits, score, cut, write, print a summary."""
    parser = CommandParser(
        (FilterArguments, DataLocationArguments),
        prog="vlfit filter",
        description="Score every image-text pair of a dataset with a model (the cosine of its image and caption "
        "embeddings, the CLIP score) and write each split without its lowest-scoring pairs (--drop_fraction) or "
        "those below a score (--min_score), the score as a column, with a histogram (scores.png) and a report. "
        "Train on the result with `vlfit train --dataset_name <output_dir>`.",
    )
    args, data = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    FILTER.claim(args.output_dir)  # a folder of something else is refused before the model and the data load
    runtime, sources, columns = open_model_and_splits(args, data, args.split)
    done = filter_splits(runtime, sources, args.output_dir, args.cut(),
                         score_column=args.score_column, batch_size=args.batch_size,
                         num_workers=args.dataloader_num_workers, bad_sample_policy=args.bad_sample_policy,
                         columns=columns)  # fmt: skip
    for split in done:
        figures = split.to_dict()
        print(
            f"{split.split}: kept {figures['kept']} of {figures['scored']} scored pairs (dropped {figures['dropped']}"
            f", lowest kept score {figures['lowest_kept_score']}); {figures['bad_samples']} bad samples left out"
        )
    print(
        f"wrote {args.output_dir} ({HISTOGRAM_NAME}, {FILTER_REPORT}); train on it with: vlfit train "
        f"--dataset_name {args.output_dir}"
    )
    return 0
