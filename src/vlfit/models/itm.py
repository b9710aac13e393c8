"""BridgeTower's image-text matching (ITM) head beside its contrastive heads, in one model and one saved folder.

The official ``BridgeTower/bridgetower-large-itm-mlm-itc`` checkpoint holds the contrastive heads (``itc_*``,
``logit_scale``) and the matching head (``itm_score.fc``) next to one ``bridgetower`` backbone.
``BridgeTowerForContrastiveLearningWithITM`` is ``BridgeTowerForContrastiveLearning`` plus that head under the same
name, so a folder it saves loads in plain transformers as ``BridgeTowerForContrastiveLearning`` and as
``BridgeTowerForImageAndTextRetrieval`` (each ignores the other's head), and a folder with an ``itm_score`` head
loads into it with the head kept.

The matching score of a pair is the head's two logits on the fused tower's pooled output (``[no match, match]``);
vlfit ranks by their difference, the log-odds of a match. ``unimodal_states`` runs the two unimodal encoders once
per text and per image and ``fused_pooled_output`` runs only the cross-modal layers on any pairing of them, which is
how training scores mined negatives and evaluation re-ranks candidates without running each pair's unimodal
encoders again. Together they compute what ``BridgeTowerModel.forward`` computes (a test checks it).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import BridgeTowerForContrastiveLearning
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerContrastiveOutput, BridgeTowerITMHead

logger = logging.getLogger(__name__)

# The matching head's name in transformers' BridgeTowerForImageAndTextRetrieval and in the official checkpoints.
ITM_HEAD = "itm_score"
_ITM_WEIGHT = f"{ITM_HEAD}.fc.weight"


@dataclass
class ContrastiveAndMatchingOutput(BridgeTowerContrastiveOutput):
    """``BridgeTowerContrastiveOutput`` plus ``itm_logits``: the matching head's ``[B, 2]`` logits of the batch's
    own (positive) pairs, from the pooled output the forward computed for the cross-modal embedding."""

    itm_logits: torch.Tensor | None = None


class BridgeTowerForContrastiveLearningWithITM(BridgeTowerForContrastiveLearning):
    """``BridgeTowerForContrastiveLearning`` with ``BridgeTowerForImageAndTextRetrieval``'s matching head."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.itm_score = BridgeTowerITMHead(config.hidden_size * 2)
        self.post_init()

    def forward(self, *args: Any, **kwargs: Any) -> ContrastiveAndMatchingOutput:  # type: ignore[override]
        kwargs["output_hidden_states"] = True  # the fused tower's last states give the pooled output
        output = super().forward(*args, **kwargs)
        cross_text, cross_image = output.hidden_states[2][-1]
        # Inside the forward, so that DDP sees the head used; the poolers are two small linear layers.
        pooled = self.bridgetower.get_cls_features(cross_text, cross_image)
        return ContrastiveAndMatchingOutput(**output, itm_logits=self.itm_score(pooled))


def has_itm_head(model: nn.Module) -> bool:
    """Whether ``model`` (or the model a DDP, FSDP or PEFT wrapper holds) has a matching head."""
    return isinstance(_unwrap(model), BridgeTowerForContrastiveLearningWithITM)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model a DDP, FSDP or PEFT wrapper holds (``model`` itself when it is no wrapper)."""
    return _unwrap(model)


def _unwrap(model: nn.Module) -> nn.Module:
    while True:
        inner = getattr(model, "module", None) or getattr(getattr(model, "base_model", None), "model", None)
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def with_itm_head(model: BridgeTowerForContrastiveLearning) -> BridgeTowerForContrastiveLearningWithITM:
    """``model`` with a matching head: itself when it has one, else with a new head initialized as transformers
    initializes ``BridgeTowerForImageAndTextRetrieval``'s (the backbone and contrastive heads are kept as they are)."""
    if isinstance(model, BridgeTowerForContrastiveLearningWithITM):
        return model
    head = BridgeTowerITMHead(model.config.hidden_size * 2)
    parameter = next(model.parameters())
    model._init_weights(head.fc)
    model.__class__ = BridgeTowerForContrastiveLearningWithITM
    model.itm_score = head.to(device=parameter.device, dtype=parameter.dtype)
    return model  # type: ignore[return-value]


