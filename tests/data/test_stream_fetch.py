"""Shard URLs read from local copies (``vlfit.data.stream.fetch``): evaluation splits, ``vlfit prepare`` and a
``--dataset_name`` of URLs, over a real loopback HTTP server with faults injected."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.http_shards import ShardServer, webdataset_shard, write_files
from vlfit.data.prepare.manifest import MANIFEST_NAME
from vlfit.data.sources import open_splits
from vlfit.data.sources.tar import TarSource
from vlfit.data.stream import ShardReader, ShardUnreadableError
from vlfit.data.stream.fetch import fetch_shards

FAST_RETRIES = {"retries": 2, "backoff": 0.02, "timeout": 2.0}
BLOCK = {"block_size": 4096}  # several Range requests per shard, so a cut connection can be resumed midway


@pytest.fixture(scope="module")
def shards() -> dict[str, bytes]:
    """``/a/000.tar``, ``/a/001.tar`` and ``/b/000.tar``: 6 samples each, keys unique."""
    return {
        f"/{source}/{i:03d}.tar": webdataset_shard(f"{source}{i}", 6, seed=10 * ord(source) + i)[0]
        for source, count in (("a", 2), ("b", 1))
        for i in range(count)
    }


@pytest.fixture(scope="module")
def local(shards: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_files(shards, tmp_path_factory.mktemp("local"))


def _records(source: TarSource) -> list[tuple[str, bytes, str | None]]:
    return [(record.id, record.image, record.caption) for record in source]


def test_a_cut_connection_resumes_at_the_byte_reached(shards: dict[str, bytes], tmp_path: Path) -> None:
    data = shards["/a/000.tar"]
    path = tmp_path / "copy.tar"
    with ShardServer(shards) as server:
        server.drop("/a/000.tar", at_byte=len(data) // 2)
        reader = ShardReader(**FAST_RETRIES, storage_options=BLOCK)
        assert reader.copy_to(server.url("/a/000.tar"), str(path), chunk_size=4096) == len(data)
        starts = [int(r.split("=")[1].split("-")[0]) for m, p, r in server.requests if m == "GET" and r]
    assert path.read_bytes() == data and os.listdir(tmp_path) == ["copy.tar"]
    # the chunk cut midway is asked for again, from where the copy had got to: not the shard from its start
    again = [start for i, start in enumerate(starts) if start in starts[:i]]
    assert again and 0 < min(again) <= len(data) // 2 and starts.count(0) == 1, starts


def test_a_shard_that_keeps_failing_is_named_and_leaves_no_file(shards: dict[str, bytes], tmp_path: Path) -> None:
    with ShardServer(shards) as server:
        server.fail("/b/000.tar", status=500)
        url = server.url("/b/000.tar")
        with pytest.raises(ShardUnreadableError, match=rf"shard {url} could not be read: .*500") as caught:
            fetch_shards([server.url("/a/000.tar"), url], ShardReader(**FAST_RETRIES), str(tmp_path), threads=2)
        gets = [p for method, p, _ in server.requests if p == "/b/000.tar"]
    assert caught.value.bad_shard.url == url
    assert len(gets) >= 1 + FAST_RETRIES["retries"]
    assert sorted(os.listdir(tmp_path)) == ["00000-000.tar"]  # the good one; no partial file of the bad one


def test_url_splits_read_as_the_same_shards_locally(shards: dict[str, bytes], local: Path) -> None:
    """A ``::`` spec of URLs as --validation_file and a URL pattern as --dataset_name open as the local shards do."""
    with ShardServer(shards) as server:
        spec = f"{server.url('/a/{000..001}.tar')}::{server.url('/b/000.tar')}"
        splits = open_splits(validation_file=spec, test_file=str(local / "b" / "000.tar"), caption_column="txt")
        named = open_splits(dataset_name=server.url("/a/{000..001}.tar"), caption_column="txt")
    expected = TarSource(
        [str(local / "a" / "000.tar"), str(local / "a" / "001.tar"), str(local / "b" / "000.tar")],
        name="local",
        caption_column="txt",
    )
    assert list(splits) == ["validation", "test"]
    assert _records(splits["validation"]) == _records(expected) and len(expected) == 18
    assert spec in splits["validation"].name  # messages name the URLs, not only the copies
    assert _records(named["train"]) == _records(expected)[:12]


def test_prepare_reads_shard_urls(shards: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vlfit.commands.prepare import main

    out = tmp_path / "prepared"
    with ShardServer(shards) as server:
        spec = server.url("/a/{000..001}.tar")
        argv = ["--train_file", spec, "--caption_column", "txt", "--output_dir", str(out), "--short_side", "16"]
        assert main([*argv, "--progress", "false"]) == 0
    assert "prepared 12 samples" in capsys.readouterr().out
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["settings"]["source"]["train_file"] == [server.url("/a/000.tar"), server.url("/a/001.tar")]
    prepared = open_splits(dataset_name=str(out), caption_column="txt")["train"]
    assert sorted(r.id for r in prepared) == sorted(f"a{i}-{j:04d}" for i in range(2) for j in range(6))
