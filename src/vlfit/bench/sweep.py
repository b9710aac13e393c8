"""The sweep: pipelines x DataLoader workers (x prefetch factors), in loader and/or train mode, plus the compute
ceiling, on one model and one set of samples.

``BenchSession`` holds what every configuration shares (samples, model, optimizer, collator, device stage) and
measures one configuration at a time; ``run_sweep`` runs a ``SweepPlan`` through it and returns the results
(plain JSON-able data) that ``vlfit.bench.report`` prints and writes.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.utils.data import DataLoader

from vlfit.bench.data import PipelineSpec, cycled, datasets_available, get_pipeline, prepared_source
from vlfit.bench.measure import (
    PeakHostMemory,
    TrainStep,
    Window,
    compute_window,
    device_peak_bytes,
    reset_device_peak,
    staged_batches,
    summarize,
    timed_window,
)
from vlfit.bench.stages import profile_stages
from vlfit.data.batch import Batch
from vlfit.data.pipeline import InputPipeline, LoaderSettings, PipelineOptions
from vlfit.models.family import InputSpec, ModelFamily

logger = logging.getLogger(__name__)

MODES: tuple[str, ...] = ("loader", "train")
MIB = 2**20


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask, which containers narrow, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers(cores: int | None = None) -> list[int]:
    """0, 1, 2, then powers of two up to the core count (the study swept 0/1/2)."""
    cores = available_cores() if cores is None else cores
    counts = [0, 1, 2]
    n = 4
    while n <= cores:
        counts.append(n)
        n *= 2
    return [c for c in counts if c <= max(cores, 2)]


def default_pipelines(device: torch.device) -> list[str]:
    """Every pipeline the machine can run: ``device`` needs CUDA, ``prepared`` the datasets package."""
    names = ["reference", "fast"]
    if datasets_available():
        names.append("prepared")
    if device.type == "cuda":
        names.append("device")
    return names


def default_precision(device: torch.device) -> str:
    """bf16 autocast on CUDA devices that support it (the study's setting), fp32 elsewhere."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


@dataclass
class SweepPlan:
    """What to measure, resolved (no defaults left to pick).

    Args:
        pipelines: Names from ``vlfit.bench.data.PIPELINES``.
        workers: DataLoader worker counts.
        prefetch_factors: DataLoader prefetch factors (for worker counts above 0).
        modes: ``loader`` (data path and device stage only) and/or ``train`` (real optimizer steps).
        batch_size: Samples per batch.
        steps: Timed steps per window.
        warmup_steps: Excluded steps at the start of each window.
        repeats: Windows per configuration (median, min and max are reported).
        precision: ``fp32``, ``bf16`` or ``fp16`` autocast for the model.
        profile_batches: Batches the per-stage profile times (0: no profile).
        compare_bf16: Also measure the compute ceiling in the other of fp32 and bf16.
        auto: After the sweep, measure the best configuration with ``auto_prefetch_factors`` too.
        auto_prefetch_factors: Prefetch factors ``auto`` tries.
        max_config_seconds: Stop repeating a configuration once it has run this long (None: no limit).
        max_seq_length: Caption truncation length.
        seed: Seed for sampling order and the model's initialization.
    """

    pipelines: list[str]
    workers: list[int]
    prefetch_factors: list[int] = field(default_factory=lambda: [2])
    modes: list[str] = field(default_factory=lambda: ["train"])
    batch_size: int = 48
    steps: int = 10
    warmup_steps: int = 3
    repeats: int = 3
    precision: str = "fp32"
    profile_batches: int = 2
    compare_bf16: bool = False
    auto: bool = False
    auto_prefetch_factors: list[int] = field(default_factory=lambda: [2, 4])
    max_config_seconds: float | None = None
    max_seq_length: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for name in self.pipelines:
            get_pipeline(name)
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"unknown mode {mode!r}; choose from: {', '.join(MODES)}")
        if not self.pipelines or not self.workers or not self.modes:
            raise ValueError("nothing to measure: give at least one pipeline, worker count and mode")
        if min(self.workers) < 0:
            raise ValueError(f"worker counts must be >= 0, got {self.workers}")
        if min(self.prefetch_factors + self.auto_prefetch_factors) < 1:
            raise ValueError("prefetch factors must be >= 1")
        for name, value, low in (
            ("per_device_train_batch_size", self.batch_size, 1),
            ("steps", self.steps, 1),
            ("warmup_steps", self.warmup_steps, 0),
            ("repeats", self.repeats, 1),
            ("profile_batches", self.profile_batches, 0),
        ):
            if value < low:
                raise ValueError(f"--{name} must be at least {low}, got {value}")


