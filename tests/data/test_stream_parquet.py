"""Parquet shards in the stream (a hub dataset's files): rows stream as the map-style split reads them, a resumed
or retried read starts at its row, and ``--streaming --dataset_name`` trains on the dataset's training files and
evaluates its validation files without loading it whole."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest

from tests.http_shards import ShardServer
from tests.training.train_runs import logged_losses, tiny_train_argv
from vlfit.cli import main
from vlfit.data.sources import open_splits
from vlfit.data.stream import ShardReader
from vlfit.data.stream.shards import ShardUnreadableError
from vlfit.data.stream.train_stream import dataset_split_files
from vlfit.data.webdataset import WebDatasetLayout
from vlfit.errors import ConfigError, DataError

ROW_GROUP = 8


@pytest.fixture(scope="module")
def parquet_folder(synthetic_dataset_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic dataset as hub-style parquet files: ``data/train-0000{0,1}-of-00002.parquet`` and
    ``data/validation-00000-of-00001.parquet``, in row groups of 8."""
    root = tmp_path_factory.mktemp("hub_style")
    (root / "data").mkdir()
    loaded = datasets.load_from_disk(synthetic_dataset_dir)
    train = loaded["train"].data.table
    half = len(train) // 2
    for number, part in enumerate((train.slice(0, half), train.slice(half))):
        pq.write_table(part, root / "data" / f"train-{number:05d}-of-00002.parquet", row_group_size=ROW_GROUP)
    pq.write_table(loaded["validation"].data.table, root / "data" / "validation-00000-of-00001.parquet")
    return root


def _rows(items) -> list[tuple[str, bytes, str | None]]:
    return [(record.id, record.image, record.caption) for _, record in items]


def test_parquet_rows_stream_as_the_map_style_split_reads_them_and_resume_at_a_row(
    parquet_folder: Path, synthetic_dataset_dir: str
) -> None:
    files = sorted(str(p) for p in (parquet_folder / "data").glob("train-*.parquet"))
    # The rows the files were written from, as the map-style split reads them.
    expected = [(r.id, r.image, r.caption) for r in open_splits(dataset_name=synthetic_dataset_dir)["train"]]
    reader = ShardReader(WebDatasetLayout(caption_column="image_description"), retries=2, backoff=0.01, timeout=2.0)
    assert [row for f in files for row in _rows(reader.samples(f))] == expected and len(expected) > 2 * ROW_GROUP
    assert _rows(reader.samples(files[0], start=ROW_GROUP + 2)) == expected[ROW_GROUP + 2 : len(expected) // 2]

    data = Path(files[1]).read_bytes()
    with ShardServer({"/train-1.parquet": data}) as server:
        server.drop("/train-1.parquet", at_byte=len(data) // 3)  # inside the row groups, after the footer is read
        streamed = _rows(reader.samples(server.url("/train-1.parquet")))
    assert streamed == expected[len(expected) // 2 :]  # every row once, through the cut connection

    with pytest.raises(
        DataError, match=r"caption column 'caption' not found.*image_description.*--caption_col"
    ) as caught:
        list(ShardReader(WebDatasetLayout(caption_column="caption")).samples(files[0]))
    assert not isinstance(caught.value, ShardUnreadableError)  # wrong settings fail at once, never retried


def test_dataset_files_are_resolved_per_split_and_an_arrow_folder_is_refused(
    parquet_folder: Path, synthetic_dataset_dir: str
) -> None:
    location = {"dataset_name": str(parquet_folder), "dataset_config_name": None, "dataset_revision": None}
    assert [Path(f).name for f in dataset_split_files(location)] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    with pytest.raises(ConfigError, match=r"no data files of split 'test' \(its splits: train, validation\)"):
        dataset_split_files(location, "test")
    with pytest.raises(ConfigError, match="a save_to_disk folder .* is not streamed"):
        dataset_split_files({**location, "dataset_name": synthetic_dataset_dir})


@pytest.mark.slow
def test_streaming_a_dataset_trains_on_its_train_files_and_evaluates_its_validation_files(
    parquet_folder: Path, synthetic_dataset_dir: str, tmp_path: Path
) -> None:
    common = ["--streaming", "--shuffle_buffer", "16", "--save_strategy", "no"]
    by_name = tiny_train_argv(str(parquet_folder), tmp_path / "by_name", *common, "--do_eval", steps=4)
    assert main(["train", *by_name]) == 0
    files = tiny_train_argv("unused", tmp_path / "by_files", *common, steps=4)
    i = files.index("--dataset_name")
    files[i : i + 2] = ["--train_file", str(parquet_folder / "data" / "train-*.parquet")]
    assert main(["train", *files]) == 0
    assert logged_losses(tmp_path / "by_name") == logged_losses(tmp_path / "by_files")  # the same stream
    metrics = json.loads((tmp_path / "by_name" / "eval_results.json").read_text())
    validation = datasets.load_from_disk(synthetic_dataset_dir)["validation"]
    assert metrics["eval_num_samples"] == len(validation) and "eval_t2i_recall@1" in metrics


def test_columns_left_at_their_defaults_find_the_common_names_as_the_map_style_read_does(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.data.image_factory import jpeg_bytes

    images = [jpeg_bytes(16, 16, seed=i) for i in range(3)]
    path = tmp_path / "metadata.parquet"  # imagefolder-style names: file_name bytes and text captions
    pq.write_table(pa.table({"file_name": images, "text": [f"caption {i}" for i in range(3)]}), path)
    defaults = WebDatasetLayout(image_column="image", caption_column="image_description")  # the flags' defaults
    rows = _rows(ShardReader(defaults).samples(str(path)))
    assert [(caption, image) for _, image, caption in rows] == [(f"caption {i}", images[i]) for i in range(3)]
    with pytest.raises(DataError, match=r"caption column 'title' not found.*Name the caption column with --caption"):
        list(ShardReader(WebDatasetLayout(image_column="file_name", caption_column="title")).samples(str(path)))
