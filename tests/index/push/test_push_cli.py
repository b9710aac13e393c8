"""vlfit retrieve push and query --index URI, vlfit.Index.push and Index.open(URI): an index of a real (tiny) model
pushed to each vector database answers text queries with the local index's hits, and every refusal is one line
naming the target."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

import vlfit
from tests.index.push.conftest import write_synthetic_index
from vlfit.cli import main
from vlfit.errors import ConfigError, MissingExtraError
from vlfit.extras import EXTRAS
from vlfit.index.push.base import TARGETS, TargetError, open_target, parse_target

QUERIES = ["picture 2 caption 0", "a red square", "something else entirely"]


@pytest.fixture(scope="module")
def image_index(tiny_checkpoint, image_folder, tmp_path_factory) -> str:
    """An index of the image folder by the tiny checkpoint (its ANN structure: flat, so exact)."""
    folder = str(tmp_path_factory.mktemp("push") / "index")
    vlfit.Index.build(str(tiny_checkpoint), folder, images=str(image_folder))
    return folder


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("Loading weights")]
    assert len(lines) == 1, lines
    return lines[0]


def test_each_target_answers_text_queries_with_the_local_index_hits(uri, image_index) -> None:
    local = vlfit.Index.open(image_index)
    report = local.push(uri, batch_size=5)
    assert report["pushed"] == len(local) and report["total"] == len(local)

    pushed = vlfit.Index.open(uri)  # its model: the one the collection records
    assert pushed.model.runtime.encoder.identity == local.model.runtime.encoder.identity
    for expected, found in zip(local.search(QUERIES, k=10), pushed.search(QUERIES, k=10), strict=True):
        assert [hit.id for hit in found] == [hit.id for hit in expected]  # paths relative to the folder indexed
        assert [hit.row for hit in found] == [hit.row for hit in expected]
        np.testing.assert_allclose([hit.score for hit in found], [hit.score for hit in expected], atol=1e-5)


@pytest.mark.slow
def test_retrieve_push_then_query_prints_what_the_local_query_prints(image_index, tmp_path, capsys) -> None:
    uri = f"lancedb:{tmp_path / 'lance'}#photos"
    assert main(["retrieve", "push", "--index", image_index, "--to", uri, "--json", "--disable_tqdm"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["created"] and report["pushed"] == report["total"] > 0
    assert main(["retrieve", "push", "--index", image_index, "--to", uri, "--disable_tqdm"]) == 0
    assert f"{uri}: pushed 0 items" in capsys.readouterr().out

    answers = []
    for index in (image_index, uri):
        assert main(["retrieve", "query", "--index", index, "--text", QUERIES[0], "--exact", "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    local, pushed = (answer["queries"][0]["results"] for answer in answers)
    assert [{**hit, "score": None} for hit in pushed] == [{**hit, "score": None} for hit in local]
    np.testing.assert_allclose([hit["score"] for hit in pushed], [hit["score"] for hit in local], atol=1e-5)
    assert answers[0]["model"] == answers[1]["model"]


@pytest.mark.slow
def test_a_qdrant_local_push_and_query_exit_without_a_traceback(image_index, tmp_path) -> None:
    """A Qdrant local-mode client left open to interpreter exit printed an "Exception ignored in
    QdrantClient.__del__" traceback after every push's and query's answer: only a process's exit shows it."""
    import subprocess

    uri = f"qdrant:{tmp_path / 'qdrant'}"
    for argv in (["push", "--index", image_index, "--to", uri, "--disable_tqdm"],
                 ["query", "--index", uri, "--text", QUERIES[0]]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "vlfit", "retrieve", *argv], capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0 and done.stdout, done.stderr[-2000:]
        assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_refused_push_ends_in_one_line_naming_the_target(image_index, tmp_path, capsys) -> None:
    uri = f"lancedb:{tmp_path / 'lance'}"
    identity = json.loads((Path(image_index) / "index_manifest.json").read_text())["identity"]
    write_synthetic_index(tmp_path / "other", 10, dim=identity["embedding_size"], family=identity["family"],
                          source="preset:another")  # fmt: skip
    assert main(["retrieve", "push", "--index", str(tmp_path / "other"), "--to", uri, "--disable_tqdm"]) == 0
    capsys.readouterr()
    assert main(["retrieve", "push", "--index", image_index, "--to", uri, "--disable_tqdm"]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"vlfit retrieve: error: {uri}: the collection holds embeddings of the preset:another, "
                           "the index of checkpoint "), line  # fmt: skip


