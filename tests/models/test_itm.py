"""BridgeTower's matching head: vlfit's fused passes equal transformers' ``BridgeTowerForImageAndTextRetrieval``, one
saved folder loads in plain transformers as both classes, an official-layout folder keeps its head, mined negatives
never show the query's image, the ITM loss and gradients on two gloo processes equal one process, FLOPs count the
fused passes, and the objective's refusals and frozen heads."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel
from transformers import BridgeTowerForContrastiveLearning, BridgeTowerForImageAndTextRetrieval

from vlfit.efficiency.flops import count_flops
from vlfit.errors import ConfigError
from vlfit.models.bridgetower import BridgeTowerFamily, expose_logit_scale
from vlfit.models.family import HARD_NEGATIVE_ATTENTION_MASK, HARD_NEGATIVE_INPUT_IDS, IMAGE_KEYS, LOCAL_LOSS, LossScope
from vlfit.models.itm import (
    BridgeTowerForContrastiveLearningWithITM,
    has_itm_head,
    match_log_odds,
    pair_scores,
    with_itm_head,
)
from vlfit.models.itm_loss import (
    contrastive_and_matching_loss,
    draw_alternatives,
    excluded_candidates,
    matching_loss,
    sample_negatives,
)
from vlfit.models.registry import family_for_preset, preset_config
from vlfit.training.itm_objective import TrainingObjective, prepare_model_for_objective

KEYS = torch.tensor([0, 1, 0, 2, 1, 3])  # rows 0, 2 and 1, 4 show one image each (across ranks)
SPLITS = {"even": (0, 3, 6), "uneven": (0, 4, 6)}


def _model(state_dict: dict[str, torch.Tensor] | None = None) -> BridgeTowerForContrastiveLearningWithITM:
    torch.manual_seed(0)
    model = BridgeTowerForContrastiveLearningWithITM(preset_config("tiny"))
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def _inputs(n: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    attention_mask = torch.ones(n, 10, dtype=torch.long)
    attention_mask[1::3, 7:] = 0  # some padded captions
    return {
        "input_ids": torch.randint(3, 1024, (n, 10), generator=generator),
        "attention_mask": attention_mask,
        "pixel_values": torch.randn(n, 3, 64, 64, generator=generator),
        IMAGE_KEYS: KEYS[:n],
    }


def _with_alternatives(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` with ``--hard_negative_column``'s alternative captions: 3 slots a row, rows with 3, 2, 1 or none."""
    n = len(inputs["input_ids"])
    generator = torch.Generator().manual_seed(2)
    mask = torch.ones(n, 3, 8, dtype=torch.long)
    for row in range(n):
        mask[row, 3 - row % 4 :] = 0  # row 0: 3 alternatives, row 1: 2, row 2: 1, row 3: none
    mask[:, :, 6:] *= torch.tensor([1, 0, 1]).view(1, 3, 1)  # one slot's captions padded
    ids = torch.randint(3, 1024, (n, 3, 8), generator=generator) * mask
    return {**inputs, HARD_NEGATIVE_INPUT_IDS: ids, HARD_NEGATIVE_ATTENTION_MASK: mask}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _retrieval_logits(folder_or_model, inputs) -> torch.Tensor:
    model = folder_or_model
    if isinstance(folder_or_model, (str, os.PathLike)):
        model = BridgeTowerForImageAndTextRetrieval.from_pretrained(folder_or_model).eval()
    with torch.no_grad():
        return model(**{k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}).logits


