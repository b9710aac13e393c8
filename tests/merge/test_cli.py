"""``vlfit merge`` end to end: a greedy soup judged on the held-out split prints its result, writes its steps, and the
folder goes on into ``vlfit eval``; a method without what it needs exits 2 in one line."""

from __future__ import annotations

import json

import pytest

from vlfit.cli import main

pytestmark = pytest.mark.slow


def test_a_greedy_soup_judged_on_held_out_data_goes_on_into_eval_index_serve_and_export(
    tiny_checkpoint, other_checkpoint, synthetic_dataset_dir, tmp_path, capsys
) -> None:
    data = ["--dataset_name", synthetic_dataset_dir, "--report_to", "none", "--disable_tqdm", "true"]
    out = tmp_path / "soup"
    assert main(["merge", "--method", "greedy", "--runs", str(tiny_checkpoint), str(other_checkpoint), *data,
                 "--output_dir", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "vlfit merge: greedy soup of" in printed and f"saved to {out}" in printed
    record = json.loads((out / "merge.json").read_text())
    assert len(record["steps"]) == 2 and record["steps"][0]["kept"] and record["scored_on_held_out_data"]
    scores = {run["run"]: run["eval_t2i_recall@1"] for run in record["runs"]}
    assert record["merged"]["eval_t2i_recall@1"] >= max(scores.values())  # never below the best run it started from
    assert main(["eval", "--model", str(out), *data, "--output_dir", str(tmp_path / "eval")]) == 0
    evaluated = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert evaluated["eval_t2i_recall@1"] == pytest.approx(record["merged"]["eval_t2i_recall@1"])

    import vlfit
    from vlfit.serve.engine import SearchEngine

    index = tmp_path / "index"
    assert main(["retrieve", "index", "--model", str(out), "--dataset_name", synthetic_dataset_dir, "--split",
                 "validation", "--output_dir", str(index), "--dataloader_num_workers", "0", "--disable_tqdm",
                 "true"]) == 0  # fmt: skip
    soup = vlfit.load(str(out))
    served = SearchEngine(str(index)).encode_texts(["a red circle"])  # the server's query path
    assert float((served * soup.encode_texts(["a red circle"])).sum()) == pytest.approx(1.0, abs=1e-5)
    export = tmp_path / "export"
    assert main(["export", "--model_name_or_path", str(out), "--output_dir", str(export), "--parity_samples",
                 "8"]) == 0  # fmt: skip
    exported = vlfit.load(str(export), precision="fp32").encode_texts(["a red circle"])
    assert float((exported * soup.encode_texts(["a red circle"])).sum()) >= 0.999


def test_a_method_without_what_it_needs_exits_2_in_one_line(tiny_checkpoint, other_checkpoint, tmp_path, capsys):
    argv = ["merge", "--method", "stock", "--runs", str(tiny_checkpoint), str(other_checkpoint), "--output_dir",
            str(tmp_path / "stock")]  # fmt: skip
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error == "vlfit merge: error: --method 'stock' needs --base: the runs' common starting model"
    assert not (tmp_path / "stock").exists()
