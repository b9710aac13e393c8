"""CLIP and SigLIP: each family's loss equals what transformers' own model returns with ``return_loss=True`` (loss
and gradients); with global negatives on 2 gloo processes, through DDP, equals one process on the concatenated
batch; embeddings equal the forward's; presets have the real checkpoints' shapes; bad checkpoints are refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.checkpoints import CAPTIONS
from vlfit.models import clip, siglip
from vlfit.models.family import (
    HARD_NEGATIVE_ATTENTION_MASK,
    HARD_NEGATIVE_INPUT_IDS,
    IMAGE_KEYS,
    OPENAI_CLIP_MEAN,
    LossScope,
)
from vlfit.models.loading import load_model, resolve_model
from vlfit.models.registry import family_for_config, family_for_preset, preset_config

FAMILIES = {"clip-tiny": clip.CLIPFamily(), "siglip-tiny": siglip.SiglipFamily()}
SPLIT = (0, 4, 6)  # rows [0, 4) on rank 0, [4, 6) on rank 1: uneven on purpose
# Rows 0 and 3 show one image, and rows 1 and 5 another (on different processes under SPLIT).
SAME_IMAGES = torch.tensor([0, 1, 2, 0, 3, 1])


def _model(preset: str, state_dict: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    family = FAMILIES[preset]
    torch.manual_seed(0)
    model = family.build(family.preset_config(preset))
    family.initialize_preset(model, preset)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def _inputs(n: int = 6, hard_negatives: bool = False, same_images: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    attention_mask = torch.ones(n, 10, dtype=torch.long)
    attention_mask[1::3, 7:] = 0  # some padded captions
    input_ids = torch.randint(5, 1024, (n, 10), generator=generator)
    input_ids[:, 0] = 0
    input_ids[torch.arange(n), attention_mask.sum(1) - 1] = 4  # CLIP presets' </s>, where CLIP pools
    inputs = {
        "input_ids": input_ids.masked_fill(attention_mask == 0, 1),
        "attention_mask": attention_mask,
        "pixel_values": torch.randn(n, 3, 64, 64, generator=generator),
    }
    if hard_negatives:
        mask = torch.ones(n, 2, 8, dtype=torch.long)
        mask[0, 1:] = 0  # row 0 has one alternative, the others two
        ids = torch.randint(5, 1024, (n, 2, 8), generator=generator)
        ids[..., -1] = 4
        inputs[HARD_NEGATIVE_INPUT_IDS] = ids * mask + (1 - mask)
        inputs[HARD_NEGATIVE_ATTENTION_MASK] = mask
    if same_images:
        inputs[IMAGE_KEYS] = SAME_IMAGES[:n]
    return inputs


def _rows(inputs: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {key: value[start:stop] for key, value in inputs.items()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _own_loss(preset: str, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' loss, on the inputs as each model's processor would give them."""
    if preset.startswith("siglip"):
        text = siglip.text_inputs(model.config, inputs["input_ids"], inputs["attention_mask"])
        return model(**text, pixel_values=inputs["pixel_values"], return_loss=True).loss
    return model(**{k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}, return_loss=True).loss


@pytest.mark.parametrize("preset", FAMILIES)
def test_the_familys_loss_is_the_models_own_with_its_gradients(preset):
    family, model, inputs = FAMILIES[preset], _model(preset), _inputs()
    reference = _own_loss(preset, model, inputs)
    reference.backward()
    reference_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    # The path global negatives take (embeddings and scale from the forward, the loss outside the model).
    loss = family.contrastive_loss(model, inputs, LossScope(global_negatives=True))
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    grads = _grads(model)
    assert grads.keys() == reference_grads.keys() and "logit_scale" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    # A different batch is a different loss: the comparison above can fail.
    assert abs(family.contrastive_loss(model, _rows(inputs, 0, 4)).item() - reference.item()) > 1e-3


