"""LoRA: the adapters go where ``--lora_target`` says and nothing else trains but them and the heads; a run saves
adapters only, which reload (merged into their base) to the outputs the adapted model gives; ``vlfit merge-lora``
writes that plain checkpoint; bad combinations stop with one line before training."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.checkpoints import CAPTIONS
from vlfit.cli import main
from vlfit.models import bridgetower, clip
from vlfit.models.loading import load_model
from vlfit.models.lora import LoraSettings, apply_lora, target_modules, trainable_parameters


def _tiny(family, preset: str) -> nn.Module:
    torch.manual_seed(0)
    return family.build(family.preset_config(preset))


def test_adapters_and_heads_are_all_that_trains():
    family = bridgetower.BridgeTowerFamily()
    model = _tiny(family, "tiny")
    linear = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    targets = target_modules(family, model, ("text", "cross"))
    assert targets and all(name.startswith(("bridgetower.text_model.", "bridgetower.cross_modal_")) for name in targets)
    assert "bridgetower.text_model.pooler.dense" not in targets  # the loss never reaches it
    heads = sum(p.numel() for name in family.head_modules() for p in model.get_submodule(name).parameters())
    r = 4
    expected = heads + sum(r * (linear[n].in_features + linear[n].out_features) for n in targets)

    adapted = apply_lora(family, model, LoraSettings(r=r, targets=("text", "cross")))
    trainable, total = trainable_parameters(adapted)
    assert trainable == expected
    assert trainable == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    frozen_vision = [n for n, p in adapted.named_parameters() if "vision_model" in n and p.requires_grad]
    assert frozen_vision == []


def test_saved_adapters_reload_merged_to_the_adapted_models_embeddings(tmp_path):
    family = clip.CLIPFamily()
    bundle = load_model(model_preset="clip-tiny", captions=lambda: CAPTIONS)
    base_dir = tmp_path / "run" / "base_model"
    bundle.model.save_pretrained(base_dir)
    adapted = apply_lora(family, bundle.model, LoraSettings(r=4, targets=("q_proj", "v_proj", "fc1")))
    with torch.no_grad():  # LoRA starts as the identity (B = 0): make the adapters change something
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    for config in adapted.peft_config.values():
        config.base_model_name_or_path = "base_model"  # as a preset's run records it
    run = tmp_path / "run"
    adapted.save_pretrained(run)
    bundle.tokenizer.save_pretrained(run)
    bundle.image_processor.save_pretrained(run)
    assert (run / "adapter_model.safetensors").exists() and not (run / "model.safetensors").exists()

    ids = bundle.tokenizer(CAPTIONS[:3], padding=True, return_tensors="pt")
    pixels = torch.randn(3, 3, 64, 64)
    adapted.eval()
    expected_text = family.encode_text(adapted, ids["input_ids"], ids["attention_mask"])
    expected_image = family.encode_image(adapted, pixels)
    plain = family.encode_text(family.from_pretrained(str(base_dir)), ids["input_ids"], ids["attention_mask"])
    assert not torch.allclose(plain, expected_text, atol=1e-3)  # the adapters matter: the checks below can fail

    merged = load_model(model_name_or_path=str(run))
    assert merged.spec.adapters == str(run) and type(merged.model).__name__ == "CLIPModel"
    torch.testing.assert_close(family.encode_text(merged.model, ids["input_ids"], ids["attention_mask"]),
                               expected_text, rtol=1e-4, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(family.encode_image(merged.model, pixels), expected_image, rtol=1e-4, atol=1e-5)

    out = tmp_path / "merged"
    assert main(["merge-lora", "--model_name_or_path", str(run), "--output_dir", str(out)]) == 0
    again = load_model(model_name_or_path=str(out))
    assert again.spec.adapters is None
    torch.testing.assert_close(family.encode_image(again.model, pixels), expected_image, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_lora_run_trains_only_adapters_and_eval_loads_it(tmp_path, synthetic_dataset_dir):
    out = tmp_path / "run"
    assert main(["train", "--model_preset", "clip-tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir",
                 str(out), "--lora_r", "4", "--lora_target", "text,vision", "--max_steps", "3",
                 "--per_device_train_batch_size", "8", "--learning_rate", "1e-2", "--save_strategy", "no",
                 "--report_to", "none"]) == 0  # fmt: skip
    assert (out / "adapter_config.json").exists() and (out / "base_model" / "model.safetensors").exists()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "base_model" and config["r"] == 4
    assert main(["eval", "--model_name_or_path", str(out), "--dataset_name", synthetic_dataset_dir,
                 "--report_to", "none"]) == 0  # fmt: skip
    assert 0.0 <= json.loads((out / "eval_results.json").read_text())["eval_t2i_recall@1"] <= 1.0
    # Trained: the merged model differs from its base.
    merged = load_model(model_name_or_path=str(out)).model.state_dict()
    base = load_model(model_name_or_path=str(out / "base_model")).model.state_dict()
    assert not torch.equal(merged["text_model.encoder.layers.0.self_attn.q_proj.weight"],
                           base["text_model.encoder.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    assert torch.equal(merged["logit_scale"], base["logit_scale"])  # the temperature stays


@pytest.mark.slow
def test_lora_with_the_matching_objective_trains_and_saves_the_head_beside_the_adapters(
    tmp_path, synthetic_dataset_dir, tiny_checkpoint
):
    """A contrastive checkpoint has no matching head: the run adds one, trains it in full beside the adapters, and
    loading the adapters onto that base adds the head back with the trained weights."""
    from safetensors.torch import load_file

    from vlfit.models.itm import has_itm_head

    out = tmp_path / "run"
    assert main(["train", "--model_name_or_path", str(tiny_checkpoint), "--dataset_name", synthetic_dataset_dir,
                 "--output_dir", str(out), "--objective", "contrastive+itm", "--lora_r", "4", "--max_steps", "3",
                 "--per_device_train_batch_size", "8", "--learning_rate", "1e-2", "--save_strategy", "no",
                 "--report_to", "none"]) == 0  # fmt: skip
    config = json.loads((out / "adapter_config.json").read_text())
    assert "itm_score" in config["modules_to_save"] and "itc_text_head" in config["modules_to_save"]
    saved = load_file(out / "adapter_model.safetensors")
    (head,) = [value for key, value in saved.items() if key.startswith("base_model.model.itm_score.") and
               key.endswith("fc.weight")]  # fmt: skip
    merged = load_model(model_name_or_path=str(out)).model
    assert has_itm_head(merged)
    torch.testing.assert_close(merged.itm_score.fc.weight, head)
    base = load_model(model_name_or_path=str(tiny_checkpoint)).model
    assert not has_itm_head(base)  # the base stays a contrastive checkpoint
    assert not torch.equal(merged.bridgetower.cross_modal_text_layers[0].attention.self.query.weight,
                           base.bridgetower.cross_modal_text_layers[0].attention.self.query.weight)  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora_r", "4", "--lora_target", "vision", "--freeze", "vision"], "which --freeze (or"),
        (["--lora_r", "4", "--lora_target", "cross"], "--lora_target 'cross' selects no linear layer of the clip"),
        (["--lora_target", "text"], "--lora_target and --lora_alpha need --lora_r"),
    ],
)
def test_bad_lora_flags_stop_in_one_line_before_training(flags, message, tmp_path, synthetic_dataset_dir, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model_preset", "clip-tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir",
                 str(out), "--max_steps", "1", "--report_to", "none", *flags]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
    assert not (out / "base_model").exists()
