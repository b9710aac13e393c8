"""The sweep: the compute ceiling, every configuration of a ``SweepPlan`` in loader and/or train mode, the
per-stage profiles and (with ``auto``) the best configuration's prefetch factors, on one ``BenchSession``.

``run_sweep`` returns plain JSON-able results, which ``vlfit.bench.report`` turns into figures and text. A
configuration that fails (out of memory, a loader worker killed) becomes a row with its error, and the sweep goes
on with the next one.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import simplejpeg
import torch
import torchvision
import transformers

from vlfit.bench.plan import Configuration, configurations
from vlfit.bench.selection import choose
from vlfit.bench.session import BenchSession
from vlfit.efficiency.cpu import cpu_info
from vlfit.efficiency.peaks import matmul_precision, peak_flops
from vlfit.threads import available_cores

logger = logging.getLogger(__name__)


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        **cpu_info().record(),  # the CPU's model and the matrix features that decide bf16's and int8's speed
        "cores": available_cores(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "jpeg_decoder": f"simplejpeg {simplejpeg.__version__} (libjpeg-turbo)",
        # Other work on the machine shows here: on a shared machine the numbers are only as quiet as this.
        "load_average_start": _load_average(),
        "transformers": transformers.__version__,
        "torchvision": torchvision.__version__,
    }


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def describe_error(error: BaseException) -> str:
    """``Type: message``, followed by the cause's when there is one (torch's DataLoader puts the worker's exit
    code there)."""
    text = f"{type(error).__name__}: {error}"
    cause = error.__cause__
    return text if cause is None else f"{text} (caused by {type(cause).__name__}: {cause})"


def failed_row(config: Configuration, error: BaseException) -> dict[str, Any]:
    """The row of a configuration that could not be measured: its settings and the error, no figures."""
    mode, pipeline, workers, prefetch = config
    return {
        "mode": mode,
        "pipeline": pipeline,
        "workers": workers,
        "prefetch_factor": prefetch,
        "samples_per_second": None,
        "data_wait_share": None,
        "error": describe_error(error),
    }


def measure_configuration(session: BenchSession, config: Configuration) -> tuple[dict[str, Any], dict | None]:
    """One configuration's row and, for a train row, the compute-ceiling reading taken right before it.

    Any error while measuring (CUDA or host out of memory, a DataLoader worker killed, which torch raises as a
    ``RuntimeError`` in the main process, a bad data file, ...) is logged with its traceback and becomes a failed
    row; the session is cleaned up so the next configuration starts as it would after a successful one. Only an
    interruption (``KeyboardInterrupt``, which SIGINT and SIGTERM raise) stops the sweep.
    """
    mode, pipeline, workers, prefetch = config
    reading = None
    try:
        if mode == "train":  # a fresh reading next to each train row, in the same machine conditions
            reading = session.compute(repeats=1)
        row = session.measure(mode, pipeline, workers, prefetch)
        row["error"] = None
    except Exception as err:
        logger.error(
            "%s %s workers=%s failed; going on with the next configuration:\n%s",
            mode,
            pipeline,
            workers,
            traceback.format_exc(),
        )
        row = failed_row(config, err)
        session.recover()
    rate = row["samples_per_second"]
    logger.info(
        "%-6s %-9s workers=%d prefetch=%s: %s samples/s",
        mode,
        pipeline,
        workers,
        prefetch,
        "failed" if rate is None else f"{rate:.1f}",
    )
    return row, reading


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

    def measure(config: Configuration) -> None:
        row, reading = measure_configuration(session, config)
        if reading is not None:
            readings.append(reading)
            record_ceiling()
        row["compute_reading"] = None if reading is None else reading["samples_per_second"]
        results["rows"].append(row)
        progress()

    if with_model:
        record_ceiling()
        # FLOPs per sample and the device's peak turn every train row's samples/s into TFLOP/s and MFU.
        results["flops_per_sample"] = session.flops_per_sample()
        results["peak"] = peak_flops(session.device, matmul_precision(session.device, plan.precision)).as_dict()
        logger.info("compute ceiling: %.1f samples/s (%s)", readings[0]["samples_per_second"], plan.precision)
    progress()
    for config in configurations(plan):
        measure(config)
    if plan.auto:
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
        try:
            results["stages"][pipeline] = session.profile(pipeline, step_ms)
        except Exception:  # the profile explains the rows; losing one is no reason to lose the sweep
            logger.exception("could not profile the stages of the %s pipeline", pipeline)
            session.recover()
    if plan.compare_bf16 and with_model:
        # Both precisions back to back, so that the machine's load is the same for the two readings.
        other = "bf16" if plan.precision == "fp32" else "fp32"
        by_precision = {p: session.compute(p)["samples_per_second"] for p in (plan.precision, other)}
        comparison: dict[str, Any] = {
            "fp32_samples_per_second": by_precision["fp32"],
            "bf16_samples_per_second": by_precision["bf16"],
            # Throughput ratios: above 1, fp32 is the faster of the two on this machine.
            "fp32_over_bf16": by_precision["fp32"] / by_precision["bf16"],
            "bf16_speedup": by_precision["bf16"] / by_precision["fp32"],
        }
        # And the weights in bf16 with fp32 copies in the optimizer (vlfit train --bf16 --bf16_weights): a second
        # copy of the model, so where it does not fit in memory the reading is lost, not the sweep.
        try:
            bf16_weights = session.compute("bf16", step=session.bf16_weights_step())["samples_per_second"]
        except Exception as error:
            logger.exception("the bf16-weights reading failed")
            comparison["bf16_weights_error"] = describe_error(error)
            session.recover()
        else:
            comparison["bf16_weights_samples_per_second"] = bf16_weights
            comparison["bf16_weights_speedup"] = bf16_weights / by_precision["fp32"]
        results["bf16_comparison"] = comparison
    for wanted, key, compare in (
        (plan.compare_attention, "attention_comparison", compare_attention),
        (plan.compare_compile, "compile_comparison", compare_compile),
    ):
        if wanted and with_model:
            try:
                results[key] = compare(session)
            except Exception as error:  # a backend that cannot compile this model loses its reading, not the sweep
                logger.exception("%s failed", key.replace("_", " "))
                results[key] = {"error": describe_error(error)}
                session.recover()
    results["machine"]["load_average_end"] = _load_average()
    results["complete"] = True
    progress()
    return results


ATTENTION_KERNELS = ("eager", "sdpa")


def compare_attention(session: BenchSession) -> dict[str, Any]:
    """The compute ceiling with eager and with fused (sdpa) attention, back to back; the model keeps its own."""
    step = session.step
    assert step is not None
    current = getattr(step.model.config, "_attn_implementation", "eager")
    by_kernel = {}
    try:
        for kernel in ATTENTION_KERNELS:
            step.family.set_attention_implementation(step.model, kernel)
            by_kernel[kernel] = session.compute()["samples_per_second"]
    finally:
        step.family.set_attention_implementation(step.model, current)
    return {
        "eager_samples_per_second": by_kernel["eager"],
        "sdpa_samples_per_second": by_kernel["sdpa"],
        "sdpa_speedup": by_kernel["sdpa"] / by_kernel["eager"],
    }


def compare_compile(session: BenchSession) -> dict[str, Any]:
    """The compute ceiling eager and under ``torch.compile``, and the first compiled step's seconds; with
    ``compare_bf16`` in fp32 and in bf16 both (``by_precision``), all four readings back to back after compiling.
    The top-level figures are the plan's precision's."""
    plan = session.plan
    precisions = [plan.precision]
    if plan.compare_bf16 and plan.precision in ("fp32", "bf16"):
        precisions.append("bf16" if plan.precision == "fp32" else "fp32")
    compiled_step, first_step_seconds = None, {}
    for precision in precisions:
        compiled_step, first_step_seconds[precision] = session.compiled_step(precision)
    by_precision = {}
    for precision in precisions:
        eager = session.compute(precision)["samples_per_second"]
        compiled = session.compute(precision, step=compiled_step)["samples_per_second"]
        by_precision[precision] = {
            "eager_samples_per_second": eager,
            "compiled_samples_per_second": compiled,
            "compiled_speedup": compiled / eager,
            "first_compiled_step_seconds": first_step_seconds[precision],
        }
    return {"backend": plan.torch_compile_backend, **by_precision[plan.precision], "by_precision": by_precision}


def _same(row: dict[str, Any], other: dict[str, Any]) -> bool:
    return all(row[key] == other[key] for key in ("mode", "pipeline", "workers"))
