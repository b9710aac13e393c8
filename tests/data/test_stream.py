"""The shard stream (``vlfit.data.stream``) over a real loopback HTTP server and local files: order, splitting,
shuffling, mixing, network faults and exact resume, through real DataLoader workers where it matters."""

from __future__ import annotations

import io
import itertools
import json
import tarfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.utils.data

from tests.http_shards import ShardServer, webdataset_shard, write_files
from vlfit.data.sources.tar import TarSource
from vlfit.data.stream import (
    ShardReader,
    ShardStream,
    StreamItem,
    StreamSource,
    parse_sources,
)
from vlfit.data.stream.fetch import fetch_shards
from vlfit.data.stream.order import pick
from vlfit.data.webdataset import WebDatasetLayout
from vlfit.errors import ConfigError, MissingFileError

SAMPLES_PER_SHARD = 8
A_SHARDS, B_SHARDS = 6, 3
# Small read-ahead blocks, so a shard takes several Range requests and a fault can hit one midway.
BLOCK = {"block_size": 8192}
FAST_RETRIES = {"retries": 2, "backoff": 0.02, "timeout": 2.0}


@pytest.fixture(scope="module")
def shard_files() -> dict[str, bytes]:
    """``/a/000.tar`` .. ``/a/005.tar`` and ``/b/000.tar`` .. ``/b/002.tar``: 8 samples each, keys unique."""
    files = {}
    for source, count in (("a", A_SHARDS), ("b", B_SHARDS)):
        for i in range(count):
            data, _ = webdataset_shard(f"{source}{i}", SAMPLES_PER_SHARD, seed=ord(source) * 10 + i)
            files[f"/{source}/{i:03d}.tar"] = data
    return files