def test_rerank_against_a_pushed_collection_is_refused_before_the_model_loads(tmp_path, capsys) -> None:
    argv = ["retrieve", "query", "--index", f"qdrant:{tmp_path}", "--text", "x", "--rerank_top_k", "5"]
    assert main(argv) == 2
    assert "--rerank_top_k reads the candidates' images, which qdrant:" in _error_line(capsys)


@pytest.mark.parametrize("scheme", sorted(TARGETS))
def test_a_target_without_its_extra_names_the_extra_to_install(scheme, monkeypatch) -> None:
    extra = TARGETS[scheme][1]
    for module in EXTRAS[extra]:
        monkeypatch.setitem(sys.modules, module, None)
    text = "postgresql://localhost/db" if scheme == "postgresql" else f"{scheme}:somewhere"
    with pytest.raises(MissingExtraError) as missing:
        open_target(text)
    assert str(missing.value) == (
        f"--to {scheme}: needs the {extra} extra ({', '.join(EXTRAS[extra])} not installed): pip install "
        f"'vlfit[{extra}]'"
    )


SERVERS = ["qdrant:http://127.0.0.1:{port}", "chroma:http://127.0.0.1:{port}",
           "postgresql://postgres@127.0.0.1:{port}/db", "milvus:http://127.0.0.1:{port}"]  # fmt: skip


@pytest.mark.parametrize("form", SERVERS)
def test_a_server_that_is_down_is_one_line_naming_it(form) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    uri = form.format(port=port)
    with pytest.raises(TargetError) as refused:
        vlfit.Index.open(uri)
    message = str(refused.value)
    assert message.startswith(f"{uri}: ") and "check that the server is up" in message and "\n" not in message


def test_target_uris_name_the_engine_location_and_collection() -> None:
    cases = {
        "lancedb:runs/vectors#photos": ("lancedb", "runs/vectors", "photos", False),
        "qdrant::memory:": ("qdrant", ":memory:", "vlfit", False),
        "qdrant:https://db.example:6333#photos": ("qdrant", "https://db.example:6333", "photos", True),
        "chroma:/data/chroma": ("chroma", "/data/chroma", "vlfit", False),
        "postgres://me:pw@host:5433/photos#items": ("postgresql", "postgresql://me:pw@host:5433/photos", "items", True),
        "milvus:vectors.db#photos": ("milvus", "vectors.db", "photos", False),
    }
    for text, (scheme, location, collection, remote) in cases.items():
        uri = parse_target(text)
        assert (uri.scheme, uri.location, uri.collection, uri.remote, uri.text) == (
            scheme, location, collection, remote, text
        )  # fmt: skip
    for text, message in [
        ("runs/index", "--to runs/index: not a vector database; give one of lancedb:PATH"),
        ("lancedb:", "--to lancedb:: no location after lancedb:"),
        ("chroma::memory:", "only qdrant has an in-memory mode"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_target(text)


@pytest.mark.parametrize(
    ("text", "forms"),
    [
        ("qdrant:ftp://x", "qdrant:PATH, qdrant::memory: or qdrant:http(s)://HOST:PORT"),
        ("chroma:ftp://x#photos", "chroma:PATH or chroma:http(s)://HOST:PORT"),
        ("milvus:tcp://host:19530", "milvus:PATH.db (Milvus Lite's file) or milvus:http(s)://HOST:PORT"),
        ("lancedb:https://host/x", "lancedb:PATH (a folder; or object storage: s3://, gs://, az://)"),
    ],
)
def test_a_location_of_a_url_scheme_the_engine_does_not_take_is_refused_naming_the_flag_and_forms(
    text, forms, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = text.partition(":")[2].partition("://")[0]
    with pytest.raises(ConfigError) as refused:
        open_target(text)
    engine = text.partition(":")[0]
    assert str(refused.value) == f"--to {text}: {engine} does not take {url}:// locations; give {forms}"
    assert list(tmp_path.iterdir()) == []  # no folder named "ftp:" made of it
    for kept in ("qdrant:C://vectors", "lancedb:s3://bucket/vectors", "milvus:https://host:19530"):
        parse_target(kept)  # a Windows drive, object storage and a server stay what they were
