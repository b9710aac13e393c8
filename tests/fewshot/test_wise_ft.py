"""``vlfit wise-ft``: alpha 0 evaluates as the zero-shot model, alpha 1 as the fine-tuned one; the chosen mix is saved
as a plain checkpoint holding the interpolated weights; models that cannot be mixed stop in one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BridgeTowerForContrastiveLearning

from tests.inference.tiny_models import save_tiny_checkpoint
from vlfit.cli import main
from vlfit.errors import ConfigError
from vlfit.models.interpolation import interpolate

pytestmark = pytest.mark.slow

KEYS = ("eval_t2i_recall@1", "eval_i2t_recall@5", "eval_zeroshot_top1", "eval_zeroshot_top5")


def test_the_curve_ends_at_both_models_and_the_chosen_mix_is_saved(labelled_checkpoint, labelled_dataset_dir,
                                                                   tmp_path, capsys) -> None:  # fmt: skip
    data = ["--dataset_name", labelled_dataset_dir, "--zeroshot_dataset", labelled_dataset_dir,
            "--zeroshot_label_column", "kind", "--report_to", "none"]  # fmt: skip
    finetuned, mixed_in_training = tmp_path / "finetuned", tmp_path / "mixed"
    train = ["train", "--model", str(labelled_checkpoint), "--dataset_name", labelled_dataset_dir, "--max_steps", "4",
             "--learning_rate", "1e-3", "--per_device_train_batch_size", "8", "--save_strategy", "no", "--report_to",
             "none", "--dataloader_num_workers", "0"]  # fmt: skip
    assert main([*train, "--output_dir", str(finetuned)]) == 0
    assert main([*train, "--output_dir", str(mixed_in_training), "--wise_ft_alpha", "0.5"]) == 0
    alone = {}
    for name, model in (("zeroshot", labelled_checkpoint), ("finetuned", finetuned)):
        assert main(["eval", "--model", str(model), *data, "--output_dir", str(tmp_path / f"eval-{name}")]) == 0
        alone[name] = json.loads((tmp_path / f"eval-{name}" / "eval_results.json").read_text())
    out = tmp_path / "wise"
    capsys.readouterr()
    assert main(["wise-ft", "--zeroshot_model", str(labelled_checkpoint), "--finetuned_model", str(finetuned),
                 "--alphas", "1,0,0.5", "--select", "mean", *data, "--output_dir", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out.split("vlfit wise-ft: alpha ")  # each alpha's line, then its metric table
    assert [part.split(":")[0] for part in printed[1:4]] == ["0 (1 of 3)", "0.5 (2 of 3)", "1 (3 of 3)"]
    assert [part.count("***** eval metrics *****") for part in printed] == [0, 1, 1, 1, 0]
    results = json.loads((out / "wise-ft.json").read_text())
    rows = {row["alpha"]: row for row in results["alphas"]}
    assert sorted(rows) == [0.0, 0.5, 1.0] and results["zeroshot_metric"] == "eval_zeroshot_top1"
    for key in KEYS:
        assert rows[0.0][key] == pytest.approx(alone["zeroshot"][key]), key
        assert rows[1.0][key] == pytest.approx(alone["finetuned"][key]), key
    assert any(rows[0.0][key] != rows[1.0][key] for key in KEYS)  # the fine-tuning changed something
    mean = {alpha: (row["eval_t2i_recall@1"] + row["eval_zeroshot_top1"]) / 2 for alpha, row in rows.items()}
    assert mean[results["chosen_alpha"]] == max(mean.values())
    assert (out / "wise-ft.md").read_text().count("\n") == 5 and (out / "wise-ft.png").stat().st_size > 0

    saved = BridgeTowerForContrastiveLearning.from_pretrained(out / "model").state_dict()
    expected = interpolate(
        BridgeTowerForContrastiveLearning.from_pretrained(labelled_checkpoint).state_dict(),
        BridgeTowerForContrastiveLearning.from_pretrained(finetuned).state_dict(),
        results["chosen_alpha"],
    )
    assert all(torch.equal(saved[name], expected[name]) for name in expected)
    card = (out / "model" / "README.md").read_text()
    assert "WiSE-FT" in card
    # The mix is no fine-tuning of the fine-tuned model on the evaluation data: the card names both ends and alpha.
    alpha = f"{results['chosen_alpha']:g}"
    assert f"(1 - {alpha}) x the zero-shot model `{labelled_checkpoint}` + {alpha} x the fine-tuned model " \
           f"`{finetuned}` (alpha {alpha}" in card  # fmt: skip
    assert "fine-tuned version of" not in card and "wise-ft" in card.split("\n---\n")[0]

    # --wise_ft_alpha ends the same training run with that mix of its start and its end.
    half = interpolate(
        BridgeTowerForContrastiveLearning.from_pretrained(labelled_checkpoint).state_dict(),
        BridgeTowerForContrastiveLearning.from_pretrained(finetuned).state_dict(),
        0.5,
    )
    trained = BridgeTowerForContrastiveLearning.from_pretrained(mixed_in_training).state_dict()
    for name, tensor in half.items():
        torch.testing.assert_close(trained[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    card = (mixed_in_training / "README.md").read_text()
    assert "--wise_ft_alpha" in card and "fine-tuned version of" not in card
    assert f"(1 - 0.5) x the starting model `{labelled_checkpoint}` + 0.5 x its fine-tuning on" in card


def test_models_that_cannot_be_mixed_stop_in_one_line(labelled_checkpoint, labelled_dataset_dir, tmp_path,
                                                      capsys) -> None:  # fmt: skip
    clip = save_tiny_checkpoint(labelled_dataset_dir, tmp_path / "clip", preset="clip-tiny")
    capsys.readouterr()
    assert main(["wise-ft", "--zeroshot_model", str(labelled_checkpoint), "--finetuned_model", str(clip),
                 "--dataset_name", labelled_dataset_dir, "--zeroshot_dataset", labelled_dataset_dir,
                 "--zeroshot_label_column", "kind", "--output_dir", str(tmp_path / "out")]) == 2  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vlfit wise-ft: error")]
    assert len(errors) == 1 and "--zeroshot_model is a bridgetower model and --finetuned_model a clip one" in errors[0]
    vqa = tmp_path / "vqa"  # what tells a VQA folder apart: its config's architectures
    vqa.mkdir()
    (vqa / "config.json").write_text(json.dumps({"architectures": ["BridgeTowerForQuestionAnswering"]}))
    assert main(["wise-ft", "--zeroshot_model", str(labelled_checkpoint), "--finetuned_model", str(vqa),
                 "--dataset_name", labelled_dataset_dir, "--zeroshot_dataset", labelled_dataset_dir,
                 "--zeroshot_label_column", "kind", "--output_dir", str(tmp_path / "out")]) == 2  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vlfit wise-ft: error")]
    assert len(errors) == 1 and f"--finetuned_model {vqa} answers questions (vlfit train --task vqa)" in errors[0]
    a = {"w": torch.zeros(2, 3), "ids": torch.arange(3)}
    with pytest.raises(ConfigError, match=r"parameter 'w' has shape \(2, 3\) in one model and \(3, 3\)"):
        interpolate(a, {"w": torch.zeros(3, 3), "ids": torch.arange(3)}, 0.5)
    with pytest.raises(ConfigError, match="'v' is in only the zero-shot one"):
        interpolate({**a, "v": torch.zeros(1)}, a, 0.5)
    mixed = interpolate(
        {"w": torch.zeros(2), "ids": torch.arange(2)}, {"w": torch.ones(2), "ids": torch.arange(2)}, 0.25
    )
    assert mixed["w"].tolist() == [0.25, 0.25] and mixed["ids"].tolist() == [0, 1]


def test_a_head_the_run_added_keeps_its_trained_weights_in_the_mix(tiny_checkpoint, synthetic_dataset_dir, tmp_path):
    # --objective contrastive+itm adds a matching head to a contrastive checkpoint: it has no start to mix with.
    from safetensors.torch import load_file

    train = ["train", "--model", str(tiny_checkpoint), "--dataset_name", synthetic_dataset_dir, "--objective",
             "contrastive+itm", "--max_steps", "2", "--learning_rate", "1e-3", "--per_device_train_batch_size", "8",
             "--save_strategy", "no", "--report_to", "none", "--dataloader_num_workers", "0"]  # fmt: skip
    assert main([*train, "--output_dir", str(tmp_path / "trained")]) == 0
    assert main([*train, "--output_dir", str(tmp_path / "mixed"), "--wise_ft_alpha", "0.5"]) == 0
    start = load_file(tiny_checkpoint / "model.safetensors")
    trained, mixed = (load_file(tmp_path / name / "model.safetensors") for name in ("trained", "mixed"))
    head = [name for name in trained if name not in start]
    assert head and all(name.startswith("itm_score.") for name in head)
    for name in head:
        torch.testing.assert_close(mixed[name], trained[name], rtol=0, atol=0, msg=name)
    half = interpolate(start, {name: trained[name] for name in start}, 0.5)
    for name, tensor in half.items():
        torch.testing.assert_close(mixed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_wise_ft_takes_a_run_fine_tuned_with_itm_and_mixes_it_as_training_does(
    labelled_checkpoint, labelled_dataset_dir, tmp_path
) -> None:
    # vlfit wise-ft and --wise_ft_alpha share one mix: the matching head the run added keeps its trained weights.
    from safetensors.torch import load_file

    train = ["train", "--model", str(labelled_checkpoint), "--dataset_name", labelled_dataset_dir, "--objective",
             "contrastive+itm", "--max_steps", "2", "--learning_rate", "1e-3", "--per_device_train_batch_size", "8",
             "--save_strategy", "no", "--report_to", "none", "--dataloader_num_workers", "0"]  # fmt: skip
    assert main([*train, "--output_dir", str(tmp_path / "trained")]) == 0
    assert main([*train, "--output_dir", str(tmp_path / "mixed"), "--wise_ft_alpha", "0.5"]) == 0
    wise = ["wise-ft", "--zeroshot_model", str(labelled_checkpoint), "--finetuned_model", str(tmp_path / "trained"),
            "--alphas", "0.5", "--dataset_name", labelled_dataset_dir, "--zeroshot_dataset", labelled_dataset_dir,
            "--zeroshot_label_column", "kind", "--report_to", "none",
            "--output_dir", str(tmp_path / "wise")]  # fmt: skip
    assert main(wise) == 0
    trained, in_training, mixed = (load_file(tmp_path / name / "model.safetensors")
                                   for name in ("trained", "mixed", "wise/model"))  # fmt: skip
    head = [name for name in trained if name.startswith("itm_score.")]
    assert head and sorted(mixed) == sorted(in_training) == sorted(trained)
    for name in head:
        torch.testing.assert_close(mixed[name], trained[name], rtol=0, atol=0, msg=name)
    for name, tensor in in_training.items():
        torch.testing.assert_close(mixed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