@pytest.fixture(scope="module")
def local_dir(shard_files: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_files(shard_files, tmp_path_factory.mktemp("shards"))


@pytest.fixture()
def server(shard_files: dict[str, bytes]) -> Iterator[ShardServer]:
    with ShardServer(shard_files) as running:
        yield running


def _http(server: ShardServer, source: str = "a", count: int = A_SHARDS) -> str:
    return server.url(f"/{source}/{{000..{count - 1:03d}}}.tar")


def _local(root: Path, source: str = "a", count: int = A_SHARDS) -> str:
    return str(root / source / f"{{000..{count - 1:03d}}}.tar")


def _reader(**options) -> ShardReader:
    return ShardReader(
        WebDatasetLayout(extra_columns=("index",)), **{**FAST_RETRIES, "storage_options": BLOCK, **options}
    )


def _ids(items: Iterable[StreamItem]) -> list[str]:
    return [item.record.id for item in items if item.record is not None]


def _all_keys(sources: str = "ab") -> list[str]:
    counts = {"a": A_SHARDS, "b": B_SHARDS}
    return [f"{s}{i}-{j:04d}" for s in sources for i in range(counts[s]) for j in range(SAMPLES_PER_SHARD)]


def _loader(stream: ShardStream, num_workers: int, batch_size: int = 3) -> torch.utils.data.DataLoader:
    context = "fork" if num_workers else None
    return torch.utils.data.DataLoader(
        stream, batch_size=batch_size, num_workers=num_workers, collate_fn=list, multiprocessing_context=context
    )


# ------------------------------------------------------------------------------------------------- specs


def test_specs_expand_braces_split_sources_and_check_weights(local_dir: Path) -> None:
    spec = f"{_local(local_dir, 'a')}::https://host/b/{{00..02}}.tar"
    a, b = parse_sources(spec, "1,4")
    assert a.urls == tuple(str(local_dir / "a" / f"{i:03d}.tar") for i in range(A_SHARDS)) and a.weight == 1.0
    assert b.urls == ("https://host/b/00.tar", "https://host/b/01.tar", "https://host/b/02.tar") and b.weight == 4.0
    assert [s.weight for s in parse_sources("s3://x/{0..1}.tar::gs://y/0.tar")] == [1.0, 1.0]

    with pytest.raises(ConfigError, match=r"--train_data_weights: 3 weight\(s\) for 2 source\(s\)"):
        parse_sources(spec, [1, 2, 3])
    with pytest.raises(ConfigError, match=r"--train_data_weights: weight '0' must be a positive number"):
        parse_sources(spec, "0,1")
    with pytest.raises(ConfigError, match=r"--w: 'x' is not a number"):
        parse_sources(spec, "x,1", weights_flag="--w")
    with pytest.raises(ConfigError, match=r"--train_file: empty source"):
        parse_sources("https://h/a.tar::")
    with pytest.raises(MissingFileError, match=r"--train_file: shard '.*nowhere.tar' not found"):
        parse_sources(str(local_dir / "nowhere.tar"))
    with pytest.raises(ConfigError, match=r"--train_file: fsspec knows no protocol 'nosuch'"):
        ShardStream(parse_sources("nosuch://host/0.tar"))
    assert [pick([1, 3], [True, True], u) for u in (0.0, 0.24, 0.26, 0.99)] == [0, 0, 1, 1]
    assert pick([1, 3], [False, True], 0.0) == 1


# ------------------------------------------------------------------------------------------------- reading


def test_http_stream_yields_the_local_shards_records_in_order(server: ShardServer, local_dir: Path) -> None:
    in_order = {"shuffle_shards": False, "shuffle_buffer": 0}
    over_http = list(ShardStream(parse_sources(_http(server)), reader=_reader(), **in_order))
    local = list(ShardStream(parse_sources(_local(local_dir)), reader=_reader(), **in_order))
    paths = sorted(str(p) for p in (local_dir / "a").glob("*.tar"))
    indexed = TarSource(paths, name="a", extra_columns=["index"])

    assert len(over_http) == len(indexed) == A_SHARDS * SAMPLES_PER_SHARD
    for streamed, read_locally, expected in zip(over_http, local, indexed, strict=True):
        for record in (streamed.record, read_locally.record):
            assert (record.id, record.image, record.caption, record.extra) == (
                expected.id,
                expected.image,
                expected.caption,
                expected.extra,
            )
    assert indexed[9].caption == "sample 1 of a1" and indexed[9].extra == {"index": 1}
    ranges = [r for method, _, r in server.requests if method == "GET"]
    assert len(ranges) > A_SHARDS and all(r and r.startswith("bytes=") for r in ranges)  # read by Range requests


def test_ranks_and_workers_share_the_shards_without_overlap(server: ShardServer) -> None:
    sources = parse_sources(_http(server))
    per_rank = []
    for rank in range(2):
        stream = ShardStream(sources, reader=_reader(), shuffle_buffer=4, seed=3, rank=rank, world_size=2)
        per_rank.append(Counter(_ids(item for batch in _loader(stream, num_workers=2) for item in batch)))
    assert not set(per_rank[0]) & set(per_rank[1])
    assert per_rank[0] + per_rank[1] == Counter(_all_keys("a"))  # every sample exactly once
    assert all(count == 1 for count in per_rank[0].values())
    roles_per_rank = [{key.split("-")[0] for key in keys} for keys in per_rank]
    assert [len(shards) for shards in roles_per_rank] == [4, 2]  # 6 shards over readers 0..3: 2, 2, 1, 1


def test_shuffle_is_the_same_for_a_seed_and_another_for_another_seed_or_epoch(local_dir: Path) -> None:
    sources = parse_sources(_local(local_dir))

    def order(seed: int, epoch: int = 0) -> list[str]:
        stream = ShardStream(sources, reader=_reader(), shuffle_buffer=16, seed=seed)
        stream.set_epoch(epoch)
        return _ids(stream)

    first = order(1)
    assert order(1) == first
    assert sorted(first) == sorted(_all_keys("a")) and first != sorted(first)
    assert order(2) != first
    assert order(1, epoch=1) != first


def test_sources_are_mixed_by_weight(local_dir: Path) -> None:
    sources = parse_sources(f"{_local(local_dir, 'a')}::{_local(local_dir, 'b', B_SHARDS)}", "1,4")
    resampled = ShardStream(sources, reader=_reader(), resampled=True, seed=5)
    drawn = [key[0] for key in _ids(itertools.islice(iter(resampled), 400))]
    # 80% from b: 320 of 400 expected, standard deviation 8.
    assert 280 <= drawn.count("b") <= 360

    epoch = _ids(ShardStream(sources, reader=_reader(), seed=5))
    assert sorted(epoch) == sorted(_all_keys("ab"))  # without resampling, every sample once
    first = [key[0] for key in epoch[:20]]  # b (24 samples) is not yet exhausted in the first 20 draws
    assert first.count("b") >= 11


def test_a_sample_without_an_image_is_counted_and_skipped(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in (("k0.jpg", b"\xff\xd8"), ("k0.txt", b"ok"), ("k1.txt", b"no image"), ("k2.png", b"p")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    (tmp_path / "s.tar").write_bytes(buffer.getvalue())
    stream = ShardStream(parse_sources(str(tmp_path / "s.tar")), reader=_reader())
    items = list(stream)
    assert _ids(items) == ["k0", "k2"]
    for item in items:
        stream.mark_consumed(item.position)
    assert stream.bad_sample_count == 1
    (key, reason), *_ = items[-1].position.bad_samples or items[0].position.bad_samples
    assert key == "k1" and "has no image member" in reason


# ------------------------------------------------------------------------------------------------- faults


def test_a_shard_answering_500_is_retried_and_read_whole(server: ShardServer) -> None:
    server.fail("/a/002.tar", 500, times=2)
    stream = ShardStream(parse_sources(_http(server)), reader=_reader(), shuffle_shards=False)
    items = list(stream)
    for item in items:
        stream.mark_consumed(item.position)
    assert _ids(items) == _all_keys("a") and stream.bad_shards == []
    assert sum(1 for _, path, _ in server.requests if path == "/a/002.tar") >= 3


@pytest.mark.parametrize("block_size", [8192, 0], ids=["range-requests", "one-streamed-get"])
def test_a_connection_dropped_midway_resumes_without_duplicates(server: ShardServer, block_size: int) -> None:
    size = len(server.files["/a/001.tar"])
    server.drop("/a/001.tar", at_byte=size * 3 // 4)  # in the second Range request, after samples were read
    stream = ShardStream(
        parse_sources(_http(server)), reader=_reader(storage_options={"block_size": block_size}), shuffle_shards=False
    )

    def requests(method: str) -> list[str | None]:
        return [r for m, path, r in server.requests if path == "/a/001.tar" and m == method]

    ids, attempt_of_a1 = [], []
    for item in stream:
        stream.mark_consumed(item.position)
        ids.append(item.record.id)
        if item.record.id.startswith("a1-"):
            attempt_of_a1.append(len(requests("HEAD")))  # fsspec opens a file with a HEAD
    assert ids == _all_keys("a") and stream.bad_sample_count == 0 and stream.bad_shards == []
    assert attempt_of_a1[0] == 1 and attempt_of_a1[-1] == 2  # samples came both before the cut and after it
    gets = requests("GET")
    if block_size:  # the retry seeks to the first sample not yet read: no second read from byte 0
        assert gets[-1] and not gets[-1].startswith("bytes=0-")
    else:  # a streamed GET cannot seek: it is read again from the start, the samples already yielded skipped
        assert gets == [None, None]


def test_a_server_that_ignores_range_is_read_whole_by_streams_and_copies(
    shard_files: dict[str, bytes], tmp_path: Path
) -> None:
    with ShardServer(shard_files, ranges=False) as plain:  # 200 and the whole file to every Range request
        stream = ShardStream(parse_sources(_http(plain)), reader=_reader(), shuffle_shards=False)
        items = list(stream)
        for item in items:
            stream.mark_consumed(item.position)
        assert _ids(items) == _all_keys("a") and stream.bad_shards == [] and stream.bad_sample_count == 0
        gets = [r for method, path, r in plain.requests if method == "GET" and path != "/a/000.tar"]
        assert gets and all(r is None for r in gets)  # once seen, the host's shards are one plain GET each

        copies = fetch_shards([plain.url("/b/000.tar")], _reader(), str(tmp_path))
        assert Path(copies[0]).read_bytes() == shard_files["/b/000.tar"]


def test_permanent_errors_are_given_up_at_once_and_transient_ones_retried(shard_files: dict[str, bytes]) -> None:
    html = b"<!DOCTYPE html><html><body>" + b"Sorry, this page moved. " * 40 + b"</body></html>"
    files = {**shard_files, "/a/002.tar": html}
    with ShardServer(files) as server:
        server.files.pop("/a/001.tar")  # 404
        server.fail("/a/003.tar", 403)
        server.fail("/a/004.tar", 410)
        server.fail("/a/005.tar", 503, times=2)  # transient (fsspec's HEAD, then its GET): read whole on the retry
        reader = _reader(retries=3, backoff=0.3)  # a retry of each permanent error would wait 0.3 + 0.6 + 1.2 s
        stream = ShardStream(parse_sources(_http(server)), reader=reader, shuffle_shards=False)
        started = time.monotonic()
        items = list(stream)
        elapsed = time.monotonic() - started
        for item in items:
            stream.mark_consumed(item.position)
        assert _ids(items) == [k for k in _all_keys("a") if k.startswith(("a0-", "a5-"))]
        bad = {shard.url.rsplit("/", 1)[1]: shard.reason for shard in stream.bad_shards}
        assert sorted(bad) == ["001.tar", "002.tar", "003.tar", "004.tar"]
        assert "404" in bad["001.tar"] and "not a tar archive" in bad["002.tar"] and "HTML" in bad["002.tar"]
        assert "403" in bad["003.tar"] and "410" in bad["004.tar"]
        heads = Counter(path for method, path, _ in server.requests if method == "HEAD")
        assert [heads[f"/a/00{i}.tar"] for i in range(1, 5)] == [1, 1, 1, 1]  # opened once: no retry
        assert heads["/a/005.tar"] == 2 and 0.3 <= elapsed < 1.5  # one retry, after one backoff


def test_missing_and_stalled_shards_become_bad_shards_and_the_rest_is_read(server: ShardServer) -> None:
    server.files.pop("/a/001.tar")
    server.stall("/a/004.tar")
    stream = ShardStream(
        parse_sources(_http(server)), reader=_reader(retries=1, timeout=1.0, backoff=0.05), shuffle_shards=False
    )
    started = time.monotonic()
    items = list(stream)
    elapsed = time.monotonic() - started
    for item in items:
        stream.mark_consumed(item.position)
    good = [k for k in _all_keys("a") if not k.startswith(("a1-", "a4-"))]
    assert _ids(items) == good
    assert elapsed < 15
    bad = {shard.url.rsplit("/", 1)[1]: shard for shard in stream.bad_shards}
    assert sorted(bad) == ["001.tar", "004.tar"]
    assert "404" in bad["001.tar"].reason and bad["001.tar"].samples_read == 0
    assert "Timeout" in bad["004.tar"].reason and bad["004.tar"].url == server.url("/a/004.tar")


def test_a_reader_whose_last_shard_is_bad_still_reports_it(server: ShardServer) -> None:
    server.files.pop("/b/002.tar")
    stream = ShardStream(parse_sources(_http(server, "b", B_SHARDS)), reader=_reader(retries=0), shuffle_shards=False)
    items = list(stream)
    assert items[-1].record is None and [b.url for b in items[-1].position.bad_shards] == [server.url("/b/002.tar")]
    assert len(_ids(items)) == 2 * SAMPLES_PER_SHARD


# ------------------------------------------------------------------------------------------------- resume


def _mixed(local_dir: Path) -> list[StreamSource]:
    return parse_sources(f"{_local(local_dir, 'a')}::{_local(local_dir, 'b', B_SHARDS)}", "2,1")


def test_a_resumed_stream_continues_exactly(local_dir: Path) -> None:
    settings = {"reader": _reader(), "shuffle_buffer": 10, "seed": 7}
    full = _ids(ShardStream(_mixed(local_dir), **settings))
    for consumed in (1, 13, 40, len(full) - 1):
        stream = ShardStream(_mixed(local_dir), **settings)
        head = []
        for item in itertools.islice(iter(stream), consumed):
            stream.mark_consumed(item.position)
            head.append(item.record.id)
        state = json.loads(json.dumps(stream.state_dict()))  # plain values
        resumed = ShardStream(_mixed(local_dir), **settings)
        resumed.load_state_dict(state)
        assert head + _ids(resumed) == full, consumed


# 1 worker resumes as 0 do (one reader per process); training's resume test runs 2 (tests/training).
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resumed_dataloader_continues_exactly(server: ShardServer, num_workers: int) -> None:
    sources = parse_sources(f"{_http(server, 'a')}::{_http(server, 'b', B_SHARDS)}", "1,1")
    settings = {"reader": _reader(), "shuffle_buffer": 6, "seed": 11}
    full = [_ids(batch) for batch in _loader(ShardStream(sources, **settings), num_workers)]

    stream = ShardStream(sources, **settings)
    head = []
    batches = iter(_loader(stream, num_workers))
    for batch in itertools.islice(batches, 5):  # 5 batches: worker 1 is due next
        for item in batch:
            stream.mark_consumed(item.position)
        head.append(_ids(batch))
    for _ in batches:  # read on while the server is up, so the workers end now, not when collected after it closed
        pass
    state = stream.state_dict()
    assert state["next_worker"] == (1 if num_workers == 2 else 0)

    resumed = ShardStream(sources, **settings)
    resumed.load_state_dict(state)
    rest = [_ids(batch) for batch in _loader(resumed, num_workers)]
    assert head + rest == full
    assert sorted(itertools.chain(*full)) == sorted(_all_keys("ab"))


def test_a_state_is_refused_by_another_stream(local_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = ShardStream(_mixed(local_dir), reader=_reader(), shuffle_buffer=4, seed=1)
    for item in itertools.islice(iter(stream), 3):
        stream.mark_consumed(item.position)
    state = stream.state_dict()
    with pytest.raises(ConfigError, match=r"saved with another seed \(1, now 2\)"):
        ShardStream(_mixed(local_dir), reader=_reader(), shuffle_buffer=4, seed=2).load_state_dict(state)
    other = ShardStream(_mixed(local_dir), reader=_reader(), shuffle_buffer=4, seed=1)
    other.load_state_dict(state)
    # As in loader worker 0 of 2 (a failed DataLoader's workers take torch's 5 s shutdown timeout each to stop).
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(num_workers=2, id=0))
    with pytest.raises(ConfigError, match=r"--dataloader_num_workers 1"):
        next(iter(other))
