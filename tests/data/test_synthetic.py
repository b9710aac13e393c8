"""Tests of the synthetic caption matching dataset and the ``make-data`` command."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import re
from collections import deque

import datasets
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image, JpegImagePlugin

from vlfit.atomic_files import FOLDER_RECORD
from vlfit.commands.make_data import main
from vlfit.data import synthetic
from vlfit.data.synthetic import FEATURES, SPLITS, SyntheticConfig, make_dataset, make_record, save_dataset
from vlfit.errors import ConfigError

SMALL = {"min_long_side": 64, "max_long_side": 96}
GROUP = re.compile(
    r"(one|two|three) (red|green|blue|yellow|purple|orange) (circles?|squares?|triangles?|cross(?:es)?) "
    r"(on the left|on the right|at the top|at the bottom|in the center)"
)
UNPLACED_GROUP = re.compile(GROUP.pattern.rsplit(" (", 1)[0])
COUNTS = {"one": 1, "two": 2, "three": 3}
SINGULAR = {"circles": "circle", "squares": "square", "triangles": "triangle", "crosses": "cross"}


def parse(caption: str) -> list[tuple[int, str, str, str]]:
    """Split a caption into (count, colour, kind, region) groups, checking grammar and plural forms."""
    assert caption.endswith("."), caption
    groups = []
    for part in caption[:-1].split(" and "):
        match = GROUP.fullmatch(part)
        assert match, f"not a templated group: {part!r}"
        count, colour, noun, region = match.groups()
        assert (COUNTS[count] == 1) == (noun not in SINGULAR), f"wrong plural in {part!r}"
        groups.append((COUNTS[count], colour, SINGULAR.get(noun, noun), region.split()[-1]))
    assert len(groups) in (1, 2) and len({g[3] for g in groups}) == len(groups), caption
    return groups


def jpeg(record: dict) -> bytes:
    return record["image"]["bytes"]


@pytest.fixture(scope="module")
def small_dataset() -> datasets.DatasetDict:
    return make_dataset(SyntheticConfig(num_samples=12, seed=3, **SMALL), num_proc=1)


def test_schema_and_splits(small_dataset: datasets.DatasetDict) -> None:
    assert list(small_dataset) == list(SPLITS)
    assert {name: split.num_rows for name, split in small_dataset.items()} == {"train": 10, "validation": 1, "test": 1}
    for split in small_dataset.values():
        assert split.features == FEATURES
        assert isinstance(split.features["image"], datasets.Image)
        assert isinstance(split.features["caption_choices"], datasets.List)
        assert split.features["caption_choices"].feature == datasets.Value("string")
    raw = small_dataset["train"].cast_column("image", datasets.Image(decode=False))[0]
    assert raw["image"]["bytes"][:2] == b"\xff\xd8" and raw["image"]["path"] is None
    decoded = small_dataset["train"][0]["image"]
    assert isinstance(decoded, Image.Image) and decoded.format == "JPEG"
    ids = [i for split in small_dataset.values() for i in split["instance_id"]]
    assert len(set(ids)) == 12
    assert ids[0] == make_record(0, SyntheticConfig(num_samples=12, seed=3, **SMALL))["instance_id"]


def test_same_seed_same_bytes_other_seed_differs() -> None:
    config = SyntheticConfig(num_samples=12, **SMALL)
    first, again = make_record(5, config), make_record(5, config)
    assert jpeg(first) == jpeg(again) and first == again
    other_seed = make_record(5, SyntheticConfig(num_samples=12, seed=1, **SMALL))
    assert jpeg(other_seed) != jpeg(first) and other_seed["instance_id"] != first["instance_id"]
    other_index = make_record(6, config)
    assert jpeg(other_index) != jpeg(first)
    captions = [make_record(i, config)["caption_choices"] for i in range(6)]
    captions_seed1 = [
        make_record(i, SyntheticConfig(num_samples=12, seed=1, **SMALL))["caption_choices"] for i in range(6)
    ]
    assert captions != captions_seed1


# Digests of records 0..3 of SyntheticConfig(num_samples=12, seed=3, **SMALL): the text columns, then the JPEG
# bytes. They pin the generator across refactors; the image digest also depends on the numpy and Pillow (libjpeg)
# builds, so a dependency upgrade may legitimately change it (numpy 2.4, Pillow 13.0 here).
PINNED_TEXT_SHA256 = "f15465d54dc555b6390b2df7d98366635361baf14707db99d646d4a3ccfafbd5"
PINNED_IMAGE_SHA256 = "65a63d249bf2f8da07ad045fbed7a4d87bd5def8dc9c6e38b21fbe5c4857e790"


def test_records_match_pinned_digests() -> None:
    config = SyntheticConfig(num_samples=12, seed=3, **SMALL)
    text, images = hashlib.sha256(), hashlib.sha256()
    for index in range(4):
        record = make_record(index, config)
        text.update(json.dumps({k: v for k, v in record.items() if k != "image"}, sort_keys=True).encode())
        images.update(jpeg(record))
    assert text.hexdigest() == PINNED_TEXT_SHA256
    assert images.hexdigest() == PINNED_IMAGE_SHA256


def test_num_proc_gives_identical_tables(small_dataset: datasets.DatasetDict) -> None:
    parallel = make_dataset(SyntheticConfig(num_samples=12, seed=3, **SMALL), num_proc=2)
    for name in SPLITS:
        assert parallel[name].data.table.equals(small_dataset[name].data.table), name


def test_default_size_jpeg_properties() -> None:
    config = SyntheticConfig()
    orientations = set()
    for index in range(8):
        data = jpeg(make_record(index, config))
        image = Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and image.mode == "RGB"
        assert JpegImagePlugin.get_sampling(image) == 2  # 4:2:0
        width, height = image.size
        assert 600 <= max(width, height) <= 1400
        assert 1.0 <= max(width, height) / min(width, height) <= 1.45
        orientations.add(width > height)
        bits_per_pixel = 8 * len(data) / (width * height)
        assert 1.0 <= bits_per_pixel <= 4.0, bits_per_pixel  # textured everywhere, not flat colour
    assert orientations == {True, False}


def _components(mask: np.ndarray, min_area: int) -> list[tuple[float, float]]:
    """Centroids (x, y) of the 4-connected components of a boolean mask with at least min_area pixels."""
    seen = np.zeros_like(mask)
    centroids = []
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        queue, pixels = deque([(y0, x0)]), []
        while queue:
            y, x = queue.popleft()
            pixels.append((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        if len(pixels) >= min_area:
            ys, xs = zip(*pixels, strict=True)
            centroids.append((float(np.mean(xs)), float(np.mean(ys))))
    return centroids


def _chroma_distance(pixels: np.ndarray, colour: str) -> np.ndarray:
    # Grain and shading shift all channels alike, so compare colours with their mean (brightness) removed.
    target = np.array(synthetic.COLOURS[colour])
    return np.abs((pixels - pixels.mean(axis=2, keepdims=True)) - (target - target.mean())).sum(axis=2)


def _region(u: float, v: float) -> str:
    # The documented layout: a center box, and four trapezoids named after the nearest image edge.
    if 0.28 <= u <= 0.72 and 0.28 <= v <= 0.72:
        return "center"
    return min((u, "left"), (1 - u, "right"), (v, "top"), (1 - v, "bottom"))[1]


def test_drawing_matches_caption() -> None:
    """Find every object by colour: the counts and regions per colour must be what the caption says, with regions
    read in the central square, which holds every object (a resize and center crop never cuts one away)."""
    config = SyntheticConfig(num_samples=100, seed=7, min_long_side=320, max_long_side=400)
    for index in range(10):
        record = make_record(index, config)
        groups = parse(record["image_description"])
        image = Image.open(io.BytesIO(jpeg(record))).convert("RGB")
        image = image.resize((image.width // 2, image.height // 2), Image.Resampling.BOX)
        pixels = np.asarray(image, dtype=np.int32)
        short = min(image.size)
        for colour in {g[1] for g in groups}:
            expected = sorted(region for count, c, _, region in groups if c == colour for _ in range(count))
            found = _components(_chroma_distance(pixels, colour) < 60, min_area=int((0.06 * short) ** 2))
            square = [((x - (image.width - short) / 2) / short, (y - (image.height - short) / 2) / short)
                      for x, y in found]  # fmt: skip
            assert all(0 <= u <= 1 and 0 <= v <= 1 for u, v in square), (index, "object outside the center crop")
            regions = sorted(_region(u, v) for u, v in square)
            assert regions == expected, (index, record["image_description"], colour)


def test_choices_are_hard_negatives() -> None:
    config = SyntheticConfig(num_samples=100, **SMALL)
    labels = set()
    for index in range(30):
        record = make_record(index, config)
        choices = record["caption_choices"]
        assert len(choices) == 5 and len(set(choices)) == 5
        assert record["label"] in "ABCDE" and len(record["label"]) == 1
        labels.add(record["label"])
        assert choices["ABCDE".index(record["label"])] == record["image_description"]
        truth = parse(record["image_description"])
        for choice in choices:
            groups = parse(choice)
            assert len(groups) == len(truth)
            # Differences from the truth over the best pairing of groups: one or two attributes (zero for itself).
            diff = min(
                sum(a != b for g, t in zip(perm, truth, strict=True) for a, b in zip(g, t, strict=True))
                for perm in itertools.permutations(groups)
            )
            assert diff <= 2 and (diff == 0) == (choice == record["image_description"]), (choice, truth)
    assert len(labels) >= 4  # the answer position is shuffled


def test_text_alone_gives_chance_accuracy() -> None:
    """Picking the choice most similar to the others (a classic leak of edit-based distractors) must not work."""
    hits = 0
    trials = 1000
    for trial in range(trials):
        _, choices, answer = synthetic.scene_and_choices(np.random.default_rng([11, trial]))
        words = [set(enumerate(choice.split())) for choice in choices]
        scores = [sum(len(w & other) for other in words) for w in words]
        hits += int(np.argmax(scores)) == answer
    assert hits / trials < 0.3


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_save_round_trip(small_dataset: datasets.DatasetDict, tmp_path, fmt: str) -> None:
    paths = save_dataset(small_dataset, str(tmp_path / "out"), format=fmt)
    if fmt == "arrow":
        assert paths == [str(tmp_path / "out")]
        loaded = datasets.load_from_disk(paths[0])
    else:
        assert paths == [str(tmp_path / "out" / f"{name}.parquet") for name in SPLITS]
        files = dict(zip(SPLITS, paths, strict=True))
        loaded = datasets.load_dataset("parquet", data_files=files, cache_dir=str(tmp_path / "cache"))
    for name in SPLITS:
        assert loaded[name].features == FEATURES
        original = small_dataset[name].cast_column("image", datasets.Image(decode=False))
        again = loaded[name].cast_column("image", datasets.Image(decode=False))
        assert again["image_description"] == original["image_description"]
        assert again["caption_choices"] == original["caption_choices"]
        assert again["label"] == original["label"]
        assert [i["bytes"] for i in again["image"]] == [i["bytes"] for i in original["image"]]


def test_save_unknown_format(small_dataset: datasets.DatasetDict, tmp_path) -> None:
    with pytest.raises(ValueError, match="'csv'.*'arrow', 'parquet'"):
        save_dataset(small_dataset, str(tmp_path), format="csv")


def test_zero_fraction_gives_empty_split_with_schema() -> None:
    dataset = make_dataset(SyntheticConfig(num_samples=4, validation_fraction=0.0, test_fraction=0.25, **SMALL))
    assert [dataset[name].num_rows for name in SPLITS] == [3, 0, 1]
    assert dataset["validation"].features == FEATURES
    assert pa.types.is_struct(dataset["validation"].data.table.schema.field("image").type)


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_a_split_without_rows_is_not_written_so_the_folder_loads_back(tmp_path, fmt: str) -> None:
    from vlfit.data.sources import open_splits

    dataset = make_dataset(SyntheticConfig(num_samples=4, validation_fraction=0.0, test_fraction=0.25, **SMALL))
    save_dataset(dataset, str(tmp_path), format=fmt)
    assert {name: len(split) for name, split in open_splits(dataset_name=str(tmp_path)).items()} == {
        "train": 3,
        "test": 1,
    }


def test_cli_writes_loadable_dataset(tmp_path, capsys) -> None:
    out = tmp_path / "synthetic"
    argv = ["--output_dir", str(out), "--num_samples", "12", "--min_long_side", "64", "--max_long_side", "96"]
    assert main([*argv, "--num_proc", "1"]) == 0
    loaded = datasets.load_from_disk(str(out))
    assert [loaded[name].num_rows for name in SPLITS] == [10, 1, 1]
    first = make_record(0, SyntheticConfig(num_samples=12, **SMALL))
    assert loaded["train"][0]["caption_choices"] == first["caption_choices"]
    printed = capsys.readouterr().out
    assert re.search(r"^train: 10 rows, [\d.]+ MB of JPEG, mean long side \d+ px$", printed, re.MULTILINE)
    assert str(out) in printed


def test_cli_parquet(tmp_path) -> None:
    out = tmp_path / "pq"
    argv = ["--output_dir", str(out), "--num_samples", "3", "--format", "parquet", "--num_proc", "1"]
    assert main([*argv, "--min_long_side", "40", "--max_long_side", "48"]) == 0
    written = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # and the folder's record
    assert written == ["test.parquet", "train.parquet", "validation.parquet"]


TINY_CLI = ["--num_samples", "3", "--min_long_side", "40", "--max_long_side", "48", "--num_proc", "1"]


def test_cli_refuses_a_folder_of_the_users_own_files_and_writes_nothing(tmp_path) -> None:
    """A folder holding the user's images and CSV is refused in one line naming it, before anything is generated:
    its synthetic rows beside the user's would be what --dataset_name FOLDER reads from then on."""
    own = tmp_path / "photos"
    own.mkdir()
    (own / "captions.csv").write_text("image,caption\na.jpg,a dog\n")
    (own / "a.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(ConfigError) as refused:
        main(["--output_dir", str(own), *TINY_CLI])
    assert str(refused.value) == (
        f"--output_dir {own} is not empty (a.jpg, captions.csv) and vlfit make-data did not write it: name a new or "
        "empty folder (--output_dir)"
    )
    assert sorted(p.name for p in own.iterdir()) == ["a.jpg", "captions.csv"]


def test_cli_rerun_replaces_its_own_dataset_whole(tmp_path) -> None:
    """A make-data folder written again (here parquet over arrow) holds the new dataset alone: the arrow one's
    dataset_dict.json beside the parquet files would be what a reader opens."""
    out = tmp_path / "synthetic"
    assert main(["--output_dir", str(out), *TINY_CLI]) == 0
    assert main(["--output_dir", str(out), *TINY_CLI, "--format", "parquet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [FOLDER_RECORD, "test.parquet", "train.parquet",
                                                     "validation.parquet"]  # fmt: skip


def test_cli_refuses_an_output_dir_that_is_a_file(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=f"^--output_dir {tmp_path / 'file'} is a file, not a folder"):
        main(["--output_dir", str(tmp_path / "file"), *TINY_CLI])


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--num_samples", "2"], "--num_samples"),
        (["--validation_fraction", "1.0"], "--validation_fraction"),
        (["--test_fraction", "-0.1"], "--test_fraction"),
        (["--validation_fraction", "0.5", "--test_fraction", "0.5"], "--validation_fraction"),
        (["--min_long_side", "900", "--max_long_side", "800"], "--min_long_side"),
        (["--min_long_side", "8", "--max_long_side", "800"], "--min_long_side"),
        (["--jpeg_quality", "0"], "--jpeg_quality"),
        (["--jpeg_quality", "101"], "--jpeg_quality"),
        (["--seed", "-1"], "--seed"),
        (["--num_proc", "0"], "--num_proc"),
    ],
)
def test_cli_bad_flags_name_the_flag(tmp_path, flags: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        main(["--output_dir", str(tmp_path / "never"), *flags])
    assert not (tmp_path / "never").exists()


def test_cli_rejects_unknown_format(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--output_dir", str(tmp_path), "--format", "csv"])
    assert "--format" in capsys.readouterr().err


def test_parse_caption_inverts_caption_and_names_the_edited_attributes() -> None:
    from vlfit.data.synthetic.scenes import caption, differing_attributes, parse_caption, scene_and_choices

    rng = np.random.default_rng(0)
    for _ in range(50):
        scene, choices, answer = scene_and_choices(rng)
        assert parse_caption(caption(scene)) == tuple(sorted(scene, key=lambda g: synthetic.REGIONS.index(g.region)))
        for choice in choices:
            changed = differing_attributes(parse_caption(choice), parse_caption(choices[answer]))
            assert len(changed) <= 2 and (not changed) == (choice == choices[answer])
    assert differing_attributes(
        parse_caption("one red circle on the left."), parse_caption("one red circle at the top.")
    ) == ("region",)
    with pytest.raises(ValueError, match="not a synthetic caption"):
        parse_caption("a red circle somewhere.")


def test_shifted_distributions_darken_the_same_scenes_and_caption_without_regions() -> None:
    from vlfit.data.synthetic.scenes import caption, scene_and_choices

    plain = SyntheticConfig(num_samples=12, seed=3, **SMALL)
    dark = SyntheticConfig(num_samples=12, seed=3, background="dark", **SMALL)
    told = SyntheticConfig(num_samples=12, seed=3, caption_grammar="no_regions", **SMALL)
    regions = r" (on the left|on the right|at the top|at the bottom|in the center)"
    for index in range(6):
        a, b, c = make_record(index, plain), make_record(index, dark), make_record(index, told)
        assert b["image_description"] == a["image_description"]  # the background alone changed
        light_pixels, dark_pixels = (
            np.asarray(Image.open(io.BytesIO(jpeg(r))).convert("L"), np.float32) for r in (a, b)
        )
        assert light_pixels.shape == dark_pixels.shape
        assert np.median(dark_pixels) < 75 < np.median(light_pixels)
        assert len(set(c["caption_choices"])) == synthetic.NUM_CHOICES
        assert c["caption_choices"][ord(c["label"]) - ord("A")] == c["image_description"]
        for text in c["caption_choices"]:
            groups = text.removeprefix("a picture of ").removesuffix(".").split(" and ")
            assert text.startswith("a picture of ") and all(UNPLACED_GROUP.fullmatch(g) for g in groups), text
    scene, _, _ = scene_and_choices(np.random.default_rng(5))
    assert caption(scene, "no_regions") == "a picture of " + re.sub(regions, "", caption(scene))
    with pytest.raises(ValueError, match="--labels region"):
        SyntheticConfig(labels="region", caption_grammar="no_regions")
    with pytest.raises(ValueError, match="--background"):
        SyntheticConfig(background="sepia")
