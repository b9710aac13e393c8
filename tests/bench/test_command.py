"""``vlfit bench`` flags: vlfit train's model and data-location flags, the sweep plan they resolve to, defaults."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from tests.bench.bench_runs import QUICK
from vlfit.arguments import DataLocationArguments, ModelArguments
from vlfit.bench.plan import SweepPlan, configurations, default_workers
from vlfit.cli import main
from vlfit.commands.bench import open_source, parser, resolve_plan
from vlfit.errors import ConfigError
from vlfit.training.arguments import OBJECTIVES


def _parse(*flags: str):
    return parser().parse_args_into_dataclasses(args=list(flags))


def test_every_model_and_data_location_flag_of_train_is_a_bench_flag() -> None:
    options = {option for action in parser()._actions for option in action.option_strings}
    for arguments in (ModelArguments, DataLocationArguments):
        for f in fields(arguments):
            assert f"--{f.name}" in options, f.name
    model_args, data_args, args = _parse("--id_column", "image_description", "--validation_file", "val.jsonl",
                                         "--dataset_revision", "v2", "--model_revision", "r1", "--split", "validation",
                                         "--num_samples", "16", "--model_preset", "small")  # fmt: skip
    assert (data_args.id_column, data_args.validation_file, data_args.dataset_revision) == (
        "image_description", "val.jsonl", "v2"
    )  # fmt: skip
    assert (model_args.model_revision, model_args.model_preset) == ("r1", "small")
    assert (args.split, args.num_samples) == ("validation", 16)


def test_id_column_picks_the_ids_of_the_samples(synthetic_dataset_dir: str) -> None:
    model_args, data_args, args = _parse("--dataset_name", synthetic_dataset_dir, "--id_column", "image_description",
                                         "--num_samples", "4")  # fmt: skip
    source, description = open_source(args, data_args, model_args, num_proc=1)
    assert len(source) == 4 and description["id_column"] == "image_description"
    assert [record.id for record in source] == [record.caption for record in source]
    model_args, data_args, args = _parse("--dataset_name", synthetic_dataset_dir, "--id_column", "no_such_column")
    with pytest.raises(ValueError, match="id column 'no_such_column' not found"):
        open_source(args, data_args, model_args, num_proc=1)


def test_flags_resolve_to_a_sweep_plan() -> None:
    _, _, args = _parse("--mode", "loader,train", "--pipelines", "reference,fast", "--workers", "0,2",
                        "--prefetch_factors", "2,4", "--per_device_train_batch_size", "8", "--bf16")  # fmt: skip
    plan = resolve_plan(args, torch.device("cpu"))
    assert (plan.modes, plan.pipelines, plan.workers, plan.batch_size, plan.precision) == (
        ["loader", "train"], ["reference", "fast"], [0, 2], 8, "bf16"
    )  # fmt: skip
    # Prefetch factors only apply with workers.
    assert configurations(plan)[:3] == [("loader", "reference", 0, None), ("loader", "reference", 2, 2),
                                        ("loader", "reference", 2, 4)]  # fmt: skip
    assert len(configurations(plan)) == 2 * 2 * 3
    _, _, args = _parse()
    assert resolve_plan(args, torch.device("cpu")).precision == "fp32"  # bf16 is the default on CUDA only
    assert not resolve_plan(args, torch.device("cpu")).compare_bf16
    assert resolve_plan(_parse("--auto")[2], torch.device("cpu")).compare_bf16  # --auto picks the precision too
    with pytest.raises(ValueError, match="takes comma-separated integers"):
        resolve_plan(_parse("--workers", "0,two")[2], torch.device("cpu"))


def test_auto_compares_torch_compile_where_it_can_run_here(monkeypatch, tmp_path, caplog) -> None:
    """--auto in a train mode measures eager against torch.compile, where inductor finds its C++ compiler on the
    CPU; where it finds none, one warning says why and what to do, and the sweep goes on without it. A loader-only
    sweep has no step to compile."""
    import shutil

    cpu = torch.device("cpu")
    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine: inductor cannot compile for its CPU")
    assert resolve_plan(_parse("--auto")[2], cpu).compare_compile
    assert resolve_plan(_parse("--compare_compile")[2], cpu).compare_compile
    assert not resolve_plan(_parse("--auto", "--mode", "loader")[2], cpu).compare_compile
    assert not resolve_plan(_parse()[2], cpu).compare_compile
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without a compiler
    monkeypatch.delenv("CXX", raising=False)
    with caplog.at_level("WARNING", logger="vlfit.commands.bench"):
        assert not resolve_plan(_parse("--auto")[2], cpu).compare_compile
    assert "torch.compile is not compared" in caplog.text and "install g++" in caplog.text
    assert resolve_plan(_parse("--auto", "--torch_compile_backend", "aot_eager")[2], cpu).compare_compile


def test_default_workers_go_up_to_the_core_count() -> None:
    assert default_workers(2) == [0, 1, 2]
    assert default_workers(1) == [0, 1, 2]
    assert default_workers(16) == [0, 1, 2, 4, 8, 16]
    assert default_workers(6) == [0, 1, 2, 4]


def test_plan_rejects_unknown_names_and_empty_sweeps(capsys) -> None:
    with pytest.raises(ValueError, match="unknown pipeline 'turbo'"):
        SweepPlan(pipelines=["turbo"], workers=[0])
    with pytest.raises(ValueError, match="unknown mode 'infer'"):
        SweepPlan(pipelines=["fast"], workers=[0], modes=["infer"])
    with pytest.raises(ValueError, match="--steps must be at least 1"):
        SweepPlan(pipelines=["fast"], workers=[0], steps=0)
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        SweepPlan(pipelines=["fast"], workers=[0], precision="fp8")
    # On the command line, a user's mistake is one error line and exit code 2.
    assert main(["bench", "--bf16", "--fp32", "--output_dir", "unused"]) == 2
    assert capsys.readouterr().err.strip() == "vlfit bench: error: --bf16 and --fp32 exclude each other"
    assert main(["bench", "--mode", "infer", "--output_dir", "unused"]) == 2
    assert "vlfit bench: error: unknown --mode 'infer'" in capsys.readouterr().err


def test_objective_takes_the_names_default_and_check_of_train() -> None:
    assert resolve_plan(_parse()[2], torch.device("cpu")).objective == "contrastive"
    for objective in OBJECTIVES:
        assert resolve_plan(_parse("--objective", objective)[2], torch.device("cpu")).objective == objective
    with pytest.raises(
        ConfigError,
        match=r"^--objective itm changes what train mode's step computes, and --mode "
        r"loader has no step: add train to --mode \(e\.g\. --mode loader,train\) or leave --objective out$",
    ):
        resolve_plan(_parse("--objective", "itm", "--mode", "loader")[2], torch.device("cpu"))  # fmt: skip
    assert resolve_plan(_parse("--objective", "itm", "--mode", "loader,train")[2], torch.device("cpu")).trains
    # A plan built without the parser (BenchSession's callers) refuses an unknown name with vlfit train's message.
    with pytest.raises(
        ConfigError, match=r"^unknown --objective 'itc'; choose one of: contrastive, contrastive\+itm, itm$"
    ):
        SweepPlan(pipelines=["fast"], workers=[0], objective="itc")


def test_an_itm_objective_on_a_clip_model_is_refused_in_one_line(tmp_path, capsys) -> None:
    code = main(["bench", "--output_dir", str(tmp_path), *QUICK, "--model_preset", "clip-tiny", "--workers", "0",
                 "--objective", "itm"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if line.startswith("vlfit bench:")]  # the rest is the run's log
    assert line.startswith("vlfit bench: error: --objective itm: image-text matching needs BridgeTower's fused tower")
    assert line.endswith("a clip model does not have; use --objective contrastive")
    assert not (tmp_path / "bench.json").exists()  # refused before anything was measured
