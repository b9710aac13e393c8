"""Shard URLs as every command reads them: a server that ignores Range, ``--storage_options`` reaching fsspec, and
a lost shard that ends ``vlfit retrieve index`` with exit 2 naming it (over a real loopback HTTP server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoints import save_tiny_checkpoint
from tests.http_shards import ShardServer, webdataset_shard
from vlfit.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"))


def test_retrieve_index_reads_a_server_without_range_with_storage_options_and_exits_2_naming_a_lost_shard(
    checkpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {f"/s/{i:03d}.tar": webdataset_shard(f"s{i}", 5, seed=i)[0] for i in range(3)}
    with ShardServer(files, ranges=False) as server:  # python -m http.server's answers: 200, the whole file
        server.files.pop("/s/002.tar")
        out = tmp_path / "index"
        options = '{"headers": {"X-Shard-Token": "t0k3n"}}'
        argv = ["retrieve", "index", "--model", checkpoint, "--dataset_name", server.url("/s/{000..002}.tar"),
                "--caption_column", "txt", "--output_dir", str(out), "--disable_tqdm", "--dataloader_num_workers", "0",
                "--shard_block_size", "4096", "--storage_options", options]  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"1 of 3 shards could not be indexed: {server.url('/s/002.tar')} (" in err and "404" in err
        assert all(headers.get("X-Shard-Token") == "t0k3n" for headers in server.headers)
    manifest = json.loads((out / "index_manifest.json").read_text())
    assert [shard["source"] for shard in manifest["shards"]] == [server.url("/s/000.tar"), server.url("/s/001.tar")]
    assert sum(shard["count"] for shard in manifest["shards"]) == 10  # every sample of the two shards there
    assert [bad["id"] for bad in manifest["bad_samples"]] == [server.url("/s/002.tar")]  # the next run retries it


def test_index_build_raises_naming_a_lost_shard_and_keeps_the_others(checkpoint: str, tmp_path: Path) -> None:
    import vlfit

    files = {f"/s/{i:03d}.tar": webdataset_shard(f"s{i}", 3, seed=i)[0] for i in range(2)}
    with ShardServer(files) as server:
        server.files.pop("/s/001.tar")
        out = tmp_path / "index"
        with pytest.raises(vlfit.DataError, match=r"1 of 2 shards could not be indexed: .*/s/001\.tar"):
            vlfit.Index.build(checkpoint, str(out), dataset_name=server.url("/s/{000..001}.tar"), caption_column="txt",
                              index_type="flat")  # fmt: skip
    assert len(vlfit.Index.open(str(out))) == 3  # the shard that was there is indexed; a rerun retries the other
