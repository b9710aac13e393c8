"""2D sine-cosine position embeddings, and the presets that start from them."""

from __future__ import annotations

import pytest
import torch

from vlfit.models.loading import build_model, resolve_model
from vlfit.models.position_embeddings import init_vit_position_embedding, sincos_1d, sincos_2d


def test_each_patch_encodes_its_row_then_its_column():
    table = sincos_2d(16, grid=3)
    assert table.shape == (9, 16)
    for row in range(3):
        for column in range(3):
            patch = table[row * 3 + column]
            torch.testing.assert_close(patch[:8], sincos_1d(8, torch.tensor([row]))[0].float())
            torch.testing.assert_close(patch[8:], sincos_1d(8, torch.tensor([column]))[0].float())
    assert sincos_1d(8, torch.tensor([0]))[0].tolist() == [0.0] * 4 + [1.0] * 4  # sin 0, cos 0


def test_vit_init_zeroes_the_class_token_and_refuses_a_non_square_grid():
    weight = torch.randn(1 + 16, 8)
    init_vit_position_embedding(weight)
    assert (weight[0] == 0).all() and torch.equal(weight[1:], sincos_2d(8, 4))
    with pytest.raises(ValueError, match="15 patch positions do not form a square grid"):
        init_vit_position_embedding(torch.randn(16, 8))


@pytest.mark.parametrize(("preset", "sincos"), [("small", True), ("small-p8", True), ("tiny", False)])
def test_a_preset_starts_from_the_position_embeddings_it_names(preset, sincos):
    model = build_model(resolve_model(model_preset=preset, captions=lambda: ["a red circle."] * 50, max_seq_length=16))
    weight = model.bridgetower.vision_model.visual.embeddings.position_embedding.weight
    expected = sincos_2d(weight.shape[1], round((weight.shape[0] - 1) ** 0.5))
    assert torch.equal(weight[1:].detach(), expected) is sincos
