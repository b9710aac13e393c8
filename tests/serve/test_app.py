"""The search API in-process (FastAPI's TestClient, the real app and engine): results, thumbnails, bad requests,
paths that must not be served, metrics, micro-batching and atomic reloads."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image

import vlfit
from tests.serve.test_limits import ROOM_FOR_32
from vlfit.serve.app import create_app
from vlfit.serve.engine import SearchEngine


@pytest.fixture(scope="module")
def engine(served_index: Path) -> SearchEngine:
    return SearchEngine(str(served_index))


@pytest.fixture(scope="module")
def client(engine: SearchEngine):
    with TestClient(create_app(engine, reload_interval=0, max_upload_mb=1)) as test_client:
        yield test_client


def _search(client: TestClient, **body) -> httpx.Response:
    return client.post("/api/search", json=body)


def _good_query_still_works(client: TestClient, caption: str) -> None:
    answer = _search(client, text=caption, k=3)
    assert answer.status_code == 200 and len(answer.json()["results"]) == 3


@pytest.mark.slow
def test_a_text_query_gets_the_librarys_top_k_with_captions(client, served_index, train_records) -> None:
    index = vlfit.Index.open(str(served_index))
    for record in train_records[:5]:
        answer = _search(client, text=record.caption, k=5)
        assert answer.status_code == 200
        body = answer.json()
        expected = index.search(record.caption, k=5)
        assert [hit["item"] for hit in body["results"]] == [hit.id for hit in expected]
        assert [hit["score"] for hit in body["results"]] == pytest.approx([hit.score for hit in expected], abs=1e-5)
        captions = {r.id: r.caption for r in train_records}
        assert all(hit["caption"] == captions[hit["item"]] for hit in body["results"])
        assert body["k"] == 5 and body["took_ms"] > 0
    # The model learned its training pairs: most captions find their own image first.
    found = sum(_search(client, text=r.caption, k=1).json()["results"][0]["item"] == r.id for r in train_records)
    assert found >= 0.9 * len(train_records)


@pytest.mark.slow
def test_an_image_finds_itself_by_base64_and_by_upload(client, train_records) -> None:
    record = train_records[7]
    by_json = _search(client, image=base64.b64encode(record.image).decode(), k=3).json()["results"]
    upload = client.post("/api/search", files={"file": ("query.jpg", record.image, "image/jpeg")}, data={"k": "3"})
    assert upload.status_code == 200
    by_upload = upload.json()["results"]
    assert by_json == by_upload
    assert by_json[0]["item"] == record.id and by_json[0]["score"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_thumbnails_by_id_only(client, engine, train_records) -> None:
    hit = _search(client, text=train_records[0].caption, k=1).json()["results"][0]
    answer = client.get(f"/api/image/{hit['row']}?size=64")
    assert answer.status_code == 200 and answer.headers["content-type"] == "image/jpeg"
    thumb = Image.open(io.BytesIO(answer.content))
    original = Image.open(io.BytesIO(train_records[[r.id for r in train_records].index(hit["item"])].image))
    assert max(thumb.size) == 64 and abs(thumb.size[0] / thumb.size[1] - original.size[0] / original.size[1]) < 0.05
    assert client.get(f"/api/image/{len(engine.snapshot)}").status_code == 404
    assert client.get("/api/image/-1").status_code == 404
    assert client.get("/api/image/0?size=5000").status_code == 400
    # Nothing but an item's number names an image: paths, encoded or not, are no route or not a number.
    for path in ("/api/image/../../etc/passwd", "/api/image/..%2F..%2Fetc%2Fpasswd", "/api/image/%2Fetc%2Fpasswd",
                 "/api/image//etc/passwd", "/api/image/etc/passwd", f"/api/image/{train_records[0].id}"):  # fmt: skip
        answer = client.get(path)
        assert answer.status_code in (404, 422), path
        assert b"root:" not in answer.content


@pytest.mark.slow
@pytest.mark.parametrize(
    ("request_kwargs", "status", "says"),
    [
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 422, "not valid JSON"),
        ({"json": {"k": 3}}, 422, 'exactly one of "text" and "image"'),
        ({"json": {"text": "a", "image": "AAAA"}}, 422, 'exactly one of "text" and "image"'),
        ({"json": {"text": "a", "limit": 3}}, 422, "limit"),
        ({"json": {"text": "a", "k": 0}}, 400, "k must be an integer from 1 to 1000"),
        ({"json": {"text": "a", "k": 1001}}, 400, "k must be an integer from 1 to 1000"),
        ({"json": {"image": "not base64!"}}, 400, "not base64"),
        ({"json": {"image": base64.b64encode(b"GIF89a not really").decode()}}, 400, "not an image vlfit can read"),
        ({"files": {"file": ("x.jpg", b"\xff\xd8\xff\xe0 truncated", "image/jpeg")}}, 400, "not an image"),
        ({"files": {"other": ("x.jpg", b"data", "image/jpeg")}}, 422, "the field 'file'"),
        ({"content": b"x" * 1_000_001, "headers": {"content-type": "application/json"}}, 413, "upload limit of 1 MB"),
    ],
    ids=[
        "malformed-json",
        "no-query",
        "two-queries",
        "unknown-field",
        "k-0",
        "k-1001",
        "bad-base64",
        "not-image",
        "truncated-upload",
        "no-file-field",
        "too-large",
    ],  # fmt: skip
)
def test_a_bad_request_gets_its_status_and_reason_and_the_server_serves_on(
    client, train_records, request_kwargs, status, says
) -> None:
    answer = client.post("/api/search", **request_kwargs)
    assert answer.status_code == status, answer.text
    assert says in answer.json()["error"]
    _good_query_still_works(client, train_records[0].caption)


@pytest.mark.slow
def test_a_chunked_body_over_the_limit_is_refused_too(client, train_records) -> None:
    def chunks():
        for _ in range(20):
            yield b"x" * 100_000

    answer = client.post("/api/search", content=chunks(), headers={"content-type": "application/json"})
    assert answer.status_code == 413
    _good_query_still_works(client, train_records[0].caption)


def _labels_of(exposition: str, sample: str) -> list[dict[str, str]]:
    """The label sets of ``sample`` in a Prometheus text exposition (whose label order is free)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(exposition)
    return [s.labels for family in families for s in family.samples if s.name == sample]


