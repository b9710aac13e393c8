"""Image collections to embed or calibrate on: a folder of image files, a dataset split, or synthetic scenes.

All are ``ImageTextSource``s, so they go through the project's ``InputPipeline`` (fast CPU pipeline, loader
workers, bad images left out and listed) like training and evaluation data. A folder has no captions: each image's
caption is its path, which nothing embeds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from vlfit.data.batch import BadSample, Batch
from vlfit.data.file_patterns import is_stream_spec
from vlfit.data.pipeline import InputPipeline, LoaderSettings, PipelineOptions
from vlfit.data.records import BadRecordError, Record, image_value_to_bytes
from vlfit.data.source_base import DEFAULT_COLUMNS, ImageTextSource
from vlfit.data.tar_source import WebDatasetLayout
from vlfit.errors import ConfigError, DataError, MissingFileError
from vlfit.models.family import IMAGE_KEYS, InputSpec

if TYPE_CHECKING:
    from vlfit.data.stream import ShardReader

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def image_files(root: str) -> list[str]:
    """The image files under a folder (recursively, not hidden), as sorted ``/``-separated paths relative to it."""
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        paths.extend(
            os.path.relpath(os.path.join(folder, name), root)
            for name in files
            if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")
        )
    return sorted(path.replace(os.sep, "/") for path in paths)


def _read_image_file(path: str, sample_id: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise BadRecordError(f"sample {sample_id}: cannot read image file: {err.strerror}") from err


class ImageFolderSource(ImageTextSource):
    """Every image file under a folder (recursively, in sorted path order); ids are paths relative to it, image ids
    their absolute paths (each file is an image of its own, its ``item_folder``'s), captions the ids.

    Args:
        root: The folder.

    Raises:
        NotADirectoryError: when ``root`` is not a folder.
        ValueError: when it holds no image files.
    """

    def __init__(self, root: str) -> None:
        if not os.path.isdir(root):
            raise MissingFileError(f"--images {root}: no such folder")
        paths = image_files(root)
        if not paths:
            raise DataError(f"--images {root}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in it")
        self.root = root
        self.paths = paths
        self.captioned = False
        self.item_folder = os.path.abspath(root)
        super().__init__(name=f"image folder {root}", column_names=["image"], num_rows=len(self.paths))

    def _read(self, row: int) -> Record:
        path = self.paths[row]
        image = _read_image_file(os.path.join(self.root, path), path)
        return Record(id=path, image=image, caption=path, image_id=os.path.join(self.item_folder, path))

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        return [self.paths[int(row)] for row in self._positions(rows)]

    def _read_ids(self, rows: np.ndarray | None) -> list[str]:
        return [self.paths[int(row)] for row in self._positions(rows)]

    def _read_image_ids(self, rows: np.ndarray | None) -> list[str | None]:
        return [os.path.join(self.item_folder, self.paths[int(row)]) for row in self._positions(rows)]  # type: ignore[arg-type]


class ImageFilesSource(ImageTextSource):
    """Image files given by path, and every image file under the folders given (in sorted order); each id is the
    file's path as given (a folder's files joined to it).

    Args:
        paths: Files and folders.

    Raises:
        FileNotFoundError: when a path does not exist.
        ValueError: when no image file is given or found.
    """

    def __init__(self, paths: Sequence[str]) -> None:
        files: list[str] = []
        for path in paths:
            if os.path.isdir(path):
                files.extend(os.path.join(path, name) for name in image_files(path))
            elif os.path.isfile(path):
                files.append(path)
            else:
                raise MissingFileError(f"{path}: no such image file or folder")
        if not files:
            raise DataError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) in {', '.join(paths) or 'no path given'}")
        self.paths = files
        super().__init__(name=f"{len(files)} image files", column_names=["image"], num_rows=len(files))

    def _read(self, row: int) -> Record:
        path = self.paths[row]
        return Record(id=path, image=_read_image_file(path, path), caption=path)

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        return [self.paths[int(row)] for row in (range(len(self.paths)) if rows is None else rows)]

    def _read_ids(self, rows: np.ndarray | None) -> list[str]:
        return [self.paths[int(row)] for row in self._positions(rows)]


class RecordListSource(ImageTextSource):
    """Records held in memory (synthetic scenes made on the spot)."""

    def __init__(self, records: Sequence[Record], name: str) -> None:
        self.records = list(records)
        super().__init__(name=name, column_names=["image", "caption"], num_rows=len(self.records))

    def _read(self, row: int) -> Record:
        return self.records[row]

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        return [self.records[int(row)].caption for row in (range(len(self.records)) if rows is None else rows)]

    def _read_ids(self, rows: np.ndarray | None) -> list[str]:
        return [self.records[int(row)].id for row in self._positions(rows)]

    def _read_image_ids(self, rows: np.ndarray | None) -> list[str | None]:
        return [self.records[int(row)].image_id for row in self._positions(rows)]


def synthetic_source(num_samples: int, seed: int = 0) -> RecordListSource:
    """``num_samples`` synthetic captioned scenes (``vlfit.data.synthetic``), photo-sized, made in memory."""
    from vlfit.data.synthetic import SyntheticConfig, make_record

    config = SyntheticConfig(num_samples=max(num_samples, 10), seed=seed, min_long_side=160, max_long_side=320)
    records = []
    for index in range(num_samples):
        row = make_record(index, config)
        image = image_value_to_bytes(row["image"], sample_id=row["instance_id"])
        records.append(Record(row["instance_id"], image, row["image_description"]))
    return RecordListSource(records, f"{num_samples} synthetic scenes (seed {seed})")


def open_dataset_split(
    dataset_name: str,
    split: str,
    *,
    image_column: str = "image",
    caption_column: str | None = "image_description",
    caption_role: str = "caption",
    image_id_column: str | None = None,
) -> ImageTextSource:
    """One split of a dataset (hub id, ``save_to_disk`` folder, parquet folder), as ``vlfit train`` opens it.

    ``caption_role`` names the caption column in error messages (``label`` when it holds classes);
    ``image_id_column`` names the image each row shows (``Record.image_id``).

    Raises:
        ValueError: when the split does not exist.
    """
    (source,) = open_dataset_splits(
        dataset_name,
        [split],
        image_column=image_column,
        caption_column=caption_column,
        caption_role=caption_role,
        image_id_column=image_id_column,
    ).values()
    return source


def open_dataset_splits(
    dataset_name: str,
    splits: Sequence[str],
    *,
    image_column: str = "image",
    caption_column: str | None = "image_description",
    caption_role: str = "caption",
    image_id_column: str | None = None,
) -> dict[str, ImageTextSource]:
    """Several splits of a dataset, opened once (as ``open_dataset_split`` opens one).

    Raises:
        ValueError: when a split does not exist.
    """
    from vlfit.data.sources import open_splits  # only here: it imports the datasets library

    opened = open_splits(
        dataset_name=dataset_name,
        image_column=image_column,
        caption_column=caption_column,
        caption_role=caption_role,
        image_id_column=image_id_column,
    )
    for split in splits:
        if split not in opened:
            raise DataError(f"{dataset_name} has no split {split!r}; its splits: {', '.join(opened)}")
    return {split: opened[split] for split in splits}


@dataclass(frozen=True)
class ShardCollection:
    """WebDataset tar shards at URLs, to index one shard at a time: each is fetched to a local copy beside the
    index, embedded and deleted (``vlfit.index.store.build_index``), so the disk holds two shards, not the set.

    Attributes:
        spec: The shards as given (``--dataset_name``: a URL pattern, or ``::``-joined ones).
        urls: Every shard, in the order the spec expands to.
        layout: Which members are a sample's image and caption.
        retries: Times a failing shard is fetched again (with backoff) before it is given up.
        timeout: Seconds a connection or one read may take.
        backoff: Seconds before the first retry (doubling after).
        storage_options: fsspec options (``--storage_options``: headers, auth...).
        block_size: Bytes per HTTP request (``--shard_block_size``; 0: whole-file streams; ``None``: fsspec's,
            with servers that ignore Range requests detected).
    """

    spec: str
    urls: tuple[str, ...]
    layout: WebDatasetLayout
    retries: int = 3
    timeout: float = 60.0
    backoff: float = 1.0
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    block_size: int | None = None

    def reader(self) -> ShardReader:
        """How the shards are fetched (``vlfit.data.stream.ShardReader``)."""
        from vlfit.data.stream import ShardReader

        return ShardReader(
            self.layout,
            retries=self.retries,
            timeout=self.timeout,
            backoff=self.backoff,
            storage_options=dict(self.storage_options),
            block_size=self.block_size,
        )

    @property
    def name(self) -> str:
        return f"{len(self.urls)} shard{'s' * (len(self.urls) != 1)} of {self.spec}"


# What an index records of the collection it embedded (``open_image_collection``'s arguments), per build.
COLLECTION_KEYS = ("images", "dataset_name", "split", "image_column", "caption_column", "image_id_column")


def open_image_collection(
    *,
    images: str | None = None,
    dataset_name: str | None = None,
    split: str = "test",
    image_column: str = "image",
    caption_column: str | None = "image_description",
    image_id_column: str | None = None,
) -> tuple[ImageTextSource | ShardCollection, dict[str, Any]]:
    """What an index embeds: a folder of image files, a split of a dataset, or tar shards at URLs (a
    ``ShardCollection``; ``split`` does not apply); and how to open it again. ``image_id_column`` names the image
    a dataset row shows (rows of one image are one item; without it, rows with identical bytes are).

    Returns:
        The source, and its description for the index manifest (``COLLECTION_KEYS``; passed back as keyword
        arguments, it opens the same collection: what appending to an index does).

    Raises:
        ConfigError: unless exactly one of ``images`` and ``dataset_name`` is given.
    """
    if (images is None) == (dataset_name is None):
        raise ConfigError("pass exactly one of --images (a folder of image files) or --dataset_name")
    if images is not None:
        if image_id_column is not None:
            raise ConfigError(
                "--image_id_column names a column of --dataset_name; an image folder's files are its items"
            )
        return ImageFolderSource(images), {"images": os.path.abspath(images)}
    if is_stream_spec(dataset_name):
        from vlfit.data.stream.urls import parse_sources

        urls = tuple(url for part in parse_sources(dataset_name, flag="--dataset_name") for url in part.urls)
        layout = WebDatasetLayout(
            image_column=image_column,
            caption_column=caption_column or DEFAULT_COLUMNS["caption"][0],  # unset: the common caption members
            image_id_column=image_id_column,
        )
        collection = {"dataset_name": dataset_name, "image_column": image_column, "caption_column": caption_column,
                      "image_id_column": image_id_column}  # fmt: skip
        return ShardCollection(dataset_name, urls, layout), {**collection, "streamed": True}
    source = open_dataset_split(
        dataset_name, split, image_column=image_column, caption_column=caption_column, image_id_column=image_id_column
    )
    collection = {"dataset_name": dataset_name, "split": split, "image_column": image_column,
                  "caption_column": caption_column, "image_id_column": image_id_column}  # fmt: skip
    return source, collection


@dataclass
class HostBatches:
    """Host batches of uint8 pixels from the fast CPU pipeline, with the bad samples they left out."""

    pipeline: InputPipeline
    loader: torch.utils.data.DataLoader

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)


def host_batches(
    source: ImageTextSource,
    spec: InputSpec,
    *,
    batch_size: int,
    num_workers: int = 0,
) -> HostBatches:
    """Batches of ``source`` as the fast CPU pipeline collates them (uint8 ``pixel_values``, tokenized captions),
    in source order; bad images are left out of their batch and listed in its ``bad_samples``."""
    pipeline = InputPipeline(spec, PipelineOptions(image_pipeline="fast"), torch.device("cpu"), keep_columns=())
    loader = pipeline.loader(
        pipeline.dataset(source, train=False),
        batch_size=batch_size,
        settings=LoaderSettings(num_workers=num_workers, prefetch_factor=4 if num_workers else None),
    )
    return HostBatches(pipeline, loader)


@dataclass
class Samples:
    """Decoded samples held at once (export's parity and calibration samples).

    Attributes:
        pixels: uint8 ``[N, 3, H, W]``.
        captions: The N captions.
        ids: The N sample ids.
        bad_samples: Samples left out.
        image_keys: int64 ``[N]``, which image each sample shows (``Record.image_key``: samples of one image share
            it, as evaluation groups them); ``None``: each sample its own image.
    """

    pixels: torch.Tensor
    captions: list[str]
    ids: list[str]
    bad_samples: list[BadSample]
    image_keys: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.ids)


def load_samples(
    source: ImageTextSource,
    spec: InputSpec,
    *,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: str | None = None,
) -> Samples:
    """Every sample of ``source`` through the fast CPU pipeline, held at once.

    Args:
        source: The samples.
        spec: The model's input spec.
        batch_size: Samples per batch.
        num_workers: Loader worker processes.
        progress: A progress bar with this label (``None``: none).

    Raises:
        DataError: when no sample is usable.
    """
    captions = source.captions()
    pixels, ids, texts, bad, keys = [], [], [], [], []
    bar = tqdm(total=len(source), unit="img", desc=progress, leave=False, disable=progress is None)
    for batch in host_batches(source, spec, batch_size=batch_size, num_workers=num_workers):
        bar.update(len(batch) + len(batch.bad_samples))
        bad.extend(batch.bad_samples)
        if len(batch):
            pixels.append(batch["pixel_values"].contiguous())
            ids.extend(batch.sample_ids)
            texts.extend(str(captions[position]) for position in batch.positions)
            keys.append(batch[IMAGE_KEYS])
    bar.close()
    if not pixels:
        raise DataError(f"{source.name}: no usable sample ({len(bad)} bad)")
    return Samples(torch.cat(pixels), texts, ids, bad, torch.cat(keys))
