"""Offline re-encoding of a dataset at training resolution into local parquet shards (``vlfit prepare``).

Each image is decoded with DCT scaling, resized so its short side equals the training resolution (aspect kept, no
crop, so a random resized crop at train time still sees the whole frame) and re-encoded as a metadata-free 4:2:0
JPEG (``reencode``). Captions, ids, extra columns and the ``--image_id_column`` column are copied unchanged (a list
caption column is written a row per caption; equal source bytes re-encode to equal bytes, so captions of one image
still group into it). Training then decodes several times
fewer pixels per sample. The output folder holds ``{split}-{shard:05d}-of-{num_shards:05d}.parquet`` files (the
image column is a ``datasets.Image`` feature) and a manifest, and reads back with
``open_splits(dataset_name=output_dir)``.

Runs are resumable: every shard is written to a temporary file and renamed into place when complete, and a re-run
builds only the shards that are missing. A re-run with different settings is refused.

Bad samples (unreadable record, undecodable image, missing/empty/whitespace caption) follow ``--bad_sample_policy``
as in ``vlfit train``: ``skip`` leaves them out, counts them per split in the report and the manifest, and lists
them in ``bad_samples.jsonl``; ``raise`` stops at the first one with ``PrepareError``.

Modules: ``resolution`` (the output short side), ``columns`` (the output schema), ``reencode`` (one image),
``shards`` (one shard, and the worker pool), ``manifest`` (``vlfit_prepare.json`` and the resume checks),
``report`` (the run's summary) and ``run`` (``prepare_dataset``, which ties them together).
"""

from __future__ import annotations

from vlfit.data.prepare.columns import DEFAULT_EXTRA_COLUMNS, OutputColumns, output_columns
from vlfit.data.prepare.manifest import MANIFEST_NAME, MANIFEST_VERSION, ManifestMismatchError
from vlfit.data.prepare.reencode import (
    CHROMA_SUBSAMPLING,
    DEFAULT_JPEG_QUALITY,
    JPEG_ENCODER,
    PreparedImage,
    encode_jpeg,
    output_size,
    prepare_image,
)
from vlfit.data.prepare.report import PrepareSummary, format_report
from vlfit.data.prepare.resolution import resolve_patch_budget, resolve_short_side
from vlfit.data.prepare.run import prepare_dataset
from vlfit.data.prepare.shards import DEFAULT_SHARD_SIZE, PrepareError, ShardStats, SkippedSample, shard_file_name

__all__ = [
    "CHROMA_SUBSAMPLING",
    "DEFAULT_EXTRA_COLUMNS",
    "DEFAULT_JPEG_QUALITY",
    "DEFAULT_SHARD_SIZE",
    "JPEG_ENCODER",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "ManifestMismatchError",
    "OutputColumns",
    "PrepareError",
    "PrepareSummary",
    "PreparedImage",
    "ShardStats",
    "SkippedSample",
    "encode_jpeg",
    "format_report",
    "output_columns",
    "output_size",
    "prepare_dataset",
    "prepare_image",
    "resolve_patch_budget",
    "resolve_short_side",
    "shard_file_name",
]