def checkpoint_has_itm_head(name_or_path: str, **hub_kwargs: Any) -> bool:
    """Whether the weights of checkpoint ``name_or_path`` (a folder or a hub id) hold a matching head
    (``itm_score.fc``), read from the safetensors headers or index, never the tensors."""
    from safetensors import safe_open
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

    hub = {k: v for k, v in hub_kwargs.items() if k in ("cache_dir", "revision", "token")}
    for name in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME):
        try:
            path = (
                os.path.join(name_or_path, name)
                if os.path.isdir(name_or_path)
                else cached_file(name_or_path, name, _raise_exceptions_for_missing_entries=False, **hub)
            )
        except OSError:
            continue
        if not path or not os.path.isfile(path):
            continue
        if name == SAFE_WEIGHTS_INDEX_NAME:
            with open(path) as f:
                return _ITM_WEIGHT in json.load(f).get("weight_map", {})
        with safe_open(path, framework="pt") as weights:
            return _ITM_WEIGHT in set(weights.keys())
    return False


# ------------------------------------------------------------------------------------------ the fused tower


class UnimodalStates(NamedTuple):
    """The unimodal encoders' states the cross-modal layers read: one per cross-modal layer, batch first.

    Attributes:
        text: ``[B, C, T, H]``: the text encoder's hidden states from the layer the first cross-modal layer reads
            to the last (C = the cross-modal layers).
        text_mask: ``[B, T]`` the captions' attention mask.
        image: ``[B, C, P, H]``: the vision encoder's block outputs at the same depths, before its final LayerNorm.
    """

    text: torch.Tensor
    text_mask: torch.Tensor
    image: torch.Tensor


def _first_bridged_layer(tower: nn.Module) -> int:
    return len(tower.text_model.encoder.layer) - tower.config.num_hidden_layers + 1


