"""``InputPipeline``: the one object that turns a source into model-ready batches, and the one place a DataLoader
is built.

Built once from the model's ``InputSpec`` (image size, mean, std, tokenizer), the pipeline options
(``--image_pipeline``, ``--decode_on_device``, augmentation, ``--bad_sample_policy``) and the device. It owns the
choice of CPU transform, the collator, the DataLoader settings, the device stage and the CUDA prefetcher:

    source --dataset()--> ImageTextDataset --loader()--> Batch (host) --feed()--> Batch (on the device)

The feed is the one owner of device placement: it copies each host batch to the device once (on CUDA on the
prefetcher's side stream). Training wraps the loader with ``shard_loader``, which lets accelerate shard and seed
it across processes without placing its batches; ``vlfit bench`` and the worker probe wrap theirs the same way.
The trainer, ``vlfit eval``, the bench and the worker probe all go through it (in the spirit of composer's
``DataSpec`` and timm's ``create_loader``); code that embeds on the CPU (the index, export, few-shot, classify)
takes its host batches from ``host_batches``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, Sampler
from transformers.trainer_pt_utils import AcceleratorConfig

from vlfit.data.batch import Batch
from vlfit.data.dataset import ImageTextCollator, ImageTextDataset, ImageTransform
from vlfit.data.device_stage import CudaPrefetcher, DeviceStage
from vlfit.data.image_inputs import image_transform
from vlfit.data.image_transforms import PassThroughEncoded, ReferenceImageTransform
from vlfit.data.naflex import check_naflex_options
from vlfit.data.records import EVAL_COLUMNS
from vlfit.data.worker_pipes import loader_context
from vlfit.errors import ConfigError, DataError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vlfit.data.sources.base import ImageTextSource
    from vlfit.data.stream import ShardStream
    from vlfit.data.stream.dataset import StreamingImageTextDataset
    from vlfit.models.family import InputSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineOptions:
    """How samples become model inputs (the data flags of ``vlfit train``).

    Attributes:
        image_pipeline: ``fast`` (DCT-scaled decode, uint8 resize in workers, normalize on the device) or
            ``reference`` (run_bridgetower.py's Pillow/float pipeline, all on the CPU).
        decode_on_device: Workers only read bytes; the device stage decodes (CUDA only; elsewhere the CPU
            pipeline is used, with a warning).
        random_resized_crop: Random resized crop in training (fast pipeline).
        horizontal_flip: Random horizontal flip in training, on the device.
        bad_sample_policy: ``skip`` or ``raise`` (see ``vlfit.data.bad_samples``).
        hard_negative_column: A column of alternative captions per sample: batches carry them tokenized as
            hard negatives (``vlfit.data.hard_negatives``); ``None``: none.
    """

    image_pipeline: str = "fast"
    decode_on_device: bool = False
    random_resized_crop: bool = False
    horizontal_flip: bool = False
    bad_sample_policy: str = "skip"
    hard_negative_column: str | None = None

    @classmethod
    def from_arguments(cls, data_args: Any) -> PipelineOptions:
        """The options of ``vlfit.arguments.DataArguments`` (or anything with the same fields)."""
        return cls(
            image_pipeline=data_args.image_pipeline,
            decode_on_device=data_args.decode_on_device,
            random_resized_crop=data_args.random_resized_crop,
            horizontal_flip=data_args.horizontal_flip,
            bad_sample_policy=data_args.bad_sample_policy,
            hard_negative_column=getattr(data_args, "hard_negative_column", None),
        )


@dataclass(frozen=True)
class LoaderSettings:
    """DataLoader settings (the ``--dataloader_*`` flags of ``TrainingArguments``)."""

    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    multiprocessing_context: str | None = None
    in_order: bool = True
    drop_last: bool = False

    @classmethod
    def from_training_args(cls, args: Any, *, drop_last: bool | None = None) -> LoaderSettings:
        """The settings of ``transformers.TrainingArguments``; pinned memory only where it helps (CUDA copies)."""
        return cls(
            num_workers=args.dataloader_num_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            pin_memory=bool(args.dataloader_pin_memory) and args.device.type == "cuda",
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=getattr(args, "dataloader_multiprocessing_context", None),
            in_order=getattr(args, "dataloader_in_order", True),
            drop_last=args.dataloader_drop_last if drop_last is None else drop_last,
        )


def shard_loader(loader: DataLoader, accelerator: Accelerator | None = None) -> DataLoader:
    """``loader`` as accelerate prepares it for the Trainer, except that its batches stay on the host.

    accelerate keeps what it does for a loader: split the batches across processes, seed the sampler
    (``SeedableRandomSampler``, a new order each epoch) and synchronize the RNG states. It does not place the
    batches (``device_placement=False``): the pipeline's ``DeviceFeed`` copies each one to the device, once.

    Args:
        loader: A loader from ``InputPipeline.loader``.
        accelerator: The run's accelerator (the Trainer's). ``None``: one process, with the loader settings of
            the Trainer's default accelerator (what ``vlfit bench`` and the worker probe measure).

    Raises:
        ConfigError: when the accelerator dispatches batches from the main process (``dispatch_batches``), which
            it can only do by placing them.
    """
    if accelerator is None:
        defaults = AcceleratorConfig()
        return prepare_data_loader(
            loader,
            num_processes=1,
            process_index=0,
            put_on_device=False,
            split_batches=defaults.split_batches,
            even_batches=defaults.even_batches,
            use_seedable_sampler=defaults.use_seedable_sampler,
        )
    if accelerator.dispatch_batches:
        raise ConfigError(
            "accelerator_config dispatch_batches=True is not supported: the input pipeline places batches on the "
            "device itself, so every process reads its own share"
        )
    return accelerator.prepare_data_loader(loader, device_placement=False)


def handed_over_batches(batches: Iterable[Batch]) -> Iterator[Batch]:
    """``batches``, with a loader worker that died while handing one over named as such.

    A batch's tensors travel from a loader worker as file descriptors the main process fetches from that worker:
    when it has just died (killed, or a native library calling ``exit``), the fetch fails with ``EOFError`` or a
    connection error before torch's own check reports the death.
    """
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except (EOFError, ConnectionResetError, ConnectionRefusedError) as error:
            raise RuntimeError(
                f"a DataLoader worker exited unexpectedly while handing over a batch ({type(error).__name__}"
                f"{': ' + str(error) if str(error) else ''}): its own error, if it printed one, is above; rerun with "
                "--dataloader_num_workers 0 to meet a failing sample's error in the main process"
            ) from error
        yield batch


class DeviceFeed:
    """Model-ready batches on the device, from an iterator of host batches.

    The one place batches move to the device: each host batch is copied once, by the device stage. On CUDA the
    next batch's copy (from pinned memory) and device stage run on a side stream while the current one computes
    (``CudaPrefetcher``); elsewhere they run right after the batch arrives. ``last_wait`` is the time the last
    ``next()`` was blocked waiting for the loader: on CUDA that includes launching the next batch's device stage
    (it is what the compute stream waits behind), on CPU it does not.

    Batches left without rows (every sample bad) pass through untouched.
    """

    def __init__(
        self, batches: Iterable[Batch], stage: DeviceStage, device: torch.device, dtype: torch.dtype, train: bool
    ) -> None:
        self._batches = handed_over_batches(batches)
        self.stage = stage
        self.device = device
        self.dtype = dtype
        self.train = train
        self.last_wait = 0.0
        self._prefetcher: CudaPrefetcher | None = None

    def __iter__(self) -> DeviceFeed:
        return self

    def __next__(self) -> Batch:
        start = time.perf_counter()
        if self.device.type == "cuda":
            if self._prefetcher is None:  # made on first use: it blocks for the first batch
                self._prefetcher = CudaPrefetcher(self._batches, self.stage, self.device, self.dtype, self.train)
            batch = next(self._prefetcher)
            self.last_wait = time.perf_counter() - start
            return batch
        batch = next(self._batches)
        self.last_wait = time.perf_counter() - start
        if not len(batch):
            return replace(batch, on_device=True)
        return self.stage(batch, self.device, self.dtype, train=self.train)


class InputPipeline:
    """Source records -> model-ready ``Batch`` objects on the device.

    Args:
        inputs: The model's input spec (image size, mean, std, tokenizer, max_seq_length).
        options: CPU transform, device decode, augmentation and bad-sample policy.
        device: Where the model runs.
        keep_columns: Extra columns carried per row (evaluation's caption choices and labels).
        cpu_device_decode: Let ``decode_on_device`` decode in the main process on a CPU device (the bench
            measures that path; training uses the CPU pipeline instead, decoding in the workers).
    """

    def __init__(
        self,
        inputs: InputSpec,
        options: PipelineOptions,
        device: torch.device,
        keep_columns: tuple[str, ...] = EVAL_COLUMNS,
        cpu_device_decode: bool = False,
    ) -> None:
        if options.image_pipeline not in ("fast", "reference"):
            raise DataError(f"unknown --image_pipeline {options.image_pipeline!r}; choose one of: fast, reference")
        if options.random_resized_crop and options.image_pipeline != "fast":
            raise DataError("--random_resized_crop is a fast-pipeline option; the reference pipeline has none")
        if options.decode_on_device and device.type != "cuda" and not cpu_device_decode:
            logger.warning(
                "--decode_on_device needs an NVIDIA GPU and the device is %s: decoding on the CPU with the %s "
                "pipeline instead",
                device.type,
                options.image_pipeline,
            )
            options = replace(options, decode_on_device=False)
        if inputs.max_num_patches is not None:
            check_naflex_options(options)
            if options.decode_on_device:
                logger.warning("--decode_on_device decodes square images; a NaFlex model's are decoded on the CPU")
                options = replace(options, decode_on_device=False)
        self.inputs = inputs
        self.options = options
        self.device = device
        self.collator = ImageTextCollator(
            inputs.tokenizer,
            inputs.max_seq_length,
            keep_columns=keep_columns,
            hard_negative_column=options.hard_negative_column,
        )
        self.device_stage = DeviceStage(
            inputs.image_size,
            inputs.image_mean,
            inputs.image_std,
            horizontal_flip=options.horizontal_flip,
            bad_sample_policy=options.bad_sample_policy,
        )

    @property
    def description(self) -> str:
        """``fast``, ``reference`` or ``fast + device decode``."""
        return self.options.image_pipeline + (" + device decode" if self.options.decode_on_device else "")

    def image_transform(self, *, train: bool) -> ImageTransform:
        """The worker-side transform: bytes -> uint8 pixels (fast), normalized floats (reference) or encoded."""
        spec, options = self.inputs, self.options
        if options.decode_on_device:
            return PassThroughEncoded()
        if options.image_pipeline == "fast":  # always, for a NaFlex model (check_naflex_options)
            return image_transform(spec, random_resized_crop=train and options.random_resized_crop)
        return ReferenceImageTransform(spec.image_size, spec.image_mean, spec.image_std)

    def dataset(self, source: ImageTextSource, *, train: bool) -> ImageTextDataset:
        """The map-style dataset over ``source``.

        Training replaces bad samples by substitutes (batches keep their size); evaluation leaves them out, since
        recall over a pool holding some pairs twice would not be comparable.
        """
        return ImageTextDataset(
            source,
            self.image_transform(train=train),
            bad_sample_policy=self.options.bad_sample_policy,
            substitute=train,
        )

    def stream_dataset(self, stream: ShardStream, *, train: bool) -> StreamingImageTextDataset:
        """The iterable dataset over a shard stream: the same image transform and bad-sample policy, bad samples
        left out rather than substituted (``vlfit.data.stream.dataset``)."""
        from vlfit.data.stream.dataset import StreamingImageTextDataset

        return StreamingImageTextDataset(stream, self.image_transform(train=train), self.options.bad_sample_policy)

    def loader(
        self,
        dataset: ImageTextDataset | StreamingImageTextDataset,
        *,
        batch_size: int,
        settings: LoaderSettings = LoaderSettings(),
        sampler: Sampler | None = None,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> DataLoader:
        """The DataLoader over ``dataset``: the only place vlfit builds one."""
        workers = settings.num_workers
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            shuffle=shuffle if sampler is None else None,
            generator=generator,
            num_workers=workers,
            collate_fn=self.collator,
            pin_memory=settings.pin_memory,
            drop_last=settings.drop_last,
            worker_init_fn=worker_init_fn,
            prefetch_factor=settings.prefetch_factor if workers else None,
            persistent_workers=settings.persistent_workers and workers > 0,
            multiprocessing_context=loader_context(settings.multiprocessing_context) if workers else None,
            in_order=settings.in_order,
        )

    def feed(self, batches: Iterable[Batch], dtype: torch.dtype, *, train: bool) -> DeviceFeed:
        """Model-ready batches on the device (see ``DeviceFeed``)."""
        return DeviceFeed(batches, self.device_stage, self.device, dtype, train)

    def to_device(self, batch: Batch, dtype: torch.dtype, *, train: bool) -> Batch:
        """One batch through the device stage; a batch a feed already staged is returned as it is (not moved)."""
        if batch.on_device:
            return batch
        if not len(batch):
            return replace(batch, on_device=True)
        return self.device_stage(batch, self.device, dtype, train=train)


@dataclass
class HostBatches:
    """Host batches of uint8 pixels from the fast CPU pipeline, with the bad samples they left out."""

    pipeline: InputPipeline
    loader: DataLoader

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)


def host_batches(source: ImageTextSource, spec: InputSpec, *, batch_size: int, num_workers: int = 0) -> HostBatches:
    """Batches of ``source`` as the fast CPU pipeline collates them (uint8 ``pixel_values``, tokenized captions),
    in source order, on the CPU; bad images are left out of their batch and listed in its ``bad_samples``."""
    pipeline = InputPipeline(spec, PipelineOptions(image_pipeline="fast"), torch.device("cpu"), keep_columns=())
    loader = pipeline.loader(
        pipeline.dataset(source, train=False),
        batch_size=batch_size,
        settings=LoaderSettings(num_workers=num_workers, prefetch_factor=4 if num_workers else None),
    )
    return HostBatches(pipeline, loader)
