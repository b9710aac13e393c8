"""``vlfit mine``: embed a split's pairs with a model and write a copy of the dataset with each caption's hardest
negative captions as a column, ready for ``vlfit train --hard_negative_column``.

The negatives come from other images' captions only, positive-aware (``vlfit.data.mining``); embedding is
``vlfit filter``'s (``vlfit.inference.pair_scores``) and so is the copy (``vlfit.data.split_copy``: parquet shards as
``vlfit prepare`` writes them). The other splits are copied as they are, so the folder trains and evaluates like the
original. The folder (with ``mine_report.json`` and the bad samples' ``bad_samples.jsonl``) is written whole or not
at all (``vlfit.atomic_files.staged_folder``). With ``--index``, the images' embeddings are read from an index of the
same split and model (``vlfit.commands.mine_index``), and only the captions are embedded. Tar shards (local, or at
URLs: fetched to local copies first, as every door that reads a split by row) are a split like any other; the copy
is parquet shards all the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vlfit.arguments import DataLocationArguments
from vlfit.arguments.runtime import flags_of
from vlfit.arguments.sizes import check_sizes
from vlfit.commands.filter import SplitModelArguments, open_model_and_splits
from vlfit.commands.parsing import CommandParser
from vlfit.commands.retrieve import VerifyArguments
from vlfit.data.mining import DEFAULT_MAX_NEGATIVE_RATIO, DEFAULT_NEGATIVE_COLUMN, DEFAULT_NUM_NEGATIVES, MiningRule
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.output_folders import MINE, MINE_REPORT

LABEL_COLUMN = "label"  # the column training reads as the right choice among a row's hard negatives
_RATIO_HELP = (
    "Positive-aware cut, in (0, 1]: a candidate scoring above this times the caption's own pair's score (its image "
    "against it) is left out as a likely unlabelled positive (NV-Retriever's TopK-PercPos)."
)
_COLUMN_HELP = "The column of negatives (a list of captions per row): train with --hard_negative_column NAME."

if TYPE_CHECKING:
    from vlfit.data.sources.base import ImageTextSource
    from vlfit.index.store import EmbeddingIndex
    from vlfit.inference.runtime import ModelRuntime

# --index as vlfit retrieve names an index folder; not given: the images are embedded.
_IndexFlag = flags_of(VerifyArguments, ("index",), index=None)


@dataclass
class MineArguments(SplitModelArguments, _IndexFlag):
    """Flags of ``vlfit mine`` besides the data location."""

    output_dir: str = flag(
        help="The folder to write the dataset copy into (parquet shards per split) with "
        f"{MINE_REPORT}: written whole once complete; a folder of an earlier vlfit mine is replaced."
    )
    num_negatives: int = flag(DEFAULT_NUM_NEGATIVES, "Negative captions per caption (K).")
    max_negative_ratio: float = flag(DEFAULT_MAX_NEGATIVE_RATIO, _RATIO_HELP)
    negative_column: str = flag(DEFAULT_NEGATIVE_COLUMN, _COLUMN_HELP)
    split: str = flag("train", "The split to mine; the others are copied as they are.")

    def __post_init__(self) -> None:
        check_sizes(self)
        self.rule()

    def rule(self) -> MiningRule:
        """``--num_negatives`` and ``--max_negative_ratio`` (refused in one line when out of range)."""
        return MiningRule(self.num_negatives, self.max_negative_ratio)


def mine_split(
    runtime: ModelRuntime,
    sources: Mapping[str, ImageTextSource],
    split: str,
    output_dir: str,
    rule: MiningRule,
    *,
    negative_column: str = DEFAULT_NEGATIVE_COLUMN,
    columns: Mapping[str, Any] | None = None,
    index: EmbeddingIndex | None = None,
    batch_size: int = 64,
    num_workers: int = 0,
    bad_sample_policy: str = "skip",
) -> dict[str, Any]:
    """Mine ``split`` of ``sources`` with ``runtime`` and write every split into ``output_dir`` (whole or not at
    all): the mined one with ``negative_column`` (its bad samples left out and listed, and its ``label`` column,
    which training would read as pointing into the negatives); the others as they are.

    Args:
        runtime: The model (``vlfit.inference.runtime.ModelRuntime``).
        sources: Split name -> source (``open_splits``).
        split: The split to mine.
        output_dir: The folder to write (``MINE``'s claim: new, empty or an earlier mine's).
        rule: How many negatives, and the positive-aware cut.
        negative_column: The negatives' column.
        columns: The column keywords of ``write_split`` (``image_column`` ...), as the sources were opened with.
        index: An index of ``split`` built by ``runtime``'s model (``vlfit.commands.mine_index.open_mining_index``):
            the images' embeddings are read from it, and only the captions are embedded. None: both are embedded.
        batch_size: Rows per forward of each tower.
        num_workers: Loader workers decoding the images (unused with ``index``).
        bad_sample_policy: ``skip`` (bad samples left out, counted and listed) or ``raise``.

    Returns:
        The report written (``mine_report.json``).

    Raises:
        ConfigError: for a split the data lacks, an output folder another command wrote, a negative column the
            data has already, or an ``index`` of another model or lacking images of the split.
        BadSampleError: under ``raise``, at the first bad sample.
    """
    import datasets
    import torch

    from vlfit.atomic_files import staged_folder
    from vlfit.commands.mine_index import indexed_pairs
    from vlfit.data.mining import mine_negatives
    from vlfit.data.split_copy import AddedColumn, write_bad_samples, write_split
    from vlfit.inference.pair_scores import embed_pairs

    if split not in sources:
        raise ConfigError(f"--split: no split named {split}; the data has: {', '.join(sources)}")
    MINE.claim(output_dir)  # before any embedding
    source = sources[split]
    with staged_folder(output_dir, MINE.command, what="the mined dataset", record_name=MINE_REPORT) as stage:
        keys = source.image_keys()
        if index is None:
            pairs = embed_pairs(runtime, source, batch_size=batch_size, num_workers=num_workers,
                                bad_sample_policy=bad_sample_policy)  # fmt: skip
        else:
            pairs = indexed_pairs(runtime, source, index, keys, batch_size=batch_size,
                                  bad_sample_policy=bad_sample_policy)  # fmt: skip
        captions = source.captions()
        keys = torch.from_numpy(keys[pairs.positions])
        mined = mine_negatives(pairs.images, pairs.texts, [captions[p] for p in pairs.positions], keys, rule)
        negatives = AddedColumn(negative_column, datasets.Sequence(datasets.Value("string")), mined.captions,
                                "--negative_column")  # fmt: skip
        # The training collator reads a row's label as its own choice among the hard negatives
        # (vlfit.data.hard_negatives.alternative_captions): the data's label points into caption_choices instead.
        kept = tuple(c for c in (columns or {}).get("extra_columns", ()) if c != LABEL_COLUMN)
        write_split(stage, split, source, pairs.positions, [negatives], **{**(columns or {}), "extra_columns": kept})
        for other, copied in sources.items():
            if other != split:
                write_split(stage, other, copied, range(len(copied)), **(columns or {}))
        write_bad_samples(stage, {split: pairs.bad_samples})
        counts = np.asarray([len(row) for row in mined.captions], dtype=np.int64)
        report = {
            "model": {"path": runtime.path, "runtime": runtime.encoder.description},
            "index": None if index is None else index.path,  # where the images' embeddings were read
            "split": split,
            "negative_column": negative_column,
            "num_negatives": rule.num_negatives,
            "max_negative_ratio": rule.max_negative_ratio,
            "read": len(source),
            "mined": len(pairs),
            "bad_samples": len(pairs.bad_samples),
            "rows_with_fewer_negatives": int((counts < rule.num_negatives).sum()),
            "mean_negatives": float(counts.mean()) if len(counts) else 0.0,
            "candidates_dropped_as_positives": int(mined.dropped.sum()),
            "copied_splits": [other for other in sources if other != split],
            "left_out_columns": [LABEL_COLUMN],
        }
        with open(os.path.join(stage, MINE_REPORT), "w", encoding="utf-8") as f:
            f.write(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit mine``: open the model and the data, mine the split, write the copy, print a summary."""
    parser = CommandParser(
        (MineArguments, DataLocationArguments),
        prog="vlfit mine",
        description="Embed a split with a model and write a copy of the dataset with each caption's hardest "
        "negative captions (other images' captions its image scores highest against, positive-aware: those above "
        "--max_negative_ratio of its own pair's score left out) as a column. With --index (vlfit retrieve index's "
        "index of the same split by the same model) the images' embeddings are read from it and only the captions "
        "are embedded. Train on it with `vlfit train --dataset_name <output_dir> --hard_negative_column "
        "mined_negatives`.",
    )
    args, data = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    from vlfit.commands.mine_index import index_embedding_dim, index_split, open_mining_index
    from vlfit.launch import launched_world_size

    MINE.claim(args.output_dir)  # a folder of something else is refused before the model and the data load
    location = {"dataset_name": data.dataset_name, "split": args.split, "image_column": data.image_column,
                "caption_column": data.caption_column, "image_id_column": data.image_id_column}  # fmt: skip
    if launched_world_size() > 1:  # the processes embed the images together; the first mines, the others are done
        sizes = {"batch_size": args.batch_size, "num_workers": args.dataloader_num_workers}
        shared = args.index or index_split(args.model, args.output_dir, location, args.settings(), **sizes)
        if shared is None or int(os.environ.get("RANK", "0")) != 0:
            return 0
        args = dataclasses.replace(args, index=shared)
    index = None
    if args.index is not None:  # its data checked before the model loads; its model once it has
        index = open_mining_index(args.index, location)
        args = dataclasses.replace(args, embedding_dim=index_embedding_dim(index, args.embedding_dim))
    runtime, sources, columns = open_model_and_splits(args, data, None)
    report = mine_split(runtime, sources, args.split, args.output_dir, args.rule(),
                        negative_column=args.negative_column, columns=columns, index=index,
                        batch_size=args.batch_size, num_workers=args.dataloader_num_workers,
                        bad_sample_policy=args.bad_sample_policy)  # fmt: skip
    print(
        f"{args.split}: {report['mined']} of {report['read']} rows mined, {report['mean_negatives']:.2f} negatives "
        f"each on average ({report['rows_with_fewer_negatives']} with fewer than {args.num_negatives}; "
        f"{report['candidates_dropped_as_positives']} candidates dropped as likely positives); "
        f"{report['bad_samples']} bad samples left out"
    )
    print(
        f"wrote {args.output_dir} ({MINE_REPORT}); train on it with: vlfit train --dataset_name {args.output_dir} "
        f"--hard_negative_column {args.negative_column}"
    )
    return 0
