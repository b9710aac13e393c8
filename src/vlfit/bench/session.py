"""``BenchSession``: what every configuration of a sweep shares, and the measurement of one configuration.

The samples, one ``InputPipeline`` per benchmark pipeline (the same object ``vlfit train`` builds its loader
with), the prepared copy of the samples, and, in train mode only, the model with its optimizer (``TrainStep``),
prepared for the plan's objective as ``vlfit train --objective`` prepares it. A loader-only sweep never builds a
model.

A configuration is measured on the path ``VlfitTrainer`` trains on: the pipeline's loader wrapped by
``shard_loader`` as the Trainer wraps it (batches left on the host), then the pipeline's device feed (the one
host-to-device copy and the device stage; on CUDA both on the prefetcher's side stream).
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import DataLoader

from vlfit.bench.data import cycled, prepared_source
from vlfit.bench.measure import (
    PeakHostMemory,
    TrainStep,
    Window,
    compute_window,
    device_peak_bytes,
    reset_device_peak,
    staged_batches,
    summarize,
    synchronize,
    timed_window,
)
from vlfit.bench.plan import SweepPlan
from vlfit.bench.selection import get_pipeline
from vlfit.bench.stages import profile_stages
from vlfit.data.batch import Batch
from vlfit.data.pipeline import InputPipeline, LoaderSettings, PipelineOptions, shard_loader
from vlfit.efficiency.flops import count_flops
from vlfit.models.family import InputSpec, ModelFamily
from vlfit.training.itm_objective import prepare_model_for_objective
from vlfit.training.master_weights import MasterWeights

logger = logging.getLogger(__name__)

MIB = 2**20


class BenchSession:
    """Samples, input pipelines and (in train mode) model and optimizer shared by every configuration of a sweep.

    Args:
        source: The distinct samples (a ``MemorySource`` or an ``ImageTextSource``).
        inputs: The model's input spec (image size, mean, std, tokenizer).
        device: Where the model runs.
        plan: The sweep settings (batch size, steps, precision, ...).
        model: The model (moved to ``device``), needed for train mode and the compute ceiling; ``None`` for a
            loader-only sweep, which then never builds one. It is prepared for ``plan.objective`` as training
            prepares it: with an image-text matching objective a matching head is added when it has none, and the
            heads the objective never reaches are frozen.
        family: The model's family (its contrastive loss); with ``model``.
        cache_dir: Where the prepared copy of the samples goes.
        source_key: Names the samples in cache folders.
        num_proc: Processes for preparing data.
    """

    def __init__(
        self,
        source: Any,
        inputs: InputSpec,
        device: torch.device,
        plan: SweepPlan,
        *,
        model: torch.nn.Module | None = None,
        family: ModelFamily | None = None,
        cache_dir: str,
        source_key: str,
        num_proc: int = 1,
    ) -> None:
        if plan.trains and model is None:
            raise ValueError("train mode needs the model")
        if model is not None and family is None:
            raise ValueError("the model needs its family (for the contrastive loss)")
        self.source = source
        # Never longer than the model's text positions (resolve_model cut the spec's to them).
        self.inputs = replace(inputs, max_seq_length=min(plan.max_seq_length, inputs.max_seq_length))
        self.device = device
        self.plan = plan
        self.cache_dir = cache_dir
        self.source_key = source_key
        self.num_proc = num_proc
        self.step: TrainStep | None = None
        if model is not None:
            # Refuses, in one line naming --objective, an ITM objective for a family without a fused tower.
            model = prepare_model_for_objective(model, family, plan.objective)  # type: ignore[arg-type]
            self.step = TrainStep(model.to(device), family, device, plan.precision,  # type: ignore[arg-type]
                                  objective=plan.objective, seed=plan.seed)  # fmt: skip
        self._compiled_step: TrainStep | None = None
        self._pipelines: dict[str, InputPipeline] = {}
        self._sources: dict[str, Any] = {}
        self._ready_batch: Batch | None = None

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the device stage hands the model (its weights'; float32 without a model)."""
        return self.step.input_dtype if self.step is not None else torch.float32

    def pipeline(self, name: str) -> InputPipeline:
        """The input pipeline of a benchmark pipeline (``device`` decodes in the main process on a CPU device)."""
        if name not in self._pipelines:
            spec = get_pipeline(name)
            options = PipelineOptions(image_pipeline=spec.image_pipeline, decode_on_device=spec.decode_on_device)
            self._pipelines[name] = InputPipeline(self.inputs, options, self.device, keep_columns=(),
                                                  cpu_device_decode=True)  # fmt: skip
        return self._pipelines[name]

    def source_for(self, pipeline: str) -> Any:
        """The records ``pipeline`` reads (the prepared copy is made on first use)."""
        if pipeline not in self._sources:
            spec = get_pipeline(pipeline)
            if spec.prepared:
                started = time.perf_counter()
                self._sources[pipeline] = prepared_source(
                    self.source,
                    image_size=self.inputs.image_size,
                    cache_dir=self.cache_dir,
                    key=self.source_key,
                    num_proc=self.num_proc,
                    patch_budget=None
                    if self.inputs.max_num_patches is None
                    else (int(self.inputs.patch_size), self.inputs.max_num_patches),  # type: ignore[arg-type]
                )
                logger.info("prepared %d samples in %.1f s", len(self.source), time.perf_counter() - started)
            else:
                self._sources[pipeline] = self.source
        return self._sources[pipeline]

    def window_length(self, workers: int, prefetch: int | None) -> int:
        """Batches one window may take: warm-up, settle, timed steps, and the CUDA prefetcher's look-ahead."""
        return self.plan.warmup_steps + workers * (prefetch or 2) + 1 + self.plan.steps + 2

    def loader(self, pipeline: str, workers: int, prefetch: int | None) -> DataLoader:
        """The loader ``vlfit train`` would use with these settings (accelerate's wrapping included, batches left on
        the host), over the samples served cyclically."""
        input_pipeline = self.pipeline(pipeline)
        length = self.window_length(workers, prefetch) * self.plan.batch_size
        dataset = input_pipeline.dataset(cycled(self.source_for(pipeline), length), train=True)
        settings = LoaderSettings(
            num_workers=workers, prefetch_factor=prefetch, pin_memory=self.device.type == "cuda", drop_last=True
        )
        loader = input_pipeline.loader(
            dataset,
            batch_size=self.plan.batch_size,
            settings=settings,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.plan.seed),
        )
        return shard_loader(loader)

    def measure(self, mode: str, pipeline: str, workers: int, prefetch: int | None) -> dict[str, Any]:
        """Median/min/max samples/s, data-wait share and peak memory of one configuration over the repeats."""
        loader = self.loader(pipeline, workers, prefetch)
        step = self.step if mode == "train" else None
        windows: list[Window] = []
        reset_device_peak(self.device)
        started = time.perf_counter()
        with PeakHostMemory() as host:
            for _ in range(self.plan.repeats):
                feed = self.pipeline(pipeline).feed(iter(loader), self.input_dtype, train=True)
                batches = staged_batches(feed)
                try:
                    windows.append(
                        timed_window(
                            batches,
                            step,
                            device=self.device,
                            batch_size=self.plan.batch_size,
                            warmup_steps=self.plan.warmup_steps,
                            steps=self.plan.steps,
                            max_settle_steps=workers * (prefetch or 2) + 1,
                        )
                    )
                finally:
                    batches.close()
                    del batches, feed  # shuts the workers down before the next window starts them
                limit = self.plan.max_config_seconds
                if limit is not None and time.perf_counter() - started > limit:
                    break
        device_peak = device_peak_bytes(self.device)
        return {
            "mode": mode,
            "pipeline": pipeline,
            "workers": workers,
            "prefetch_factor": prefetch,
            **summarize(windows),
            "peak_host_rss_mib": None if host.peak_bytes is None else round(host.peak_bytes / MIB, 1),
            "peak_device_memory_mib": None if device_peak is None else round(device_peak / MIB, 1),
            "seconds": round(time.perf_counter() - started, 2),
        }

    def ready_batch(self) -> Batch:
        """One model-ready batch (fast pipeline, no workers) for the compute ceiling."""
        pipeline = "fast" if "fast" in self.plan.pipelines else self.plan.pipelines[0]
        batch = next(iter(self.loader(pipeline, 0, None)))
        return self.pipeline(pipeline).to_device(batch, self.input_dtype, train=True)

    def _step_and_ready_batch(self, purpose: str) -> tuple[TrainStep, Batch]:
        """The training step and the one ready batch the ceiling and the FLOP count use (made on first use)."""
        if self.step is None:
            raise ValueError(f"{purpose} needs the model (train mode)")
        if self._ready_batch is None:
            self._ready_batch = self.ready_batch()
        return self.step, self._ready_batch

    def compiled_step(self, precision: str | None = None) -> tuple[TrainStep, float]:
        """The training step with the model under ``torch.compile`` (``plan.torch_compile_backend``), and the
        seconds its first call in ``precision`` (default: the plan's) took: compilation included, since each
        autocast state is a graph of its own (the weights are the eager step's, trained on)."""
        step, batch = self._step_and_ready_batch("the compiled compute ceiling")
        if self._compiled_step is None:
            compiled = torch.compile(step.model, backend=self.plan.torch_compile_backend)
            self._compiled_step = TrainStep(compiled, step.family, self.device, step.precision,  # type: ignore[arg-type]
                                            objective=self.plan.objective, seed=self.plan.seed)  # fmt: skip
        started = time.perf_counter()
        self._compiled_step(batch, precision)
        synchronize(self.device)
        return self._compiled_step, time.perf_counter() - started

    def bf16_weights_step(self) -> TrainStep:
        """The training step of ``vlfit train --bf16 --bf16_weights``: a bf16 copy of the model under bf16 autocast,
        its optimizer over fp32 copies of the weights, which it clips (``vlfit.training.master_weights``). The
        session's model is left as it is; the step holds the model a second time, so let go of it after use."""
        step, _ = self._step_and_ready_batch("the bf16-weights compute ceiling")
        model = copy.deepcopy(step.model)
        weights_step = TrainStep(model, step.family, self.device, "bf16", objective=self.plan.objective,
                                 seed=self.plan.seed)  # fmt: skip
        weights_step.parameters = MasterWeights(model, weights_step.optimizer).trained
        return weights_step

    def compute(
        self, precision: str | None = None, repeats: int | None = None, *, step: TrainStep | None = None
    ) -> dict[str, Any]:
        """A reading of the compute ceiling: training steps on one ready batch, repeated (no data path).

        ``step`` replaces the session's training step (the compiled one of ``compiled_step``).
        """
        own_step, batch = self._step_and_ready_batch("the compute ceiling")
        step = step or own_step
        precision = precision or self.plan.precision
        reset_device_peak(self.device)
        windows = [
            compute_window(
                batch,
                lambda b: step(b, precision),
                device=self.device,
                batch_size=self.plan.batch_size,
                warmup_steps=max(self.plan.warmup_steps, 1),
                steps=self.plan.steps,
            )
            for _ in range(repeats or self.plan.repeats)
        ]
        figures = summarize(windows)
        device_peak = device_peak_bytes(self.device)
        return {
            "precision": precision,
            "samples_per_second": figures["samples_per_second"],
            "samples_per_second_min": figures["samples_per_second_min"],
            "samples_per_second_max": figures["samples_per_second_max"],
            "repeats": figures["repeats"],
            "step_ms": 1000.0 * self.plan.batch_size / figures["samples_per_second"],
            "peak_device_memory_mib": None if device_peak is None else round(device_peak / MIB, 1),
        }

    def flops_per_sample(self) -> float:
        """FLOPs of one training sample (forward and backward), counted on a step of the ceiling's ready batch: the
        plan's objective's, so with an image-text matching objective the fused passes on the negatives count."""
        step, batch = self._step_and_ready_batch("counting FLOPs")
        _, flops = count_flops(lambda: step(batch))
        return flops / len(batch)

    def profile(self, pipeline: str, compute_ms: float | None) -> dict[str, Any]:
        """Per-stage milliseconds per batch of ``pipeline`` (see ``vlfit.bench.stages``)."""
        return profile_stages(
            get_pipeline(pipeline),
            self.pipeline(pipeline),
            self.source_for(pipeline),
            batches=self.plan.profile_batches,
            batch_size=self.plan.batch_size,
            dtype=self.input_dtype,
            compute_ms=compute_ms,
        )

    def recover(self) -> None:
        """Clean up after a configuration that failed part-way (out of memory, a loader worker killed).

        Drops gradients a failed step left behind and returns cached device memory, so that the next
        configuration starts from the same state as it would have after a successful one.
        """
        if self.step is not None:
            self.step.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Free the model and optimizer (device memory too)."""
        self.step = None
        self._compiled_step = None
        self._ready_batch = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
