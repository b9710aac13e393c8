"""The input pipeline on a shard stream: streamed bytes over loopback HTTP decode, through the fast pipeline and
loader workers, to the pixels the same shards give read locally; a bad image is left out and counted; the
positions batches carry resume the loader exactly."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch

from tests.data.test_dataset import CAPTIONS
from tests.http_shards import ShardServer, webdataset_shard
from vlfit.data.pipeline import InputPipeline, LoaderSettings, PipelineOptions
from vlfit.data.sources.tar import TarSource
from vlfit.data.stream import ShardReader, ShardStream, parse_sources
from vlfit.data.webdataset import WebDatasetLayout
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, InputSpec
from vlfit.models.tokenizer import train_caption_tokenizer

CPU = torch.device("cpu")

SHARDS, PER_SHARD, BATCH = 4, 6, 4


def _with_a_broken_image(shard: bytes) -> bytes:
    """The shard with one more sample whose ``.jpg`` is not an image."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(shard), mode="r:") as src, tarfile.open(fileobj=out, mode="w") as dst:
        for member in src:
            dst.addfile(member, src.extractfile(member))
        for ext, data in (("jpg", b"not a jpeg at all"), ("txt", b"a caption")):
            info = tarfile.TarInfo(f"broken.{ext}")
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, bytes]:
    files = {f"/s/{i:03d}.tar": webdataset_shard(f"s{i}", PER_SHARD, seed=i, size=40)[0] for i in range(SHARDS)}
    files["/s/001.tar"] = _with_a_broken_image(files["/s/001.tar"])
    return files


@pytest.fixture(scope="module")
def pipeline() -> InputPipeline:
    tokenizer = train_caption_tokenizer(CAPTIONS * 10, vocab_size=512)
    spec = InputSpec(32, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, tokenizer, max_seq_length=16)
    return InputPipeline(spec, PipelineOptions(), torch.device("cpu"))


def _stream(server: ShardServer) -> ShardStream:
    sources = parse_sources(server.url("/s/{000..003}.tar"))
    reader = ShardReader(WebDatasetLayout(), retries=1, timeout=5, backoff=0.05)
    return ShardStream(sources, reader=reader, shuffle_buffer=5, seed=3)


def _loader(pipeline: InputPipeline, stream: ShardStream, workers: int):
    dataset = pipeline.stream_dataset(stream, train=False)
    return pipeline.loader(dataset, batch_size=BATCH, settings=LoaderSettings(num_workers=workers))


def test_streamed_shards_decode_to_the_pixels_of_local_reads_and_resume_exactly(
    pipeline: InputPipeline, shards: dict[str, bytes], tmp_path: Path
) -> None:
    for path, data in shards.items():
        (tmp_path / Path(path).name).write_bytes(data)
    local = TarSource(sorted(str(p) for p in tmp_path.glob("*.tar")), name="local shards")
    expected = {}
    for batch in pipeline.loader(pipeline.dataset(local, train=False), batch_size=BATCH):
        expected.update(zip(batch.sample_ids, batch["pixel_values"], strict=True))

    with ShardServer(shards) as server:
        batches = list(_loader(pipeline, _stream(server), workers=2))
        got = {
            i: pixels for batch in batches for i, pixels in zip(batch.sample_ids, batch["pixel_values"], strict=True)
        }
        assert sorted(got) == sorted(expected)  # every good sample once, the broken one left out
        assert all(torch.equal(got[i], expected[i]) for i in got)  # the fast pipeline, unchanged on streamed bytes
        bad = [b for batch in batches for b in batch.bad_samples]
        assert [b.id for b in bad] == ["broken"] and "not an image" in bad[0].reason
        assert sum(len(b) for b in batches) == SHARDS * PER_SHARD
        assert all(b.stream_positions for b in batches)

        # Resume after two batches: the batches the uninterrupted loader gave next, in order.
        stream = _stream(server)
        for batch in batches[:2]:
            for position in batch.stream_positions:
                stream.mark_consumed(position)
        resumed = _stream(server)
        resumed.load_state_dict(stream.state_dict())
        rest = [batch.sample_ids for batch in _loader(pipeline, resumed, workers=2)]
        assert rest == [batch.sample_ids for batch in batches[2:]]


def test_device_decode_takes_streamed_bytes_as_it_takes_local_ones(
    pipeline: InputPipeline, shards: dict[str, bytes], tmp_path: Path
) -> None:
    """``--decode_on_device`` on a stream: workers pass the streamed bytes on, the device stage decodes them (its
    CPU seam here: the code path nvJPEG runs on a GPU), to the pixels the same shards give read locally."""
    seam = InputPipeline(pipeline.inputs, PipelineOptions(decode_on_device=True), CPU, cpu_device_decode=True)
    for path, data in shards.items():
        (tmp_path / Path(path).name).write_bytes(data)
    local = TarSource(sorted(str(p) for p in tmp_path.glob("*.tar")), name="local shards")

    def decoded(batches) -> tuple[dict[str, torch.Tensor], list[str]]:
        pixels, bad = {}, []
        for batch in seam.feed(batches, torch.float32, train=False):
            bad += [b.id for b in batch.bad_samples]
            if len(batch):  # a batch whose every image was bad is empty once the device stage has decoded it
                pixels.update(zip(batch.sample_ids, batch["pixel_values"], strict=True))
        return pixels, bad

    expected, _ = decoded(seam.loader(seam.dataset(local, train=False), batch_size=BATCH))
    with ShardServer(shards) as server:
        loader = seam.loader(seam.stream_dataset(_stream(server), train=False), batch_size=BATCH)
        got, bad = decoded(loader)
    assert sorted(got) == sorted(expected) and len(got) == SHARDS * PER_SHARD
    assert all(torch.equal(got[i], expected[i]) for i in got)
    assert bad == ["broken"]  # the image the device stage could not decode, left out and named
