"""vlfit retrieve: an index answers queries as brute force over its embeddings does, resumes and appends to the index
a one-shot build makes, lists bad images, and refuses models, graphs and indexes that do not belong together."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.http_shards import ShardServer, webdataset_shard
from tests.inference.tiny_models import save_tiny_checkpoint, write_image_folder
from vlfit.cli import main
from vlfit.data.sources.images import ImageFolderSource
from vlfit.data.sources.openers import open_collection
from vlfit.data.sources.tar import ShardCollection, TarSource
from vlfit.data.webdataset import WebDatasetLayout
from vlfit.index.build import BuildRequest, build_index
from vlfit.index.shard_embedding import FETCH_FOLDER
from vlfit.index.store import EmbeddingIndex
from vlfit.inference.runtime import ModelRuntime

pytestmark = pytest.mark.slow


def _query_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["retrieve", "query", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _build(encoder, source, request: BuildRequest, **kwargs):
    """``build_index`` over the index at ``request.output_dir`` as it stands (opened as the job opens it)."""
    return build_index(encoder, source, request, index=EmbeddingIndex.existing(request.output_dir), **kwargs)


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("Loading weights")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def torch_index(tiny_checkpoint, image_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("index") / "torch"
    assert main(["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(image_folder),
                 "--output_dir", str(out), "--batch_size", "5", "--dataloader_num_workers", "1",
                 "--disable_tqdm", "true"]) == 0  # fmt: skip
    return out


def test_index_lists_bad_images_and_queries_match_brute_force(
    torch_index, tiny_checkpoint, image_folder, capsys, monkeypatch
):
    index = EmbeddingIndex(str(torch_index))
    files = sorted(str(p) for p in image_folder.rglob("*.jpg") if p.name != "broken.jpg")
    assert index.ids() == files  # every image once, in path order
    assert [bad["id"] for bad in index.manifest.bad_samples] == [str(image_folder / "test" / "broken.jpg")]
    assert index.manifest.model["backend"] == "torch"

    # An image finds itself first, with cosine 1.
    result = _query_json(capsys, "--index", str(torch_index), "--image", files[3], "-k", "3")
    top = result["queries"][0]["results"][0]
    items = [os.path.relpath(file, image_folder) for file in files]  # results name files relative to the folder
    assert top["id"] == items[3] and top["score"] == pytest.approx(1.0, abs=1e-5)

    # Text queries (each --text flag, and a file of them) get the brute-force top-k of the whole index, in order; an
    # image: line's path is taken as typed (relative to the working directory, not to the file).
    queries = image_folder / "lists" / "queries.txt"
    queries.parent.mkdir()
    queries.write_text("image:" + os.path.relpath(files[0], image_folder) + "\n")
    monkeypatch.chdir(image_folder)
    result = _query_json(capsys, "--index", str(torch_index), "--text", "one blue square at the top.",
                         "--text", "two red circles on the left.", "--queries", str(queries), "-k", "4",
                         "--chunk_elements", "7")  # fmt: skip
    encoder = ModelRuntime.open(str(tiny_checkpoint)).encoder
    embeddings = index.embeddings()
    texts = encoder.encode_texts(["one blue square at the top.", "two red circles on the left."])
    expected = torch.topk(texts @ embeddings.t(), 4, dim=1).indices.tolist()
    got = [[items.index(hit["id"]) for hit in q["results"]] for q in result["queries"][:2]]
    assert got == expected
    assert len(result["queries"]) == 3 and result["queries"][2]["query"].startswith("image:")
    assert result["queries"][2]["results"][0]["id"] == items[0]


def test_an_interrupted_build_resumes_to_the_index_a_one_shot_build_makes(tiny_checkpoint, image_folder, tmp_path):
    encoder = ModelRuntime.open(str(tiny_checkpoint)).encoder
    source = ImageFolderSource(str(image_folder))
    settings = {"collection": {"images": str(image_folder)}, "batch_size": 3, "shard_size": 4, "progress": False}
    _build(encoder, source, BuildRequest(str(tmp_path / "once"), **settings))

    def interrupt(manifest):
        if len(manifest.shards) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _build(encoder, source, BuildRequest(str(tmp_path / "resumed"), **settings), on_shard=interrupt)
    stopped = EmbeddingIndex(str(tmp_path / "resumed")).manifest
    assert stopped.count + len(stopped.bad_samples) == 12  # two shards of two batches of 3, the broken file in them
    _build(encoder, source, BuildRequest(str(tmp_path / "resumed"), **settings))
    once, resumed = EmbeddingIndex(str(tmp_path / "once")), EmbeddingIndex(str(tmp_path / "resumed"))
    assert resumed.ids() == once.ids()
    assert torch.equal(resumed.embeddings(), once.embeddings())
    assert resumed.manifest.bad_samples == once.manifest.bad_samples  # the broken file listed once


def two_process_payload(folder: Path, dataset_dir: str) -> dict:
    """For the 2-process check (``tests.two_processes``): a tiny checkpoint, a folder of images with a broken one,
    its index built by one process, and the same build stopped after its first shard, which the two processes
    finish through ``vlfit retrieve index``."""
    checkpoint = save_tiny_checkpoint(dataset_dir, folder / "model")
    images = write_image_folder(dataset_dir, folder / "images")
    encoder, source = ModelRuntime.open(str(checkpoint)).encoder, ImageFolderSource(str(images))
    settings = {"collection": {"images": str(images)}, "batch_size": 2, "shard_size": 2, "progress": False}
    _build(encoder, source, BuildRequest(str(folder / "once"), **settings))

    def stop(manifest):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _build(encoder, source, BuildRequest(str(folder / "parallel"), **settings), on_shard=stop)
    argv = ["index", "--model", str(checkpoint), "--images", str(images), "--output_dir",
            str(folder / "parallel"), "--batch_size", "2", "--shard_size", "2", "--dataloader_num_workers", "0",
            "--disable_tqdm", "true"]  # fmt: skip
    # Three tar shards of a '::' spec (streamed, as URLs are): indexed a shard at a time, 2 on rank 0, 1 on rank 1.
    spec = "::".join(_write_shards(folder / "tars", {"a": 2, "b": 1}))
    shards, collection = open_collection(dataset_name=spec, caption_column="txt")
    _build(encoder, shards, BuildRequest(str(folder / "stream_once"), collection, batch_size=2, progress=False))
    stream_argv = ["index", "--model", str(checkpoint), "--dataset_name", spec, "--caption_column", "txt",
                   "--output_dir", str(folder / "stream_parallel"), "--batch_size", "2",
                   "--dataloader_num_workers", "0", "--disable_tqdm", "true"]  # fmt: skip
    return {"argv": argv, "once": str(folder / "once"), "parallel": str(folder / "parallel"),
            "stream_argv": stream_argv, "stream_once": str(folder / "stream_once"),
            "stream_parallel": str(folder / "stream_parallel")}  # fmt: skip


def _write_shards(root: Path, counts: dict[str, int], samples: int = 5) -> list[str]:
    """Tar shards ``root/<source>/000.tar``... of ``samples`` samples each; per source, its brace pattern."""
    specs = []
    for source, count in counts.items():
        (root / source).mkdir(parents=True)
        for i in range(count):
            data, _ = webdataset_shard(f"{source}{i}", samples, seed=10 * ord(source) + i)
            (root / source / f"{i:03d}.tar").write_bytes(data)
        specs.append(str(root / source / f"{{000..{count - 1:03d}}}.tar"))
    return specs


def two_process_worker(rank: int, world: int, init_file: str, payload_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from vlfit.commands.retrieve import main as retrieve  # vlfit retrieve, in the group formed here
    from vlfit.launch import join_gloo_group

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        payload = torch.load(payload_path)
        code = retrieve(payload["argv"])
        code += retrieve(payload["stream_argv"])
        joined = join_gloo_group(60)  # what the build took its rank and world size from
        torch.save({"code": code, "joined": joined, **payload}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_processes_resume_a_stopped_build_to_the_index_one_process_makes(two_process_results):
    ranks = two_process_results[__name__]
    assert [(rank["code"], rank["joined"]) for rank in ranks] == [(0, (0, 2)), (0, (1, 2))]
    once, parallel = EmbeddingIndex(ranks[0]["once"]), EmbeddingIndex(ranks[0]["parallel"])
    assert len(parallel.manifest.shards) == len(once.manifest.shards) > 4  # both processes wrote shards
    assert parallel.ids() == once.ids()
    torch.testing.assert_close(parallel.embeddings(), once.embeddings(), atol=1e-5, rtol=0)
    assert parallel.manifest.bad_samples == once.manifest.bad_samples
    assert parallel.manifest.ann is not None and parallel.manifest.ann["count"] == once.manifest.count
    once, parallel = EmbeddingIndex(ranks[0]["stream_once"]), EmbeddingIndex(ranks[0]["stream_parallel"])
    sources = [shard["source"] for shard in parallel.manifest.shards]
    assert sources == [shard["source"] for shard in once.manifest.shards] and len(sources) == 3
    assert parallel.ids() == once.ids() and len(parallel) == 15
    torch.testing.assert_close(parallel.embeddings(), once.embeddings(), atol=1e-5, rtol=0)
    assert not os.path.exists(os.path.join(ranks[0]["stream_parallel"], FETCH_FOLDER))


def test_tar_shards_at_urls_are_indexed_as_read_locally_and_a_failed_shard_is_tried_again(tiny_checkpoint, tmp_path):
    """Over a loopback HTTP server: one index shard per tar shard, the same embeddings as the same shards indexed
    map-style from disk; a shard that keeps failing is listed as bad by its URL, and the next run fetches it alone."""
    paths = [tmp_path / "tars" / "s" / f"{i:03d}.tar" for i in range(3)]
    _write_shards(tmp_path / "tars", {"s": 3})
    encoder = ModelRuntime.open(str(tiny_checkpoint)).encoder
    local = TarSource([str(p) for p in paths], name="local", caption_column="txt")
    _build(encoder, local, BuildRequest(str(tmp_path / "local"), {}, batch_size=2, shard_size=100, progress=False))
    local_index = EmbeddingIndex(str(tmp_path / "local"))
    expected = dict(zip(local_index.ids(), local_index.embeddings(), strict=True))

    out = str(tmp_path / "streamed")
    with ShardServer({f"/s/{p.name}": p.read_bytes() for p in paths}) as server:
        urls = [server.url(f"/s/{p.name}") for p in paths]
        shards = ShardCollection(server.url("/s/{000..002}.tar"), tuple(urls), WebDatasetLayout(caption_column="txt"),
                                 retries=1, timeout=2.0, backoff=0.01)  # fmt: skip
        server.fail("/s/001.tar", status=500)
        _build(encoder, shards, BuildRequest(out, {"streamed": True}, batch_size=2, progress=False))
        first = EmbeddingIndex(out).manifest
        assert [shard["source"] for shard in first.shards] == [urls[0], urls[2]]
        assert [bad["id"] for bad in first.bad_samples] == [urls[1]] and "500" in first.bad_samples[0]["reason"]
        again = _build(encoder, shards, BuildRequest(out, {"streamed": True}, batch_size=2, progress=False))
        assert [bad["id"] for bad in again.bad_samples] == [urls[1]] and again.added == 0  # lost again: reported
        server.heal("/s/001.tar")
        asked = len(server.requests)
        _build(encoder, shards, BuildRequest(out, {"streamed": True}, batch_size=2, progress=False))
        assert {path for _, path, _ in server.requests[asked:]} == {"/s/001.tar"}
        index = EmbeddingIndex(out)
        assert [shard["source"] for shard in index.manifest.shards] == [urls[0], urls[2], urls[1]]
        assert index.manifest.bad_samples == [] and sorted(index.ids()) == sorted(expected) and len(index) == 15
        for item, embedding in zip(index.ids(), index.embeddings(), strict=True):
            torch.testing.assert_close(embedding, expected[item], atol=1e-5, rtol=0)
        assert not os.path.exists(os.path.join(out, FETCH_FOLDER))

        # A damaged index shard is fetched and embedded again in its place: every row stays where it was.
        ids, embeddings, asked = index.ids(), index.embeddings(), len(server.requests)
        damaged = Path(out, index.manifest.shards[0]["embeddings"])
        damaged.write_bytes(damaged.read_bytes()[:40])
        _build(encoder, shards, BuildRequest(out, {"streamed": True}, batch_size=2, progress=False))
        assert {path for _, path, _ in server.requests[asked:]} == {"/s/000.tar"}
    repaired = EmbeddingIndex(out)
    assert [shard["source"] for shard in repaired.manifest.shards] == [urls[0], urls[2], urls[1]]
    assert repaired.ids() == ids and not damaged.exists()
    torch.testing.assert_close(repaired.embeddings(), embeddings, atol=1e-5, rtol=0)
    assert not os.path.exists(os.path.join(out, FETCH_FOLDER))


def test_appending_embeds_only_the_new_images(tiny_checkpoint, image_folder, tmp_path, capsys):
    folder = tmp_path / "photos"
    shutil.copytree(image_folder / "validation", folder)
    argv = ["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(folder), "--output_dir",
            str(tmp_path / "index"), "--storage", "npy", "--dataloader_num_workers", "0",
            "--disable_tqdm", "true", "--json"]  # fmt: skip
    assert main(argv) == 0
    first = EmbeddingIndex(str(tmp_path / "index"))
    shutil.copytree(image_folder / "test", folder / "more")
    capsys.readouterr()
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["added"] == len(list((folder / "more").glob("*.jpg"))) - 1 and len(summary["bad_samples"]) == 1
    appended = EmbeddingIndex(str(tmp_path / "index"))
    assert appended.ids()[: len(first)] == first.ids()
    assert torch.equal(appended.embeddings()[: len(first)], first.embeddings())
    assert len(appended) == len(first) + summary["added"]
    assert os.path.exists(tmp_path / "index" / "shard-00000.npy")


def test_an_append_without_the_build_flags_replays_those_the_index_was_built_with(
    tiny_checkpoint, image_folder, tmp_path, capsys
):
    folder = tmp_path / "photos"
    shutil.copytree(image_folder / "validation", folder)
    argv = ["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(folder), "--output_dir",
            str(tmp_path / "index"), "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--json"]  # fmt: skip
    settings = {"index_type": "hnsw", "max_index_memory": 10**7, "target_recall": 0.9, "shard_size": 8}
    assert main([*argv, *(f"--{name}={value}" for name, value in settings.items())]) == 0
    shutil.copytree(image_folder / "test", folder / "more")
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["ann"]["type"] == "hnsw"  # not auto's flat
    manifest = EmbeddingIndex(str(tmp_path / "index")).manifest
    recorded = {**settings, "vector_storage": "float32", "rescore": None}  # and the defaults of those not given
    assert [entry["settings"] for entry in manifest.collections] == [recorded, recorded]
    assert manifest.ann["max_index_memory"] == 10**7


def test_an_index_of_exported_graphs_is_queried_with_them(onnx_export, image_folder, tmp_path, capsys):
    out = tmp_path / "onnx-index"
    assert main(["retrieve", "index", "--model", str(onnx_export), "--images", str(image_folder / "validation"),
                 "--output_dir", str(out), "--dataloader_num_workers", "0", "--disable_tqdm", "true"]) == 0  # fmt: skip
    image = sorted((image_folder / "validation").glob("*.jpg"))[2]
    result = _query_json(capsys, "--index", str(out), "--image", str(image), "-k", "2")
    assert result["model"].endswith("on onnxruntime (int8)")
    assert result["queries"][0]["results"][0]["id"] == image.name


def test_refused_combinations_end_in_one_line(
    torch_index, tiny_checkpoint, other_checkpoint, onnx_export, image_folder, tmp_path, capsys
):
    query = ["retrieve", "query", "--index", str(torch_index), "--text", "a red circle"]
    assert main([*query, "--model", str(other_checkpoint)]) == 2
    assert re.fullmatch(r"vlfit retrieve: error: the index .* was built with checkpoint \w{12} but the model .* "
                        r"comes from checkpoint \w{12}: .*", _error_line(capsys))  # fmt: skip

    smaller = tmp_path / "smaller"
    shutil.copytree(torch_index, smaller)
    manifest = json.loads((smaller / "index_manifest.json").read_text())
    manifest["identity"]["embedding_size"] = 32
    (smaller / "index_manifest.json").write_text(json.dumps(manifest))
    assert main(["retrieve", "query", "--index", str(smaller), "--text", "a red circle"]) == 2
    assert "holds bridgetower embeddings of size 32 but the model" in _error_line(capsys)

    # An export whose checkpoint was overwritten by other weights after the export.
    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "checkpoint")
    stale = shutil.copytree(onnx_export, tmp_path / "stale")
    manifest = json.loads((stale / "export_manifest.json").read_text())
    manifest["source"]["path"] = str(checkpoint)
    (stale / "export_manifest.json").write_text(json.dumps(manifest))
    shutil.copy(other_checkpoint / "model.safetensors", checkpoint / "model.safetensors")
    index = ["retrieve", "index", "--images", str(image_folder / "validation"), "--output_dir", str(tmp_path / "i")]
    assert main([*index, "--model", str(stale)]) == 2
    assert "the exported graphs are older than their checkpoint" in _error_line(capsys)

    no_tokenizer = shutil.copytree(onnx_export, tmp_path / "no-tokenizer")
    os.remove(no_tokenizer / "tokenizer.json")
    assert main([*index, "--model", str(no_tokenizer)]) == 2
    assert "the exported model has no tokenizer" in _error_line(capsys)

    assert main([*index, "--model", str(tiny_checkpoint), "--backend", "openvino"]) == 2
    assert "is a checkpoint, which runs on torch" in _error_line(capsys)


def test_a_dataset_split_is_indexed_by_sample_id_and_a_second_run_adds_nothing(
    tiny_checkpoint, synthetic_dataset_dir, image_folder, tmp_path, capsys
):
    argv = ["retrieve", "index", "--model", str(tiny_checkpoint), "--dataset_name", synthetic_dataset_dir, "--split",
            "validation", "--output_dir", str(tmp_path / "index"), "--dataloader_num_workers", "0",
            "--disable_tqdm", "true", "--json"]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["added"] == 0
    index = EmbeddingIndex(str(tmp_path / "index"))
    image = sorted((image_folder / "validation").glob("*.jpg"))[1]  # the same record, written out as a file
    assert index.ids() == sorted(path.stem for path in (image_folder / "validation").glob("*.jpg"))
    result = _query_json(capsys, "--index", str(tmp_path / "index"), "--image", str(image), "-k", "1")
    assert result["queries"][0]["results"][0]["id"] == image.stem


def test_a_trained_model_finds_each_image_from_its_own_caption(synthetic_dataset_dir, trained_clip, tmp_path, capsys):
    # A model that learned the training split (seen pairs: the test is about the index and the query path, not
    # generalization), then the same split indexed and queried by its own captions.
    model = trained_clip
    index = tmp_path / "index"
    assert main(["retrieve", "index", "--model", str(model), "--dataset_name", synthetic_dataset_dir, "--split",
                 "train", "--output_dir", str(index), "--disable_tqdm", "true"]) == 0  # fmt: skip
    from vlfit.data.sources import open_splits

    train = open_splits(dataset_name=synthetic_dataset_dir)["train"]
    records = [train[i] for i in range(len(train))]
    queries = tmp_path / "queries.txt"
    queries.write_text("".join(f"{record.caption}\n" for record in records))
    result = _query_json(capsys, "--index", str(index), "--queries", str(queries), "-k", "5")
    top1 = [query["results"][0]["id"] for query in result["queries"]]
    top5 = [[hit["id"] for hit in query["results"]] for query in result["queries"]]
    hits = sum(found == record.id for found, record in zip(top1, records, strict=True))
    hits5 = sum(record.id in found for found, record in zip(top5, records, strict=True))
    # Chance is 1 in len(records) (64) at top-1.
    assert hits >= 0.9 * len(records), (hits, len(records))
    assert hits5 >= 0.98 * len(records), (hits5, len(records))


def test_an_hnsw_index_answers_as_the_exact_scan_follows_appends_and_drops_removed_images(
    tiny_checkpoint, image_folder, tmp_path, capsys
):
    folder = tmp_path / "photos"
    shutil.copytree(image_folder / "validation", folder)
    out = tmp_path / "index"
    argv = ["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(folder), "--output_dir", str(out),
            "--index_type", "hnsw", "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    manifest = EmbeddingIndex(str(out)).manifest
    assert summary["ann"]["type"] == manifest.ann["type"] == "hnsw" and manifest.ann["count"] == manifest.count
    assert manifest.ann["recall_at_10"] >= 0.95 and (out / "ann.faiss").is_file()

    files = sorted(str(p) for p in folder.glob("*.jpg"))
    query = ["--index", str(out), "--image", files[2], "--text", "two red circles on the left.", "-k", "5"]
    approximate, exact = _query_json(capsys, *query), _query_json(capsys, *query, "--exact")
    assert [q["results"][0] for q in approximate["queries"]] == [q["results"][0] for q in exact["queries"]]
    assert approximate["queries"][1]["results"][0]["score"] == pytest.approx(1.0, abs=1e-5)  # itself (or a twin)

    # Appended images go into the HNSW graph in place, and are found.
    shutil.copytree(image_folder / "test", folder / "more")
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ann"]["extended"] and summary["added"] > 0
    new = sorted(str(p) for p in (folder / "more").glob("*.jpg") if p.name != "broken.jpg")
    found = _query_json(capsys, "--index", str(out), "--image", *new[:3], "-k", "3")["queries"]
    assert all(os.path.relpath(path, folder) in [hit["id"] for hit in q["results"]]
               for path, q in zip(new, found, strict=False))  # fmt: skip

    # A removed file is listed as removed on re-indexing, and neither the ANN search nor the exact scan returns it.
    kept = tmp_path / "kept.jpg"
    shutil.move(files[2], kept)
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 1
    assert EmbeddingIndex(str(out)).manifest.removed == [files[2]]
    for flags in ([], ["--exact"]):
        ids = [hit["id"] for hit in _query_json(capsys, "--index", str(out), "--image", str(kept), "-k", "50",
                                                *flags)["queries"][0]["results"]]  # fmt: skip
        assert os.path.relpath(files[2], folder) not in ids and len(ids) == min(50, len(EmbeddingIndex(str(out))) - 1)


def test_timing_splits_a_query_into_its_stages(torch_index, image_folder, capsys):
    image = str(next(p for p in sorted(image_folder.rglob("*.jpg")) if p.name != "broken.jpg"))
    query = ["--index", str(torch_index), "--text", "a red circle", "-k", "2"]
    timing = _query_json(capsys, *query, "--image", image, "--timing")["timing"]
    assert list(timing) == ["open", "decode", "encode", "search", "total"]
    assert all(ms >= 0 for ms in timing.values()) and timing["encode"] > 0
    stages = sum(ms for stage, ms in timing.items() if stage != "total")
    assert stages <= timing["total"] + 0.003  # each figure is rounded to the microsecond
    assert "timing" not in _query_json(capsys, *query)  # only when asked

    # Without --json: one line per stage after the results.
    capsys.readouterr()
    assert main(["retrieve", "query", *query, "--timing"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[-4:]] == ["open", "encode", "search", "total"]
    assert all(line.endswith(" ms") for line in lines[-4:]) and lines[0] == "a red circle"


def test_a_flat_ann_index_returns_what_the_exact_scan_does(torch_index, tmp_path, capsys):
    out = shutil.copytree(torch_index, tmp_path / "flat")
    from vlfit.index.ann_update import update_ann

    assert update_ann(str(out), index_type="flat")["type"] == "flat"
    query = ["--index", str(out), "--text", "one blue square at the top.", "--text", "a red circle", "-k", "8"]
    approximate, exact = _query_json(capsys, *query), _query_json(capsys, *query, "--exact")
    for got, want in zip(approximate["queries"], exact["queries"], strict=True):
        assert [hit["id"] for hit in got["results"]] == [hit["id"] for hit in want["results"]]
        scores = [hit["score"] for hit in want["results"]]  # faiss's thread count may differ by run order: 1e-6 apart
        assert [hit["score"] for hit in got["results"]] == pytest.approx(scores, abs=1e-5)


def test_indexing_without_faiss_stops_in_one_line_before_embedding(image_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)
    argv = ["retrieve", "index", "--model", str(tmp_path / "no-model"), "--images", str(image_folder), "--output_dir",
            str(tmp_path / "index")]  # fmt: skip
    assert main(argv) == 2
    assert _error_line(capsys) == (
        "vlfit retrieve: error: vlfit retrieve index needs the serve extra (faiss not installed): "
        "pip install 'vlfit[serve]'"
    )
    assert not (tmp_path / "index").exists()


def test_captions_of_one_image_are_one_item_with_all_its_captions(tiny_checkpoint, tmp_path, capsys):
    # 8 images x 3 captions: rows with an image_id column (by the column, and by their identical bytes), and one
    # row per image with a list caption column. Each way: 8 items, each with its 3 captions, one embedding each.
    from tests.inference.several_captions import IMAGES, captions_of, write_caption_lists, write_csv

    csv_file = write_csv(tmp_path / "csv")
    lists = write_caption_lists(tmp_path / "lists")
    common = ["retrieve", "index", "--model", str(tiny_checkpoint), "--dataloader_num_workers", "0",
              "--disable_tqdm", "true", "--batch_size", "5"]  # fmt: skip
    variants = {
        "by_id": ["--dataset_name", str(csv_file), "--split", "train", "--image_column", "file_name",
                  "--caption_column", "caption", "--image_id_column", "image_id"],
        "by_bytes": ["--dataset_name", str(csv_file), "--split", "train", "--image_column", "file_name",
                     "--caption_column", "caption"],
        "lists": ["--dataset_name", str(lists), "--caption_column", "captions"],
    }  # fmt: skip
    for name, argv in variants.items():
        out = tmp_path / name
        assert main([*common, *argv, "--output_dir", str(out)]) == 0, name
        index = EmbeddingIndex(str(out))
        assert len(index) == IMAGES, (name, index.ids())
        captions = index.item_captions()
        assert sorted(sorted(c) for c in captions.values()) == [captions_of(n) for n in range(IMAGES)], name
        if name == "by_id":
            assert index.ids() == [f"img-{n}" for n in range(IMAGES)]
        result = _query_json(capsys, "--index", str(out), "--text", "picture 3 caption 1", "-k", "3", "--exact")
        hits = result["queries"][0]["results"]
        assert len({hit["id"] for hit in hits}) == 3, (name, hits)
        assert all(hit["captions"] == captions[hit["id"]] for hit in hits)


def test_index_build_takes_the_image_id_column_and_its_hits_carry_the_captions(tiny_checkpoint, tmp_path):
    import vlfit
    from tests.inference.several_captions import IMAGES, captions_of, write_csv

    csv_file = write_csv(tmp_path / "csv")
    index = vlfit.Index.build(str(tiny_checkpoint), str(tmp_path / "index"), dataset_name=str(csv_file),
                              split="train", image_column="file_name", caption_column="caption",
                              image_id_column="image_id")  # fmt: skip
    assert len(index) == IMAGES
    hits = index.search("picture 5 caption 2", k=4)
    assert len({hit.id for hit in hits}) == 4
    assert all(hit.captions == captions_of(int(hit.id.split("-")[1])) for hit in hits)


def test_index_ends_with_what_it_wrote_and_prints_json_only_when_asked(tiny_checkpoint, image_folder, tmp_path,
                                                                        capsys):  # fmt: skip
    index = tmp_path / "index"  # export's own last line is checked in tests/inference/test_export.py
    capsys.readouterr()
    argv = ["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(image_folder / "validation"),
            "--output_dir", str(index), "--dataloader_num_workers", "0", "--disable_tqdm", "true"]  # fmt: skip
    assert main(argv) == 0
    items = len(EmbeddingIndex(str(index)))
    assert re.fullmatch(rf"wrote {re.escape(str(index))}: {items} items \({items} added, 0 left out, 0 removed\) "
                        r"embedded by .*; ANN flat.*", capsys.readouterr().out.strip().splitlines()[-1])  # fmt: skip
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["added"] == 0


def test_a_build_that_leaves_out_every_item_ends_in_one_line_and_exit_2(tiny_checkpoint, tmp_path, capsys):
    images = tmp_path / "photos"
    images.mkdir()
    for number in range(2):
        (images / f"p{number}.jpg").write_bytes(b"PK\x03\x04 a zip, not an image")
    index = tmp_path / "index"
    argv = ["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(images), "--output_dir", str(index),
            "--dataloader_num_workers", "0", "--disable_tqdm", "true"]  # fmt: skip
    assert main(argv) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert f"{index}: every item was left out (2; the first: {images / 'p0.jpg'}: " in line
    assert "so the index holds none" in line
