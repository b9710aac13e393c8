"""One owner of device placement: the training loader yields host batches, and the input pipeline's device stage
moves each batch exactly once (accelerate shards and seeds the loader but places nothing; ``_prepare_inputs``
moves nothing already staged). The CUDA-only test checks that the copy runs on the prefetcher's side stream."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from accelerate.data_loader import DataLoaderShard, SeedableRandomSampler
from transformers import TrainingArguments

from tests.data.test_dataset import CAPTIONS, FakeSource
from vlfit.data import device_stage
from vlfit.data.batch import Batch
from vlfit.data.device_stage import CudaPrefetcher, DeviceStage, copy_to_device
from vlfit.data.pipeline import InputPipeline, PipelineOptions, shard_loader
from vlfit.errors import ConfigError
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, InputSpec
from vlfit.models.loading import load_model
from vlfit.models.tokenizer import train_caption_tokenizer
from vlfit.training.trainer import VlfitTrainer

BATCH = 3


class MoveCounter:
    """Counts ``Batch.to`` calls (every move of a batch goes through it, accelerate's ``send_to_device`` too) and
    the devices they went to, by wrapping the real method."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.devices: list[str] = []
        original = Batch.to

        def counted(batch: Batch, device: torch.device | str, non_blocking: bool = False) -> Batch:
            self.devices.append(str(device))
            return original(batch, device, non_blocking=non_blocking)

        monkeypatch.setattr(Batch, "to", counted)

    @property
    def moves(self) -> int:
        return len(self.devices)


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> MoveCounter:
    return MoveCounter(monkeypatch)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VlfitTrainer]:
    """A VlfitTrainer on the tiny preset over 9 samples, as ``vlfit train`` builds one (CPU, 1 loader worker)."""
    bundle = load_model(model_preset="tiny", captions=lambda: CAPTIONS * 5)
    args = TrainingArguments(
        output_dir=str(tmp_path_factory.mktemp("run")), report_to="none", use_cpu=True, max_steps=2,
        per_device_train_batch_size=BATCH, dataloader_num_workers=1, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    pipeline = InputPipeline(bundle.inputs, PipelineOptions(), args.device)
    yield VlfitTrainer(
        model=bundle.model,
        args=args,
        train_dataset=pipeline.dataset(FakeSource(9), train=True),  # type: ignore[arg-type]
        pipeline=pipeline,
        family=bundle.family,
    )


def test_the_trainers_loader_is_sharded_and_seeded_by_accelerate_but_yields_host_batches(
    trainer: VlfitTrainer, moves: MoveCounter
) -> None:
    loader = trainer.get_train_dataloader()
    assert isinstance(loader, DataLoaderShard) and loader.device is None  # accelerate's, placing nothing
    assert isinstance(loader.get_sampler(), SeedableRandomSampler)  # accelerate's seeded order, a new one each epoch
    batches = list(loader)
    assert [len(batch) for batch in batches] == [3, 3, 3]
    for batch in batches:
        assert isinstance(batch, Batch) and not batch.on_device
        assert batch["pixel_values"].dtype == torch.uint8  # the worker's pixels, not yet normalized
        assert all(value.device.type == "cpu" for value in batch.inputs.values())
    assert moves.moves == 0


def test_the_trainers_batches_are_moved_once_by_the_device_stage(trainer: VlfitTrainer, moves: MoveCounter) -> None:
    loader = trainer.get_train_dataloader()
    staged, _ = trainer.get_batch_samples(iter(loader), 2, trainer.args.device)
    assert len(staged) == 2 and all(batch.on_device for batch in staged)
    assert staged[0]["pixel_values"].dtype == torch.float32
    assert moves.devices == [str(trainer.args.device)] * 2  # one move per batch, by the feed's device stage
    for batch in staged:
        assert trainer._prepare_inputs(batch) is batch  # already on the device: not moved again
    assert moves.moves == 2
    trainer._close_feed()


@pytest.mark.slow
def test_training_moves_each_batch_once(trainer: VlfitTrainer, moves: MoveCounter) -> None:
    copies: list[int] = []
    stage_copy = device_stage.copy_to_device

    def counted_copy(batch: Batch, device: torch.device) -> Batch:
        copies.append(len(batch))
        return stage_copy(batch, device)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device_stage, "copy_to_device", counted_copy)
        trainer.train()
    assert copies == [BATCH, BATCH]  # max_steps 2: two batches, each copied by the device stage
    assert moves.moves == 2  # and by nothing else (no accelerate placement, no _prepare_inputs move)