def test_fused_passes_equal_transformers_image_and_text_retrieval():
    model = _model()
    reference = BridgeTowerForImageAndTextRetrieval(copy.deepcopy(model.config)).eval()
    reference.load_state_dict(model.state_dict(), strict=False)
    inputs = _inputs()
    expected = _retrieval_logits(reference, inputs)
    with torch.no_grad():
        own = model(**{k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}).itm_logits
        # Every caption against every image, each tower run once per caption and image.
        texts, images = torch.arange(6).repeat_interleave(6), torch.arange(6).repeat(6)
        all_pairs = pair_scores(model, (inputs["input_ids"], inputs["attention_mask"]), inputs["pixel_values"],
                                texts, images).view(6, 6)  # fmt: skip
    torch.testing.assert_close(own, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(all_pairs.diagonal(), match_log_odds(expected), rtol=0, atol=1e-5)
    swapped = {**inputs, "pixel_values": inputs["pixel_values"].roll(1, 0)}
    torch.testing.assert_close(all_pairs[torch.arange(6), torch.arange(6).roll(1)],
                               match_log_odds(_retrieval_logits(reference, swapped)), rtol=0, atol=1e-5)  # fmt: skip


def test_saved_folder_loads_in_plain_transformers_as_both_classes(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    inputs = _inputs()
    forward = {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}
    with torch.no_grad():
        own = model(**forward)
        contrastive = BridgeTowerForContrastiveLearning.from_pretrained(tmp_path).eval()(**forward)
    torch.testing.assert_close(contrastive.text_embeds, own.text_embeds, rtol=0, atol=1e-6)
    torch.testing.assert_close(contrastive.cross_embeds, own.cross_embeds, rtol=0, atol=1e-6)
    torch.testing.assert_close(_retrieval_logits(tmp_path, inputs), own.itm_logits, rtol=0, atol=1e-5)
    # vlfit loads it back with its head.
    loaded = BridgeTowerFamily().from_pretrained(str(tmp_path))
    assert has_itm_head(loaded)
    torch.testing.assert_close(loaded.itm_score.fc.weight, model.itm_score.fc.weight)


def test_a_folder_laid_out_like_the_official_itm_mlm_itc_checkpoint_keeps_its_itm_head(tmp_path):
    config = preset_config("tiny")
    torch.manual_seed(3)
    retrieval = BridgeTowerForImageAndTextRetrieval(copy.deepcopy(config))
    contrastive = BridgeTowerForContrastiveLearning(copy.deepcopy(config))
    state = {**contrastive.state_dict(), **retrieval.state_dict()}  # one backbone, both sets of heads
    state["mlm_score.bias"] = torch.zeros(config.text_config.vocab_size)  # the official file has an MLM head too
    config.architectures = ["BridgeTowerForContrastiveLearning"]
    config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = BridgeTowerFamily().from_pretrained(str(tmp_path))
    assert has_itm_head(loaded)
    torch.testing.assert_close(loaded.itm_score.fc.weight, retrieval.itm_score.fc.weight)
    # A contrastive-only folder stays contrastive-only.
    BridgeTowerForContrastiveLearning(copy.deepcopy(config)).save_pretrained(tmp_path / "plain")
    assert not has_itm_head(BridgeTowerFamily().from_pretrained(str(tmp_path / "plain")))


def test_negatives_are_never_the_pair_or_a_caption_of_the_same_image():
    keys = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    excluded = excluded_candidates(keys, 8, keys, 0, 8, torch.device("cpu"))
    similarity = torch.randn(8, 8) * 5
    similarity[keys.unsqueeze(1) == keys.unsqueeze(0)] += 100  # the same image's rows score highest
    drawn = set()
    for seed in range(200):
        noise = torch.rand(8, 8, generator=torch.Generator().manual_seed(seed))
        negatives, found = sample_negatives(similarity, excluded, noise)
        assert found.all()
        assert not (keys[negatives] == keys).any()
        drawn.update(zip(range(8), negatives.tolist(), strict=True))
    assert len(drawn) > 16  # a draw, not an argmax
    # A row whose every candidate shows its image has no negative.
    same = torch.tensor([5, 5])
    _, found = sample_negatives(torch.zeros(2, 2), excluded_candidates(same, 2, same, 0, 2, torch.device("cpu")),
                                torch.rand(2, 2))  # fmt: skip
    assert not found.any()


def test_the_draw_follows_the_softmax():
    similarity = torch.tensor([[0.0, 0.0, 2.0, 1.0]])
    excluded = torch.tensor([[True, False, False, False]])
    noise = torch.rand(20000, 4, generator=torch.Generator().manual_seed(0))
    drawn, _ = sample_negatives(similarity.expand(20000, 4), excluded.expand(20000, 4), noise)
    share = torch.bincount(drawn, minlength=4).float() / 20000
    torch.testing.assert_close(share[1:], torch.softmax(similarity[0, 1:], 0), rtol=0, atol=0.02)


def two_process_payload() -> dict:
    """What both processes of the 2-process check read (``tests.two_processes``)."""
    return {"state_dict": _model().state_dict(), "inputs": _inputs(), "alternatives": _with_alternatives(_inputs())}


def two_process_worker(rank: int, world: int, init_file: str, payload_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        payload = torch.load(payload_path)
        model = _model(payload["state_dict"])
        expose_logit_scale(model)
        ddp = DistributedDataParallel(model, find_unused_parameters=True)  # as the Trainer wraps it
        results = {}
        for name, bounds in [*SPLITS.items(), ("alternatives", SPLITS["uneven"])]:
            batch = payload["alternatives" if name == "alternatives" else "inputs"]
            rows = {key: value[bounds[rank] : bounds[rank + 1]] for key, value in batch.items()}
            model.zero_grad(set_to_none=True)
            loss, terms = contrastive_and_matching_loss(
                BridgeTowerFamily(), ddp, rows, scope=LossScope(global_negatives=True), seed=7
            )
            loss.backward()
            results[name] = {"loss": terms["loss_itm"], "total": loss.detach(), "grads": _grads(model)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_itm_loss_and_gradients_on_two_processes_equal_one_process(two_process_results):
    model = _model()
    expose_logit_scale(model)
    loss, terms = contrastive_and_matching_loss(
        BridgeTowerFamily(), model, _inputs(), scope=LossScope(global_negatives=True), seed=7
    )
    loss.backward()
    reference = _grads(model)
    assert any("itm_score" in name for name in reference)
    model.zero_grad(set_to_none=True)
    alternatives = _with_alternatives(_inputs())
    loss_alt, terms_alt = contrastive_and_matching_loss(
        BridgeTowerFamily(), model, alternatives, scope=LossScope(global_negatives=True), seed=7
    )
    loss_alt.backward()
    expected_by_name = {name: (terms["loss_itm"], loss.detach(), reference) for name in SPLITS}
    expected_by_name["alternatives"] = (terms_alt["loss_itm"], loss_alt.detach(), _grads(model))
    for name, (itm, total, grads) in expected_by_name.items():
        ranks = [rank[name] for rank in two_process_results[__name__]]
        for key, expected in (("loss", itm), ("total", total)):
            torch.testing.assert_close((ranks[0][key] + ranks[1][key]) / 2, expected, rtol=0, atol=2e-6, msg=name)
        for rank in ranks:
            assert rank["grads"].keys() == grads.keys()
            for param, grad in rank["grads"].items():
                torch.testing.assert_close(grad, grads[param], rtol=1e-4, atol=1e-6, msg=f"{name} {param}")


def test_each_image_is_also_paired_with_one_of_its_own_alternative_captions():
    inputs = _with_alternatives(_inputs())
    valid = inputs[HARD_NEGATIVE_ATTENTION_MASK].bool().any(-1)
    draws = torch.stack([draw_alternatives(valid, seed, 0, 6) for seed in range(600)])  # [seeds, rows]
    for row in range(6):
        if valid[row].any():
            assert valid[row, draws[:, row]].all()  # never an empty slot
            share = torch.bincount(draws[:, row], minlength=3).float()[valid[row]] / len(draws)
            torch.testing.assert_close(share, torch.full_like(share, 1 / int(valid[row].sum())), rtol=0, atol=0.07)
    # A process holding rows 4 and 5 of the global batch draws what one process draws for them.
    torch.testing.assert_close(draw_alternatives(valid[4:], 9, 4, 6), draw_alternatives(valid, 9, 0, 6)[4:])
    # The head scores one more pair for each row that has alternatives (5 of the 6 here).
    model = _model()
    expose_logit_scale(model)
    outputs = model(**{k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}, return_loss=False)
    without = {k: v for k, v in inputs.items() if k not in (HARD_NEGATIVE_INPUT_IDS, HARD_NEGATIVE_ATTENTION_MASK)}
    assert matching_loss(model, outputs, without).pairs == 3 * 6
    assert matching_loss(model, outputs, inputs).pairs == 3 * 6 + 5


def test_flops_per_sample_count_the_fused_passes():
    family, inputs = BridgeTowerFamily(), _inputs(3)
    model = _model()
    family.prepare_for_training(model)

    def contrastive() -> None:
        family.contrastive_loss(model, inputs).backward()

    def with_itm() -> None:
        contrastive_and_matching_loss(family, model, inputs)[0].backward()

    _, plain = count_flops(contrastive)
    _, matched = count_flops(with_itm)
    assert matched > 1.2 * plain


def test_the_objective_logs_its_terms_and_trains_every_head_it_reaches():
    family = family_for_preset("tiny")
    model = prepare_model_for_objective(BridgeTowerForContrastiveLearning(preset_config("tiny")), family,
                                        "contrastive+itm")  # fmt: skip
    assert has_itm_head(model) and model.itm_score.fc.weight.requires_grad
    family.prepare_for_training(model)
    objective = TrainingObjective("contrastive+itm", seed=0)
    objective.loss(family, model, _inputs(4), step=0, scope=LOCAL_LOSS).backward()
    logged = objective.window()
    assert set(logged) == {"loss_contrastive", "loss_itm", "itm_accuracy"}
    assert 0.0 <= logged["itm_accuracy"] <= 1.0 and objective.window() == {}
    assert model.itm_score.fc.weight.grad is not None and model.itc_text_head.fc.weight.grad is not None
    # itm alone: the contrastive heads only rank the negatives' draw, frozen; contrastive alone: the ITM head frozen.
    alone = prepare_model_for_objective(_model(), family, "itm")
    assert not alone.itc_cross_modal_head.fc.weight.requires_grad and not alone.logit_scale.requires_grad
    assert alone.itm_score.fc.weight.requires_grad
    kept = prepare_model_for_objective(_model(), family, "contrastive")
    assert has_itm_head(kept) and not kept.itm_score.fc.weight.requires_grad


def test_objective_refusals_name_the_flag():
    clip = family_for_preset("clip-tiny")
    with pytest.raises(ConfigError, match=r"^--objective contrastive\+itm: .*clip model"):
        prepare_model_for_objective(torch.nn.Linear(1, 1), clip, "contrastive+itm")
    with pytest.raises(ConfigError, match="unknown --objective 'mlm'"):
        TrainingObjective("mlm")


def test_adding_a_head_keeps_the_model_and_its_weights():
    model = BridgeTowerForContrastiveLearning(preset_config("tiny"))
    before = {name: p.clone() for name, p in model.state_dict().items()}
    same = with_itm_head(model)
    assert same is model and has_itm_head(model)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())


def test_each_process_draws_its_rows_of_one_noise_matrix():
    from vlfit.models.itm_loss import noise_rows

    whole = noise_rows(5, 7, 0, 7, torch.device("cpu"), block=3)
    assert whole.shape == (2, 7, 7)
    for offset, rows in ((0, 4), (4, 3), (2, 1)):
        torch.testing.assert_close(noise_rows(5, 7, offset, rows, torch.device("cpu"), block=3),
                                   whole[:, offset : offset + rows], rtol=0, atol=0)  # fmt: skip


def test_a_batch_without_any_negative_scores_its_positives_and_runs_every_pass():
    """Every row showing one image leaves no image to mine, and rows without alternative captions add none: the
    loss scores the positives alone, and the passes still run (weighed by nothing) so that every process of an FSDP
    run calls the same layers."""
    model = _model()
    expose_logit_scale(model)
    inputs = _with_alternatives(_inputs())
    inputs[IMAGE_KEYS] = torch.zeros(6, dtype=torch.long)  # one image
    inputs[HARD_NEGATIVE_ATTENTION_MASK] = torch.zeros_like(inputs[HARD_NEGATIVE_ATTENTION_MASK])  # no alternatives
    outputs = model(**{k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}, return_loss=False)
    assert matching_loss(model, outputs, inputs).pairs == 6
    calls = []
    for layer in model.bridgetower.cross_modal_text_layers:
        layer.register_forward_hook(lambda *args: calls.append(1))
    loss, terms = contrastive_and_matching_loss(BridgeTowerFamily(), model, inputs)
    assert len(calls) == 3 * len(model.bridgetower.cross_modal_text_layers)  # the forward, mined, alternatives
    loss.backward()
    grads = _grads(model)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert grads["itm_score.fc.weight"].abs().sum() > 0  # the positives still train the head
