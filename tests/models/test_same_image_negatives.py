"""Captions of one image are not each other's negatives: with ``image_keys`` marking rows that show the same image,
every family's loss equals the loss computed by hand with those pairs removed from the negatives (and with distinct
keys, the loss without keys). Global negatives, gradient caching and two processes: tests/models/test_losses.py,
test_dual_encoders.py and tests/training/test_gradient_cache.py run the same batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.test_dual_encoders import SAME_IMAGES, _inputs
from vlfit.models import bridgetower, clip, siglip
from vlfit.models.family import IMAGE_KEYS

FAMILIES = {
    "tiny": bridgetower.BridgeTowerFamily(),
    "clip-tiny": clip.CLIPFamily(),
    "siglip-tiny": siglip.SiglipFamily(),
}


def _model(preset: str) -> torch.nn.Module:
    family = FAMILIES[preset]
    torch.manual_seed(0)
    model = family.build(family.preset_config(preset))
    family.initialize_preset(model, preset)
    family.prepare_for_training(model)
    return model.eval()


def _info_nce_without_same_images(terms: list, scale: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each query's cross-entropy over its own pair and the candidates showing another image, terms averaged."""
    losses = []
    for term in terms:
        queries, candidates = term[0], term[1]
        rows = []
        for i in range(len(keys)):
            allowed = [j for j in range(len(keys)) if j == i or keys[j] != keys[i]]
            logits = queries[i] @ candidates[allowed].t() * scale
            rows.append(F.cross_entropy(logits.unsqueeze(0), torch.tensor([allowed.index(i)])))
        losses.append(torch.stack(rows).mean())
    return torch.stack(losses).mean()


def _sigmoid_without_same_images(embeddings, keys: torch.Tensor) -> torch.Tensor:
    text, image = embeddings.rows["text"], embeddings.rows["image"]
    scale, bias = embeddings.shared["logit_scale"], embeddings.shared["logit_bias"]
    total = text.new_zeros(())
    for i in range(len(keys)):
        for j in range(len(keys)):
            if i != j and keys[i] == keys[j]:
                continue  # neither a positive nor a negative pair
            sign = 1.0 if i == j else -1.0
            total = total - F.logsigmoid(sign * (text[i] @ image[j] * scale + bias))
    return total / len(keys)


@pytest.mark.parametrize("preset", FAMILIES)
def test_pairs_of_one_image_are_left_out_of_the_negatives(preset):
    family, model = FAMILIES[preset], _model(preset)
    if preset == "siglip-tiny":
        model.logit_bias.data.zero_()  # at the initial bias of -10 a negative pair's loss is ~5e-5: make it count
    keyed = _inputs(same_images=True)
    with torch.no_grad():
        embeddings = family.loss_embeddings(model, keyed)
        masked = family.loss_from_embeddings(embeddings)
        rows = embeddings.rows
        if preset == "siglip-tiny":
            expected = _sigmoid_without_same_images(embeddings, SAME_IMAGES)
        elif preset == "clip-tiny":
            terms = clip.loss_terms(rows["text"], rows["image"])
            expected = _info_nce_without_same_images(terms, embeddings.shared["logit_scale"], SAME_IMAGES)
        else:
            outputs = bridgetower.ContrastiveEmbeddings(rows["text"], rows["image"], rows["cross"])
            terms = bridgetower.loss_terms(outputs)
            expected = _info_nce_without_same_images(terms, embeddings.shared["logit_scale"], SAME_IMAGES)
        torch.testing.assert_close(masked, expected, rtol=1e-5, atol=1e-6)
        # Every row its own image: the plain loss, and the duplicates made a difference above (the test can fail).
        distinct = family.contrastive_loss(model, {**keyed, IMAGE_KEYS: torch.arange(6)})
        plain = family.contrastive_loss(model, {k: v for k, v in keyed.items() if k != IMAGE_KEYS})
    torch.testing.assert_close(distinct, plain, rtol=1e-5, atol=1e-6)
    assert abs(float(masked - plain)) > 1e-4
