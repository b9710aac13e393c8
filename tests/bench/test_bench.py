"""vlfit bench: a tiny sweep end to end (JSON fields, files, verdict, choice), the choice rule, the measurement
window, fallbacks for missing packages, benchmarks/gpu.sh on the CPU, and ``vlfit train
--dataloader_num_workers auto``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from vlfit.bench.auto import AUTO_TOLERANCE, choose, take_auto_workers, train_flags
from vlfit.bench.measure import PeakHostMemory, host_rss_bytes, timed_window
from vlfit.bench.report import CEILING_TOLERANCE, DATA_BOUND_BELOW, finalize, write_outputs
from vlfit.bench.stages import MAIN_STAGES, WORKER_STAGES
from vlfit.bench.sweep import SweepPlan, default_workers
from vlfit.cli import main

REPO = Path(__file__).resolve().parents[2]
# Few small images, batch 4, one warm-up and three timed steps: every code path, in seconds per configuration.
TINY = ["--model_preset", "tiny", "--num_samples", "8", "--synthetic_min_long_side", "160",
        "--synthetic_max_long_side", "320", "--per_device_train_batch_size", "4", "--steps", "3",
        "--warmup_steps", "1", "--repeats", "1", "--profile_batches", "1", "--num_proc", "1"]  # fmt: skip
PIPELINES = ("reference", "fast", "prepared")
WORKERS = (0, 1)
MODES = ("loader", "train")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    """One tiny sweep over both modes, three pipelines and 0/1 workers, with --auto and --compare_bf16."""
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--output_dir", str(out), *TINY, "--mode", "loader,train", "--pipelines", ",".join(PIPELINES),
            "--workers", "0,1", "--auto", "--compare_bf16"]  # fmt: skip
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    return out, json.loads((out / "bench.json").read_text()), stdout.getvalue()


def test_bench_json_has_every_field_with_sane_values(bench_run) -> None:
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
        if row["mode"] == "train":
            # A train step does all a ceiling step does, and waits for data besides: only noise can put it above.
            assert rate <= ceiling * (1 + tolerance), row
            assert row["above_ceiling"] is False
        if row["pipeline"] == "reference" and row["workers"] == 0:
            assert row["speedup_vs_reference"] == pytest.approx(1.0)
    assert results["machine"]["cores"] >= 1 and results["machine"]["device"] == "cpu"
    comparison = results["bf16_comparison"]
    assert comparison["fp32_samples_per_second"] > 0 and comparison["bf16_samples_per_second"] > 0
    assert comparison["fp32_over_bf16"] == pytest.approx(
        comparison["fp32_samples_per_second"] / comparison["bf16_samples_per_second"]
    )


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


def test_bench_verdict_follows_the_threshold(bench_run) -> None:
    _, results, _ = bench_run
    verdict = results["verdict"]
    best = max((r for r in results["rows"] if r["mode"] == "train"), key=lambda r: r["samples_per_second"])
    assert verdict["best"]["samples_per_second"] == best["samples_per_second"]
    fraction = best["samples_per_second"] / results["compute"]["samples_per_second"]
    assert verdict["fraction_of_compute"] == pytest.approx(fraction)
    assert verdict["bound"] == ("data-bound" if fraction < DATA_BOUND_BELOW else "compute-bound")
    assert verdict["bound"] in verdict["text"] and f"{fraction:.2f}" in verdict["text"]


def test_bench_writes_markdown_png_and_a_terminal_table(bench_run) -> None:
    out, results, stdout = bench_run
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["settings"]["chart_renderer"] == "matplotlib"
    markdown = (out / "bench.md").read_text()
    for text in ("| mode | pipeline | workers |", "## Verdict", "## Published figures", "601.5 (75.2)", "bench.png"):
        assert text in markdown
    assert "samples/s" in stdout and "verdict: " in stdout and "vlfit train" in stdout
    assert stdout.count("\ntrain  ") + stdout.count("\nloader ") == len(results["rows"])


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


def test_bench_reads_a_dataset_folder_and_prepares_it(tmp_path: Path, synthetic_dataset_dir: str) -> None:
    cache = tmp_path / "cache"
    argv = ["bench", "--output_dir", str(tmp_path / "out"), *TINY, "--dataset_name", synthetic_dataset_dir,
            "--pipelines", "fast,prepared", "--workers", "0", "--mode", "loader", "--profile_batches", "0",
            "--cache_dir", str(cache)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    results = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert synthetic_dataset_dir in results["settings"]["data"]
    assert [r["pipeline"] for r in results["rows"]] == ["fast", "prepared"]
    assert all(r["samples_per_second"] > 0 and r["error"] is None for r in results["rows"])
    assert results["stages"] == {}
    (prepared,) = cache.glob("prepared-64px-*")  # kept for the next run: the tiny preset's 64 px
    assert list(prepared.glob("train-*.parquet"))


def _row(pipeline: str, workers: int, rate: float, mode: str = "train", prefetch: int | None = None) -> dict:
    return {"mode": mode, "pipeline": pipeline, "workers": workers, "samples_per_second": rate,
            "prefetch_factor": prefetch if prefetch is not None else (2 if workers else None)}  # fmt: skip


def test_choose_prefers_no_preparation_then_fewer_workers_within_the_tolerance() -> None:
    near = 1 - AUTO_TOLERANCE / 2
    rows = [_row("fast", 2, 100.0), _row("fast", 1, 100.0 * near), _row("prepared", 0, 102.0)]
    assert choose(rows)["workers"] == 1 and choose(rows)["pipeline"] == "fast"
    rows.append(_row("prepared", 1, 100.0 / (1 - AUTO_TOLERANCE) + 1.0))  # clearly fastest: worth preparing
    assert choose(rows)["pipeline"] == "prepared"
    # Train rows win over loader rows however fast the loader alone is; failed rows are ignored.
    mixed = [_row("fast", 2, 900.0, mode="loader"), _row("reference", 0, 10.0), _row("fast", 1, None)]
    assert choose(mixed)["pipeline"] == "reference"
    assert choose([_row("fast", 1, None)]) is None
    assert choose([_row("fast", 2, 100.0, prefetch=4), _row("fast", 2, 99.0, prefetch=2)])["prefetch_factor"] == 2


def test_train_flags_reproduce_each_pipeline() -> None:
    device = train_flags(_row("device", 2, 1.0, prefetch=4), precision="bf16", batch_size=48)
    assert device == ["--image_pipeline", "fast", "--decode_on_device", "--dataloader_num_workers", "2",
                      "--dataloader_prefetch_factor", "4", "--per_device_train_batch_size", "48", "--bf16"]  # fmt: skip
    reference = train_flags(_row("reference", 0, 1.0), precision="fp32", batch_size=8)
    assert reference == ["--image_pipeline", "reference", "--dataloader_num_workers", "0",
                         "--per_device_train_batch_size", "8"]  # fmt: skip


def test_take_auto_workers_rewrites_only_the_auto_value() -> None:
    assert take_auto_workers(["--x", "1", "--dataloader_num_workers", "auto"]) == (
        ["--x", "1", "--dataloader_num_workers", "0"],
        True,
    )
    assert take_auto_workers(["--dataloader_num_workers=auto"]) == (["--dataloader_num_workers=0"], True)
    assert take_auto_workers(["--dataloader_num_workers", "3"]) == (["--dataloader_num_workers", "3"], False)
    assert take_auto_workers(["--output_dir", "auto"]) == (["--output_dir", "auto"], False)
    assert take_auto_workers(None) == (None, False)


def test_default_workers_go_up_to_the_core_count() -> None:
    assert default_workers(2) == [0, 1, 2]
    assert default_workers(1) == [0, 1, 2]
    assert default_workers(16) == [0, 1, 2, 4, 8, 16]
    assert default_workers(6) == [0, 1, 2, 4]


def test_plan_rejects_unknown_names_and_empty_sweeps() -> None:
    with pytest.raises(ValueError, match="unknown pipeline 'turbo'"):
        SweepPlan(pipelines=["turbo"], workers=[0])
    with pytest.raises(ValueError, match="unknown mode 'infer'"):
        SweepPlan(pipelines=["fast"], workers=[0], modes=["infer"])
    with pytest.raises(ValueError, match="--steps must be at least 1"):
        SweepPlan(pipelines=["fast"], workers=[0], steps=0)
    with pytest.raises(ValueError, match="exclude each other"):
        main(["bench", "--bf16", "--fp32", "--output_dir", "unused"])


def _batches(waits: list[float]):
    for wait in waits:
        time.sleep(wait)
        yield wait, {}


def test_window_settles_until_a_step_waits_then_times_the_steps() -> None:
    # Three batches were buffered during warm-up (no wait), then every batch takes 20 ms to arrive.
    waits = [0.0, 0.0, 0.0, 0.0] + [0.02] * 6
    window = timed_window(_batches(waits), lambda batch: None, device=torch.device("cpu"), batch_size=4,
                          warmup_steps=1, steps=4, max_settle_steps=5)  # fmt: skip
    assert window.settle_steps == 4  # three buffered batches, then the first that waited
    assert window.steps == 4 and window.data_wait_share > 0.5
    assert window.samples_per_second < 4 / 0.015  # the buffered batches were not counted
    with pytest.raises(RuntimeError, match="ran out of batches"):
        timed_window(_batches([0.0] * 3), None, device=torch.device("cpu"), batch_size=1, warmup_steps=1, steps=5,
                     max_settle_steps=0)  # fmt: skip


def test_host_memory_without_psutil_reads_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    with_psutil = host_rss_bytes()
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` now raises ImportError
    from_proc = host_rss_bytes()
    assert from_proc is not None and with_psutil is not None
    assert from_proc == pytest.approx(with_psutil, rel=0.2)
    with PeakHostMemory(interval_s=0.01) as peak:
        block = bytearray(64 * 2**20)  # touch 64 MiB while the sampler runs
        time.sleep(0.05)
        del block
    assert peak.peak_bytes >= from_proc + 32 * 2**20


def _made_up_results(best: float, ceiling: float) -> dict[str, Any]:
    rows = [_row("reference", 0, best / 4), _row("fast", 1, best)]
    for row in rows:
        row.update(samples_per_second_min=row["samples_per_second"], samples_per_second_max=row["samples_per_second"],
                   data_wait_share=0.5, peak_host_rss_mib=100.0, peak_device_memory_mib=None, error=None)  # fmt: skip
    return {
        "settings": {"batch_size": 48, "precision": "bf16", "steps": 10, "warmup_steps": 3, "repeats": 1,
                     "prefetch_factors": [2], "model": "preset large", "model_flags": ["--model_preset", "large"]},
        "machine": {"cpu": "test", "cores": 2, "device_name": "cpu", "jpeg_decoder": "x", "torch": "x"},
        "compute": {"samples_per_second": ceiling, "step_ms": 1000 * 48 / ceiling, "precision": "bf16",
                    "readings": [ceiling]},
        "rows": rows,
        "stages": {},
        "complete": True,
    }  # fmt: skip


def test_verdict_threshold_ceiling_flag_and_pillow_chart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data_bound = finalize(_made_up_results(best=80.0, ceiling=100.0))
    assert data_bound["verdict"]["bound"] == "data-bound"
    assert data_bound["rows"][1]["speedup_vs_reference"] == pytest.approx(4.0)
    compute_bound = finalize(_made_up_results(best=95.0, ceiling=100.0))
    assert compute_bound["verdict"]["bound"] == "compute-bound"
    assert not any(r["above_ceiling"] for r in compute_bound["rows"])
    above = finalize(_made_up_results(best=100.0 * (1 + CEILING_TOLERANCE) + 1, ceiling=100.0))
    assert above["rows"][1]["above_ceiling"] is True
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no matplotlib: Pillow draws the chart
    paths = write_outputs(data_bound, str(tmp_path))
    assert Path(paths["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(Path(paths["json"]).read_text())["settings"]["chart_renderer"] == "pillow"
    assert "--bf16" in data_bound["recommendation"]["command"]


def test_interrupted_bench_writes_partial_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vlfit.bench.sweep import BenchSession

    measure = BenchSession.measure
    calls = []

    def interrupt_second(self, *args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(self, *args)

    monkeypatch.setattr(BenchSession, "measure", interrupt_second)
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["bench", "--output_dir", str(tmp_path), *TINY, "--pipelines", "fast", "--workers", "0,1"])
    assert code == 130
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["complete"] is False and len(results["rows"]) == 1
    assert "Partial results" in (tmp_path / "bench.md").read_text()


def test_sigterm_stops_the_sweep_and_keeps_what_was_measured(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "vlfit", "bench", "--output_dir", str(tmp_path), *TINY, "--pipelines",
            "reference,fast", "--workers", "0,1,2", "--steps", "20", "--repeats", "3"]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "bench.json").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the first partial write comes after the first compute reading
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["complete"] is False and results["compute"]["samples_per_second"] > 0
    assert (tmp_path / "bench.png").exists()


def _blocked_packages(folder: Path, names: tuple[str, ...]) -> str:
    """A folder that, first on PYTHONPATH, makes ``import NAME`` fail as on a machine without NAME."""
    for name in names:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed here')\n")
    return str(folder)


def test_gpu_script_runs_on_a_cpu_without_datasets_simplejpeg_or_matplotlib(tmp_path: Path) -> None:
    out = tmp_path / "out"
    blocked = _blocked_packages(tmp_path / "blocked", ("datasets", "simplejpeg", "matplotlib"))
    args = " ".join([*TINY, "--pipelines", "fast,device", "--workers", "0,1"])
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": blocked, "VLFIT_BENCH_ALLOW_CPU": "1",
           "VLFIT_BENCH_ARGS": args}  # fmt: skip
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "simplejpeg no" in done.stdout and "datasets no" in done.stdout
    results = json.loads((out / "bench.json").read_text())
    assert results["machine"]["jpeg_decoder"].startswith("pillow")
    assert results["machine"]["datasets_installed"] is False
    assert results["settings"]["chart_renderer"] == "pillow"
    assert len(results["rows"]) == 4 and all(row["samples_per_second"] > 0 for row in results["rows"])
    assert (out / "bench.png").stat().st_size > 0 and (out / "bench.log").stat().st_size > 0
    # The CUDA tests ran first and, without a GPU, reported every one of them skipped.
    tests_log = (out / "cuda_tests.log").read_text()
    assert "SKIPPED" in tests_log and "needs an NVIDIA GPU" in tests_log and "failed" not in tests_log
    assert "gpu.sh: CUDA tests exit 0" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_script_refuses_to_run_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("VLFIT_BENCH_ALLOW_CPU", None)
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and "no CUDA GPU" in done.stderr
    assert not (tmp_path / "bench.json").exists()


def test_train_with_auto_workers_probes_and_uses_the_choice(tmp_path: Path, synthetic_dataset_dir: str, caplog) -> None:
    out = tmp_path / "model"
    caplog.set_level("INFO", logger="vlfit")
    argv = ["train", "--model_preset", "tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir", str(out),
            "--max_steps", "2", "--per_device_train_batch_size", "4", "--dataloader_num_workers", "auto",
            "--report_to", "none", "--save_strategy", "no"]  # fmt: skip
    assert main(argv) == 0
    chosen = [r.getMessage() for r in caplog.records if "--dataloader_num_workers auto ->" in r.getMessage()]
    assert len(chosen) == 1
    workers = int(chosen[0].split("->")[1].split()[0])
    assert workers in default_workers()
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert args.dataloader_num_workers == workers
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_bench_on_cuda_measures_device_memory_and_device_decode(tmp_path: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["bench", "--output_dir", str(tmp_path), *TINY, "--pipelines", "fast,device", "--workers", "0,1",
                     "--device", "cuda"]) == 0  # fmt: skip
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["settings"]["precision"] in ("bf16", "fp32")
    for row in results["rows"]:
        assert row["error"] is None and row["samples_per_second"] > 0
        assert row["peak_device_memory_mib"] > 0
