"""Tests for vlfit.data.sources (with the tar source and file patterns it uses): every storage format, built
locally, yields the stored bytes unchanged."""

from __future__ import annotations

import csv
import io
import json
import os
import pickle
import re
import tarfile
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlfit.data.file_patterns import expand_braces, resolve_files
from vlfit.data.records import Record
from vlfit.data.sources import ArrowSource, ImageTextSource, TarSource, locations, open_splits
from vlfit.errors import ConfigError, DataError

COLOURS = [(220, 30, 30), (30, 200, 40), (40, 50, 230), (240, 220, 20)]
CAPTIONS = ["a red square", "a green square", "a blue square", "a yellow square"]


def _jpeg(colour: tuple[int, int, int]) -> bytes:
    image = Image.new("RGB", (32, 24), colour)
    image.paste((colour[2], colour[0], colour[1]), (4, 4, 12, 10))  # a patch so the files differ in more than colour
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _write_images(folder: Path, n: int = 3, offset: int = 0) -> list[bytes]:
    """Write n JPEGs as folder/images/{i}.jpg and return their bytes."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    blobs = []
    for i in range(n):
        data = _jpeg(COLOURS[(i + offset) % len(COLOURS)])
        (folder / "images" / f"{i}.jpg").write_bytes(data)
        blobs.append(data)
    return blobs


def _check_source(
    source: ImageTextSource, ids: list[str], images: list[bytes], captions: list[str | None], extra: list[dict] | None
) -> None:
    """Length, records, captions(), select and pickling all agree with what was written."""
    assert len(source) == len(ids)
    records = list(source)
    assert all(isinstance(r, Record) for r in records)
    assert [r.id for r in records] == ids
    assert [r.image for r in records] == images  # exact stored bytes, never re-encoded
    assert [r.caption for r in records] == captions
    if extra is not None:
        assert [r.extra for r in records] == extra
    assert source.captions() == captions
    assert source[-1] == records[-1]
    assert source[np.int64(0)] == records[0]
    with pytest.raises(IndexError):
        source[len(ids)]

    subset = source.select([len(ids) - 1, 0])
    assert len(subset) == 2
    assert [subset[0], subset[1]] == [records[-1], records[0]]
    assert subset.captions() == [captions[-1], captions[0]]
    assert subset.select([-1])[0] == records[0]  # select of a select keeps the original ids
    with pytest.raises(IndexError):
        source.select([len(ids)])

    for candidate in (source, subset):
        clone = pickle.loads(pickle.dumps(candidate))
        assert clone[0] == candidate[0]
        assert clone.captions() == candidate.captions()
    assert len(source) == len(ids)  # select did not change the parent


# ----------------------------------------------------------------------------------------- save_to_disk folders


def test_save_to_disk_dataset_dict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = _write_images(tmp_path, 4)
    features = datasets.Features(
        {
            "image": datasets.Image(),  # decode=True: the source must still hand out the stored bytes
            "image_description": datasets.Value("string"),
            "instance_id": datasets.Value("string"),
            "label": datasets.Value("int64"),
            "unused": datasets.Value("string"),
        }
    )

    def rows(lo: int, hi: int) -> dict:
        return {
            "image": [{"bytes": b, "path": None} for b in blobs[lo:hi]],
            "image_description": CAPTIONS[lo:hi],
            "instance_id": [f"img{i}" for i in range(lo, hi)],
            "label": list(range(lo, hi)),
            "unused": ["x"] * (hi - lo),
        }

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(rows(0, 3), features=features),
            "validation": datasets.Dataset.from_dict(rows(3, 4), features=features),
        }
    )
    dd.save_to_disk(str(tmp_path / "saved"))

    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("a source decoded pixels")

    monkeypatch.setattr(datasets.Image, "decode_example", no_decoding)
    splits = open_splits(dataset_name=str(tmp_path / "saved"), extra_columns=["label", "caption_choices"])
    assert sorted(splits) == ["train", "validation"]
    train = splits["train"]
    assert isinstance(train, ArrowSource)
    assert train.column_names == ["image", "image_description", "instance_id", "label", "unused"]
    _check_source(train, ["img0", "img1", "img2"], blobs[:3], CAPTIONS[:3], [{"label": i} for i in range(3)])
    _check_source(splits["validation"], ["img3"], blobs[3:], CAPTIONS[3:], [{"label": 3}])


def test_save_to_disk_single_dataset_with_image_paths_and_pil(tmp_path: Path) -> None:
    blobs = _write_images(tmp_path, 2)
    paths = [str(tmp_path / "images" / f"{i}.jpg") for i in range(2)]
    in_memory = Image.new("RGB", (8, 6), (10, 200, 90))  # a decoded image with no file behind it
    opened = Image.open(paths[1])  # a decoded image that remembers its file
    ds = datasets.Dataset.from_dict(
        {
            "image": [paths[0], opened, in_memory],
            "image_description": ["first", "second", "third"],
            "id": [7, 8, 9],
        },
        features=datasets.Features(
            {"image": datasets.Image(), "image_description": datasets.Value("string"), "id": datasets.Value("int64")}
        ),
    )
    opened.close()
    ds.save_to_disk(str(tmp_path / "single"))

    splits = open_splits(dataset_name=str(tmp_path / "single"))
    assert list(splits) == ["train"]
    source = splits["train"]
    records = list(source)
    assert [r.id for r in records] == ["7", "8", "9"]  # "id" column used when there is no "instance_id"
    assert [r.image for r in records[:2]] == blobs
    # The in-memory image was stored as an encoded file by datasets; the source returns those bytes unchanged.
    assert Image.open(io.BytesIO(records[2].image)).tobytes() == in_memory.tobytes()
    assert source.captions() == ["first", "second", "third"]
    assert pickle.loads(pickle.dumps(source))[2] == records[2]


def test_arrow_source_generated_ids_and_row_image_values(tmp_path: Path) -> None:
    blobs = _write_images(tmp_path, 3)
    # No Image feature: a raw-bytes column, a {bytes, path} struct column and a relative path column.
    ds = datasets.Dataset.from_dict(
        {
            "raw": blobs,
            "struct": [{"bytes": None, "path": f"images/{i}.jpg"} for i in range(3)],
            "path": [f"images/{i}.jpg" for i in range(3)],
            "caption": CAPTIONS[:3],
        }
    )
    for column in ("raw", "struct", "path"):
        source = ArrowSource(
            ds, name="test", image_column=column, caption_column="caption", split="dev", base_dirs=[(0, str(tmp_path))]
        )
        _check_source(source, ["dev-0", "dev-1", "dev-2"], blobs, CAPTIONS[:3], [{}, {}, {}])


# ------------------------------------------------------------------------------------------------ parquet


def _hf_parquet(path: Path, blobs: list[bytes], captions: list[str], ids: list[str]) -> None:
    """A parquet file as the hub writes it: an Image feature recorded in the schema metadata."""
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in blobs], "image_description": captions, "instance_id": ids},
        features=datasets.Features(
            {
                "image": datasets.Image(),
                "image_description": datasets.Value("string"),
                "instance_id": datasets.Value("string"),
            }
        ),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path))


def test_parquet_folder_split_from_file_names(tmp_path: Path) -> None:
    blobs = _write_images(tmp_path, 4)
    root = tmp_path / "pq"
    _hf_parquet(root / "data" / "train-00000-of-00002.parquet", blobs[:2], CAPTIONS[:2], ["a", "b"])
    _hf_parquet(root / "data" / "train-00001-of-00002.parquet", blobs[2:3], CAPTIONS[2:3], ["c"])
    _hf_parquet(root / "data" / "validation-00000-of-00001.parquet", blobs[3:], CAPTIONS[3:], ["d"])
    (root / ".cache").mkdir()
    (root / ".cache" / "junk.parquet").write_bytes(b"not parquet")  # hidden folders are skipped

    splits = open_splits(dataset_name=str(root), cache_dir=str(tmp_path / "hf_cache"))
    assert sorted(splits) == ["train", "validation"]
    _check_source(splits["train"], ["a", "b", "c"], blobs[:3], CAPTIONS[:3], None)
    _check_source(splits["validation"], ["d"], blobs[3:], CAPTIONS[3:], None)


def test_parquet_folder_split_from_folders_with_plain_arrow_columns(tmp_path: Path) -> None:
    blobs = _write_images(tmp_path / "pq" / "test", 3)
    root = tmp_path / "pq"
    # Plain parquet (no datasets metadata): a {bytes, path} struct in train, relative path strings in test.
    struct = pa.array([{"bytes": b, "path": None} for b in blobs[:2]])
    pq.write_table(pa.table({"image": struct, "image_description": CAPTIONS[:2]}), _mk(root / "train" / "0.parquet"))
    pq.write_table(
        pa.table({"image": ["images/2.jpg"], "image_description": [CAPTIONS[2]]}), _mk(root / "test" / "part-0.parquet")
    )

    splits = open_splits(dataset_name=str(root), cache_dir=str(tmp_path / "hf_cache"))
    assert sorted(splits) == ["test", "train"]
    _check_source(splits["train"], ["train-0", "train-1"], blobs[:2], CAPTIONS[:2], None)
    _check_source(splits["test"], ["test-0"], blobs[2:], CAPTIONS[2:3], None)  # path relative to the parquet file


def test_parquet_folder_without_split_names_is_train_and_data_dir(tmp_path: Path) -> None:
    blobs = _write_images(tmp_path, 2)
    _hf_parquet(tmp_path / "root" / "sub" / "everything.parquet", blobs, CAPTIONS[:2], ["x", "y"])
    splits = open_splits(dataset_name=str(tmp_path / "root"), data_dir="sub", cache_dir=str(tmp_path / "c"))
    assert list(splits) == ["train"]
    _check_source(splits["train"], ["x", "y"], blobs, CAPTIONS[:2], None)


def _mk(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


def test_parquet_files_glob_and_list(tmp_path: Path) -> None:
    blobs = _write_images(tmp_path, 4)
    for i in range(3):
        _hf_parquet(tmp_path / "shards" / f"train-{i}.parquet", blobs[i : i + 1], CAPTIONS[i : i + 1], [f"t{i}"])
    _hf_parquet(tmp_path / "val.parquet", blobs[3:], CAPTIONS[3:], ["v0"])

    splits = open_splits(
        train_file=str(tmp_path / "shards" / "train-*.parquet"),
        validation_file=f"{tmp_path / 'val.parquet'}",
        test_file=f"{tmp_path / 'shards' / 'train-2.parquet'}, {tmp_path / 'shards' / 'train-0.parquet'}",
        cache_dir=str(tmp_path / "hf_cache"),
    )
    assert sorted(splits) == ["test", "train", "validation"]
    _check_source(splits["train"], ["t0", "t1", "t2"], blobs[:3], CAPTIONS[:3], None)
    _check_source(splits["validation"], ["v0"], blobs[3:], CAPTIONS[3:], None)
    _check_source(splits["test"], ["t2", "t0"], [blobs[2], blobs[0]], [CAPTIONS[2], CAPTIONS[0]], None)


# ----------------------------------------------------------------------------------- JSON lines / CSV + images


def test_jsonl_with_image_folder_resolves_paths_per_file(tmp_path: Path) -> None:
    # Two caption files in different folders, each listing images/0.jpg relative to itself.
    blobs_a = _write_images(tmp_path / "a", 2, offset=0)
    blobs_b = _write_images(tmp_path / "b", 1, offset=2)
    for folder, n, first in (("a", 2, 0), ("b", 1, 2)):
        lines = [
            {"image": f"images/{i}.jpg", "image_description": CAPTIONS[first + i], "caption_choices": ["x", "y"]}
            for i in range(n)
        ]
        (tmp_path / folder / "captions.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")

    splits = open_splits(
        train_file=f"{tmp_path}/{{a,b}}/captions.jsonl",
        extra_columns=["caption_choices", "label"],
        cache_dir=str(tmp_path / "hf_cache"),
    )
    _check_source(
        splits["train"],
        ["train-0", "train-1", "train-2"],
        blobs_a + blobs_b,
        CAPTIONS[:3],
        [{"caption_choices": ["x", "y"]}] * 3,
    )


def test_dataset_name_takes_the_files_forms_too(tmp_path: Path) -> None:
    # A folder of jsonl files split by name (image paths relative to each file, not to the working directory), one
    # file, and a pattern: the forms --train_file takes.
    blobs = _write_images(tmp_path / "data", 3)
    for split, rows in (("train", range(2)), ("test", range(2, 3))):
        lines = [{"image": f"images/{i}.jpg", "image_description": CAPTIONS[i]} for i in rows]
        (tmp_path / "data" / f"{split}.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    cache = str(tmp_path / "hf_cache")
    splits = open_splits(dataset_name=str(tmp_path / "data"), cache_dir=cache)
    assert sorted(splits) == ["test", "train"]
    _check_source(splits["train"], ["train-0", "train-1"], blobs[:2], CAPTIONS[:2], None)
    _check_source(splits["test"], ["test-0"], blobs[2:], CAPTIONS[2:3], None)
    one = open_splits(dataset_name=str(tmp_path / "data" / "test.jsonl"), cache_dir=cache)
    _check_source(one["train"], ["train-0"], blobs[2:], CAPTIONS[2:3], None)
    pattern = open_splits(dataset_name=str(tmp_path / "data" / "*.jsonl"), cache_dir=cache)
    assert len(pattern["train"]) == 3


def test_json_array_file(tmp_path: Path) -> None:
    blobs = _write_images(tmp_path, 2)
    rows = [{"image": f"images/{i}.jpg", "image_description": CAPTIONS[i], "id": f"j{i}"} for i in range(2)]
    (tmp_path / "val.json").write_text(json.dumps(rows))
    splits = open_splits(validation_file=str(tmp_path / "val.json"), cache_dir=str(tmp_path / "hf_cache"))
    _check_source(splits["validation"], ["j0", "j1"], blobs, CAPTIONS[:2], None)


def test_csv_with_image_folder_and_missing_caption(tmp_path: Path) -> None:
    blobs = _write_images(tmp_path, 3)
    with open(tmp_path / "captions.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "caption", "key"])
        writer.writerows([["images/0.jpg", CAPTIONS[0], "k0"], ["images/1.jpg", "", "k1"], ["images/2.jpg", "z", "k2"]])

    splits = open_splits(
        train_file=str(tmp_path / "captions.csv"),
        image_column="file",
        caption_column="caption",
        id_column="key",
        cache_dir=str(tmp_path / "hf_cache"),
    )
    _check_source(splits["train"], ["k0", "k1", "k2"], blobs, [CAPTIONS[0], None, "z"], None)


# ----------------------------------------------------------------------------------------------- WebDataset


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_webdataset_txt_captions_brace_shards(tmp_path: Path) -> None:
    blobs = [_jpeg(c) for c in COLOURS]
    _write_tar(
        tmp_path / "train-000.tar",
        [("s0.jpg", blobs[0]), ("s0.txt", b"a red square\n"), ("dir/s1.png", blobs[1]), ("dir/s1.txt", b"")],
    )
    _write_tar(tmp_path / "train-001.tar", [("s2.txt", CAPTIONS[2].encode()), ("s2.jpeg", blobs[2])])

    splits = open_splits(train_file=str(tmp_path / "train-{000..001}.tar"))
    source = splits["train"]
    assert isinstance(source, TarSource)
    assert set(source.column_names) == {"jpg", "txt", "png", "jpeg"}
    _check_source(source, ["s0", "dir/s1", "s2"], blobs[:3], [CAPTIONS[0], "", CAPTIONS[2]], [{}, {}, {}])


def test_webdataset_json_captions_and_extras(tmp_path: Path) -> None:
    blobs = [_jpeg(c) for c in COLOURS]
    members = []
    for i in range(3):
        meta = {"image_description": CAPTIONS[i], "caption_choices": ["p", "q"], "other": 1}
        members += [(f"k{i}.webp", blobs[i]), (f"k{i}.json", json.dumps(meta).encode()), (f"k{i}.cls", b"%d" % i)]
    _write_tar(tmp_path / "val.tar", members)

    splits = open_splits(validation_file=str(tmp_path / "*.tar"), extra_columns=["caption_choices", "cls", "label"])
    extra = [{"caption_choices": ["p", "q"], "cls": i} for i in range(3)]
    _check_source(splits["validation"], ["k0", "k1", "k2"], blobs[:3], CAPTIONS[:3], extra)


def test_webdataset_image_column_picks_member(tmp_path: Path) -> None:
    jpg, png = _jpeg(COLOURS[0]), _jpeg(COLOURS[1])
    _write_tar(tmp_path / "x.tar", [("a.jpg", jpg), ("a.png", png), ("a.caption", b"hello")])
    source = open_splits(train_file=str(tmp_path / "x.tar"), image_column="png", caption_column="caption")["train"]
    assert source[0].image == png
    assert source[0].caption == "hello"
    assert open_splits(train_file=str(tmp_path / "x.tar"), caption_column="caption")["train"][0].image == jpg


@pytest.mark.parametrize("reader", ["map-style", "stream"])
def test_webdataset_columns_named_on_purpose_must_exist_and_defaults_find_the_common_members(
    tmp_path: Path, reader: str
) -> None:
    from vlfit.data.stream import ShardReader
    from vlfit.data.webdataset import WebDatasetLayout

    jpg = _jpeg(COLOURS[0])
    shard = tmp_path / "x.tar"
    _write_tar(shard, [("a.jpg", jpg), ("a.txt", b"from txt"), ("a.json", b'{"caption": "from json", "n": 1}')])

    def first(**columns: str) -> Record:
        if reader == "map-style":
            return open_splits(train_file=str(shard), **columns)["train"][0]
        ((_, record),) = ShardReader(WebDatasetLayout(**columns), retries=0).samples(str(shard))
        return record

    for flag, value in (("caption_column", "title"), ("image_column", "png")):
        with pytest.raises(DataError, match=rf"--{flag} '{value}': shard .*x\.tar has no '\.{value}' member.*"
                                            r"\['jpg', 'json', 'txt'\]"):  # fmt: skip
            first(**{flag: value})  # not the .txt member, nor the .jpg one, in its place
    assert first(caption_column="caption").caption == "from json"  # a .json key
    default = first(caption_column="image_description", image_column="image")  # the flags' defaults
    assert (default.caption, default.image) == ("from txt", jpg)


def test_webdataset_reads_after_fork_and_in_dataloader_workers(tmp_path: Path) -> None:
    blobs = [_jpeg(c) for c in COLOURS]
    _write_tar(tmp_path / "s.tar", [m for i, b in enumerate(blobs) for m in ((f"{i}.jpg", b), (f"{i}.txt", b"c"))])
    source = open_splits(train_file=str(tmp_path / "s.tar"))["train"]
    assert source[0].image == blobs[0]  # the parent opens its descriptor before forking

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: read every record through the inherited source
        try:
            ok = [source[i].image for i in range(len(source))] == blobs
            os.write(write_end, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write_end)
    assert os.read(read_end, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(read_end)
    assert source[3].image == blobs[3]  # the child closing its copies did not disturb the parent

    subset = source.select([1])
    del subset  # a dropped subset must not close the parent's descriptors
    assert source[1].image == blobs[1]

    torch_data = pytest.importorskip("torch.utils.data")
    loader = torch_data.DataLoader(
        source,
        batch_size=2,
        num_workers=2,
        collate_fn=lambda batch: [r.image for r in batch],
        multiprocessing_context="fork",
    )
    assert [b for batch in loader for b in batch] == blobs


def test_webdataset_errors(tmp_path: Path) -> None:
    _write_tar(tmp_path / "bad.tar", [("a.jpg", b"x"), ("a.txt", b"t"), ("b.txt", b"no image")])
    with pytest.raises(ValueError, match=r"sample 'b' in shard .*bad\.tar has no image member.*\['txt'\]"):
        open_splits(train_file=str(tmp_path / "bad.tar"))

    _write_tar(tmp_path / "nocap.tar", [("a.jpg", b"x"), ("a.cls", b"1")])
    with pytest.raises(ValueError, match=r"no caption found.*\['jpg', 'cls'\]"):
        open_splits(train_file=str(tmp_path / "nocap.tar"))

    _write_tar(tmp_path / "wrongkey.tar", [("a.jpg", b"x"), ("a.json", b'{"words": "c", "url": "u"}')])
    with pytest.raises(ValueError, match=r"caption key 'image_description' not found.*\['url', 'words'\]"):
        open_splits(train_file=str(tmp_path / "wrongkey.tar"))
    assert open_splits(train_file=str(tmp_path / "wrongkey.tar"), caption_column="words")["train"][0].caption == "c"

    (tmp_path / "gz.tar").write_bytes(b"\x1f\x8b" + b"\0" * 600)
    with pytest.raises(ValueError, match=r"cannot index tar shard .*gz\.tar"):
        open_splits(train_file=str(tmp_path / "gz.tar"))


# ----------------------------------------------------------------------------------------------------- hub


def test_hub_arguments_are_passed_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = [_jpeg(c) for c in COLOURS[:2]]
    calls: list[tuple[tuple, dict]] = []
    real_load_dataset = datasets.load_dataset

    def fake_load_dataset(*args: object, **kwargs: object) -> datasets.DatasetDict:
        if args[0] in ("json", "csv", "parquet"):  # local files still load for real
            return real_load_dataset(*args, **kwargs)
        calls.append((args, kwargs))
        ds = datasets.Dataset.from_dict(
            {"image": [{"bytes": b, "path": None} for b in blobs], "text": CAPTIONS[:2], "instance_id": ["h0", "h1"]},
            features=datasets.Features(
                {"image": datasets.Image(), "text": datasets.Value("string"), "instance_id": datasets.Value("string")}
            ),
        )
        return datasets.DatasetDict({"train": ds, "validation": ds.select([1])})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    splits = open_splits(
        dataset_name="org/name",
        dataset_config_name="cfg",
        dataset_revision="v1.0",
        data_dir="sub",
        cache_dir=str(tmp_path / "cache"),
        token="tok",
        caption_column="text",
    )
    assert calls == [
        (
            ("org/name", "cfg"),
            {"revision": "v1.0", "cache_dir": str(tmp_path / "cache"), "token": "tok", "data_dir": "sub"},
        )
    ]
    assert sorted(splits) == ["train", "validation"]
    _check_source(splits["train"], ["h0", "h1"], blobs, CAPTIONS[:2], None)
    _check_source(splits["validation"], ["h1"], blobs[1:], CAPTIONS[1:2], None)

    # Files given alongside a hub dataset replace that split.
    blob = _write_images(tmp_path, 1)
    (tmp_path / "v.jsonl").write_text(json.dumps({"image": "images/0.jpg", "text": "local"}) + "\n")
    mixed = open_splits(
        dataset_name="org/name",
        validation_file=str(tmp_path / "v.jsonl"),
        caption_column="text",
        cache_dir=str(tmp_path),
    )
    assert calls[-1] == (
        ("org/name", None),
        {"revision": None, "cache_dir": str(tmp_path), "token": None, "data_dir": None},
    )
    assert mixed["validation"][0].image == blob[0]
    assert len(mixed["train"]) == 2

    # A local folder that is neither save_to_disk output nor parquet is left to datasets.load_dataset.
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "README.md").write_text("---\nconfigs: []\n---\n")
    open_splits(dataset_name=str(tmp_path / "repo"), caption_column="text")
    assert calls[-1][0] == (str(tmp_path / "repo"), None)


# --------------------------------------------------------------------------------------------------- errors


def test_missing_columns_name_split_and_list_columns(tmp_path: Path) -> None:
    _write_images(tmp_path, 1)
    (tmp_path / "c.jsonl").write_text(json.dumps({"img": "images/0.jpg", "text": "t"}) + "\n")
    cache = str(tmp_path / "hf_cache")
    with pytest.raises(
        ValueError, match=r"split 'train' \(.*c\.jsonl\): image column 'image' not found.*\['img', 'text'\]"
    ):
        open_splits(train_file=str(tmp_path / "c.jsonl"), cache_dir=cache)
    # No image_description column: text, a common caption column, is read as the default one.
    assert (
        open_splits(train_file=str(tmp_path / "c.jsonl"), image_column="img", cache_dir=cache)["train"][0].caption
        == "t"
    )
    with pytest.raises(ValueError, match=r"id column 'uid' not found"):
        open_splits(train_file=str(tmp_path / "c.jsonl"), image_column="img", caption_column="text", id_column="uid")

    numbers = datasets.Dataset.from_dict({"image": [b"x"], "caps": [[1, 2]]})  # lists of texts are captions
    with pytest.raises(ValueError, match=r"caption column 'caps' holds List.*one text value per row, or a list"):
        ArrowSource(numbers, name="multi", image_column="image", caption_column="caps")


def test_an_image_column_of_text_or_numbers_is_refused_when_the_split_opens(tmp_path: Path) -> None:
    """Before, every row of such a column failed only once training read it (each a bad sample)."""
    blobs = _write_images(tmp_path, 1)
    rows = {"image": [blobs[0]], "caption": ["a red square on grey"], "n": [3], "path": ["images/0.jpg"]}
    split = datasets.Dataset.from_dict(rows)
    text = r"^split: --image_column 'caption' holds text that names no file \(first row: 'a red square on grey'\)"
    with pytest.raises(DataError, match=text + r", not images; .*its columns: image, caption"):
        ArrowSource(split, name="split", image_column="caption", caption_column="caption")
    with pytest.raises(DataError, match=r"--image_column 'n' holds Value\('int64'\), not images"):
        ArrowSource(split, name="split", image_column="n", caption_column="caption")
    # Bytes, image files, and names of image files that are missing (that row's bad sample) all open.
    assert ArrowSource(split, name="split", image_column="image", caption_column="caption")[0].image == blobs[0]
    here = ArrowSource(
        split, name="split", image_column="path", caption_column="caption", base_dirs=[(0, str(tmp_path))]
    )
    assert here[0].image == blobs[0]
    gone = datasets.Dataset.from_dict({"path": ["images/gone.jpg"], "caption": ["c"]})
    ArrowSource(gone, name="split", image_column="path", caption_column="caption")


def test_common_column_names_are_read_as_the_defaults_are_and_explicit_flags_win(tmp_path: Path) -> None:
    blobs = _write_images(tmp_path, 2)
    with open(tmp_path / "hf.csv", "w", newline="") as f:  # imagefolder's metadata names
        csv.writer(f).writerows([["file_name", "text"], ["images/0.jpg", "a red square"], ["images/1.jpg", "green"]])
    coco = [{"image": f"images/{i}.jpg", "caption": CAPTIONS[i], "text": "not this"} for i in range(2)]
    (tmp_path / "coco.jsonl").write_text("".join(json.dumps(row) + "\n" for row in coco))
    cache = str(tmp_path / "hf_cache")
    hf = open_splits(train_file=str(tmp_path / "hf.csv"), cache_dir=cache)["train"]
    assert [r.image for r in hf] == blobs and hf.captions() == ["a red square", "green"]
    coco_source = open_splits(train_file=str(tmp_path / "coco.jsonl"), cache_dir=cache)["train"]
    assert coco_source.captions() == CAPTIONS[:2]  # caption comes before text in the list of common names
    assert (
        open_splits(train_file=str(tmp_path / "coco.jsonl"), caption_column="text", cache_dir=cache)["train"].captions()
        == ["not this"] * 2
    )
    with pytest.raises(DataError, match=r"caption column 'caption' not found; available columns: \['file_name', "
                                        r"'text'\]\. Name the caption column with --caption_column"):  # fmt: skip
        open_splits(train_file=str(tmp_path / "hf.csv"), caption_column="caption", cache_dir=cache)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"pass --dataset_name .* or --train_file"):
        open_splits()
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match=r"data\.txt.*\['\.parquet', '\.jsonl', '\.json', '\.csv', '\.tar'\]"):
        open_splits(train_file=str(tmp_path / "data.txt"))
    with pytest.raises(FileNotFoundError, match=r"no files match the pattern '.*nothing-\*\.tar'"):
        open_splits(train_file=str(tmp_path / "nothing-*.tar"))
    with pytest.raises(FileNotFoundError, match=r"file not found: '.*missing\.parquet'"):
        open_splits(validation_file=str(tmp_path / "missing.parquet"))
    (tmp_path / "a.csv").write_text("image,image_description\n")
    (tmp_path / "b.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"share a format.*\['\.csv', '\.jsonl'\]"):
        open_splits(train_file=f"{tmp_path / 'a.csv'},{tmp_path / 'b.jsonl'}")
    (tmp_path / "c.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"several formats \(\.csv, \.jsonl, \.parquet\)|c\.parquet: the file is emp"):
        open_splits(dataset_name=str(tmp_path))


def test_an_empty_data_file_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "empty.csv").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.csv: the file is empty \(0 bytes\).*header line naming the columns"):
        open_splits(validation_file=str(tmp_path / "empty.csv"), cache_dir=str(tmp_path / "hf_cache"))


@pytest.mark.parametrize(("name", "content"), [("head.csv", "image,caption\n\n"), ("blank.jsonl", "\n \n")])
def test_a_data_file_with_no_rows_is_refused_saying_so(tmp_path: Path, name: str, content: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=rf"^{tmp_path / name}: the file has no rows \(a (csv|json) file is "):
        open_splits(train_file=str(tmp_path / name), cache_dir=str(tmp_path / "hf_cache"))


@pytest.mark.parametrize(
    ("marker", "what", "use"),
    [
        ("index_manifest.json", "an index (vlfit retrieve index wrote it)", "search it with vlfit retrieve query"),
        ("config.json", "a model (it holds config.json)", "give it as --model_name_or_path"),
    ],
)
def test_a_model_or_an_index_named_as_a_dataset_is_refused_naming_what_it_is(
    tmp_path: Path, marker: str, what: str, use: str
) -> None:
    (tmp_path / marker).write_text("{}")
    (tmp_path / "shard-00000.json").write_text("[1, 2]")  # json files no reader of rows takes
    with pytest.raises(ConfigError, match=rf"^--dataset_name {tmp_path}: {re.escape(what)}, not a dataset: {use} "):
        open_splits(dataset_name=str(tmp_path), cache_dir=str(tmp_path / "hf_cache"))


# ------------------------------------------------------------------------------------------------ patterns


def test_expand_braces_and_resolve_files(tmp_path: Path) -> None:
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_braces("{a,b}-{8..10}") == ["a-8", "a-9", "a-10", "b-8", "b-9", "b-10"]
    assert expand_braces("plain{x}.tar") == ["plain{x}.tar"]
    for name in ("s-0.tar", "s-1.tar", "t.tar"):
        (tmp_path / name).write_bytes(b"")
    spec = f"{tmp_path}/s-*.tar, {tmp_path}/{{t,s-0}}.tar"
    assert resolve_files(spec) == [str(tmp_path / n) for n in ("s-0.tar", "s-1.tar", "t.tar")]
    with pytest.raises(FileNotFoundError, match=r"s-2\.tar"):
        resolve_files(f"{tmp_path}/s-{{0..2}}.tar")


def test_resolve_files_lists_with_braces_padding_and_globs(tmp_path: Path) -> None:
    for name in ("shard-000.tar", "shard-001.tar", "shard-002.tar", "a.tar", "b.tar", "c.tar", "x-1.tar", "x-2.tar"):
        (tmp_path / name).write_bytes(b"")
    d = tmp_path
    # A comma inside braces is an alternative of that brace; a comma outside separates the list.
    spec = f"{d}/{{b,a}}.tar,{d}/shard-{{000..001}}.tar, {d}/x-*.tar,{d}/c.tar"
    names = ["b.tar", "a.tar", "shard-000.tar", "shard-001.tar", "x-1.tar", "x-2.tar", "c.tar"]
    assert resolve_files(spec) == [str(d / n) for n in names]
    assert resolve_files(f"{d}/{{shard-{{000..002..2}},c}}.tar") == [
        str(d / n) for n in ("shard-000.tar", "shard-002.tar", "c.tar")
    ]
    assert resolve_files(f"{d}/a.tar,,{d}/a.tar, ") == [str(d / "a.tar")]  # blank parts and duplicates dropped
    with pytest.raises(FileNotFoundError, match=r"no files match the pattern '.*/y-\*\.tar'"):
        resolve_files(f"{d}/a.tar,{d}/{{x,y}}-*.tar")
    with pytest.raises(FileNotFoundError, match=r"no files given in ' , '"):
        resolve_files(" , ")


def test_resolve_files_with_braces_that_do_not_pair(tmp_path: Path) -> None:
    (tmp_path / "odd{name.tar").write_bytes(b"")
    assert resolve_files(str(tmp_path / "odd{name.tar")) == [str(tmp_path / "odd{name.tar")]
    with pytest.raises(FileNotFoundError, match=r"braces do not pair up"):
        resolve_files(f"{tmp_path}/a.tar,{tmp_path}/s-{{0..2.tar")


def test_split_rules_for_parquet_folders(tmp_path: Path) -> None:
    for rel in ("train-0.parquet", "val/a.parquet", "extra-00000-of-00001.parquet", "custom/x.parquet"):
        _mk(tmp_path / rel)
        (tmp_path / rel).write_bytes(b"")
    splits = locations._data_file_splits(str(tmp_path))
    assert {k: [os.path.relpath(p, tmp_path) for p in v] for k, v in splits.items()} == {
        "train": ["train-0.parquet"],
        "val": [os.path.join("val", "a.parquet")],
        "extra": ["extra-00000-of-00001.parquet"],
        "custom": [os.path.join("custom", "x.parquet")],
    }


def test_a_class_label_caption_column_reads_as_its_names_and_no_caption_column_as_the_ids(tmp_path: Path) -> None:
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(jpeg, format="JPEG")
    features = datasets.Features({"image": datasets.Image(), "animal": datasets.ClassLabel(names=["cat", "dog"]),
                                  "id": datasets.Value("string")})  # fmt: skip
    rows = {"image": [{"bytes": jpeg.getvalue(), "path": None}] * 3, "animal": [1, 0, 1], "id": ["a", "b", "c"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(tmp_path / "d")
    labelled = open_splits(dataset_name=str(tmp_path / "d"), caption_column="animal", caption_role="label")["train"]
    assert labelled.captions() == ["dog", "cat", "dog"] and labelled.select([1])[0].caption == "cat"
    assert labelled.class_names == ["cat", "dog"]
    images_only = open_splits(dataset_name=str(tmp_path / "d"), caption_column=None)["train"]
    assert images_only.captions() == ["a", "b", "c"] and images_only[2].caption == "c"
    with pytest.raises(ValueError, match=r"label column 'kind' not found.*Name the label column with --label_column"):
        open_splits(dataset_name=str(tmp_path / "d"), caption_column="kind", caption_role="label")


def test_every_kind_of_source_gives_its_record_ids_and_image_ids_without_reading_an_image(tmp_path: Path) -> None:
    from vlfit.data.records import BadRecordError
    from vlfit.data.sources import ImageFilesSource, ImageFolderSource, MemorySource, synthetic_source

    def check(source: ImageTextSource, unreadable: int | None = None) -> None:
        """ids() and image_ids() are its records' (read here, but for ``unreadable``, whose image is gone)."""
        ids, image_ids = source.ids(), source.image_ids()
        assert len(ids) == len(image_ids) == len(source)
        for i in range(len(source)):
            if i == unreadable:
                with pytest.raises(BadRecordError):
                    source[i]
                continue
            assert (ids[i], image_ids[i]) == (source[i].id, source[i].image_id)

    blobs = _write_images(tmp_path, 3)
    rows = [{"image": f"images/{i}.jpg", "caption": CAPTIONS[i], "id": f"r{i}", "group": f"g{i % 2}"} for i in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))  # images/3.jpg is missing
    split = open_splits(train_file=str(tmp_path / "data.jsonl"), caption_column="caption", image_id_column="group")
    check(split["train"], unreadable=3)
    assert split["train"].image_ids() == ["g0", "g1", "g0", "g1"]
    assert split["train"].select([3, 0]).ids() == ["r3", "r0"]
    table = {"image": [{"bytes": b, "path": None} for b in blobs], "caption": [["x", "y"], [], ["z"]]}
    lists = ArrowSource(
        datasets.Dataset.from_dict(table), name="lists", image_column="image", caption_column="caption", split="val"
    )
    check(lists)
    assert lists.ids() == ["val-0#0", "val-0#1", "val-2#0"] and lists.select([2, 1]).ids() == ["val-2#0", "val-0#1"]

    members = []
    for i in range(3):  # the image member last, so that cutting the shard short cuts only the last image
        members += [
            (f"k{i}.json", json.dumps({"txt": CAPTIONS[i], "photo": f"p{i}"}).encode()),
            (f"k{i}.jpg", blobs[i]),
        ]
    _write_tar(tmp_path / "shard.tar", members)
    tar = TarSource([str(tmp_path / "shard.tar")], name="shard", caption_column="txt", image_id_column="photo")
    with open(tmp_path / "shard.tar", "r+b") as f:
        f.truncate(int(tar._image_loc[2, 0]) + 10)
    check(tar, unreadable=2)
    assert tar.select([2, 0]).image_ids() == ["p2", "p0"]

    folder = ImageFolderSource(str(tmp_path / "images"))
    (tmp_path / "images" / "1.jpg").unlink()
    check(folder, unreadable=1)
    assert folder.image_ids() == [str(tmp_path / "images" / f"{i}.jpg") for i in range(3)]
    check(ImageFilesSource([str(tmp_path / "images" / "0.jpg")]))
    check(MemorySource([Record("m0", blobs[0], "a", image_id="i0"), Record("m1", blobs[1], "b")]).select([1, 0, 1]))
    check(synthetic_source(2))
