"""The re-ranking weight of a run: training with a matching head and a validation split ends by sweeping it and
saving it (``rerank.json``), ``vlfit eval --save_rerank_weight`` does the same for a saved run, ``vlfit eval`` fuses
with the weight the run saved, and a bad re-ranking flag is one line naming it."""

from __future__ import annotations

import json
import shutil

import pytest

from vlfit.cli import USAGE_ERROR_EXIT_CODE, main
from vlfit.inference.rerank_score import RERANK_FILE, SWEPT_WEIGHTS, save_rerank_file
from vlfit.training import rerank_weight

pytestmark = pytest.mark.slow  # each test runs vlfit train or vlfit eval


def _eval(model, dataset: str, output, *flags: str) -> dict:
    argv = ["eval", "--model_name_or_path", str(model), "--dataset_name", dataset, "--eval_split", "validation",
            "--output_dir", str(output), "--report_to", "none", "--disable_tqdm", "true", *flags]  # fmt: skip
    assert main(argv) == 0
    return json.loads((output / "eval_results.json").read_text())


def test_training_with_a_matching_head_ends_by_saving_the_weight_swept_on_validation(
    tiny_checkpoint, synthetic_dataset_dir, tmp_path
):
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_checkpoint), "--dataset_name", synthetic_dataset_dir, "--objective",
                 "contrastive+itm", "--max_steps", "2", "--per_device_train_batch_size", "8", "--do_eval",
                 "--eval_split", "validation", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm",
                 "true", "--output_dir", str(out)]) == 0  # fmt: skip
    record = json.loads((out / RERANK_FILE).read_text())
    # The top 16 by default, all 8 images of this validation split.
    assert record["rerank_weight"] in SWEPT_WEIGHTS and record["split"] == "validation" and record["top_k"] == 8
    assert set(record["swept"]) == {f"{weight:g}" for weight in SWEPT_WEIGHTS}
    results = json.loads((out / "eval_results.json").read_text())
    best = (results["eval_t2i_fused_recall@1"] + results["eval_i2t_fused_recall@1"]) / 2
    assert results["eval_rerank_weight"] == record["rerank_weight"]
    assert best == pytest.approx(max(record["swept"].values()), abs=1e-6)  # the best of the sweep, reported


def test_training_on_a_validation_split_too_large_to_hold_sweeps_nothing_and_says_how(
    tiny_checkpoint, synthetic_dataset_dir, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(rerank_weight, "SWEEP_MAX_SAMPLES", 4)  # the 8 validation pairs are "too many"
    out = tmp_path / "run"
    with caplog.at_level("INFO", logger="vlfit.training.rerank_weight"):
        assert main(["train", "--model", str(tiny_checkpoint), "--dataset_name", synthetic_dataset_dir,
                     "--objective", "contrastive+itm", "--max_steps", "1", "--per_device_train_batch_size", "8",
                     "--do_eval", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
                     "--output_dir", str(out)]) == 0  # fmt: skip
    assert not (out / RERANK_FILE).exists()
    assert "--save_rerank_weight --max_eval_samples 4" in caplog.text


def test_vlfit_eval_fuses_with_the_weight_the_run_saved_and_can_save_one(
    itm_checkpoint, synthetic_dataset_dir, tmp_path
):
    run = tmp_path / "run"
    shutil.copytree(itm_checkpoint, run)
    no_weight = _eval(run, synthetic_dataset_dir, tmp_path / "a", "--rerank_top_k", "4")
    assert "eval_t2i_rerank_recall@1" in no_weight and not any("fused" in key for key in no_weight)

    save_rerank_file(str(run), {"rerank_weight": 32.0})
    saved = _eval(run, synthetic_dataset_dir, tmp_path / "b", "--rerank_top_k", "4")
    assert saved["eval_rerank_weight"] == 32.0 and "eval_t2i_fused_recall@1" in saved
    table = {"eval_t2i_fused_top4_recall@1", "eval_i2t_rerank_top8_recall@5", "eval_rerank_top8_ms_per_query"}
    assert table <= set(saved) and "eval_rerank_top16_ms_per_query" not in saved  # the Ks 8 images reach
    itm = _eval(run, synthetic_dataset_dir, tmp_path / "c", "--rerank_top_k", "4", "--rerank_score", "itm")
    assert not any("fused" in key for key in itm)

    swept = _eval(run, synthetic_dataset_dir, tmp_path / "d", "--save_rerank_weight", "true")
    record = json.loads((run / RERANK_FILE).read_text())
    assert record["split"] == "validation" and swept["eval_rerank_weight"] == record["rerank_weight"]


def test_bad_rerank_flags_are_one_line_naming_the_flag(itm_checkpoint, synthetic_dataset_dir, tmp_path, capsys):
    base = ["eval", "--model_name_or_path", str(itm_checkpoint), "--dataset_name", synthetic_dataset_dir,
            "--output_dir", str(tmp_path)]  # fmt: skip
    cases = [
        (["--rerank_top_k", "4", "--rerank_weight", "-1"], "--rerank_weight must be a finite number >= 0"),
        (["--rerank_top_k", "4", "--rerank_score", "cosine"], "--rerank_score"),
        (["--rerank_top_k", "4", "--rerank_score", "itm+itc"], "--rerank_score itm+itc needs a weight"),
        (["--rerank_weight", "2"], "add --rerank_top_k K"),
        (["--rerank_top_k", "4", "--rerank_score", "itm", "--rerank_weight", "2"], "drop it for --rerank_score itm"),
        (["--save_rerank_weight", "true", "--rerank_weight", "2"], "--save_rerank_weight sweeps the weight it saves"),
        (["--save_rerank_weight", "true", "--model_preset", "tiny", "--model_name_or_path", None],
         "--save_rerank_weight saves the weight into the model's folder"),
    ]  # fmt: skip
    for flags, expected in cases:
        argv = list(base)
        if None in flags:  # a preset instead of the folder
            argv = [arg for arg in argv if arg not in ("--model_name_or_path", str(itm_checkpoint))]
            flags = [flag for flag in flags if flag not in ("--model_name_or_path", None)]
        capsys.readouterr()
        try:
            code = main([*argv, *flags])
        except SystemExit as stop:  # argparse's own refusal (a value not among the choices)
            code = stop.code
        assert code == USAGE_ERROR_EXIT_CODE, flags
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and expected in errors[0], (flags, errors)
