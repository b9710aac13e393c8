"""The contrastive loss: InfoNCE over BridgeTower's three terms equals BridgeTower's own loss locally, and with global
negatives in a 2-process gloo run equals (loss and every gradient, through DDP) one process on the concatenated
batch, also when the family computes it through a DDP-wrapped model."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import BridgeTowerForContrastiveLearning

from vlfit.models.bridgetower import BridgeTowerFamily, encode_text, expose_logit_scale, loss_terms
from vlfit.models.family import HARD_NEGATIVE_ATTENTION_MASK, HARD_NEGATIVE_INPUT_IDS, IMAGE_KEYS, LossScope
from vlfit.models.losses import embed_hard_negatives, info_nce
from vlfit.models.registry import preset_config

# Rows [0, 3) on rank 0 and [3, 6) on rank 1, then an uneven split: [0, 4) and [4, 6).
SPLITS = {"even": (0, 3, 6), "uneven": (0, 4, 6)}
KEYED_IMAGES = torch.tensor([0, 1, 0, 2, 1, 3])  # rows 0, 2 and 1, 4 show one image each (across ranks)


def _model(state_dict: dict[str, torch.Tensor] | None = None) -> BridgeTowerForContrastiveLearning:
    torch.manual_seed(0)
    model = BridgeTowerForContrastiveLearning(preset_config("tiny"))
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()  # no dropout: the two runs must compute the same function


def _inputs(n: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    attention_mask = torch.ones(n, 10, dtype=torch.long)
    attention_mask[1::3, 7:] = 0  # some padded captions
    return {
        "input_ids": torch.randint(3, 1024, (n, 10), generator=generator),
        "attention_mask": attention_mask,
        "pixel_values": torch.randn(n, 3, 64, 64, generator=generator),
    }


def _with_hard_negatives(inputs: dict[str, torch.Tensor], slots: int = 3) -> dict[str, torch.Tensor]:
    """Each row's alternative captions: row 0 has 2, row 1 none, every other row ``slots`` (padded tokens too)."""
    n = inputs["input_ids"].shape[0]
    generator = torch.Generator().manual_seed(2)
    mask = torch.ones(n, slots, 8, dtype=torch.long)
    mask[:, :, 6:] = 0
    mask[0, 2:] = 0
    mask[1] = 0
    ids = torch.randint(3, 1024, (n, slots, 8), generator=generator) * mask + (1 - mask)  # 1: the pad id
    return {**inputs, HARD_NEGATIVE_INPUT_IDS: ids, HARD_NEGATIVE_ATTENTION_MASK: mask}