def text_states(model: BridgeTowerForContrastiveLearning, input_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> torch.Tensor:  # fmt: skip
    """``UnimodalStates.text`` of captions (``[B, C, T, H]``)."""
    tower = model.bridgetower
    hidden = tower.text_model.embeddings(input_ids=input_ids)
    mask = create_bidirectional_mask(
        config=tower.config, inputs_embeds=hidden[:, 0:1, :], attention_mask=attention_mask
    )
    first = _first_bridged_layer(tower)
    kept = []
    for index, layer in enumerate(tower.text_model.encoder.layer):
        hidden = layer(hidden, mask)
        if index + 1 >= first:
            kept.append(hidden)
    return torch.stack(kept, dim=1)


def image_states(model: BridgeTowerForContrastiveLearning, pixel_values: torch.Tensor) -> torch.Tensor:
    """``UnimodalStates.image`` of normalized pixels (``[B, C, P, H]``)."""
    tower = model.bridgetower
    visual = tower.vision_model.visual
    hidden = visual.forward_pre(pixel_values.type(tower.vision_model.dtype))  # [P, B, H]: the blocks are seq-first
    first = _first_bridged_layer(tower)
    kept = []
    for index, block in enumerate(visual.transformer.resblocks[: len(tower.text_model.encoder.layer)]):
        hidden = block(hidden)
        if index + 1 >= first:
            kept.append(hidden.permute(1, 0, 2))
    return torch.stack(kept, dim=1)


def states_from_outputs(model: BridgeTowerForContrastiveLearning, outputs: Any, attention_mask: torch.Tensor
                        ) -> UnimodalStates:  # fmt: skip
    """The ``UnimodalStates`` of a contrastive forward's own rows, from its ``hidden_states`` (with gradient)."""
    first = _first_bridged_layer(model.bridgetower)
    texts, images = outputs.hidden_states[0], outputs.hidden_states[1]
    text = torch.stack(list(texts[first:]), dim=1)
    image = torch.stack([state.permute(1, 0, 2) for state in images[first:]], dim=1)
    return UnimodalStates(text, attention_mask, image)


def fused_pooled_output(model: BridgeTowerForContrastiveLearning, states: UnimodalStates) -> torch.Tensor:
    """The fused tower's pooled output ``[B, 2H]`` of pairs: row ``i`` pairs ``states.text[i]`` with
    ``states.image[i]``. The cross-modal half of ``BridgeTowerModel.forward``, step by step."""
    tower = model.bridgetower
    visual = tower.vision_model.visual
    text, image = states.text, states.image
    mask = create_bidirectional_mask(
        config=tower.config, inputs_embeds=text[:, 0, 0:1, :], attention_mask=states.text_mask
    )
    device = text.device
    text_type = tower.token_type_embeddings(torch.zeros(1, dtype=torch.long, device=device))
    image_type = tower.token_type_embeddings(torch.ones(1, dtype=torch.long, device=device))
    dtype = tower.vision_model.dtype
    cross_text = tower.cross_modal_text_layernorm(tower._apply_text_transform(text[:, 0], 0) + text_type)
    cross_image = tower.cross_modal_image_layernorm(
        tower._apply_image_transform(visual.ln_post(image[:, 0].type(dtype)), 0) + image_type
    )
    text_features = tower.cross_modal_text_layers[0](cross_text, cross_image, attention_mask=mask)[0]
    image_features = tower.cross_modal_image_layers[0](cross_image, cross_text, encoder_attention_mask=mask)[0]
    for link in range(text.shape[1] - 1):
        bridged_image = tower._apply_image_transform(visual.ln_post(image[:, link + 1].type(dtype)), link + 1)
        text_in = tower.cross_modal_text_link_tower[link](
            tower._apply_text_transform(text[:, link + 1], link + 1) + text_type, text_features, mask
        )
        image_in = tower.cross_modal_image_link_tower[link](bridged_image + image_type, image_features, None)
        text_features = tower.cross_modal_text_layers[link + 1](text_in, image_in, attention_mask=mask)[0]
        image_features = tower.cross_modal_image_layers[link + 1](image_in, text_in, encoder_attention_mask=mask)[0]
    return tower.get_cls_features(text_features, image_features)


def pair_states(states: UnimodalStates, text_rows: torch.Tensor, image_rows: torch.Tensor) -> UnimodalStates:
    """The states of the pairs (``text_rows[i]``, ``image_rows[i]``)."""
    return UnimodalStates(states.text[text_rows], states.text_mask[text_rows], states.image[image_rows])


def match_log_odds(logits: torch.Tensor) -> torch.Tensor:
    """The score vlfit ranks by: ``match - no match`` logit (the log-odds of a match), in float32."""
    logits = logits.float()
    return logits[..., 1] - logits[..., 0]


def itm_logits(model: nn.Module, states: UnimodalStates) -> torch.Tensor:
    """The matching head's ``[B, 2]`` logits of the pairs in ``states``."""
    unwrapped = _unwrap(model)
    return unwrapped.itm_score(fused_pooled_output(unwrapped, states))  # type: ignore[operator]


def pair_scores(
    model: nn.Module,
    texts: tuple[torch.Tensor, torch.Tensor],
    pixel_values: torch.Tensor,
    text_rows: torch.Tensor,
    image_rows: torch.Tensor,
) -> torch.Tensor:
    """Matching log-odds ``[P]`` of the pairs (caption ``text_rows[i]``, image ``image_rows[i]``).

    Each caption and image runs its unimodal encoder once however many pairs it is in.

    Args:
        model: A model with a matching head (``has_itm_head``).
        texts: Token ids and attention mask ``[Nt, T]`` of the captions.
        pixel_values: ``[Ni, 3, S, S]`` normalized images.
        text_rows, image_rows: ``[P]`` int64 indices into them.
    """
    unwrapped = _unwrap(model)
    used_texts, text_index = torch.unique(text_rows, return_inverse=True)
    used_images, image_index = torch.unique(image_rows, return_inverse=True)
    input_ids, attention_mask = texts[0][used_texts], texts[1][used_texts]
    length = max(int(attention_mask.sum(dim=1).max()), 1)  # the captions' own padding, no more
    states = UnimodalStates(
        text_states(unwrapped, input_ids[:, :length], attention_mask[:, :length]),  # type: ignore[arg-type]
        attention_mask[:, :length],
        image_states(unwrapped, pixel_values[used_images]),  # type: ignore[arg-type]
    )
    return match_log_odds(itm_logits(unwrapped, pair_states(states, text_index, image_index)))
