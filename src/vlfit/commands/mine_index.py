"""``vlfit mine --index``: the image embeddings of a split read from an index that ``vlfit retrieve index`` built of
it, so that mining embeds only the captions.

An index is used only when it holds what embedding the split's images would give: the same data (its manifest's
``collections`` record the dataset, split and columns it was built from: one of them must be the split mined) and
the same model (its ``identity``: family, embedding size and checkpoint hash), and an item for every image of the
split (its id as the index names it: ``vlfit.data.image_groups.image_items``). Anything else is refused in one line
naming ``--index`` and what differs. An image the index left out as bad is a bad sample of mining too.

Under torchrun without ``--index``, the processes first embed the split's images together into an index beside the
output (``index_split``: ``vlfit retrieve index``'s job, each process its share), which the first process then mines
with; a rerun reuses it and embeds only what it lacks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vlfit.data.bad_samples import RAISE_HINT, BadCaptionError, BadSampleError, clean_caption, describe_error
from vlfit.data.batch import BadSample
from vlfit.data.image_groups import group_images
from vlfit.data.sources.base import ImageTextSource
from vlfit.data.sources.openers import COLLECTION_KEYS
from vlfit.errors import ConfigError
from vlfit.index.store import EmbeddingIndex
from vlfit.index.verify import open_index
from vlfit.inference.identity import shown_source
from vlfit.inference.pair_scores import PairEmbeddings
from vlfit.inference.runtime import ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings

# The parts of a collection that decide which images an index holds, and under which ids (the caption column does
# not change an image's embedding).
_IMAGE_KEYS = tuple(key for key in COLLECTION_KEYS if key != "caption_column")
_LEAVE_OUT = "or leave --index out to embed the images"


def open_mining_index(path: str, location: Mapping[str, Any], *, verify: str = "quick") -> EmbeddingIndex:
    """The index at ``path`` once it is whole (``verify``) and was built from the split ``location`` names.

    Args:
        path: The index folder (``--index``).
        location: The split mined, as an index records a collection (``COLLECTION_KEYS``: ``dataset_name``,
            ``split``, ``image_column``, ``caption_column``, ``image_id_column``).
        verify: ``quick`` or ``full`` (``vlfit.index.verify.open_index``).

    Raises:
        ConfigError: when no build of the index read that split, naming what differs.
        MissingFileError, DamagedIndexError: for a folder without an index, or a damaged one.
    """
    index = open_index(path, verify)
    built = index.manifest.collections
    differences = [_differences(collection, location) for collection in built]
    if not built or all(differences):
        closest = min(differences, key=len) if built else ["it records no data"]
        raise ConfigError(
            f"--index {path} was built from other data than the split mined ({'; '.join(closest)}): index this split "
            f"with vlfit retrieve index, {_LEAVE_OUT}"
        )
    return index


def _differences(collection: Mapping[str, Any], location: Mapping[str, Any]) -> list[str]:
    """What differs between a collection an index recorded and the split mined, as ``--flag there / here``."""
    recorded = dict(collection)
    if recorded.get("streamed"):  # tar shards at URLs open as one split, train (vlfit.data.sources.openers)
        recorded["split"] = "train"
    found = []
    for key in _IMAGE_KEYS:
        there, here = recorded.get(key), location.get(key)
        same = there == here or (
            key in ("images", "dataset_name") and None not in (there, here) and _same_path(str(there), str(here))
        )
        if not same:
            found.append(f"--{key} {there} there, {here} here")
    return found


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def index_split(model: str, output_dir: str, location: Mapping[str, Any], runtime: RuntimeSettings, *,
                batch_size: int, num_workers: int) -> str | None:  # fmt: skip
    """The split ``location`` names embedded by every process of a torchrun launch into ``<output_dir>-index``
    (``vlfit retrieve index``'s job: each process its share, the first lists and writes); that folder on the first
    process, None on the others.

    Raises:
        ConfigError: for data given otherwise than by ``--dataset_name`` (what an index is built from).
    """
    from vlfit.index.job import IndexJob, index_collection

    if location.get("dataset_name") is None:
        raise ConfigError("under torchrun, vlfit mine embeds the split as vlfit retrieve index does, from "
                          "--dataset_name (a folder, hub id, data files or tar shards): give the data so")  # fmt: skip
    folder = output_dir.rstrip("/" + os.sep) + "-index"
    job = IndexJob(model, folder, **location, runtime=runtime, batch_size=batch_size, num_workers=num_workers,
                   progress=False)  # fmt: skip
    report = index_collection(job)
    report.raise_for_failures()
    return folder if report.lead else None


def index_embedding_dim(index: EmbeddingIndex, asked: int | None) -> int | None:
    """The ``--embedding_dim`` the captions are embedded at: the size the index holds (``asked`` must be that, or
    None).

    Raises:
        ConfigError: for an ``--embedding_dim`` other than the index's.
    """
    index.manifest.check_embedding_dim(asked, index.path)
    return index.manifest.model.get("embedding_dim")


def check_index_model(index: EmbeddingIndex, runtime: ModelRuntime) -> None:
    """Refuse, in one line, an index whose images another model embedded (family, embedding size or checkpoint).

    Raises:
        ConfigError: naming ``--index``, ``--model`` and what differs.
    """
    built, asked = index.manifest.identity, runtime.encoder.identity
    differs = [
        f"{name} {there} there, {here} here"
        for name, there, here in (
            ("family", built.family, asked.family),
            ("embedding size", built.embedding_size, asked.embedding_size),
            ("weights", shown_source(built.checkpoint_sha256), shown_source(asked.checkpoint_sha256)),
        )
        if there != here
    ]
    if differs:
        raise ConfigError(
            f"--index {index.path} holds images embedded by another model than --model {runtime.path} "
            f"({'; '.join(differs)}): mine with the model the index was built with, {_LEAVE_OUT}"
        )


def indexed_pairs(
    runtime: ModelRuntime,
    source: ImageTextSource,
    index: EmbeddingIndex,
    image_keys: np.ndarray,
    *,
    batch_size: int = 64,
    bad_sample_policy: str = "skip",
) -> PairEmbeddings:
    """Each row's image embedding read from ``index`` and its caption embedded by ``runtime``: what
    ``vlfit.inference.pair_scores.embed_pairs`` gives, with no image decoded or embedded.

    Args:
        runtime: The model the index was built with.
        source: The split the index was built from.
        index: The index (``open_mining_index``).
        image_keys: ``source.image_keys()`` (which rows show one image).
        batch_size: Captions per forward.
        bad_sample_policy: ``skip`` (rows whose image the index left out, or whose caption is missing, are left
            out and listed) or ``raise``.

    Raises:
        ConfigError: for another model than the index's, or an image of the split that the index does not hold.
        BadSampleError: under ``raise``, at the first bad sample.
    """
    check_index_model(index, runtime)
    captions, record_ids, image_ids = source.captions(), source.ids(), source.image_ids()
    first, image_of_row = group_images(torch.from_numpy(image_keys), len(source))
    # An image's item id, as a build names it (``image_items``): its image id, else its first record's id.
    items = [record_ids[r] if image_ids[r] is None else str(image_ids[r]) for r in first.tolist()]
    row_of_item = {item: row for row, item in enumerate(index.row_ids)}
    left_out = {bad["id"]: bad["reason"] for bad in index.manifest.bad_samples}
    missing = [item for item in items if item not in row_of_item and item not in left_out]
    if missing:
        raise ConfigError(
            f"--index {index.path} lacks {len(missing)} of the split's {len(items)} images (the first: {missing[0]}): "
            f"run vlfit retrieve index on the split again to add them, {_LEAVE_OUT}"
        )
    positions, words, rows, bad = [], [], [], []
    for position, image in enumerate(image_of_row.tolist()):
        item, sample = items[image], record_ids[position]
        reason = f"the index left its image out: {left_out[item]}" if item in left_out else None
        if reason is None:
            try:
                words.append(clean_caption(captions[position], sample))
            except BadCaptionError as err:
                reason = describe_error(err, sample)[1]
        if reason is not None:
            if bad_sample_policy == "raise":
                raise BadSampleError.for_sample(sample, reason, RAISE_HINT)
            bad.append(BadSample(sample, reason))
            continue
        positions.append(position)
        rows.append(row_of_item[item])
    with torch.inference_mode():
        texts = runtime.embed_texts(words, batch_size=batch_size)
    images = torch.from_numpy(index.vectors()[rows]) if rows else torch.zeros(0, texts.shape[1])
    return PairEmbeddings(np.asarray(positions, dtype=np.int64), images, texts, bad)


__all__ = ["check_index_model", "index_embedding_dim", "index_split", "indexed_pairs", "open_mining_index"]