def _rows(inputs: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {key: value[start:stop] for key, value in inputs.items()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def two_process_payload() -> dict:
    """What both processes of the 2-process check read (``tests.two_processes``)."""
    inputs = _inputs()
    return {"state_dict": _model().state_dict(), "inputs": inputs, "hard_inputs": _with_hard_negatives(inputs),
            "keyed_inputs": {**inputs, IMAGE_KEYS: KEYED_IMAGES}}  # fmt: skip


def two_process_worker(rank: int, world: int, init_file: str, payload_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        payload = torch.load(payload_path)
        model = _model(payload["state_dict"])
        expose_logit_scale(model)
        # As the Trainer wraps it: find_unused_parameters, since the text pooler gets no gradient.
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        results = {}
        family = BridgeTowerFamily()
        for name, bounds in SPLITS.items():
            rows = _rows(payload["inputs"], bounds[rank], bounds[rank + 1])
            model.zero_grad(set_to_none=True)
            outputs = ddp(**rows, return_loss=False)
            loss = info_nce(loss_terms(outputs), outputs.logit_scale, gather=True)
            loss.backward()
            results[name] = {"loss": loss.detach(), "grads": _grads(model)}
            # The family's loss, as the trainer calls it (the model as training wraps it).
            model.zero_grad(set_to_none=True)
            family_loss = family.contrastive_loss(ddp, rows, LossScope(global_negatives=True))
            family_loss.backward()
            results[f"{name} family"] = {"loss": family_loss.detach(), "grads": _grads(model)}
            # With hard negatives: embedded outside the DDP forward, each query's own, never gathered.
            model.zero_grad(set_to_none=True)
            hard_rows = _rows(payload["hard_inputs"], bounds[rank], bounds[rank + 1])
            hard_loss = family.contrastive_loss(ddp, hard_rows, LossScope(global_negatives=True))
            hard_loss.backward()
            results[f"{name} hard negatives"] = {"loss": hard_loss.detach(), "grads": _grads(model)}
            # Rows of one image on the same and on different processes: not each other's negatives.
            model.zero_grad(set_to_none=True)
            keyed_loss = family.contrastive_loss(
                ddp, _rows(payload["keyed_inputs"], bounds[rank], bounds[rank + 1]), LossScope(global_negatives=True)
            )
            keyed_loss.backward()
            results[f"{name} same images"] = {"loss": keyed_loss.detach(), "grads": _grads(model)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_local_loss_matches_bridgetower_loss_and_gradients():
    model = _model()
    inputs = _inputs()
    reference = model(**inputs, return_loss=True)
    reference.loss.backward()
    reference_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    outputs = model(**inputs, return_loss=False)
    assert outputs.loss is None
    loss = info_nce(loss_terms(outputs), model.logit_scale.exp())
    loss.backward()
    torch.testing.assert_close(loss, reference.loss, rtol=0, atol=1e-6)
    grads = _grads(model)
    assert grads.keys() == reference_grads.keys() and "logit_scale" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)

    # Without a process group, global negatives are the local batch.
    again = info_nce(loss_terms(outputs), model.logit_scale.exp(), gather=True)
    torch.testing.assert_close(again, loss)
    # The family's local loss is the model's own.
    torch.testing.assert_close(BridgeTowerFamily().contrastive_loss(model, inputs), reference.loss)


def test_symmetric_loss_adds_image_to_text_to_the_three_terms():
    model = _model()
    expose_logit_scale(model)
    inputs = _inputs()
    own = model(**inputs, return_loss=True)
    scale = model.logit_scale.exp()
    image_to_text = torch.nn.functional.cross_entropy(
        own.image_embeds @ own.text_embeds.t() * scale, torch.arange(own.image_embeds.shape[0])
    )
    symmetric = BridgeTowerFamily().contrastive_loss(model, inputs, LossScope(symmetric=True))
    torch.testing.assert_close(symmetric, (3 * own.loss + image_to_text) / 4, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(symmetric, own.loss)


def test_hard_negatives_join_each_images_image_to_text_candidates():
    model = _model()
    expose_logit_scale(model)
    inputs = _with_hard_negatives(_inputs())
    loss = BridgeTowerFamily().contrastive_loss(model, inputs)
    loss.backward()
    assert all(torch.isfinite(grad).all() for grad in _grads(model).values())  # padded slots poison nothing

    with torch.no_grad():
        own = model(**{key: inputs[key] for key in ("input_ids", "attention_mask", "pixel_values")}, return_loss=True)
        scale = model.logit_scale.exp()
        per_image = []
        for i in range(6):
            valid = inputs[HARD_NEGATIVE_ATTENTION_MASK][i].bool().any(dim=-1)
            logits = own.image_embeds[i] @ own.text_embeds.t()
            if valid.any():
                ids, mask = inputs[HARD_NEGATIVE_INPUT_IDS][i][valid], inputs[HARD_NEGATIVE_ATTENTION_MASK][i][valid]
                logits = torch.cat([logits, encode_text(model, ids, mask) @ own.image_embeds[i]])
            per_image.append(torch.nn.functional.cross_entropy(logits[None] * scale, torch.tensor([i])))
        expected = (3 * own.loss + torch.stack(per_image).mean()) / 4
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    # Hard negatives change the loss over plain image->text: the comparison above can fail.
    plain_image_to_text = BridgeTowerFamily().contrastive_loss(model, _inputs(), LossScope(symmetric=True)).detach()
    assert abs(float(plain_image_to_text - loss.detach())) > 1e-3


def test_padded_hard_negative_slots_never_reach_the_text_encoder():
    seen: list[int] = []

    def encode(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seen.append(ids.shape[0])
        return torch.nn.functional.normalize(torch.ones(ids.shape[0], 4), dim=-1)

    inputs = _with_hard_negatives(_inputs())
    negatives = embed_hard_negatives(encode, inputs[HARD_NEGATIVE_INPUT_IDS], inputs[HARD_NEGATIVE_ATTENTION_MASK])
    assert seen == [2 + 0 + 4 * 3]
    assert negatives.valid.sum(dim=1).tolist() == [2, 0, 3, 3, 3, 3]
    assert negatives.embeds.shape == (6, 3, 4) and (negatives.embeds[~negatives.valid] == 0).all()


def test_exposed_logit_scale_is_in_the_outputs_and_carries_gradient():
    model = _model()
    expose_logit_scale(model)
    expose_logit_scale(model)  # idempotent: one hook
    outputs = model(**_inputs(2), return_loss=False)
    torch.testing.assert_close(outputs.logit_scale, model.logit_scale.exp())
    outputs.logit_scale.backward()
    assert model.logit_scale.grad is not None
    assert len(model._forward_hooks) == 1


@pytest.mark.slow
def test_global_negatives_on_two_processes_equal_one_process_on_the_concatenated_batch(two_process_results):
    inputs = _inputs()
    model = _model()
    hard_inputs = _with_hard_negatives(inputs)
    keyed_inputs = {**inputs, IMAGE_KEYS: KEYED_IMAGES}
    ranks = two_process_results[__name__]

    reference = model(**inputs, return_loss=True)
    reference.loss.backward()
    reference_grads = _grads(model)

    for name, bounds in [*SPLITS.items(), *((f"{n} family", b) for n, b in SPLITS.items())]:
        # The Trainer logs the mean over processes; DDP averages the gradients.
        loss = (ranks[0][name]["loss"] + ranks[1][name]["loss"]) / 2
        torch.testing.assert_close(loss, reference.loss.detach(), rtol=0, atol=2e-6, msg=name)
        for rank in ranks:
            grads = rank[name]["grads"]
            assert grads.keys() == reference_grads.keys(), name
            for param, grad in grads.items():
                torch.testing.assert_close(grad, reference_grads[param], rtol=1e-4, atol=1e-6, msg=f"{name} {param}")

        # The same split with per-process negatives is a different loss: the comparison above can fail.
        local = []
        with torch.no_grad():
            for rank in range(2):
                local.append(model(**_rows(inputs, bounds[rank], bounds[rank + 1]), return_loss=True).loss)
        assert abs(float(sum(local) / 2 - reference.loss.detach())) > 1e-2, name

    expose_logit_scale(model)
    for case, batch in (("hard negatives", hard_inputs), ("same images", keyed_inputs)):
        model.zero_grad(set_to_none=True)
        case_reference = BridgeTowerFamily().contrastive_loss(model, batch, LossScope(global_negatives=True))
        case_reference.backward()
        case_grads = _grads(model)
        for name in SPLITS:
            loss = (ranks[0][f"{name} {case}"]["loss"] + ranks[1][f"{name} {case}"]["loss"]) / 2
            torch.testing.assert_close(loss, case_reference.detach(), rtol=0, atol=2e-6, msg=f"{name} {case}")
            for rank in ranks:
                for param, grad in rank[f"{name} {case}"]["grads"].items():
                    torch.testing.assert_close(grad, case_grads[param], rtol=1e-4, atol=1e-6, msg=f"{name} {param}")
    assert abs(float(case_reference.detach() - reference.loss.detach())) > 1e-4  # the keys changed the loss


@pytest.mark.parametrize("negatives", ["local", "global"])
def test_loss_is_float32_under_bf16_autocast(negatives):
    model = _model()
    expose_logit_scale(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(**_inputs(3), return_loss=False)
        loss = info_nce(loss_terms(outputs), outputs.logit_scale, gather=negatives == "global")
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
