"""Tests for vlfit prepare: re-encoded shards read back like the source, at the short side, resumably."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlfit.commands.prepare import main
from vlfit.data.bad_samples import BAD_SAMPLES_REPORT, RAISE_HINT, BadSampleError
from vlfit.data.image_transforms import FastImageTransform
from vlfit.data.prepare import (
    MANIFEST_NAME,
    ManifestMismatchError,
    PrepareError,
    PrepareSummary,
    format_report,
    prepare_dataset,
    resolve_short_side,
)
from vlfit.data.records import BadRecordError, Record
from vlfit.data.sources import ImageTextSource, open_splits
from vlfit.data.synthetic import SyntheticConfig, make_dataset, save_dataset

SHORT_SIDE = 64
SHARD_SIZE = 8
EXTRAS = ("caption_choices", "label")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prepare")


@pytest.fixture(scope="module")
def source_dir(workdir: Path) -> str:
    """30 synthetic samples (train 24, validation 3, test 3), long sides 200..400 px, as a save_to_disk folder."""
    path = str(workdir / "source")
    save_dataset(make_dataset(SyntheticConfig(num_samples=30, min_long_side=200, max_long_side=400)), path)
    return path


def _open(path: str, cache: Path, **kwargs) -> dict[str, ImageTextSource]:
    return open_splits(dataset_name=path, cache_dir=str(cache), extra_columns=EXTRAS, **kwargs)


def _prepare(sources: dict[str, ImageTextSource], out: str, **kwargs) -> PrepareSummary:
    settings = {"short_side": SHORT_SIDE, "shard_size": SHARD_SIZE, "progress": False, **kwargs}
    return prepare_dataset(sources, out, **settings)


@pytest.fixture(scope="module")
def prepared(source_dir: str, workdir: Path) -> tuple[str, PrepareSummary]:
    out = str(workdir / "prepared")
    return out, _prepare(_open(source_dir, workdir / "cache"), out)


def _size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        return image.size


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _jpeg(width: int, height: int, orientation: int | None = None) -> bytes:
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    kwargs = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=92, **kwargs)
    return buffer.getvalue()


def _write_parquet(path: Path, images: list[bytes]) -> str:
    features = datasets.Features({"image": datasets.Image(), "image_description": datasets.Value("string")})
    rows = {
        "image": [{"bytes": b, "path": None} for b in images],
        "image_description": [f"caption {i}" for i in range(len(images))],
    }
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    return str(path)


# ------------------------------------------------------------------------------------------------------ layout


def test_shards_per_split_and_manifest(prepared: tuple[str, PrepareSummary]) -> None:
    out, summary = prepared
    expected = [f"train-{i:05d}-of-00003.parquet" for i in range(3)]
    expected += ["test-00000-of-00001.parquet", "validation-00000-of-00001.parquet"]
    assert sorted(f for f in os.listdir(out) if f.endswith(".parquet")) == sorted(expected)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    assert [pq.ParquetFile(os.path.join(out, f)).metadata.num_rows for f in expected] == [8, 8, 8, 3, 3]
    manifest = json.loads(Path(out, MANIFEST_NAME).read_text())
    assert manifest["complete"] is True
    assert manifest["settings"]["short_side"] == SHORT_SIDE and manifest["settings"]["shard_size"] == SHARD_SIZE
    assert {s: m["rows"] for s, m in manifest["splits"].items()} == {"train": 24, "validation": 3, "test": 3}
    shard = manifest["splits"]["train"]["shards"]["train-00000-of-00003.parquet"]
    assert shard["rows"] == 8 and shard["output_bytes"] == os.path.getsize(os.path.join(out, expected[0]))
    assert summary.samples == 30 and summary.shards_built == summary.shards_total == 5
    assert summary.totals.output_bytes < summary.totals.input_bytes
    assert summary.totals.output_pixels < summary.totals.decoded_pixels <= summary.totals.source_pixels


def test_reads_back_like_the_source(prepared: tuple[str, PrepareSummary], source_dir: str, workdir: Path) -> None:
    out, _ = prepared
    original, result = _open(source_dir, workdir / "cache"), _open(out, workdir / "cache")
    assert set(result) == set(original)
    for split, source in original.items():
        assert isinstance(result[split].dataset.features["image"], datasets.Image)
        assert result[split].dataset.features["caption_choices"] == source.dataset.features["caption_choices"]
        assert len(result[split]) == len(source)
        for before, after in zip(source, result[split], strict=True):
            assert (after.id, after.caption, after.extra) == (before.id, before.caption, before.extra)
            assert set(after.extra) == set(EXTRAS)
            assert len(after.image) < len(before.image)


def test_images_have_the_short_side_and_aspect(
    prepared: tuple[str, PrepareSummary], source_dir: str, workdir: Path
) -> None:
    out, _ = prepared
    original, result = _open(source_dir, workdir / "cache"), _open(out, workdir / "cache")
    for split, source in original.items():
        for before, after in zip(source, result[split], strict=True):
            (w0, h0), (w1, h1) = _size(before.image), _size(after.image)
            assert min(w1, h1) == SHORT_SIDE
            long_expected = max(w0, h0) * SHORT_SIDE / min(w0, h0)
            assert 0 <= long_expected - max(w1, h1) < 1  # torchvision's Resize([S]) size of the full image
            assert (w1 >= h1) == (w0 >= h0)
            with Image.open(io.BytesIO(after.image)) as image:
                assert not image.getexif() and image.format == "JPEG"


def test_center_crop_matches_the_direct_fast_path(
    prepared: tuple[str, PrepareSummary], source_dir: str, workdir: Path
) -> None:
    out, _ = prepared
    transform = FastImageTransform(SHORT_SIDE)
    original, result = _open(source_dir, workdir / "cache"), _open(out, workdir / "cache")
    directs, prepared_crops = [], []
    for split in ("train", "validation"):
        for before, after in zip(original[split], result[split], strict=True):
            direct, via_prepared = transform(before.image).numpy(), transform(after.image).numpy()
            assert direct.shape == via_prepared.shape == (3, SHORT_SIDE, SHORT_SIDE)
            # Per image, sub-pixel geometry dominates on these grainy images: the fast path sizes from the
            # DCT-scaled array (libjpeg rounds its sides up), prepare from the full size. Both are off the
            # reference pipeline by as much.
            assert _psnr(direct, via_prepared) >= 25.0, before.id
            directs.append(direct)
            prepared_crops.append(via_prepared)
    assert _psnr(np.stack(directs), np.stack(prepared_crops)) >= 30.0


# ------------------------------------------------------------------------------------------------------ images


def test_small_images_kept_orientation_applied_and_generated_ids(tmp_path: Path) -> None:
    # 40x30 is below the short side; 300x200 with EXIF orientation 6 shows as 200x300; a PNG goes through Pillow.
    png = io.BytesIO()
    Image.fromarray(np.full((80, 100, 3), 128, np.uint8)).save(png, format="PNG")
    images = [_jpeg(40, 30), _jpeg(300, 200, orientation=6), png.getvalue()]
    data = _write_parquet(tmp_path / "pairs.parquet", images)
    out = str(tmp_path / "out")
    train = open_splits(train_file=data, cache_dir=str(tmp_path / "cache"))["train"]
    summary = _prepare({"train": train, "validation": train.select([])}, out)
    assert summary.totals.small_images == 1
    # An empty split gets no shard (the parquet reader cannot read a file without rows).
    assert sorted(f for f in os.listdir(out) if f.endswith(".parquet")) == ["train-00000-of-00001.parquet"]
    (result,) = _open(out, tmp_path / "cache").values()
    assert [r.id for r in result] == ["train-0", "train-1", "train-2"]  # the source's generated ids, kept
    assert result.dataset.column_names == ["image", "image_description", "instance_id"]
    assert [_size(r.image) for r in result] == [(40, 30), (64, 96), (80, 64)]
    assert [r.caption for r in result] == ["caption 0", "caption 1", "caption 2"]


def test_bad_sample_names_id_and_split(tmp_path: Path) -> None:
    data = _write_parquet(tmp_path / "bad.parquet", [_jpeg(100, 100), b"\xff\xd8\xff\xe0 not a jpeg"])
    sources = open_splits(validation_file=data, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(
        PrepareError, match=r"sample 'validation-1' of split 'validation' \(row 1\): corrupt JPEG header|cannot decode"
    ):
        _prepare(sources, str(tmp_path / "out"), bad_sample_policy="raise")
    assert not [f for f in os.listdir(tmp_path / "out") if f.endswith(".tmp")]


# ------------------------------------------------------------------------------------------------- bad samples

BAD_RECORD = "cannot read image file 'gone.jpg': No such file or directory"


class _DirtySource(ImageTextSource):
    """Records from ``(id, image, caption)`` rows; ``image=None`` makes the record unreadable (``BadRecordError``),
    and reading row ``fail_at`` raises ``RuntimeError``, as an interruption would stop a run."""

    def __init__(self, rows: list[tuple[str, bytes | None, str | None]], fail_at: int | None = None) -> None:
        super().__init__(name="dirty", column_names=["image", "image_description"], num_rows=len(rows))
        self._data = rows
        self.fail_at = fail_at

    def _read(self, row: int) -> Record:
        if row == self.fail_at:
            raise RuntimeError("interrupted")
        sample_id, image, caption = self._data[row]
        if image is None:
            raise BadRecordError(f"sample {sample_id}: {BAD_RECORD}")
        return Record(id=sample_id, image=image, caption=caption)

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        return [self._data[int(r)][2] for r in (range(len(self._data)) if rows is None else rows)]


def _dirty_splits(fail_at: int | None = None) -> dict[str, ImageTextSource]:
    """train: 12 rows in shards of 4, with bad samples in shards 0 and 2 and a shard (1) of bad samples only;
    validation: 3 rows, one bad."""
    good = _jpeg(120, 90)
    broken = b""
    train: list[tuple[str, bytes | None, str | None]] = [(f"t{i}", good, f"caption {i}") for i in range(12)]
    train[1] = ("t1", broken, "caption 1")
    train[4] = ("t4", good, None)
    train[5] = ("t5", good, "")
    train[6] = ("t6", good, " \t ")
    train[7] = ("t7", None, "caption 7")
    train[10] = ("t10", good, "")
    validation: list[tuple[str, bytes | None, str | None]] = [(f"v{i}", good, f"caption {i}") for i in range(3)]
    validation[2] = ("v2", good, None)
    return {"train": _DirtySource(train, fail_at=fail_at), "validation": _DirtySource(validation)}


EXPECTED_BAD = [
    ("train", "t1", "image is empty (0 bytes)"),
    ("train", "t4", "caption is missing (None)"),
    ("train", "t5", "caption is empty"),
    ("train", "t6", "caption is whitespace only"),
    ("train", "t7", BAD_RECORD),
    ("train", "t10", "caption is empty"),
    ("validation", "v2", "caption is missing (None)"),
]


def _bad_lines(out: str) -> list[tuple[str, str, str]]:
    lines = [json.loads(line) for line in Path(out, BAD_SAMPLES_REPORT).read_text().splitlines()]
    assert all(list(line) == ["split", "id", "reason"] for line in lines)
    return [(line["split"], line["id"], line["reason"]) for line in lines]


def test_skip_leaves_bad_samples_out_and_reports_them(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    summary = _prepare(_dirty_splits(), out, shard_size=4)
    assert summary.bad_samples == {"train": 6, "validation": 1} and summary.skipped == 7
    assert summary.samples == 8 and summary.samples_built == 15
    # Shard 1 lost all its samples: no file for it, as for an empty split.
    assert sorted(f for f in os.listdir(out) if f.endswith(".parquet")) == [
        "train-00000-of-00003.parquet",
        "train-00002-of-00003.parquet",
        "validation-00000-of-00001.parquet",
    ]
    result = _open(out, tmp_path / "cache")
    assert [r.id for r in result["train"]] == ["t0", "t2", "t3", "t8", "t9", "t11"]
    assert [r.id for r in result["validation"]] == ["v0", "v1"]
    assert [r.caption for r in result["train"]][:2] == ["caption 0", "caption 2"]

    assert _bad_lines(out) == EXPECTED_BAD
    manifest = json.loads(Path(out, MANIFEST_NAME).read_text())
    assert {s: m["bad_samples"] for s, m in manifest["splits"].items()} == {"train": 6, "validation": 1}
    shard = manifest["splits"]["train"]["shards"]["train-00001-of-00003.parquet"]
    assert (
        shard["rows"] == 0
        and shard["skipped"] == 4
        and [b["id"] for b in shard["bad_samples"]]
        == [
            "t4",
            "t5",
            "t6",
            "t7",
        ]
    )
    report = format_report(summary)
    assert "prepared 8 samples (train 6, validation 2)" in report
    assert f"bad samples: 7 left out (train 6, validation 1); each with its reason in {out}" in report

    again = _prepare(_dirty_splits(), out, shard_size=4)  # nothing left to do: every shard is kept
    assert again.shards_built == 0 and again.bad_samples == summary.bad_samples
    assert _bad_lines(out) == EXPECTED_BAD


def test_raise_names_split_sample_and_reason(tmp_path: Path) -> None:
    sources = _dirty_splits()
    with pytest.raises(PrepareError, match=r"sample 't1' of split 'train' \(row 1\): image is empty") as caught:
        _prepare(sources, str(tmp_path / "serial"), shard_size=4, bad_sample_policy="raise")
    assert RAISE_HINT in str(caught.value) and isinstance(caught.value, BadSampleError)
    # From a worker process: the error crosses the process boundary with its attributes.
    clean_train = sources["train"].select([0, 2, 3])
    with pytest.raises(
        PrepareError, match=r"sample 'v2' of split 'validation' \(row 2\): caption is missing"
    ) as caught:
        pool_run = {"train": clean_train, "validation": sources["validation"]}
        _prepare(pool_run, str(tmp_path / "pool"), shard_size=4, num_proc=2, bad_sample_policy="raise")
    assert (caught.value.split, caught.value.sample_id, caught.value.reason) == (
        "validation",
        "v2",
        "caption is missing (None)",
    )
    with pytest.raises(ValueError, match="unknown --bad_sample_policy 'ignore'"):
        _prepare(sources, str(tmp_path / "never"), bad_sample_policy="ignore")


def test_resumed_run_reports_the_same_bad_samples(tmp_path: Path) -> None:
    whole = _prepare(_dirty_splits(), str(tmp_path / "whole"), shard_size=4)

    out = str(tmp_path / "resumed")
    with pytest.raises(RuntimeError, match="interrupted") as caught:
        _prepare(_dirty_splits(fail_at=9), out, shard_size=4)  # stops in shard 2, after shards 0 and 1
    assert "while preparing row 9 of split 'train'" in caught.value.__notes__
    assert not Path(out, BAD_SAMPLES_REPORT).exists()
    resumed = _prepare(_dirty_splits(), out, shard_size=4)
    assert resumed.built_shards == ["train-00002-of-00003.parquet", "validation-00000-of-00001.parquet"]
    assert resumed.bad_samples == whole.bad_samples and resumed.totals.skipped == whole.totals.skipped == 7
    assert resumed.totals.rows == whole.totals.rows
    assert Path(out, BAD_SAMPLES_REPORT).read_bytes() == Path(whole.output_dir, BAD_SAMPLES_REPORT).read_bytes()
    assert _bad_lines(out) == EXPECTED_BAD

    # raise refuses to finish on top of shards that an earlier skip run left samples out of.
    with pytest.raises(PrepareError, match=r"sample 't1' of split 'train': image is empty.*earlier run"):
        _prepare(_dirty_splits(), out, shard_size=4, bad_sample_policy="raise")


# ------------------------------------------------------------------------------------------------------ resume


def test_resume_rebuilds_only_missing_shard(
    prepared: tuple[str, PrepareSummary], source_dir: str, workdir: Path, tmp_path: Path
) -> None:
    out = str(tmp_path / "copy")
    shutil.copytree(prepared[0], out)
    missing = "train-00001-of-00003.parquet"
    reference = Path(out, missing).read_bytes()
    os.remove(os.path.join(out, missing))
    Path(out, f".{missing}.999.tmp").write_bytes(b"partial")  # left behind by an interrupted run
    mtimes = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out) if f.endswith(".parquet")}

    summary = _prepare(_open(source_dir, workdir / "cache"), out)
    assert summary.built_shards == [missing] and summary.samples_built == SHARD_SIZE
    assert summary.samples == 30 and summary.totals == prepared[1].totals
    assert Path(out, missing).read_bytes() == reference
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in mtimes} == mtimes
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


@pytest.mark.parametrize(("setting", "value"), [("jpeg_quality", 90), ("short_side", 48), ("shard_size", 10)])
def test_changed_setting_is_refused(
    prepared: tuple[str, PrepareSummary], source_dir: str, workdir: Path, setting: str, value: int
) -> None:
    before = Path(prepared[0], MANIFEST_NAME).read_bytes()
    with pytest.raises(ManifestMismatchError, match=rf"{setting}: was .*new --output_dir"):
        _prepare(_open(source_dir, workdir / "cache"), prepared[0], **{setting: value})
    assert Path(prepared[0], MANIFEST_NAME).read_bytes() == before


def test_changed_source_is_refused(prepared: tuple[str, PrepareSummary], source_dir: str, workdir: Path) -> None:
    sources = _open(source_dir, workdir / "cache")
    with pytest.raises(ManifestMismatchError, match="source"):
        _prepare(sources, prepared[0], source_description={"dataset_name": "elsewhere"})
    with pytest.raises(ManifestMismatchError, match="'train' has 20 rows now but 24"):
        _prepare({**sources, "train": sources["train"].select(range(20))}, prepared[0])


def test_foreign_output_dir_is_refused(source_dir: str, workdir: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("someone else's folder")
    with pytest.raises(ManifestMismatchError, match="not empty"):
        _prepare(_open(source_dir, workdir / "cache"), str(tmp_path))


# ------------------------------------------------------------------------------------------------- short side


def test_short_side_from_preset_checkpoint_or_number(tmp_path: Path) -> None:
    from vlfit.models.registry import preset_config

    preset_config("tiny").save_pretrained(str(tmp_path / "ckpt"))
    assert resolve_short_side(model_preset="tiny") == 64
    assert resolve_short_side(model_name_or_path=str(tmp_path / "ckpt")) == 64
    assert resolve_short_side(short_side=100) == 100
    with pytest.raises(ValueError, match="exactly one of --short_side"):
        resolve_short_side()
    with pytest.raises(ValueError, match="got --short_side and --model_preset"):
        resolve_short_side(short_side=64, model_preset="tiny")
    with pytest.raises(ValueError, match="unknown --model_preset"):
        resolve_short_side(model_preset="huge")


# --------------------------------------------------------------------------------------------------------- CLI


def test_cli_end_to_end(source_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    argv = ["--dataset_name", source_dir, "--output_dir", out, "--model_preset", "tiny", "--shard_size", "10"]
    argv += ["--num_proc", "2", "--splits", "train,validation", "--cache_dir", str(tmp_path / "cache")]
    assert main([*argv, "--progress", "false"]) == 0
    report = capsys.readouterr().out
    for text in ("prepared 27 samples", "short side 64 px", "MB", "images/s", "decoded pixels", "x fewer"):
        assert text in report
    shards = sorted(f for f in os.listdir(out) if f.endswith(".parquet"))
    assert shards == [f"train-{i:05d}-of-00003.parquet" for i in range(3)] + ["validation-00000-of-00001.parquet"]
    manifest = json.loads(Path(out, MANIFEST_NAME).read_text())
    assert manifest["settings"]["source"]["dataset_name"] == os.path.abspath(source_dir)
    assert len(_open(out, tmp_path / "cache")["train"]) == 24

    assert main([*argv, "--progress", "false"]) == 0  # a second run has nothing left to do
    assert "(0 built now, 4 kept" in capsys.readouterr().out


def test_cli_bad_sample_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write_parquet(tmp_path / "pairs.parquet", [_jpeg(100, 80), b"\xff\xd8\xff\xe0 not a jpeg", _jpeg(90, 90)])
    argv = ["--train_file", data, "--short_side", "64", "--cache_dir", str(tmp_path / "cache"), "--progress", "false"]
    with pytest.raises(PrepareError, match=r"sample 'train-1' of split 'train'.*--bad_sample_policy skip"):
        main([*argv, "--output_dir", str(tmp_path / "raise"), "--bad_sample_policy", "raise"])
    out = tmp_path / "skip"
    assert main([*argv, "--output_dir", str(out)]) == 0  # skip is the default
    report = capsys.readouterr().out
    assert "prepared 2 samples (train 2)" in report and "bad samples: 1 left out (train 1)" in report
    (line,) = [json.loads(text) for text in (out / BAD_SAMPLES_REPORT).read_text().splitlines()]
    assert (line["split"], line["id"]) == ("train", "train-1") and "JPEG" in line["reason"]


def test_cli_errors(source_dir: str, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="exactly one of --short_side"):
        main(["--dataset_name", source_dir, "--output_dir", out])
    with pytest.raises(ValueError, match="no split named dev"):
        main(["--dataset_name", source_dir, "--output_dir", out, "--short_side", "64", "--splits", "dev"])
    with pytest.raises(ValueError, match="inside the source dataset"):
        main(["--dataset_name", source_dir, "--output_dir", os.path.join(source_dir, "x"), "--short_side", "64"])


def test_prepared_shards_group_captions_into_images_as_the_source_does(tmp_path: Path) -> None:
    # 8 images x 3 captions: rows with an image_id column (--image_id_column), and a list caption column.
    from tests.inference.several_captions import IMAGES, captions_of, write_caption_lists, write_csv
    from vlfit.data.image_groups import image_items

    csv_file = str(write_csv(tmp_path / "csv"))
    columns = ["--image_column", "file_name", "--caption_column", "caption", "--image_id_column", "image_id"]
    common = ["--short_side", "16", "--progress", "false", "--cache_dir", str(tmp_path / "cache")]
    assert main(["--dataset_name", csv_file, *columns, "--output_dir", str(tmp_path / "rows"), *common]) == 0
    rows = open_splits(dataset_name=str(tmp_path / "rows"), image_column="file_name", caption_column="caption",
                       image_id_column="image_id", cache_dir=str(tmp_path / "cache"))["train"]  # fmt: skip
    items = image_items(rows)
    assert items.ids == [f"img-{n}" for n in range(IMAGES)]
    assert items.captions == [captions_of(n) for n in range(IMAGES)]

    lists = str(write_caption_lists(tmp_path / "lists"))
    assert main(["--dataset_name", lists, "--caption_column", "captions", "--output_dir", str(tmp_path / "out"),
                 *common]) == 0  # fmt: skip
    prepared = open_splits(dataset_name=str(tmp_path / "out"), caption_column="captions")["test"]
    assert image_items(prepared).captions == [captions_of(n) for n in range(IMAGES)]
