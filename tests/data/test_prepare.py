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
from vlfit.data.image_transforms import FastImageTransform
from vlfit.data.prepare import (
    MANIFEST_NAME,
    ManifestMismatchError,
    PrepareError,
    PrepareSummary,
    prepare_dataset,
    resolve_short_side,
)
from vlfit.data.source_base import ImageTextSource
from vlfit.data.sources import open_splits
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
    with pytest.raises(PrepareError, match=r"sample 'validation-1' of split 'validation'"):
        _prepare(sources, str(tmp_path / "out"))
    assert not [f for f in os.listdir(tmp_path / "out") if f.endswith(".tmp")]


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
    from vlfit.models.presets import preset_config

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


def test_cli_errors(source_dir: str, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="exactly one of --short_side"):
        main(["--dataset_name", source_dir, "--output_dir", out])
    with pytest.raises(ValueError, match="no split named dev"):
        main(["--dataset_name", source_dir, "--output_dir", out, "--short_side", "64", "--splits", "dev"])
    with pytest.raises(ValueError, match="inside the source dataset"):
        main(["--dataset_name", source_dir, "--output_dir", os.path.join(source_dir, "x"), "--short_side", "64"])