@pytest.mark.slow
def test_health_metrics_and_page(client, engine) -> None:
    health = client.get("/api/health").json()
    assert health["status"] == "ok" and health["items"] == len(engine.snapshot) == 64
    assert health["workers"] == {"ready": 1, "of": 1}  # one process: ready once it answers
    _search(client, text="one red circle on the left.", k=2)
    client.get("/api/image/999999")
    text = client.get("/metrics").text
    assert 'vlfit_requests_total{route="/api/search",status="200"}' in text
    assert 'vlfit_requests_total{route="/api/image/{item}",status="404"}' in text
    assert {"route": "/api/search", "le": "+Inf"} in _labels_of(text, "vlfit_request_seconds_bucket")
    assert "vlfit_index_items 64" in text and "vlfit_search_batch_size_count" in text
    page = client.get("/")
    assert page.status_code == 200 and 'id="query"' in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no external asset


def _stage_counts(client: TestClient) -> dict[str, float]:
    """``vlfit_stage_seconds``'s count per stage, as ``/metrics`` shows it."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(client.get("/metrics").text)
    return {s.labels["stage"]: s.value for f in families for s in f.samples if s.name == "vlfit_stage_seconds_count"}


@pytest.mark.slow
def test_metrics_split_each_search_into_its_stages(client, train_records) -> None:
    before = _stage_counts(client)
    assert _search(client, text=train_records[0].caption, k=2).status_code == 200
    assert _search(client, image=base64.b64encode(train_records[1].image).decode(), k=2).status_code == 200
    after = _stage_counts(client)
    added = {stage: after.get(stage, 0) - before.get(stage, 0) for stage in ("decode", "encode", "search", "rerank")}
    # The text query: encode and search; the image query: decode too. Nothing re-ranked.
    assert added == {"decode": 1, "encode": 2, "search": 2, "rerank": 0}


def test_stage_figures_count_only_what_came_after_an_earlier_reading() -> None:
    from vlfit.serve.metrics import ServerMetrics, stage_figures

    metrics = ServerMetrics()
    metrics.observe_stages({"encode": 0.5}, 2)
    earlier = metrics.render(0, 1).decode()
    metrics.observe_stages({"encode": 0.003, "search": 0.0002}, 3)  # a batch of 3: each waited for the whole
    figures = stage_figures(metrics.render(0, 1).decode(), since=earlier)
    assert figures["encode"]["requests"] == 3 and figures["encode"]["mean_ms"] == pytest.approx(3.0)
    assert 2.5 <= figures["encode"]["p50_ms"] <= 5.0  # within the bucket holding 3 ms
    assert figures["search"]["requests"] == 3 and "decode" not in figures


@pytest.mark.slow
def test_a_failure_to_count_stages_does_not_fail_the_search(engine, train_records, monkeypatch) -> None:
    with TestClient(create_app(engine, reload_interval=0)) as client:

        def broken(**labels):
            raise RuntimeError("the metrics store is gone")

        monkeypatch.setattr(client.app.state.metrics.stages, "labels", broken)
        assert _search(client, text=train_records[0].caption, k=2).status_code == 200
        assert _search(client, image=base64.b64encode(train_records[1].image).decode(), k=2).status_code == 200


@pytest.mark.slow
def test_concurrent_text_queries_are_batched_and_answered_as_alone(engine, train_records) -> None:
    captions = [record.caption for record in train_records[:16]]

    async def run() -> tuple[list[list[str]], list[list[str]], str]:
        app = create_app(engine, reload_interval=0, max_wait_ms=50, limits=ROOM_FOR_32)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                together = await asyncio.gather(*(http.post("/api/search", json={"text": c, "k": 4}) for c in captions))
                alone = [await http.post("/api/search", json={"text": c, "k": 4}) for c in captions[:4]]
                metrics = (await http.get("/metrics")).text
        return ([[h["item"] for h in r.json()["results"]] for r in together],
                [[h["item"] for h in r.json()["results"]] for r in alone], metrics)  # fmt: skip

    together, alone, metrics = asyncio.run(run())
    assert together[:4] == alone
    (line,) = [line for line in metrics.splitlines() if line.startswith("vlfit_search_batch_size_count")]
    count = float(line.split()[-1])  # the exposition format's numbers are floats ("17.0")
    assert count < len(captions) + 4  # fewer batches than queries: some were embedded together


@pytest.mark.slow
def test_reload_switches_to_a_grown_index_and_keeps_serving_through_a_broken_manifest(
    served_index, synthetic_dataset_dir, tmp_path
) -> None:
    folder = tmp_path / "index"
    shutil.copytree(served_index, folder)
    engine = SearchEngine(str(folder))
    with TestClient(create_app(engine, reload_interval=0)) as client:
        assert client.post("/api/reload").json()["reloaded"] is False  # nothing changed
        vlfit.Index.build(
            vlfit.Model(engine.runtime), str(folder), dataset_name=synthetic_dataset_dir, split="validation"
        )
        answer = client.post("/api/reload").json()
        assert answer["reloaded"] is True and answer["items"] == 72 and answer["generation"] == 2
        assert answer["search"] == "hnsw"  # the append builds as the index was built (its recorded index_type)
        manifest = folder / "index_manifest.json"
        good = manifest.read_text()
        manifest.write_text(good[: len(good) // 2])  # half-written by something else
        refused = client.post("/api/reload").json()  # the server is degraded, saying why
        assert refused == {**answer, "reloaded": False, "status": "degraded", "reason": refused["reason"]}
        assert refused["reason"].startswith("index/index_manifest.json: does not parse (")
        assert _search(client, text="two red circles on the left.", k=72).json()["generation"] == 2
        assert len(_search(client, text="two red circles on the left.", k=100).json()["results"]) == 72
        manifest.write_text(json.dumps({**json.loads(good)}))  # whole again (another stamp): served
        assert client.post("/api/reload").json()["generation"] == 3


@pytest.mark.slow
def test_without_an_ann_structure_the_snapshot_scans_exactly_to_the_same_results(served_index, tmp_path) -> None:
    from vlfit.serve.engine import Snapshot

    folder = tmp_path / "index"
    shutil.copytree(served_index, folder)
    with_ann = Snapshot(str(folder))
    manifest = json.loads((folder / "index_manifest.json").read_text())
    del manifest["ann"]
    (folder / "index_manifest.json").write_text(json.dumps(manifest))
    exact = Snapshot(str(folder))
    assert with_ann.search_kind == "hnsw" and exact.search_kind == "exact"
    queries = exact.embeddings[:6] if exact.embeddings is not None else None
    assert queries is not None
    for a, b in zip(with_ann.search(queries, 5), exact.search(queries, 5), strict=True):
        assert [hit.id for hit in a] == [hit.id for hit in b]
        assert [hit.score for hit in a] == pytest.approx([hit.score for hit in b], abs=1e-5)


def test_an_item_of_several_captions_is_served_with_all_of_them(synthetic_dataset_dir, tmp_path) -> None:
    from tests.inference.several_captions import IMAGES, captions_of, jpeg, write_csv
    from tests.inference.tiny_models import save_tiny_checkpoint

    model = save_tiny_checkpoint(synthetic_dataset_dir, tmp_path / "model")
    vlfit.Index.build(str(model), str(tmp_path / "index"), dataset_name=str(write_csv(tmp_path / "csv")),
                      split="train", image_column="file_name", caption_column="caption",
                      image_id_column="image_id")  # fmt: skip
    engine = SearchEngine(str(tmp_path / "index"))
    (results,) = engine.search(engine.encode_texts(["picture 2 caption 0"]), 3)
    assert len(results) == 3 and len({result["item"] for result in results}) == 3
    for result in results:
        number = int(result["item"].split("-")[1])
        body = result  # the engine answers with the server's JSON results
        assert body["captions"] == captions_of(number) and body["caption"] == captions_of(number)[0]
        assert engine.snapshot.image_bytes(result["row"]) == jpeg(number)
    assert len(engine.snapshot) == IMAGES