def test_shard_loader_without_an_accelerator_is_one_process_of_the_trainers_wrapping() -> None:
    pipeline = _cpu_pipeline()
    dataset = pipeline.dataset(FakeSource(6), train=True)
    loader = pipeline.loader(dataset, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    prepared = shard_loader(loader)
    assert isinstance(prepared, DataLoaderShard) and prepared.device is None
    assert isinstance(prepared.get_sampler(), SeedableRandomSampler)
    first, second = ([id for batch in prepared for id in batch.sample_ids] for _ in range(2))
    assert sorted(first) == sorted(second) == [f"id{i}" for i in range(6)]  # every sample, each epoch
    assert all(not batch.on_device for batch in prepared)


def test_shard_loader_refuses_dispatched_batches() -> None:
    pipeline = _cpu_pipeline()
    loader = pipeline.loader(pipeline.dataset(FakeSource(2), train=True), batch_size=2)
    with pytest.raises(ConfigError, match="dispatch_batches"):
        shard_loader(loader, SimpleNamespace(dispatch_batches=True))  # type: ignore[arg-type]


def test_the_feed_moves_each_host_batch_once_and_passes_staged_ones(moves: MoveCounter) -> None:
    pipeline = _cpu_pipeline()
    loader = pipeline.loader(pipeline.dataset(FakeSource(6), train=False), batch_size=2)
    staged = list(pipeline.feed(loader, torch.float32, train=False))
    assert len(staged) == 3 and all(batch.on_device for batch in staged)
    assert moves.moves == 3
    assert all(pipeline.to_device(batch, torch.float32, train=False) is batch for batch in staged)
    assert moves.moves == 3


def test_copy_to_device_moves_every_tensor_and_leaves_tensors_already_there() -> None:
    batch = _host_batch()
    meta = torch.device("meta")  # a device that is not the CPU, on every machine
    moved = copy_to_device(batch, meta)
    assert all(value.device == meta for value in moved.inputs.values())
    assert all(value.device.type == "cpu" for value in batch.inputs.values())  # the host batch is untouched
    again = copy_to_device(moved, meta)
    assert all(again.inputs[key] is moved.inputs[key] for key in moved.inputs)  # nothing copied twice


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_prefetcher_copies_pinned_batches_on_its_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda")
    streams: list[torch.cuda.Stream] = []
    stage_copy = device_stage.copy_to_device

    def recorded_copy(batch: Batch, target: torch.device) -> Batch:
        assert all(value.is_pinned() for value in batch.inputs.values())  # non_blocking really is asynchronous
        streams.append(torch.cuda.current_stream(device))
        return stage_copy(batch, target)

    monkeypatch.setattr(device_stage, "copy_to_device", recorded_copy)
    batches = [_host_batch(seed).pin_memory() for seed in range(3)]
    prefetcher = CudaPrefetcher(iter(batches), _stage(), device, torch.bfloat16, train=False)
    out = list(prefetcher)
    assert len(out) == 3 and len(streams) == 3
    assert all(stream == prefetcher.stream for stream in streams)  # every copy on the side stream
    assert all(stream != torch.cuda.current_stream(device) for stream in streams)
    for batch, staged in zip(batches, out, strict=True):
        assert staged.on_device and staged["pixel_values"].device.type == "cuda"
        torch.testing.assert_close(staged["input_ids"].cpu(), batch["input_ids"])
        expected = _stage()(batch, torch.device("cpu"), torch.float32, train=False)["pixel_values"]
        torch.testing.assert_close(staged["pixel_values"].float().cpu(), expected, atol=2e-2, rtol=1e-2)


def _cpu_pipeline() -> InputPipeline:
    tokenizer = train_caption_tokenizer(CAPTIONS * 10, vocab_size=512)
    spec = InputSpec(16, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, tokenizer, max_seq_length=16)
    return InputPipeline(spec, PipelineOptions(), torch.device("cpu"))


def _stage() -> DeviceStage:
    return DeviceStage(8, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)


def _host_batch(seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8, generator=generator).permute(0, 3, 1, 2)
    inputs = {"input_ids": torch.arange(16).view(2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.long),
              "pixel_values": pixels}  # fmt: skip
    return Batch(inputs=inputs, sample_ids=["a", "b"], positions=[0, 1])
