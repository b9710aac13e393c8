"""An index that proves it is whole: the manifest records each file's size and SHA-256 (computed while writing, the
file flushed before the manifest names it), opening checks them (``quick``: sizes; ``full``: checksums, finite
embeddings) and refuses in one line naming the file and the command that rebuilds it, ``vlfit retrieve verify``
reports the same, embeddings that are not finite are never written and never reach a result, and a build over a
damaged index embeds the damaged shard's items again."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vlfit.atomic_files import digest_file
from vlfit.cli import main
from vlfit.errors import DataError
from vlfit.index.ann import AnnIndex
from vlfit.index.ann_update import update_ann
from vlfit.index.integrity import DamagedIndexError
from vlfit.index.manifest import MANIFEST_NAME
from vlfit.index.search import search
from vlfit.index.store import EmbeddingIndex, write_index_from_embeddings
from vlfit.index.verify import open_index, verify_index
from vlfit.inference.identity import ModelIdentity

DIM = 8
ROWS = 100
IDENTITY = ModelIdentity("clip", DIM, "0" * 64)
MODEL = {"path": "runs/model", "backend": "torch", "precision": "fp32"}


def _unit(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(rows, DIM, generator=torch.Generator().manual_seed(seed)), dim=1)


def _write(folder: Path, embeddings: torch.Tensor | None = None, **options) -> Path:
    embeddings = _unit(ROWS) if embeddings is None else embeddings
    ids = [f"/photos/{i}.jpg" for i in range(len(embeddings))]
    write_index_from_embeddings(str(folder), IDENTITY, MODEL, ids, embeddings, collection={"images": "/photos"},
                                shard_size=40, **options)  # fmt: skip
    return folder


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())


def _forget_records(folder: Path) -> None:
    """Make the manifest one written before sizes and checksums were recorded."""
    manifest = _manifest(folder)
    for shard in manifest["shards"]:
        shard.pop("files")
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def _verify_lines(capsys, folder: Path, *flags: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["retrieve", "verify", "--index", str(folder), *flags])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).strip().splitlines()


@pytest.mark.parametrize("storage", ["safetensors", "npy"])
def test_the_manifest_records_the_size_and_checksum_of_every_file_written(tmp_path, storage) -> None:
    folder = _write(tmp_path / "index", storage=storage)
    update_ann(str(folder), index_type="hnsw")
    manifest = _manifest(folder)
    named = []
    for shard in manifest["shards"]:
        names = [shard["embeddings"], shard["ids"]]
        assert sorted(shard["files"]) == sorted(names) and names[0].endswith(storage)
        named += [(name, shard["files"][name]) for name in names]
    named.append(("ann.faiss", manifest["ann"]))
    for name, recorded in named:
        found = digest_file(str(folder / name))
        assert (recorded["bytes"], recorded["sha256"]) == (found.size, found.sha256), name
    assert verify_index(str(folder), "full").whole


def test_index_files_are_flushed_to_disk_before_the_manifest_names_them(tmp_path, monkeypatch) -> None:
    from vlfit import atomic_files

    events: list[tuple[str, str]] = []
    fsync_file, replace = atomic_files.fsync_file, os.replace
    monkeypatch.setattr(atomic_files, "fsync_file", lambda path: (events.append(("fsync", path)), fsync_file(path)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), replace(a, b)))
    folder = _write(tmp_path / "index")
    update_ann(str(folder), index_type="flat")

    manifest = _manifest(folder)
    last_manifest = max(
        i for i, (kind, path) in enumerate(events) if kind == "replace" and path.endswith(MANIFEST_NAME)
    )
    names = [name for shard in manifest["shards"] for name in shard["files"]] + ["ann.faiss", "ann.json"]
    for name in names:
        published = next(i for i, event in enumerate(events) if event == ("replace", str(folder / name)))
        flushed = published - 1  # the temporary file, flushed just before its rename
        assert events[flushed][0] == "fsync" and os.path.basename(events[flushed][1]).startswith(f".{name}.")
        assert published < last_manifest
    assert events[last_manifest - 1][0] == "fsync"  # the manifest itself is flushed too


def test_a_truncated_manifest_shard_json_or_shard_file_names_the_file_in_one_line(tmp_path, capsys) -> None:
    whole = _write(tmp_path / "whole")
    assert _verify_lines(capsys, whole) == (0, [f"{whole}: whole (quick check of 7 files, 100 items)"])
    rebuild = f"rebuild it: vlfit retrieve index --model runs/model --images /photos --output_dir {tmp_path}"

    for name, cut in (("shard-00001.safetensors", 100), ("shard-00002.json", 10), (MANIFEST_NAME, 50)):
        folder = _write(tmp_path / name)
        path = folder / name
        path.write_bytes(path.read_bytes()[:cut])
        with pytest.raises(DamagedIndexError) as error:
            open_index(str(folder))
        assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)
        code, lines = _verify_lines(capsys, folder)
        assert code == 2 and lines[0] == str(error.value) and lines[-1].startswith(f"{folder}: 1 damaged")
        if name != MANIFEST_NAME:
            assert f"(truncated); {rebuild}/{name}" in lines[0]
        else:  # no manifest: nothing says what the index held; build it again
            assert "does not parse" in lines[0] and "--output_dir NEW_FOLDER" in lines[0]
        # The commands that open an index end in the same one line, exit 2, never a traceback.
        assert main(["retrieve", "query", "--index", str(folder), "--text", "a cat"]) == 2
        assert capsys.readouterr().err.strip() == f"vlfit retrieve: error: {error.value}"


def test_a_changed_byte_is_found_by_the_full_check_only(tmp_path, capsys) -> None:
    folder = _write(tmp_path / "index")
    shard = folder / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size, another value
    shard.write_bytes(bytes(data))
    assert verify_index(str(folder), "quick").whole
    code, lines = _verify_lines(capsys, folder, "--verify", "full")
    assert code == 2 and len(lines) == 2
    changed = rf"{shard}: checksum \w{{12}}\.\.\., the manifest records \w{{12}}\.\.\. \(changed\); "
    assert re.fullmatch(changed + rf"rebuild it: vlfit retrieve index .* --output_dir {folder} --verify full", lines[0])
    with pytest.raises(DamagedIndexError, match="checksum"):
        open_index(str(folder), "full")
    code, lines = _verify_lines(capsys, folder, "--verify", "full", "--json")
    report = json.loads("\n".join(lines))
    assert report["whole"] is False and report["problems"][0]["file"] == str(shard)


def test_an_index_without_sizes_and_checksums_opens_with_what_can_be_checked(tmp_path, capsys) -> None:
    folder = _write(tmp_path / "index")
    _forget_records(folder)
    code, lines = _verify_lines(capsys, folder)
    assert code == 0 and lines[0].startswith("note: 6 of 6 files have no size or checksum in the manifest")
    assert "checked only that they exist and hold their rows" in lines[0]
    assert len(open_index(str(folder))) == ROWS

    # A shard cut short is still found: its header says how many rows it holds.
    shard = folder / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(DamagedIndexError, match=rf"^{shard}: cannot be read"):
        open_index(str(folder))
    # An ids file cut short is found as it is read (the full check parses it).
    folder = _write(tmp_path / "ids")
    _forget_records(folder)
    ids = folder / "shard-00000.json"
    ids.write_text(ids.read_text()[:20])
    with pytest.raises(DamagedIndexError, match=rf"^{ids}: does not parse"):
        open_index(str(folder), "full")
    with pytest.raises(DamagedIndexError, match=rf"^{ids}: does not parse"):
        EmbeddingIndex(str(folder)).ids()


def test_embeddings_that_are_not_finite_are_refused_at_write_naming_the_items(tmp_path) -> None:
    embeddings = _unit(ROWS)
    embeddings[7, 3] = float("nan")
    embeddings[42] = float("inf")
    with pytest.raises(DataError, match=r"^2 of 100 items embed to NaN or infinite values.*: /photos/7.jpg, "
                                        r"/photos/42.jpg\. The model's weights"):  # fmt: skip
        _write(tmp_path / "index", embeddings)
    assert not (tmp_path / "index").exists()


def _with_nan_rows(folder: Path, rows: list[int]) -> torch.Tensor:
    """An index whose rows ``rows`` hold NaN, as one written before they were refused (no recorded checksums)."""
    from safetensors.torch import save_file

    embeddings = _unit(ROWS)
    _write(folder, embeddings)
    _forget_records(folder)
    broken = embeddings.clone()
    broken[rows] = float("nan")
    for number, start in enumerate(range(0, ROWS, 40)):
        save_file(
            {"embeddings": broken[start : start + 40].contiguous()}, str(folder / f"shard-{number:05d}.safetensors")
        )
    return embeddings


@pytest.mark.parametrize("structure", ["exact", "flat", "hnsw"])
def test_embeddings_that_are_not_finite_never_reach_a_result(tmp_path, structure, capsys) -> None:
    broken_rows = [0, 5, 41, 99]
    embeddings = _with_nan_rows(tmp_path / "index", broken_rows)
    folder = str(tmp_path / "index")
    if structure != "exact":
        update_ann(folder, index_type=structure)
    code, lines = _verify_lines(capsys, tmp_path / "index", "--verify", "full")
    assert code == 2 and "shard-00000.safetensors: 2 of 40 embeddings hold NaN or infinite values" in lines[0]
    assert "shard-00001.safetensors: 1 of 40" in lines[1] and "shard-00002.safetensors: 1 of 20" in lines[2]

    index = open_index(folder)  # quick: opens; searches leave the rows out
    if structure == "exact":
        index.hold_embeddings()  # as a server without an ANN structure holds them
    queries = embeddings[[0, 1, 50]]
    good = [row for row in range(ROWS) if row not in broken_rows]
    expected = (queries @ embeddings[good].T).topk(10).indices
    for hits, want in zip(search(index, queries, 10), expected.tolist(), strict=True):
        assert all(np.isfinite(hit.score) for hit in hits) and not {hit.row for hit in hits} & set(broken_rows)
        if structure != "hnsw":  # exact answers: the 10 best finite rows
            assert [hit.row for hit in hits] == [good[row] for row in want]
    with pytest.raises(DataError, match="embeds query 1 to NaN or infinite values"):
        search(index, torch.stack([queries[0], torch.full((DIM,), float("nan"))]), 5)


def test_the_ann_file_is_read_into_memory_and_checked_against_its_record(tmp_path) -> None:
    folder = _write(tmp_path / "index")
    update_ann(str(folder), index_type="hnsw")
    ann = EmbeddingIndex(str(folder)).ann
    assert ann is not None and len(ann) == ROWS

    path = folder / "ann.faiss"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a vector of its storage: it still parses
    path.write_bytes(bytes(data))
    assert verify_index(str(folder)).whole  # the size is right: only the checksum tells
    with pytest.raises(DamagedIndexError, match=rf"^{path}: checksum .* \(changed\); rebuild it: vlfit retrieve index"):
        EmbeddingIndex(str(folder)).ann  # noqa: B018 - opening it is the test
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(DamagedIndexError, match=rf"^{path}: 100 bytes, the manifest records \d+ \(truncated\)"):
        open_index(str(folder))
    with pytest.raises(DamagedIndexError, match=rf"^{path}: does not parse as a faiss index"):
        AnnIndex.load(str(folder))

    # Asked again, vlfit retrieve index's ANN step builds it anew instead of keeping a file that is not the one named.
    described = update_ann(str(folder), index_type="hnsw")
    assert described["bytes"] == path.stat().st_size and verify_index(str(folder), "full").whole


@pytest.mark.slow
def test_a_build_over_a_damaged_index_embeds_the_damaged_shards_items_again(tiny_checkpoint, image_folder, tmp_path,
                                                                            caplog) -> None:  # fmt: skip
    """A shard whose embeddings are damaged is embedded again in its place (every row stays where it was: a
    server's item ids are rows); one whose ids file is damaged cannot be, so its items go to the end, with a
    warning that the rows after it moved."""
    build = ["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(image_folder / "validation"),
             "--output_dir", str(tmp_path / "index"), "--shard_size", "4", "--batch_size", "2",
             "--dataloader_num_workers", "0", "--disable_tqdm", "true"]  # fmt: skip
    assert main(build) == 0
    folder = str(tmp_path / "index")
    before = EmbeddingIndex(folder)
    ids, embeddings, first_ids = before.ids(), before.embeddings(), before.shard_ids(before.manifest.shards[0])
    rows = dict(zip(ids, embeddings, strict=True))
    shard = Path(folder) / before.manifest.shards[1]["embeddings"]
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(DamagedIndexError) as error:
        open_index(folder)
    repair = str(error.value).split("; rebuild it: ", 1)[1]
    assert repair.startswith(f"vlfit retrieve index --model {tiny_checkpoint} --images {image_folder / 'validation'}")

    assert main(repair.split()[1:] + ["--disable_tqdm", "true"]) == 0  # the command the error names
    after = open_index(folder, "full")
    assert after.ids() == ids  # in place
    torch.testing.assert_close(after.embeddings(), embeddings)
    assert "its shard's items are embedded again in its place" in caplog.text

    (Path(folder) / after.manifest.shards[0]["ids"]).write_text("[")  # the ids of the first shard: unknown now
    caplog.clear()
    assert main(repair.split()[1:] + ["--disable_tqdm", "true"]) == 0
    moved = open_index(folder, "full")
    assert moved.ids() == ids[len(first_ids) :] + first_ids
    assert "embedded again at the end of the index: the rows after it move" in caplog.text
    for item, embedding in zip(moved.ids(), moved.embeddings(), strict=True):
        torch.testing.assert_close(embedding, rows[item])


@pytest.mark.slow
def test_a_damaged_shard_of_another_collection_is_not_lost_by_this_ones_build(tiny_checkpoint, image_folder, tmp_path,
                                                                              capsys) -> None:  # fmt: skip
    """An index of two collections: a damaged shard whose ids are unknown can only be embedded again from the
    collection it came from; another collection's build refuses in one line, naming that collection's command,
    instead of leaving its items out."""
    folder = str(tmp_path / "index")

    def build(images: Path) -> list[str]:
        return ["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(images), "--output_dir",
                folder, "--shard_size", "4", "--batch_size", "2", "--dataloader_num_workers", "0", "--disable_tqdm",
                "true"]  # fmt: skip

    assert main(build(image_folder / "validation")) == 0 and main(build(image_folder / "test")) == 0
    whole = EmbeddingIndex(folder)
    ids, first = whole.ids(), whole.manifest.shards[0]
    assert [shard["collection"] for shard in whole.manifest.shards][:2] == [0, 0]  # the validation folder's build
    (Path(folder) / first["ids"]).write_text("[")  # its items are unknown now
    (problem,) = verify_index(folder).problems  # verify names the build that can repair it: its own collection's
    assert f"--images {image_folder / 'validation'} " in problem.repair, problem
    capsys.readouterr()

    assert main(build(image_folder / "test")) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert first["ids"] in line and "not from this build's, so this build would lose them" in line
    assert f"vlfit retrieve index --model {tiny_checkpoint} --images {image_folder / 'validation'}" in line
    assert EmbeddingIndex(folder).manifest.shards == whole.manifest.shards  # nothing written

    assert main(build(image_folder / "validation")) == 0  # that collection's build embeds them again, at the end
    assert sorted(open_index(folder, "full").ids()) == sorted(ids)


@pytest.mark.slow
def test_a_repaired_shard_that_lost_an_image_says_the_rows_after_it_move(tiny_checkpoint, image_folder, tmp_path,
                                                                          caplog) -> None:  # fmt: skip
    images = tmp_path / "images"
    shutil.copytree(image_folder / "validation", images)
    build = ["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(images), "--output_dir",
             str(tmp_path / "index"), "--shard_size", "4", "--batch_size", "2", "--dataloader_num_workers", "0",
             "--disable_tqdm", "true"]  # fmt: skip
    assert main(build) == 0
    folder = str(tmp_path / "index")
    before = EmbeddingIndex(folder)
    ids, second = before.ids(), before.manifest.shards[1]
    lost = before.shard_ids(second)[0]
    (images / lost).write_bytes(b"not a jpeg any more")  # the image the repair would read again
    shard = Path(folder) / second["embeddings"]
    shard.write_bytes(shard.read_bytes()[:50])
    caplog.clear()
    assert main(build) == 0
    assert open_index(folder, "full").ids() == [item for item in ids if item != lost]
    assert f"{second['embeddings']} held 4 items; 3 of them were embedded again" in caplog.text
    assert "the rows after it move up by 1" in caplog.text
