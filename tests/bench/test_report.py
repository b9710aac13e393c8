"""Derived figures, verdict and text; the chart; the files; the published figures."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

import vlfit.bench.files
import vlfit.bench.published
from tests.bench.bench_runs import assert_png, made_up_results, row
from vlfit.bench.chart import write_png
from vlfit.bench.files import write_outputs
from vlfit.bench.published import citation, published_figures
from vlfit.bench.report import CEILING_TOLERANCE, finalize, format_markdown, format_terminal


def test_verdict_threshold_and_ceiling_flag() -> None:
    data_bound = finalize(made_up_results(best=80.0, ceiling=100.0))
    assert data_bound["verdict"]["bound"] == "data-bound"
    assert data_bound["rows"][1]["speedup_vs_reference"] == pytest.approx(4.0)
    assert "--bf16" in data_bound["recommendation"]["command"]
    compute_bound = finalize(made_up_results(best=95.0, ceiling=100.0))
    assert compute_bound["verdict"]["bound"] == "compute-bound"
    assert not any(r["above_ceiling"] for r in compute_bound["rows"])
    above = finalize(made_up_results(best=100.0 * (1 + CEILING_TOLERANCE) + 1, ceiling=100.0))
    assert above["rows"][1]["above_ceiling"] is True
    assert "(!)" in format_terminal(above)


def test_the_report_names_the_objective_measured() -> None:
    results = made_up_results(best=80.0, ceiling=100.0)
    results["settings"]["objective"] = "contrastive+itm"
    results.update(flops_per_sample=3e9, peak={"peak_tflops": 100.0, "peak_precision": "bf16",
                                               "peak_device": "test", "peak_source": "made up"})  # fmt: skip
    results = finalize(results)
    text = format_terminal(results)
    assert "bf16, objective contrastive+itm;" in text
    assert "counted on a training step of objective contrastive+itm" in text
    assert results["recommendation"]["command"].endswith("--bf16 --objective contrastive+itm")
    assert "objective contrastive;" in format_terminal(finalize(made_up_results(best=80.0, ceiling=100.0)))


def test_a_failed_row_shows_its_error_on_one_line() -> None:
    results = made_up_results(best=80.0, ceiling=100.0)
    error = "OutOfMemoryError: CUDA out of memory.\nTried to allocate 2.00 GiB | GPU 0"
    results["rows"].append({**row("fast", 2, None), "data_wait_share": None, "error": error})
    results = finalize(results)
    assert results["verdict"]["best"]["workers"] == 1  # the failed row is no candidate
    lines = [line for line in format_markdown(results).splitlines() if "| failed |" in line]
    assert len(lines) == 1
    assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB / GPU 0" in lines[0]
    assert "failed" in format_terminal(results)


def test_chart_is_a_png_the_markdown_links(tmp_path: Path) -> None:
    results = finalize(made_up_results(best=80.0, ceiling=100.0))
    write_png(results, str(tmp_path / "chart.png"))
    assert_png(tmp_path / "chart.png")
    paths = write_outputs(results, str(tmp_path / "out"))
    drawn = assert_png(Path(paths["png"]))
    # Bars: the rows' colours fill part of the picture, not just axes and text.
    colours = {colour for _, colour in drawn.getcolors(maxcolors=1 << 16)}
    assert len(colours) > 2
    assert "bench.png" in Path(paths["md"]).read_text()


def test_files_are_written_whole_and_the_numbers_survive_a_broken_chart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(results, path):
        Path(path).write_bytes(b"half a chart")
        raise RuntimeError("no fonts here")

    monkeypatch.setattr(vlfit.bench.files, "write_png", broken)
    results = finalize(made_up_results(best=80.0, ceiling=100.0))
    paths = write_outputs(results, str(tmp_path))
    assert set(paths) == {"json", "md"}
    assert json.loads(Path(paths["json"]).read_text())["verdict"]["bound"] == "data-bound"
    assert "![" not in Path(paths["md"]).read_text()  # no link to a chart that was not drawn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md"]  # no temporary files either


def test_published_figures_come_from_the_data_file_with_their_source(monkeypatch: pytest.MonkeyPatch) -> None:
    text = resources.files("vlfit.bench").joinpath("published.json").read_text(encoding="utf-8")
    figures = published_figures()
    assert figures == json.loads(text)
    by_device = {entry["device"]: entry for entry in figures["rows"]}
    assert by_device["Gaudi2"]["samples_per_second"] == {"0": 601.5, "1": 747.4, "2": 768.7}
    assert by_device["Gaudi2"]["media_pipeline"] == 847.7
    assert by_device["H100"]["samples_per_second"] == {"0": 336.5, "1": 580.1, "2": 602.1}
    assert by_device["A100"]["samples_per_second"] == {"0": 227.5, "1": 339.7, "2": 345.4}
    assert (figures["devices"], figures["batch_size_per_device"], figures["precision"]) == (8, 48, "bf16")
    source = figures["source"]
    assert source["url"] == "https://huggingface.co/blog/bridgetower"
    assert source["title"] == "Accelerating Vision-Language Models: BridgeTower on Habana Gaudi2"
    assert source["authors"] == ["Régis Pierrard", "Anahita Bhiwandiwalla"]
    # The report reads whatever the file holds.
    changed = json.loads(text)
    changed["rows"][0]["samples_per_second"]["1"] = 123.4
    monkeypatch.setattr(vlfit.bench.published, "_text", lambda: json.dumps(changed))
    results = finalize(made_up_results(best=80.0, ceiling=100.0))
    assert results["published"]["rows"][0]["samples_per_second"]["1"] == 123.4
    markdown = format_markdown(results)
    assert "123.4 (15.4)" in markdown and "747.4" not in markdown
    assert citation(changed) in markdown


def test_published_figures_must_cover_every_worker_count(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = published_figures()
    del broken["rows"][1]["samples_per_second"]["2"]
    monkeypatch.setattr(vlfit.bench.published, "_text", lambda: json.dumps(broken))
    with pytest.raises(ValueError, match="H100 has no figure for 2 workers"):
        published_figures()


def test_a_step_below_the_ceiling_that_never_waits_for_data_is_not_data_bound() -> None:
    results = made_up_results(best=60.0, ceiling=100.0)
    for r in results["rows"]:
        r["mode"], r["data_wait_share"] = "train", 0.0
    verdict = finalize(results)["verdict"]
    assert verdict["bound"] == "compute-bound"
    assert "the gap is the training step's own overhead" in verdict["text"]
    results["rows"][1]["data_wait_share"] = 0.2  # the same rate, waiting a fifth of the time: the data holds it back
    assert finalize(results)["verdict"]["bound"] == "data-bound"


@pytest.mark.parametrize(
    ("fp32", "bf16", "chosen"),
    [(10.0, 30.0, "bf16"), (30.0, 5.2, "fp32"), (10.0, 10.5, "bf16")],  # AMX; an AVX2 CPU; within noise: its own
)
def test_the_recommendation_takes_the_precision_measured_faster(fp32: float, bf16: float, chosen: str) -> None:
    results = made_up_results(best=80.0, ceiling=100.0)  # swept in bf16
    results["machine"]["cpu_features"] = ["amx_bf16", "amx_int8", "avx512_vnni"]
    results["bf16_comparison"] = {"fp32_samples_per_second": fp32, "bf16_samples_per_second": bf16,
                                  "fp32_over_bf16": fp32 / bf16, "bf16_speedup": bf16 / fp32}  # fmt: skip
    recommendation = finalize(results)["recommendation"]
    assert ("--bf16" in recommendation["flags"]) == (chosen == "bf16")
    assert (
        f"; {chosen}: bf16 ran {bf16 / fp32:.2f}x fp32's compute here on a CPU with amx_bf16"
        in (recommendation["text"])
    )


@pytest.mark.parametrize(("bf16_weights", "flags"), [(30.0, ["--bf16", "--bf16_weights"]), (25.0, ["--bf16"])])
def test_bf16_weights_are_recommended_where_they_beat_autocast_by_the_margin(bf16_weights: float, flags) -> None:
    results = made_up_results(best=80.0, ceiling=100.0)
    results["settings"]["precision"] = "fp32"
    results["bf16_comparison"] = {"fp32_samples_per_second": 10.0, "bf16_samples_per_second": 24.0,
                                  "bf16_weights_samples_per_second": bf16_weights, "fp32_over_bf16": 10 / 24,
                                  "bf16_speedup": 2.4, "bf16_weights_speedup": bf16_weights / 10}  # fmt: skip
    recommendation = finalize(results)["recommendation"]
    assert [flag for flag in recommendation["flags"] if flag.startswith("--bf16")] == flags
    assert f"bf16 weights with fp32 copies (--bf16_weights) {bf16_weights / 10:.2f}x" in recommendation["text"]


@pytest.mark.parametrize(
    ("fp32_compiled", "bf16_compiled", "backend", "flags"),
    [
        (1.4, 1.3, "inductor", ["--bf16", "--torch_compile", "true"]),  # bf16 compiled: 2.4 x 1.3 = 3.1x fp32 eager
        (1.02, 1.04, "inductor", ["--bf16"]),  # compiling gains less than the margin: bf16 eager
        (3.0, 0.5, "aot_eager", ["--torch_compile", "true", "--torch_compile_backend", "aot_eager"]),  # fp32 compiled
    ],
)
def test_the_recommendation_takes_torch_compile_where_it_measured_faster(
    fp32_compiled: float, bf16_compiled: float, backend: str, flags: list[str]
) -> None:
    results = made_up_results(best=80.0, ceiling=100.0)
    results["settings"]["precision"] = "fp32"
    results["bf16_comparison"] = {"fp32_samples_per_second": 10.0, "bf16_samples_per_second": 24.0,
                                  "fp32_over_bf16": 10 / 24, "bf16_speedup": 2.4}  # fmt: skip
    by_precision = {
        precision: {
            "eager_samples_per_second": eager,
            "compiled_samples_per_second": eager * speedup,
            "compiled_speedup": speedup,
            "first_compiled_step_seconds": 90.0,
        }  # fmt: skip
        for precision, eager, speedup in (("fp32", 10.0, fp32_compiled), ("bf16", 24.0, bf16_compiled))
    }
    results["compile_comparison"] = {"backend": backend, **by_precision["fp32"], "by_precision": by_precision}
    recommendation = finalize(results)["recommendation"]
    chosen = [flag for flag in recommendation["flags"] if flag in ("--bf16", "--torch_compile", "true", backend)]
    assert chosen == [flag for flag in flags if flag != "--torch_compile_backend"]
    assert recommendation["command"].endswith(" ".join(flags))
    precision = "bf16" if "--bf16" in flags else "fp32"
    speedup = by_precision[precision]["compiled_speedup"]
    verdict = "torch.compile" if "--torch_compile" in flags else "eager"
    assert (
        f"; {verdict}: {precision} under torch.compile ({backend}) ran {speedup:.2f}x its eager compute"
        in (recommendation["text"])
    )
    assert f"{precision} eager {by_precision[precision]['eager_samples_per_second']:.1f}, compiled" in (
        format_terminal(results)
    )
