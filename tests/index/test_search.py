"""One search of an index: ``vlfit retrieve query``, ``vlfit.Index.search`` and ``vlfit serve`` answer through the
same function, with the same hits."""

from __future__ import annotations

import json

import vlfit
from vlfit.index.search import search
from vlfit.index.store import EmbeddingIndex
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.serve.engine import SearchEngine


def test_the_library_the_server_and_retrieve_query_give_the_same_hits(synthetic_dataset_dir, tmp_path) -> None:
    from tests.inference.several_captions import IMAGES, captions_of, write_csv
    from tests.inference.tiny_models import save_tiny_checkpoint

    model = save_tiny_checkpoint(synthetic_dataset_dir, tmp_path / "model")
    folder = str(tmp_path / "index")
    vlfit.Index.build(str(model), folder, dataset_name=str(write_csv(tmp_path / "csv")), split="train",
                      image_column="file_name", caption_column="caption", image_id_column="image_id")  # fmt: skip
    manifest_file = tmp_path / "index" / "index_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({**manifest, "removed": ["img-3"]}))  # an item gone since: never a hit

    engine = SearchEngine(folder)
    queries = engine.encode_texts(["picture 3 caption 0", "picture 5 caption 1"])
    expected = search(EmbeddingIndex(folder), queries, IMAGES)  # the ANN structure (flat at this size)
    exact = search(EmbeddingIndex(folder), queries, IMAGES, exact=True)
    assert [[hit.id for hit in hits] for hits in exact] == [[hit.id for hit in hits] for hits in expected]
    for hits in expected:
        assert len(hits) == IMAGES - 1 and "img-3" not in {hit.id for hit in hits}
        assert all(type(hit) is vlfit.SearchHit for hit in hits)  # one hit type, public as vlfit.SearchHit
        assert all(hit.captions == captions_of(int(hit.id.split("-")[1])) for hit in hits)

    assert vlfit.Index.open(folder).search(queries.numpy(), k=IMAGES) == expected
    assert engine.snapshot.search(queries, IMAGES) == expected
    served = engine.search(queries, IMAGES)  # the JSON results: Hit.to_json's, and the server's own fields
    for hits, results in zip(expected, served, strict=True):
        assert [{key: r[key] for key in ("id", "row", "score", "captions")} for r in results] == [
            hit.to_json() for hit in hits
        ]
        assert all(engine.snapshot.items[hit.row] == hit.id for hit in hits)


def test_an_image_folders_hit_is_one_json_through_every_door(synthetic_dataset_dir, tmp_path, capsys) -> None:
    """``id`` is the file relative to the folder indexed in ``retrieve query --json``, the library and
    ``/api/search`` alike; the row is its own field, what ``GET /api/image/{row}`` takes."""
    from fastapi.testclient import TestClient

    from tests.inference.several_captions import jpeg
    from tests.inference.tiny_models import save_tiny_checkpoint
    from vlfit.cli import main
    from vlfit.serve.app import create_app

    model = save_tiny_checkpoint(synthetic_dataset_dir, tmp_path / "model")
    images = tmp_path / "photos"
    (images / "trips").mkdir(parents=True)
    for number in range(4):
        (images / "trips" / f"p{number}.jpg").write_bytes(jpeg(number))
    folder = str(tmp_path / "index")
    vlfit.Index.build(str(model), folder, images=str(images))
    text = "picture 2 caption 0"

    library = [hit.to_json() for hit in vlfit.Index.open(folder).search(text, k=4)]
    assert sorted(hit["id"] for hit in library) == [f"trips/p{number}.jpg" for number in range(4)]
    capsys.readouterr()
    assert main(["retrieve", "query", "--index", folder, "--text", text, "-k", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["queries"][0]["results"] == library
    engine = SearchEngine(folder)
    with TestClient(create_app(engine, reload_interval=0)) as client:
        served = client.post("/api/search", json={"text": text, "k": 4}).json()["results"]
        assert [{key: hit[key] for key in ("id", "row", "score")} for hit in served] == library
        thumbnail = client.get(f"/api/image/{served[0]['row']}?size=16")
    assert thumbnail.status_code == 200 and thumbnail.headers["content-type"] == "image/jpeg"


def test_queries_are_embedded_on_the_runtime_and_precision_the_index_was_built_with(
    onnx_export, image_folder, tmp_path
) -> None:
    from vlfit.index.job import IndexJob, index_collection
    from vlfit.index.search import query_runtime
    from vlfit.index.verify import open_index

    out = str(tmp_path / "index")
    # The export holds INT8 graphs too: auto would take them.
    fp32 = RuntimeSettings(precision="fp32")
    index_collection(IndexJob(str(onnx_export), out, images=str(image_folder), progress=False, index_type="flat",
                              runtime=fp32))  # fmt: skip
    index = open_index(out)
    built = query_runtime(index).encoder
    assert (built.backend, built.precision) == ("onnxruntime", "fp32")
    assert (
        query_runtime(index, settings=RuntimeSettings(precision="int8")).encoder.precision == "int8"
    )  # asked for: what the caller says