def configurations(plan: SweepPlan) -> list[tuple[str, str, int, int | None]]:
    """``(mode, pipeline, workers, prefetch_factor)`` in sweep order (prefetch is None without workers)."""
    out = []
    for mode in plan.modes:
        for pipeline in plan.pipelines:
            for workers in plan.workers:
                for prefetch in plan.prefetch_factors if workers else [None]:
                    out.append((mode, pipeline, workers, prefetch))
    return out


class BenchSession:
    """Samples, input pipelines and (in train mode) model and optimizer shared by every configuration of a sweep.

    Args:
        source: The distinct samples (a ``MemorySource`` or an ``ImageTextSource``).
        inputs: The model's input spec (image size, mean, std, tokenizer).
        device: Where the model runs.
        plan: The sweep settings (batch size, steps, precision, ...).
        model: The model (moved to ``device``), needed for train mode and the compute ceiling; ``None`` for a
            loader-only sweep, which then never builds one.
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
        if "train" in plan.modes and model is None:
            raise ValueError("train mode needs the model")
        self.source = source
        self.inputs = replace(inputs, max_seq_length=plan.max_seq_length)
        self.device = device
        self.plan = plan
        self.cache_dir = cache_dir
        self.source_key = source_key
        self.num_proc = num_proc
        self.step = None if model is None else TrainStep(model.to(device), family, device, plan.precision)
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
            spec: PipelineSpec = get_pipeline(name)
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
                )
                logger.info("prepared %d samples in %.1f s", len(self.source), time.perf_counter() - started)
            else:
                self._sources[pipeline] = self.source
        return self._sources[pipeline]

    def window_length(self, workers: int, prefetch: int | None) -> int:
        """Batches one window may take: warm-up, settle, timed steps, and the CUDA prefetcher's look-ahead."""
        return self.plan.warmup_steps + workers * (prefetch or 2) + 1 + self.plan.steps + 2

    def loader(self, pipeline: str, workers: int, prefetch: int | None) -> DataLoader:
        """The DataLoader ``vlfit train`` would use with these settings, over the samples served cyclically."""
        input_pipeline = self.pipeline(pipeline)
        length = self.window_length(workers, prefetch) * self.plan.batch_size
        dataset = input_pipeline.dataset(cycled(self.source_for(pipeline), length), train=True)
        settings = LoaderSettings(
            num_workers=workers, prefetch_factor=prefetch, pin_memory=self.device.type == "cuda", drop_last=True
        )
        return input_pipeline.loader(
            dataset,
            batch_size=self.plan.batch_size,
            settings=settings,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.plan.seed),
        )

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

    def compute(self, precision: str | None = None, repeats: int | None = None) -> dict[str, Any]:
        """A reading of the compute ceiling: training steps on one ready batch, repeated (no data path)."""
        step = self.step
        if step is None:
            raise ValueError("the compute ceiling needs the model (train mode)")
        if self._ready_batch is None:
            self._ready_batch = self.ready_batch()
        batch = self._ready_batch
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

    def close(self) -> None:
        """Free the model and optimizer (device memory too)."""
        self.step = None
        self._ready_batch = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    from vlfit.data.decode import simplejpeg

    cpu_model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu_model)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu_model,
        "cores": available_cores(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "jpeg_decoder": "simplejpeg (libjpeg-turbo)" if simplejpeg is not None else "pillow (draft mode)",
        "datasets_installed": datasets_available(),
        # Other work on the machine shows here: on a shared machine the numbers are only as quiet as this.
        "load_average_start": _load_average(),
    }
    try:
        import torchvision
        import transformers

        info.update(transformers=transformers.__version__, torchvision=torchvision.__version__)
    except ImportError:
        pass
    return info


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _measure_row(session: BenchSession, config: tuple[str, str, int, int | None]) -> dict[str, Any]:
    mode, pipeline, workers, prefetch = config
    try:
        row = session.measure(mode, pipeline, workers, prefetch)
        row["error"] = None
    except (RuntimeError, ValueError, OSError) as err:  # e.g. CUDA out of memory: report it, keep sweeping
        logger.error("%s %s workers=%s failed:\n%s", mode, pipeline, workers, traceback.format_exc())
        row = {"mode": mode, "pipeline": pipeline, "workers": workers, "prefetch_factor": prefetch}
        row.update(samples_per_second=None, data_wait_share=None, error=f"{type(err).__name__}: {err}")
        if session.device.type == "cuda":
            torch.cuda.empty_cache()
    logger.info(
        "%-6s %-9s workers=%d prefetch=%s: %s samples/s",
        mode,
        pipeline,
        workers,
        prefetch,
        "failed" if row["samples_per_second"] is None else f"{row['samples_per_second']:.1f}",
    )
    return row


