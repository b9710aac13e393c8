"""Where a batch's time goes: each stage of a pipeline timed on its own, on a few batches, in the main process.

The loader runs read, decode, resize/crop and collate inside a worker, one batch per worker at a time; here the
same functions (those ``FastImageTransform``, ``ReferenceImageTransform`` and ``ImageTextCollator`` call) run one
after the other on ``batches`` batches with one torch thread, as in a worker. The host-to-device copy (after
pinning, on CUDA) and the device stage run with the main process's threads and are synchronized, so the times are
what they would cost alone. Compute is the compute ceiling's time per step.

It is an approximation: in a real run the stages overlap (workers in parallel with each other and with the
main process), share cores and caches, and the worker-to-main pipe (pickling the batch) is not timed. With
``w`` workers the worker stages bound throughput at about ``w * batch_size / worker_ms``; the main-process stages
(copy, device stage, compute) at ``batch_size / main_ms`` on CPU, where they run one after the other.
"""

from __future__ import annotations

from typing import Any

import torch
import torchvision.transforms.functional as TF

from vlfit.bench.measure import StageClock, synchronize
from vlfit.bench.selection import PipelineSpec
from vlfit.data.dataset import Sample
from vlfit.data.decode import decode_pil, decode_scaled
from vlfit.data.image_transforms import (
    EncodedImage,
    ReferenceImageTransform,
    hwc_to_chw_view,
    new_image_batch,
    resize_crop_uint8,
)
from vlfit.data.pipeline import InputPipeline
from vlfit.threads import torch_threads

WORKER_STAGES: tuple[str, ...] = ("read", "decode", "resize/crop", "collate")
MAIN_STAGES: tuple[str, ...] = ("host->device copy", "device stage", "compute")


def _cpu_images(spec: PipelineSpec, records: list[Any], image_size: int, mean, std, clock: StageClock) -> list[Any]:
    if spec.decode_on_device:
        return [EncodedImage(record.image, record.id) for record in records]
    if spec.image_pipeline == "reference":
        reference = ReferenceImageTransform(image_size, mean, std)
        with clock("decode"):
            pictures = [decode_pil(record.image, record.id) for record in records]
        with clock("resize/crop"), torch.no_grad():  # to float, resize, crop and normalize, as the reference does
            return [reference.transforms(TF.to_tensor(picture)) for picture in pictures]
    with clock("decode"):
        arrays = [decode_scaled(record.image, image_size, record.id) for record in records]
    with clock("resize/crop"):  # into the rows of one batch, as the loader's dataset does
        rows = new_image_batch(len(arrays), image_size)
        return [resize_crop_uint8(hwc_to_chw_view(pixels), image_size, out=rows[i]) for i, pixels in enumerate(arrays)]


def profile_stages(
    spec: PipelineSpec,
    pipeline: InputPipeline,
    source: Any,
    *,
    batches: int,
    batch_size: int,
    dtype: torch.dtype,
    compute_ms: float | None,
) -> dict[str, Any]:
    """Time each stage of ``spec`` on ``batches`` batches of ``source``.

    Args:
        spec: The pipeline.
        pipeline: Its input pipeline (image size, mean, std, collator, device stage, device).
        source: Its records (the prepared copy for ``prepared``).
        batches: Batches to time (after one untimed batch that warms caches and lazy imports).
        batch_size: Samples per batch.
        dtype: The dtype the device stage produces.
        compute_ms: Milliseconds per training step from the compute ceiling (None: not measured).

    Returns:
        ``stages_ms`` (milliseconds per batch of each stage; stages a pipeline lacks are 0), ``worker_ms`` and
        ``main_ms`` (their sums), ``largest_worker_stage`` and ``batches``.
    """
    inputs, device = pipeline.inputs, pipeline.device
    clock = StageClock()
    for number in range(batches + 1):
        if number == 1:
            clock = StageClock()  # the first batch only warms up
        start = number * batch_size
        with torch_threads(1):
            with clock("read"):
                records = [source[(start + i) % len(source)] for i in range(batch_size)]
            images = _cpu_images(spec, records, inputs.image_size, inputs.image_mean, inputs.image_std, clock)
            samples = [
                Sample(
                    record.id,
                    start + i,
                    image=image,
                    caption=record.caption,
                    columns=dict(record.extra),
                    image_key=record.image_key,
                )  # fmt: skip
                for i, (image, record) in enumerate(zip(images, records, strict=True))
            ]
            with clock("collate"):
                batch = pipeline.collator(samples)
        with clock("host->device copy", device):
            if device.type == "cuda":
                batch = batch.pin_memory()
            batch = batch.to(device, non_blocking=True)
        with clock("device stage", device):
            pipeline.device_stage(batch, device, dtype)
        synchronize(device)
    stages = {name: 0.0 for name in (*WORKER_STAGES, *MAIN_STAGES)}
    stages.update(clock.per_batch_ms(batches))
    stages["compute"] = compute_ms or 0.0
    worker_ms = sum(stages[name] for name in WORKER_STAGES)
    return {
        "stages_ms": {name: round(value, 3) for name, value in stages.items()},
        "worker_ms": round(worker_ms, 3),
        "main_ms": round(sum(stages[name] for name in MAIN_STAGES), 3),
        "largest_worker_stage": max(WORKER_STAGES, key=lambda name: stages[name]),
        "batches": batches,
    }