@pytest.mark.parametrize("preset", FAMILIES)
def test_hard_negatives_are_more_negative_pairs_of_their_image(preset):
    family, model = FAMILIES[preset], _model(preset)
    inputs = _inputs(hard_negatives=True)
    with torch.no_grad():
        outputs_loss = family.contrastive_loss(model, {k: inputs[k] for k in family.model_inputs})
        with_hard = family.contrastive_loss(model, inputs)
        texts = family.encode_text(model, inputs["input_ids"], inputs["attention_mask"])
        images = family.encode_image(model, inputs["pixel_values"])
        hard_ids, hard_mask = inputs[HARD_NEGATIVE_INPUT_IDS], inputs[HARD_NEGATIVE_ATTENTION_MASK]
        hard = family.encode_text(model, hard_ids[:, 0], hard_mask[:, 0])  # every row's first alternative
        hard2 = family.encode_text(model, hard_ids[1:, 1], hard_mask[1:, 1])  # the second, which row 0 lacks
        n = images.shape[0]
        if preset.startswith("clip"):
            scale = model.logit_scale.exp()
            t2i = torch.nn.functional.cross_entropy(texts @ images.t() * scale, torch.arange(n))
            i2t_logits = torch.cat(
                [images @ texts.t(), (images * hard).sum(1, keepdim=True),
                 torch.cat([torch.full((1, 1), -torch.inf), (images[1:] * hard2).sum(1, keepdim=True)])], dim=1
            ) * scale  # fmt: skip
            i2t_logits[0, -1] = -torch.inf
            expected = (t2i + torch.nn.functional.cross_entropy(i2t_logits, torch.arange(n))) / 2
        else:
            scale, bias = model.logit_scale.exp(), model.logit_bias
            logits = texts @ images.t() * scale + bias
            signs = 2 * torch.eye(n) - 1
            pairs = -torch.nn.functional.logsigmoid(signs * logits).sum()
            extra = -torch.nn.functional.logsigmoid(-((images * hard).sum(1) * scale + bias)).sum()
            extra = extra - torch.nn.functional.logsigmoid(-((images[1:] * hard2).sum(1) * scale + bias)).sum()
            expected = (pairs + extra) / n
    torch.testing.assert_close(with_hard, expected, rtol=1e-5, atol=1e-6)
    assert float(with_hard) > float(outputs_loss)  # more negatives, more loss (little at SigLIP's bias of -10)


def _two_process_batches() -> dict[str, dict[str, torch.Tensor]]:
    return {"plain": _inputs(), "hard": _inputs(hard_negatives=True), "same images": _inputs(same_images=True)}


def two_process_payload() -> dict:
    """What both processes of the 2-process check read (``tests.two_processes``)."""
    return {**{preset: _model(preset).state_dict() for preset in FAMILIES}, **_two_process_batches()}