def run_sweep(
    session: BenchSession,
    *,
    info: dict[str, Any] | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Measure the compute ceiling, every configuration of the plan, the per-stage profiles and (with ``auto``)
    the best configuration's prefetch factors.

    The ceiling is read before and after the configurations and right before each train configuration; the
    highest reading is the ceiling (other work on the machine can only lower a reading), and all are kept.

    Args:
        session: Samples, model and plan.
        info: Extra fields for the results' ``settings`` (model, data description, ...).
        on_progress: Called with the results so far after every measurement (to write partial outputs).

    Returns:
        ``settings``, ``machine``, ``compute``, ``rows``, ``stages`` and, when asked, ``bf16_comparison``.
        ``vlfit.bench.report.finalize`` adds the derived fields, verdict and choice.
    """
    plan = session.plan
    results: dict[str, Any] = {
        "settings": {**asdict(plan), **(info or {})},
        "machine": machine_info(session.device),
        "rows": [],
        "stages": {},
        "complete": False,
    }

    def progress() -> None:
        if on_progress is not None:
            on_progress(results)

    with_model = session.step is not None  # a loader-only sweep has no model: no compute ceiling, no verdict
    readings = [session.compute()] if with_model else []

    def record_ceiling() -> None:
        best = max(readings, key=lambda reading: reading["samples_per_second"])
        results["compute"] = {**best, "readings": [round(r["samples_per_second"], 3) for r in readings]}

    def measure(config: tuple[str, str, int, int | None]) -> None:
        reading = None
        if config[0] == "train":  # a fresh reading next to each train row, in the same machine conditions
            reading = session.compute(repeats=1)
            readings.append(reading)
            record_ceiling()
        row = _measure_row(session, config)
        row["compute_reading"] = None if reading is None else reading["samples_per_second"]
        results["rows"].append(row)
        progress()

    if with_model:
        record_ceiling()
        logger.info("compute ceiling: %.1f samples/s (%s)", readings[0]["samples_per_second"], plan.precision)
    progress()
    for config in configurations(plan):
        measure(config)
    if plan.auto:
        from vlfit.bench.auto import choose

        best = choose(results["rows"])
        if best is not None and best["workers"] > 0:
            done = {r["prefetch_factor"] for r in results["rows"] if _same(r, best)}
            for prefetch in plan.auto_prefetch_factors:
                if prefetch not in done:
                    measure((best["mode"], best["pipeline"], best["workers"], prefetch))
    if with_model:
        readings.append(session.compute())
        record_ceiling()
    step_ms = results["compute"]["step_ms"] if with_model else None
    for pipeline in plan.pipelines if plan.profile_batches else []:
        results["stages"][pipeline] = session.profile(pipeline, step_ms)
    if plan.compare_bf16 and with_model:
        # Both precisions back to back, so that the machine's load is the same for the two readings.
        other = "bf16" if plan.precision == "fp32" else "fp32"
        by_precision = {p: session.compute(p)["samples_per_second"] for p in (plan.precision, other)}
        results["bf16_comparison"] = {
            "fp32_samples_per_second": by_precision["fp32"],
            "bf16_samples_per_second": by_precision["bf16"],
            # Throughput ratios: above 1, fp32 is the faster of the two on this machine.
            "fp32_over_bf16": by_precision["fp32"] / by_precision["bf16"],
            "bf16_speedup": by_precision["bf16"] / by_precision["fp32"],
        }
    results["machine"]["load_average_end"] = _load_average()
    results["complete"] = True
    progress()
    return results


def _same(row: dict[str, Any], other: dict[str, Any]) -> bool:
    return all(row[key] == other[key] for key in ("mode", "pipeline", "workers"))
