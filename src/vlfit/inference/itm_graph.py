"""The matching head's pair scoring as one module: what ``vlfit export`` traces into ``itm.onnx`` and the PyTorch
pair scorer runs (``vlfit.inference.pair_scorer``).

Apart from ``pair_scorer`` so that opening an exported graph imports no transformers model code.
"""

from __future__ import annotations

import torch
from torch import nn

from vlfit.data.device_stage import normalize_uint8
from vlfit.models.family import InputSpec
from vlfit.models.itm import UnimodalStates, image_states, itm_logits, match_log_odds, pair_states, unwrap_model
from vlfit.models.itm import text_states as unimodal_text_states


class PairScoringGraph(nn.Module):
    """Token ids, attention mask ``[Nt, T]``, uint8 pixels ``[Ni, 3, H, W]`` and pair rows ``[P]`` (int64) ->
    matching log-odds ``[P]`` (float32).

    The unimodal encoders run once per caption and per image (``vlfit.models.itm.text_states``, ``image_states``),
    the cross-modal layers and the head once per pair (``itm_logits``). Pixels are normalized inside, with the
    model's mean and std, as the exported image tower does.

    Args:
        model: A BridgeTower model with a matching head (``has_itm_head``), in eval mode.
        spec: The model's input spec (mean and std).
    """

    def __init__(self, model: nn.Module, spec: InputSpec) -> None:
        super().__init__()
        self.model = unwrap_model(model)
        self.register_buffer("mean", torch.tensor(spec.image_mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(spec.image_std, dtype=torch.float32), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixels: torch.Tensor,
        text_rows: torch.Tensor,
        image_rows: torch.Tensor,
    ) -> torch.Tensor:
        normalized = normalize_uint8(pixels, self.mean, self.std, torch.float32)
        states = UnimodalStates(
            unimodal_text_states(self.model, input_ids, attention_mask),  # type: ignore[arg-type]
            attention_mask,
            image_states(self.model, normalized),  # type: ignore[arg-type]
        )
        return match_log_odds(itm_logits(self.model, pair_states(states, text_rows, image_rows)))
