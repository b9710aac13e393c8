"""``vlfit bench`` end to end on a tiny sweep: the fields of bench.json, the stage profile, the verdict, the files
and the recommendation; reading a dataset folder; failed configurations; interruption."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data

from tests.bench.bench_runs import QUICK, TINY, assert_png, run_bench
from vlfit.bench.report import CEILING_TOLERANCE, DATA_BOUND_BELOW, DATA_WAIT_BOUND
from vlfit.bench.session import BenchSession
from vlfit.bench.stages import MAIN_STAGES, WORKER_STAGES
from vlfit.bench.sweep import measure_configuration
from vlfit.data.dataset import ImageTextDataset
from vlfit.models.bridgetower import BridgeTowerFamily

PIPELINES = ("reference", "fast", "prepared")
WORKERS = (0, 1)
MODES = ("loader", "train")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    """One tiny sweep over both modes, three pipelines and 0/1 workers, with --auto, --compare_bf16,
    --compare_attention and --compare_compile (the eager backend: dynamo's graph capture alone; aot_eager's
    autograd tracing doubled the sweep's time, and inductor's code generation takes minutes; compiled training
    itself is tests/training/test_torch_compile.py's). Two timed steps a window: what is checked is the fields and
    how they relate, not the rates."""
    out = tmp_path_factory.mktemp("bench")
    code, results, stdout = run_bench(out, *TINY, "--steps", "2", "--mode", "loader,train",
                                      "--pipelines", ",".join(PIPELINES), "--workers", "0,1", "--auto",
                                      "--compare_bf16", "--compare_compile", "--torch_compile_backend", "eager",
                                      "--compare_attention")  # fmt: skip
    assert code == 0 and results is not None
    return out, results, stdout


@pytest.mark.slow
def test_bench_json_has_every_field_with_consistent_values(bench_run) -> None:
    _, results, _ = bench_run
    assert results["complete"] is True
    compute = results["compute"]
    ceiling = compute["samples_per_second"]
    assert ceiling > 0 and compute["step_ms"] > 0 and compute["precision"] == "fp32"
    rows = results["rows"]
    train_rows = [r for r in rows if r["mode"] == "train"]
    # Read before and after the sweep and beside every train row; the highest reading is the ceiling.
    assert len(compute["readings"]) == 2 + len(train_rows)
    assert ceiling == pytest.approx(max(compute["readings"]), rel=1e-3)
    assert all(0 < r["compute_reading"] <= ceiling * 1.001 for r in train_rows)
    measured = {(r["mode"], r["pipeline"], r["workers"], r["prefetch_factor"]) for r in rows}
    for mode in MODES:
        for pipeline in PIPELINES:
            for workers in WORKERS:
                assert (mode, pipeline, workers, 2 if workers else None) in measured
    tolerance = results["ceiling_tolerance"]
    assert tolerance == CEILING_TOLERANCE
    for row in rows:
        assert row["error"] is None, row
        rate = row["samples_per_second"]
        assert 0 < row["samples_per_second_min"] <= rate <= row["samples_per_second_max"]
        assert 0.0 <= row["data_wait_share"] <= 1.0
        assert row["fraction_of_compute"] == pytest.approx(rate / ceiling)
        assert row["speedup_vs_reference"] > 0
        assert row["peak_host_rss_mib"] > 50  # at least the Python process with torch loaded
        assert row["peak_device_memory_mib"] is None  # CPU
        # Two timed steps on a shared machine can read above the ceiling: the flag says so when they do.
        assert row["above_ceiling"] is (row["mode"] == "train" and rate > ceiling * (1 + tolerance))
        if row["pipeline"] == "reference" and row["workers"] == 0:
            assert row["speedup_vs_reference"] == pytest.approx(1.0)
    assert results["machine"]["cores"] >= 1 and results["machine"]["device"] == "cpu"
    comparison = results["bf16_comparison"]
    assert comparison["fp32_samples_per_second"] > 0 and comparison["bf16_samples_per_second"] > 0
    assert comparison["bf16_weights_speedup"] == pytest.approx(
        comparison["bf16_weights_samples_per_second"] / comparison["fp32_samples_per_second"]
    )
    assert comparison["fp32_over_bf16"] == pytest.approx(
        comparison["fp32_samples_per_second"] / comparison["bf16_samples_per_second"]
    )
    attention = results["attention_comparison"]
    assert attention["eager_samples_per_second"] > 0 and attention["sdpa_samples_per_second"] > 0
    compiled = results["compile_comparison"]
    assert compiled["backend"] == "eager" and compiled["first_compiled_step_seconds"] > 0
    assert compiled["compiled_speedup"] == pytest.approx(
        compiled["compiled_samples_per_second"] / compiled["eager_samples_per_second"]
    )
    # With --compare_bf16 the compiled step is measured in both precisions (bf16: under autocast, its own graph).
    assert set(compiled["by_precision"]) == {"fp32", "bf16"}
    assert compiled["by_precision"]["fp32"]["compiled_samples_per_second"] == compiled["compiled_samples_per_second"]
    for figures in compiled["by_precision"].values():
        assert figures["compiled_samples_per_second"] > 0 and figures["first_compiled_step_seconds"] > 0
    assert results["settings"]["estimated_train_memory_gib"] > 0  # the fit check ran before the sweep
    # Compute efficiency: FLOPs counted on a step, a peak measured on this CPU, TFLOP/s and MFU per train row.
    peak = results["peak"]
    assert results["flops_per_sample"] > 1e6 and peak["peak_measured"] and peak["peak_tflops"] > 0
    for row in rows:
        if row["mode"] == "train":
            assert row["tflops_per_second"] == pytest.approx(
                row["samples_per_second"] * results["flops_per_sample"] / 1e12
            )
            assert row["mfu"] == pytest.approx(row["tflops_per_second"] / peak["peak_tflops"])
        else:
            assert row["tflops_per_second"] is None and row["mfu"] is None


@pytest.mark.slow
def test_bench_profiles_every_stage_of_every_pipeline(bench_run) -> None:
    _, results, _ = bench_run
    assert set(results["stages"]) == set(PIPELINES)
    for pipeline, profile in results["stages"].items():
        stages = profile["stages_ms"]
        assert set(stages) == {*WORKER_STAGES, *MAIN_STAGES}
        assert all(value >= 0 for value in stages.values())
        assert stages["decode"] > 0 and stages["collate"] > 0, pipeline
        assert stages["compute"] == pytest.approx(results["compute"]["step_ms"], rel=1e-3)
        assert profile["worker_ms"] == pytest.approx(sum(stages[s] for s in WORKER_STAGES), abs=0.01)
        assert profile["largest_worker_stage"] in WORKER_STAGES


@pytest.mark.slow
def test_bench_verdict_follows_the_threshold(bench_run) -> None:
    _, results, _ = bench_run
    verdict = results["verdict"]
    best = max((r for r in results["rows"] if r["mode"] == "train"), key=lambda r: r["samples_per_second"])
    assert verdict["best"]["samples_per_second"] == best["samples_per_second"]
    fraction = best["samples_per_second"] / results["compute"]["samples_per_second"]
    assert verdict["fraction_of_compute"] == pytest.approx(fraction)
    # Data-bound below the threshold only where the run waited for data (train mode); else the step's own overhead.
    waits = best.get("data_wait_share") is None or best["data_wait_share"] >= DATA_WAIT_BOUND
    assert verdict["bound"] == ("data-bound" if fraction < DATA_BOUND_BELOW and waits else "compute-bound")
    assert verdict["bound"] in verdict["text"] and f"{fraction:.2f}" in verdict["text"]


@pytest.mark.slow
def test_bench_writes_markdown_png_and_a_terminal_table(bench_run) -> None:
    out, results, stdout = bench_run
    assert_png(out / "bench.png")
    markdown = (out / "bench.md").read_text()
    for text in ("| mode | pipeline | workers |", "## Verdict", "## Published figures", "601.5 (75.2)", "bench.png",
                 "https://huggingface.co/blog/bridgetower"):  # fmt: skip
        assert text in markdown
    assert "samples/s" in stdout and "verdict: " in stdout and "vlfit train" in stdout
    assert "attention kernel compute: eager" in stdout
    assert "torch.compile (eager) compute: fp32 eager" in stdout and "; bf16 eager" in stdout  # both precisions
    assert "torch.compile (eager)" in markdown
    assert stdout.count("\ntrain  ") + stdout.count("\nloader ") == len(results["rows"])
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left behind


@pytest.mark.slow
def test_auto_recommends_a_configuration_that_is_in_the_sweep(bench_run) -> None:
    _, results, stdout = bench_run
    chosen = results["recommendation"]["row"]
    matches = [
        r for r in results["rows"]
        if all(r[k] == chosen[k] for k in ("mode", "pipeline", "workers", "prefetch_factor", "samples_per_second"))
    ]  # fmt: skip
    assert len(matches) == 1 and chosen["mode"] == "train"
    flags = results["recommendation"]["flags"]
    assert flags[flags.index("--dataloader_num_workers") + 1] == str(chosen["workers"])
    assert results["recommendation"]["command"] in stdout
    if chosen["pipeline"] == "prepared":
        assert "vlfit prepare" in results["recommendation"]["prepare_command"]
    # --auto measured prefetch 4 next to prefetch 2 for whatever configuration led with workers.
    for row in results["rows"]:
        if row["prefetch_factor"] == 4:
            same = [r for r in results["rows"] if all(r[k] == row[k] for k in ("mode", "pipeline", "workers"))]
            assert {r["prefetch_factor"] for r in same} == {2, 4}


@pytest.mark.slow
def test_bench_reads_a_dataset_folder_and_prepares_it(tmp_path: Path, synthetic_dataset_dir: str) -> None:
    cache = tmp_path / "cache"
    code, results, _ = run_bench(tmp_path / "out", *TINY, "--dataset_name", synthetic_dataset_dir, "--pipelines",
                                 "fast,prepared", "--workers", "0", "--mode", "loader", "--profile_batches", "0",
                                 "--cache_dir", str(cache), "--id_column", "instance_id")  # fmt: skip
    assert code == 0
    assert synthetic_dataset_dir in results["settings"]["data"]
    assert [r["pipeline"] for r in results["rows"]] == ["fast", "prepared"]
    assert all(r["samples_per_second"] > 0 and r["error"] is None for r in results["rows"])
    assert results["stages"] == {}
    (prepared,) = cache.glob("prepared-64px-*")  # kept for the next run: the tiny preset's 64 px
    assert list(prepared.glob("train-*.parquet"))


@pytest.mark.slow
def test_loader_mode_never_builds_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("loader mode built a model")

    # Every way to a model's weights goes through the family's build (presets) or from_pretrained (checkpoints).
    monkeypatch.setattr(BridgeTowerFamily, "build", refuse)
    monkeypatch.setattr(BridgeTowerFamily, "from_pretrained", refuse)
    code, results, _ = run_bench(tmp_path, *QUICK, "--mode", "loader", "--workers", "0")
    assert code == 0
    assert [r["mode"] for r in results["rows"]] == ["loader"] and results["rows"][0]["samples_per_second"] > 0
    assert "compute" not in results and results["verdict"] is None  # no model, no compute ceiling
    assert "parameters" not in results["settings"]["model"]


def _exit_in_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every DataLoader worker die at its first sample, as one the OOM killer ends (no exception raised)."""
    make_sample = ImageTextDataset._sample  # what both __getitem__ and __getitems__ (the loader's) call

    def die_in_a_worker(self: ImageTextDataset, *args: Any, **kwargs: Any) -> Any:
        if torch.utils.data.get_worker_info() is not None:
            os._exit(9)
        return make_sample(self, *args, **kwargs)

    monkeypatch.setattr(ImageTextDataset, "_sample", die_in_a_worker)


@pytest.mark.slow
def test_a_killed_worker_fails_its_row_and_the_sweep_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _exit_in_workers(monkeypatch)
    code, results, stdout = run_bench(tmp_path, *QUICK, "--mode", "loader", "--workers", "1,0")
    assert code == 0 and results["complete"] is True
    failed, measured = results["rows"]
    assert (failed["workers"], failed["samples_per_second"]) == (1, None)
    assert failed["error"].startswith("RuntimeError: DataLoader worker") and "exited unexpectedly" in failed["error"]
    assert (measured["workers"], measured["error"]) == (0, None) and measured["samples_per_second"] > 0
    markdown = (tmp_path / "bench.md").read_text()
    failed_lines = [line for line in markdown.splitlines() if "| failed |" in line]
    assert len(failed_lines) == 1 and "exited unexpectedly" in failed_lines[0]
    assert "failed" in stdout


class _StubSession:
    """Stands in for a ``BenchSession`` whose measurement raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.recovered = 0

    def compute(self, repeats: int | None = None) -> dict[str, Any]:
        return {"samples_per_second": 10.0}

    def measure(self, *config: Any) -> dict[str, Any]:
        raise self.error

    def recover(self) -> None:
        self.recovered += 1


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), MemoryError(), OSError("disk")],
    ids=["cuda-oom", "host-oom", "os-error"],
)
def test_a_failing_configuration_becomes_a_row_with_its_error(error: BaseException) -> None:
    session = _StubSession(error)
    row, reading = measure_configuration(session, ("train", "fast", 2, 4))  # type: ignore[arg-type]
    assert {k: row[k] for k in ("mode", "pipeline", "workers", "prefetch_factor")} == {
        "mode": "train", "pipeline": "fast", "workers": 2, "prefetch_factor": 4
    }  # fmt: skip
    assert row["samples_per_second"] is None and row["error"].startswith(type(error).__name__)
    assert reading == {"samples_per_second": 10.0}  # the ceiling reading taken beside it is kept
    assert session.recovered == 1  # gradients and cached memory of the failed step are dropped
    with pytest.raises(KeyboardInterrupt):  # an interruption is not a failed configuration
        measure_configuration(_StubSession(KeyboardInterrupt()), ("loader", "fast", 0, None))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_stopped_sweep_keeps_what_was_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str) -> None:
    """Ctrl-C, or a real SIGTERM to the process running the sweep (this one), once a reading exists."""
    measure = BenchSession.measure
    calls = []

    def stop_at_second(self, *args):
        calls.append(args)
        if len(calls) == 2:
            if stop == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # the bench's handler must take it, or pytest dies here
        return measure(self, *args)

    monkeypatch.setattr(BenchSession, "measure", stop_at_second)
    code, results, _ = run_bench(tmp_path, *TINY, "--pipelines", "fast", "--workers", "0,1")
    assert code == 130
    assert results["complete"] is False and len(results["rows"]) == 1
    assert results["compute"]["samples_per_second"] > 0
    assert "Partial results" in (tmp_path / "bench.md").read_text()
    assert_png(tmp_path / "bench.png")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was removed


@pytest.mark.slow
def test_a_compile_backend_that_fails_loses_its_reading_not_the_sweep(tmp_path: Path) -> None:
    code, results, stdout = run_bench(tmp_path, *QUICK, "--mode", "train", "--workers", "0", "--compare_compile",
                                      "--torch_compile_backend", "no_such_backend")  # fmt: skip
    assert code == 0 and results["complete"] is True and results["rows"][0]["samples_per_second"] > 0
    assert "no_such_backend" in results["compile_comparison"]["error"]
    assert "torch.compile comparison failed" in stdout


@pytest.mark.slow
def test_a_bf16_weights_step_that_fails_loses_its_reading_not_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The step holds a second copy of the model: where that copy does not fit, the comparison keeps fp32 and bf16.
    def out_of_memory(self: BenchSession) -> None:
        raise RuntimeError("out of memory for a second copy of the model")

    monkeypatch.setattr(BenchSession, "bf16_weights_step", out_of_memory)
    code, results, stdout = run_bench(tmp_path, *QUICK, "--mode", "train", "--workers", "0", "--compare_bf16")
    assert code == 0 and results["complete"] is True
    comparison = results["bf16_comparison"]
    assert comparison["fp32_samples_per_second"] > 0 and comparison["bf16_samples_per_second"] > 0
    assert "bf16_weights_speedup" not in comparison and "out of memory" in comparison["bf16_weights_error"]
    assert "(--bf16_weights) failed: " in stdout and "out of memory" in stdout


@pytest.mark.slow
def test_bench_with_an_itm_objective_measures_and_records_it(tmp_path: Path) -> None:
    code, results, stdout = run_bench(tmp_path, *QUICK, "--mode", "train", "--workers", "0",
                                      "--objective", "contrastive+itm")  # fmt: skip
    assert code == 0 and results["complete"] is True and results["settings"]["objective"] == "contrastive+itm"
    assert results["rows"][0]["error"] is None and results["rows"][0]["samples_per_second"] > 0
    assert results["flops_per_sample"] > 0 and results["rows"][0]["mfu"] > 0
    assert "objective contrastive+itm" in stdout and "objective contrastive+itm" in (tmp_path / "bench.md").read_text()
