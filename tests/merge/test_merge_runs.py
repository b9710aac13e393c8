"""``vlfit.merging.runs.merge_runs``, the merge behind ``vlfit merge`` and ``vlfit search --soup``: the folder it writes
is a run plain transformers and ``vlfit.load`` open, holding the merged weights, the runs' input settings and a card
naming the method and the runs; LoRA adapters are merged into their base first; a greedy soup leaves out a broken run
and says so in ``merge.json``."""

from __future__ import annotations

import json

import torch
from transformers import AutoProcessor

import vlfit
from tests.merge.runs import changed_run, weights_of
from vlfit.merging.runs import merge_runs
from vlfit.models.input_spec_file import INPUT_SPEC_FILE
from vlfit.models.loading import load_model


def test_merging_two_identical_runs_gives_the_run(tiny_checkpoint, tmp_path) -> None:
    twin = changed_run(tiny_checkpoint, tmp_path / "twin")
    merge_runs([str(tiny_checkpoint), str(twin)], method="uniform", output_dir=str(tmp_path / "soup"))
    merged, run = weights_of(tmp_path / "soup"), weights_of(tiny_checkpoint)
    assert merged.keys() == run.keys() and all(torch.equal(merged[name], run[name]) for name in run)


def test_the_merged_run_loads_in_plain_transformers_with_the_mean_and_the_runs_inputs(
    tiny_checkpoint, other_checkpoint, tmp_path
) -> None:
    out = tmp_path / "soup"
    result = merge_runs([str(tiny_checkpoint), str(other_checkpoint)], method="uniform", output_dir=str(out))
    a, b, merged = weights_of(tiny_checkpoint), weights_of(other_checkpoint), weights_of(out)
    floats = [name for name in a if a[name].is_floating_point()]
    assert floats and all(torch.allclose(merged[name], (a[name] + b[name]) / 2) for name in floats)
    AutoProcessor.from_pretrained(out)  # the tokenizer and image processor travel with it
    settings = json.loads((out / INPUT_SPEC_FILE).read_text())
    assert settings["max_seq_length"] == load_model(model_name_or_path=str(tiny_checkpoint)).inputs.max_seq_length
    card = (out / "README.md").read_text()
    assert "uniform soup" in card and str(other_checkpoint) in card and "model-soup" in card
    assert result.record["method"] == "uniform" and result.metrics == {}  # no held-out data: nothing evaluated
    assert vlfit.load(str(out)).encode_texts(["a red square"]).shape[0] == 1


class DistanceScorer:
    """A held-out score without data: minus the mean distance of the weights from ``target``'s."""

    def __init__(self, target: dict[str, torch.Tensor]) -> None:
        self.target = target

    def evaluate(self, label: str, weights: dict[str, torch.Tensor]) -> dict[str, float]:
        names = [name for name, tensor in self.target.items() if tensor.is_floating_point()]
        distance = sum(float((weights[n].float() - self.target[n].float()).abs().mean()) for n in names) / len(names)
        return {"eval_t2i_recall@1": -distance}


def test_a_greedy_soup_leaves_out_a_broken_run_and_records_each_step(tiny_checkpoint, tmp_path) -> None:
    target = weights_of(tiny_checkpoint)
    near = changed_run(tiny_checkpoint, tmp_path / "near", lambda name, w: w + 0.01 * torch.randn_like(w))
    broken = changed_run(tiny_checkpoint, tmp_path / "broken", lambda name, w: 3.0 * w)  # weights scaled
    out = tmp_path / "greedy"
    result = merge_runs([str(broken), str(near), str(tiny_checkpoint)], method="greedy", output_dir=str(out),
                        scorer=DistanceScorer(target))  # type: ignore[arg-type]  # fmt: skip
    record = json.loads((out / "merge.json").read_text())
    assert [step["run"] for step in record["steps"]] == [str(tiny_checkpoint), str(near), str(broken)]
    assert [step["kept"] for step in record["steps"]] == [True, False, False]  # the soup with near is further too
    assert record["kept"] == [str(tiny_checkpoint)] and result.metrics["eval_t2i_recall@1"] == 0.0
    merged = weights_of(out)
    assert all(torch.equal(merged[name], target[name]) for name in target)
    assert "left out" in (out / "README.md").read_text()


def test_lora_adapters_are_merged_into_their_base_before_the_soup(tiny_checkpoint, other_checkpoint, tmp_path):
    from vlfit.models.lora import LoraSettings, apply_lora

    loaded = load_model(model_name_or_path=str(tiny_checkpoint))
    adapted = apply_lora(loaded.family, loaded.model, LoraSettings(r=4, targets=("text",)))
    with torch.no_grad():  # LoRA starts as the identity (B = 0): make the adapters change something
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    for config in adapted.peft_config.values():
        config.base_model_name_or_path = str(tiny_checkpoint)
    adapters = tmp_path / "adapters"
    adapted.save_pretrained(adapters)
    loaded.tokenizer.save_pretrained(adapters)
    loaded.image_processor.save_pretrained(adapters)

    out = tmp_path / "soup"
    merge_runs([str(adapters), str(other_checkpoint)], method="uniform", output_dir=str(out))
    a = load_model(model_name_or_path=str(adapters)).model.state_dict()  # the adapters merged into their base
    b, merged = weights_of(other_checkpoint), weights_of(out)
    query = "bridgetower.text_model.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(a[query], weights_of(tiny_checkpoint)[query])  # the adapters changed the text tower
    assert all(torch.allclose(merged[name], (a[name] + b[name]) / 2) for name in b if b[name].is_floating_point())


def test_the_api_function_merge_is_not_hidden_by_the_package_that_merges() -> None:
    import vlfit.merging.runs  # noqa: F401  (what vlfit.merge itself imports)

    assert callable(vlfit.merge) and vlfit.merge.__module__ == "vlfit.api.runs"