def two_process_worker(rank: int, world: int, init_file: str, payload_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        payload = torch.load(payload_path)
        results = {}
        for preset, family in FAMILIES.items():
            model = _model(preset, payload[preset])
            family.prepare_for_training(model)
            ddp = DistributedDataParallel(model)
            for name in ("plain", "hard", "same images"):
                inputs = payload[name]
                model.zero_grad(set_to_none=True)
                loss = family.contrastive_loss(
                    ddp, _rows(inputs, SPLIT[rank], SPLIT[rank + 1]), LossScope(global_negatives=True)
                )
                loss.backward()
                results[f"{preset} {name}"] = {"loss": loss.detach(), "grads": _grads(model)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_global_negatives_on_two_processes_equal_one_process_on_the_concatenated_batch(two_process_results):
    batches = _two_process_batches()
    ranks = two_process_results[__name__]
    for preset, family in FAMILIES.items():
        model = _model(preset)
        for name, batch in batches.items():
            model.zero_grad(set_to_none=True)
            reference = family.contrastive_loss(model, batch)
            reference.backward()
            reference_grads = _grads(model)
            key = f"{preset} {name}"
            # The Trainer logs the mean over processes; DDP averages the gradients.
            loss = (ranks[0][key]["loss"] + ranks[1][key]["loss"]) / 2
            torch.testing.assert_close(loss, reference.detach(), rtol=0, atol=2e-6, msg=key)
            for rank in ranks:
                assert rank[key]["grads"].keys() == reference_grads.keys(), key
                for param, grad in rank[key]["grads"].items():
                    torch.testing.assert_close(grad, reference_grads[param], rtol=1e-4, atol=1e-6, msg=f"{key} {param}")
            # Per-process negatives are a different loss: the comparison above can fail.
            with torch.no_grad():
                local = sum(family.contrastive_loss(model, _rows(batch, a, b)) for a, b in ((0, 4), (4, 6)))
            assert abs(float(local / 2 - reference.detach())) > 1e-3, key


@pytest.mark.parametrize("preset", FAMILIES)
def test_embeddings_are_the_forwards_and_never_depend_on_the_batchs_padding(preset):
    family, model, inputs = FAMILIES[preset], _model(preset), _inputs()
    with torch.no_grad():
        outputs = model(**(siglip.text_inputs(model.config, inputs["input_ids"], inputs["attention_mask"])
                           if preset.startswith("siglip") else {k: inputs[k] for k in ("input_ids", "attention_mask")}),
                        pixel_values=inputs["pixel_values"])  # fmt: skip
    texts = family.encode_text(model, inputs["input_ids"], inputs["attention_mask"])
    torch.testing.assert_close(texts, outputs.text_embeds, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(family.encode_image(model, inputs["pixel_values"]), outputs.image_embeds)
    # Row 1 is padded after 7 tokens: alone, cut to its 7 tokens, it embeds the same.
    alone = family.encode_text(model, inputs["input_ids"][1:2, :7], inputs["attention_mask"][1:2, :7])
    torch.testing.assert_close(alone, texts[1:2], rtol=1e-5, atol=1e-6)


def test_base_presets_have_the_published_checkpoints_shapes():
    with torch.device("meta"):
        clip_base = clip.CLIPFamily().build(preset_config("clip-base"))
    # openai/clip-vit-base-patch32: 151,277,313 parameters.
    assert sum(p.numel() for p in clip_base.parameters()) == 151_277_313
    config = preset_config("siglip-base")
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (768, 12, 32000)
    assert text.max_position_embeddings == 64
    assert (vision.hidden_size, vision.num_hidden_layers, vision.patch_size, vision.image_size) == (768, 12, 16, 224)


@pytest.mark.parametrize("preset", FAMILIES)
def test_a_saved_preset_loads_back_as_its_family_with_its_own_image_statistics(preset, tmp_path):
    bundle = load_model(model_preset=preset, captions=lambda: CAPTIONS)
    assert family_for_preset(preset).name == bundle.family.name == preset.split("-")[0]
    bundle.model.save_pretrained(tmp_path)
    bundle.tokenizer.save_pretrained(tmp_path)
    bundle.image_processor.save_pretrained(tmp_path)
    loaded = load_model(model_name_or_path=str(tmp_path))
    assert family_for_config(loaded.model.config).name == bundle.family.name
    expected_mean = (0.5, 0.5, 0.5) if preset.startswith("siglip") else OPENAI_CLIP_MEAN
    assert loaded.inputs.image_mean == pytest.approx(expected_mean) and loaded.inputs.image_size == 64
    # run_clip.py's default --max_seq_length (128) is cut to the text tower's positions.
    assert loaded.inputs.max_seq_length == (64 if preset.startswith("siglip") else 77)
    for name, param in bundle.model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], param, msg=name)
    if preset.startswith("siglip"):
        assert loaded.model.logit_bias.item() == pytest.approx(siglip.INITIAL_LOGIT_BIAS)


def test_an_image_size_that_is_no_multiple_of_the_patch_size_is_refused(tmp_path):
    config = preset_config("clip-tiny")
    config.vision_config.image_size = 70
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="image size 70 is not a multiple of the patch size 16"):
        resolve_model(model_preset="clip-tiny", config_name=str(tmp_path), captions=lambda: CAPTIONS)
