"""--bad_sample_policy at the dataset, collator and device stage: skipped samples are replaced (training) or
left out (evaluation) and reported with their ids; ``raise`` names the sample and the reason."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from torch.utils.data import DataLoader

from tests.robustness.bad_corpus import ListSource, bad_images, captions, valid_images
from vlfit.data.bad_samples import (
    MAX_SUBSTITUTE_ATTEMPTS,
    BadSampleError,
    clean_caption,
    describe_error,
    substitute_index,
)
from vlfit.data.batch import DEVICE, BadSample, Batch
from vlfit.data.dataset import ImageTextCollator, ImageTextDataset
from vlfit.data.device_stage import DeviceStage
from vlfit.data.image_transforms import EncodedImage, FastImageTransform, PassThroughEncoded, ReferenceImageTransform
from vlfit.data.records import Record
from vlfit.data.sources import ArrowSource, open_splits
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from vlfit.models.tokenizer import train_caption_tokenizer

SIZE = 32
MAX_SEQ = 32
PLAIN = "a red square above a blue circle"


def dirty_records() -> tuple[list[Record], dict[str, str]]:
    """Valid pairs interleaved with every bad image and every bad caption; returns records and {bad id: regex}."""
    valid = valid_images()
    records = [Record(id=f"ok-{i}", image=valid[i % len(valid)].data, caption=f"{PLAIN} {i}") for i in range(16)]
    bad: dict[str, str] = {}
    for image in bad_images():
        records.append(Record(id=f"img-{image.name}", image=image.data, caption=PLAIN))
        bad[f"img-{image.name}"] = image.bad_reason or ""
    for caption in captions():
        sample_id = f"cap-{caption.name}"
        records.append(Record(id=sample_id, image=valid[0].data, caption=caption.value))  # type: ignore[arg-type]
        if caption.bad_reason is not None:
            bad[sample_id] = caption.bad_reason
    order = sorted(range(len(records)), key=lambda i: substitute_index(i, 1, 1000))  # interleave, reproducibly
    return [records[i] for i in order], bad


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_caption_tokenizer([f"{PLAIN} {i}" for i in range(50)] + ["a cat on a long caption"] * 10, 512)


def _dataset(records: list[Record], pipeline: str, **kwargs: Any) -> ImageTextDataset:
    transforms = {
        "fast": FastImageTransform(SIZE),
        "reference": ReferenceImageTransform(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
        "device": PassThroughEncoded(),
    }
    transform = transforms[pipeline]
    return ImageTextDataset(ListSource(records), transform, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- skip: training


@pytest.mark.parametrize(("pipeline", "num_workers"), [("reference", 0), ("fast", 0), ("fast", 2), ("device", 0)])
def test_skip_keeps_batch_size_and_reports_every_bad_sample(tokenizer: Any, pipeline: str, num_workers: int) -> None:
    records, bad = dirty_records()
    loader = DataLoader(
        _dataset(records, pipeline),
        batch_size=5,
        num_workers=num_workers,
        collate_fn=ImageTextCollator(tokenizer, MAX_SEQ),
    )
    stage = DeviceStage(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, bad_sample_policy="skip")
    # Device decode: the worker's header check catches everything but a JPEG corrupt after its header, which
    # only decoding finds: that one is dropped from its batch at device decode instead.
    late = {"img-jpeg_truncated"} if pipeline == "device" else set()
    rows, reported, device_reported = 0, {}, {}
    for batch in loader:
        expected_rows = min(5, len(records) - rows)
        assert len(batch) == expected_rows == batch["input_ids"].shape[0]
        rows += expected_rows
        assert not set(batch.sample_ids) & (set(bad) - late), "a bad sample reached a batch"
        reported.update((b.id, b.reason) for b in batch.bad_samples)
        staged = stage(batch, torch.device("cpu"))
        device_reported.update((b.id, b.reason) for b in staged.bad_samples if b.stage == DEVICE)
        n = len(staged)
        assert not set(staged.sample_ids) & set(bad)
        assert staged["pixel_values"].shape == (n, 3, SIZE, SIZE) and staged["input_ids"].shape[0] == n
    assert rows == len(records)
    assert set(reported) == set(bad) - late
    assert set(device_reported) == late
    for sample_id, reason in {**reported, **device_reported}.items():
        assert re.search(bad[sample_id], reason), (sample_id, reason)


def test_substitutes_are_deterministic_and_bad_chains_are_followed() -> None:
    records, bad = dirty_records()
    first, second = _dataset(records, "fast"), _dataset(records, "fast")
    for index, record in enumerate(records):
        a, b = first[index], second[index]
        assert a.id == b.id and torch.equal(a.image, b.image)
        if record.id in bad:
            assert a.bad_samples[0].id == record.id and a.id not in bad
            # The substitute is the first usable sample of the fixed sequence of candidates.
            candidates = [substitute_index(index, k, len(records)) for k in range(1, MAX_SUBSTITUTE_ATTEMPTS + 1)]
            first_good = next(c for c in candidates if records[c].id not in bad)
            assert a.id == records[first_good].id and a.position == index
            assert len(a.bad_samples) == 1 + candidates.index(first_good)
        else:
            assert a.id == record.id and a.bad_samples == []


def test_substitute_index_is_in_range_and_never_the_index_itself() -> None:
    for length in (2, 3, 17, 1000):
        for index in range(min(length, 50)):
            subs = [substitute_index(index, k, length) for k in range(1, 9)]
            assert all(0 <= s < length and s != index for s in subs)
    assert len({substitute_index(0, k, 1000) for k in range(1, 17)}) > 8  # spread out, not index + 1, + 2 ...
    assert substitute_index(5, 1, 1) == 0


def test_data_that_is_all_bad_stops_with_a_clear_error() -> None:
    records = [Record(id=f"b{i}", image=b"", caption=PLAIN) for i in range(40)]
    with pytest.raises(BadSampleError, match=r"bad sample b3: image is empty.*substitutes.*mostly unreadable"):
        _dataset(records, "fast")[3]


# ---------------------------------------------------------------------------------------------- skip: evaluation


def test_evaluation_leaves_bad_samples_out(tokenizer: Any) -> None:
    records, bad = dirty_records()
    dataset = _dataset(records, "fast", substitute=False)
    collator = ImageTextCollator(tokenizer, MAX_SEQ, keep_columns=("label",))
    batch = collator([dataset[i] for i in range(len(dataset))])
    assert batch.sample_ids == [r.id for r in records if r.id not in bad]
    assert batch["pixel_values"].shape[0] == batch["input_ids"].shape[0] == len(records) - len(bad)
    assert {b.id for b in batch.bad_samples} == bad.keys()
    only_bad = [i for i, r in enumerate(records) if r.id in bad][:3]
    empty = collator([dataset[i] for i in only_bad])
    assert len(empty) == 0 and empty.sample_ids == [] and len(empty.bad_samples) == 3


# ---------------------------------------------------------------------------------------------- raise


@pytest.mark.parametrize("pipeline", ["reference", "fast", "device"])
def test_raise_names_the_sample_the_reason_and_the_way_out(pipeline: str) -> None:
    records, bad = dirty_records()
    dataset = _dataset(records, pipeline, bad_sample_policy="raise")
    seen = 0
    for index, record in enumerate(records):
        if record.id not in bad or (pipeline == "device" and record.id == "img-jpeg_truncated"):
            assert dataset[index].id == record.id
            continue
        with pytest.raises(BadSampleError) as caught:
            dataset[index]
        error = caught.value
        assert error.sample_id == record.id and re.search(bad[record.id], error.reason)
        assert str(error).startswith(f"bad sample {record.id}: ") and "--bad_sample_policy skip" in str(error)
        seen += 1
    assert seen == len(bad) - (pipeline == "device")


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown --bad_sample_policy 'drop'; choose one of: skip, raise"):
        _dataset([], "fast", bad_sample_policy="drop")


# ---------------------------------------------------------------------------------------------- device stage


def _encoded_batch(tokenizer: Any, datas: list[tuple[str, bytes]]) -> Batch:
    text = tokenizer([f"caption of {i}" for i, _ in datas], padding="longest", return_tensors="pt")
    return Batch(
        inputs={"input_ids": text["input_ids"], "attention_mask": text["attention_mask"]},
        sample_ids=[sample_id for sample_id, _ in datas],
        positions=list(range(len(datas))),
        bad_samples=[BadSample("earlier", "caption is empty")],
        encoded_images=[EncodedImage(data, sample_id) for sample_id, data in datas],
        columns={"label": list(range(len(datas)))},
    )


def test_device_stage_skip_drops_the_rows_of_undecodable_images(tokenizer: Any) -> None:
    valid, bad = valid_images(), {image.name: image for image in bad_images()}
    datas = [("a", valid[0].data), ("t", bad["jpeg_truncated"].data), ("b", valid[1].data), ("z", b"")]
    batch = _encoded_batch(tokenizer, datas)
    full_ids = batch["input_ids"].clone()
    stage = DeviceStage(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, bad_sample_policy="skip")
    out = stage(batch, torch.device("cpu"))
    assert out.sample_ids == ["a", "b"] and out.columns["label"] == [0, 2] and out.positions == [0, 2]
    assert torch.equal(out["input_ids"], full_ids[[0, 2]])
    assert out["pixel_values"].shape == (2, 3, SIZE, SIZE) and out.on_device and out.encoded_images is None
    assert out.bad_samples[0] == BadSample("earlier", "caption is empty")  # found in a worker: kept as it was
    assert [(b.id, b.stage) for b in out.bad_samples[1:]] == [("t", DEVICE), ("z", DEVICE)]


def test_device_stage_raise_and_all_bad(tokenizer: Any) -> None:
    truncated = next(i for i in bad_images() if i.name == "jpeg_truncated").data
    raising = DeviceStage(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, bad_sample_policy="raise")
    with pytest.raises(BadSampleError, match=r"bad sample t: cannot decode JPEG.*--bad_sample_policy skip"):
        raising(_encoded_batch(tokenizer, [("a", valid_images()[0].data), ("t", truncated)]), torch.device("cpu"))
    skipping = DeviceStage(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, bad_sample_policy="skip")
    with pytest.raises(BadSampleError, match=r"all 2 images of the batch failed to decode"):
        skipping(_encoded_batch(tokenizer, [("t", truncated), ("u", truncated)]), torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- captions


def test_caption_rules() -> None:
    by_name = {c.name: c for c in captions()}
    for caption in captions():
        if caption.bad_reason is None:
            assert clean_caption(caption.value, "s")
        else:
            with pytest.raises(ValueError, match=f"sample s: {caption.bad_reason}"):
                clean_caption(caption.value, "s")
    fixed = clean_caption(by_name["invalid_utf8"].value, "s")
    assert fixed == "a caf\ufffd on the corner \ufffd\ufffd of the street"
    assert clean_caption(by_name["long_10000"].value, "s") == by_name["long_10000"].value  # not cut here


def test_long_caption_is_truncated_by_the_tokenizer(tokenizer: Any) -> None:
    long = next(c for c in captions() if c.name == "long_10000")
    assert isinstance(long.value, str) and len(long.value) == 10_000
    dataset = _dataset([Record(id="long", image=valid_images()[0].data, caption=long.value)], "fast")
    sample = dataset[0]
    assert sample.bad_samples == [] and sample.caption == long.value
    batch = ImageTextCollator(tokenizer, MAX_SEQ)([sample])
    assert batch["input_ids"].shape == (1, MAX_SEQ) and int(batch["attention_mask"].sum()) == MAX_SEQ


def test_invalid_utf8_captions_are_decoded_with_replacement_in_every_source(tmp_path: Path) -> None:
    raw = b"a caf\xe9 on the corner"
    image = valid_images()[0].data
    table = datasets.Dataset.from_dict(
        {"image": [{"bytes": image, "path": None}], "caption": [raw]},
        features=datasets.Features({"image": datasets.Image(), "caption": datasets.Value("binary")}),
    )
    arrow = ArrowSource(table, name="t", image_column="image", caption_column="caption")
    with tarfile.open(tmp_path / "train-0.tar", "w") as archive:
        for name, data in (("s0.jpg", image), ("s0.txt", raw)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    tar = open_splits(train_file=str(tmp_path / "train-0.tar"))["train"]
    for source in (arrow, tar):
        assert source[0].caption == "a caf\ufffd on the corner"
        assert source.captions() == ["a caf\ufffd on the corner"]
        sample = ImageTextDataset(source, FastImageTransform(SIZE))[0]
        assert sample.bad_samples == [] and sample.caption == "a caf\ufffd on the corner"


# ---------------------------------------------------------------------------------------------- errors


def test_describe_error_splits_vlfit_messages() -> None:
    assert describe_error(ValueError("sample a:b: image is empty (0 bytes)"), "row 3") == (
        "a:b",
        "image is empty (0 bytes)",
    )
    assert describe_error(ValueError("weird"), "row 3") == ("row 3", "weird")
