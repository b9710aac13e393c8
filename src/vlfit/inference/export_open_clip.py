"""``vlfit export --format open_clip``: a CLIP checkpoint as a folder open_clip's own loader builds, so that
``open_clip.create_model_and_transforms("local-dir:FOLDER")`` (or ``"hf-hub:ORG/REPO"`` once the folder is uploaded)
and ``open_clip.get_tokenizer`` take a vlfit run, and with them clip-retrieval, clip-as-service and scripts::

    open_clip_config.json          {"model_cfg": ..., "preprocess_cfg": ...}: the towers in open_clip's naming, and
                                   the run's image size, mean, std, resize (shortest side, bicubic, center crop)
    open_clip_model.safetensors    the weights, converted to open_clip's native CLIP (the first name it looks for)
    tokenizer.json, ...            the run's tokenizer, which open_clip loads with AutoTokenizer
                                   (``text_cfg.hf_tokenizer_name``; ``local-dir:`` reads it from the folder)
    vlfit_export.json              what was exported from what, and the parity measured (open_clip ignores it)

transformers' ``CLIPModel`` (and ``MetaClip2Model``, the same towers) is open_clip's ``CLIP`` with other names: a
pre-norm ViT with a class token, a causal text transformer, projections without bias. The conversion is one table of
names (q, k and v joined into ``in_proj``, the projections transposed, the text positions cut at the run's caption
length, which becomes open_clip's context length), and every weight must land somewhere: a checkpoint with one more
is refused rather than loaded in part. The text tower pools where vlfit's does: at the first end-of-text token
(open_clip's ``pool_type`` ``eos``), or, for a CLIP config with transformers' legacy ``eos_token_id`` 2, at the
highest id (``argmax``, OpenAI's rule).

Other families are refused in one line (``open_clip_refusal``): SigLIP and SigLIP 2 (open_clip builds their image
tower from a named timm architecture, whose shapes and weights a vlfit run does not map onto), BridgeTower (open_clip
has no cross-modal tower) and two towers (transformers models of any kind, which open_clip's CLIP towers cannot hold).

Like the other formats, the folder is staged, loaded back with open_clip's own ``create_model_and_transforms`` and
``get_tokenizer``, and moved in only when its embeddings match PyTorch's (``--parity_threshold``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import time
from typing import Any

import torch

from vlfit.atomic_files import write_text_atomically
from vlfit.data.normalize import normalize_uint8
from vlfit.errors import ConfigError
from vlfit.extras import require_extra
from vlfit.inference.backends import TorchEncoder
from vlfit.inference.export import check_output_dir, cosine_figures
from vlfit.inference.export_immich import RECORD_NAME, immich_resize, preprocess_config, write_layout_record
from vlfit.inference.export_samples import Samples
from vlfit.inference.staging import fp32_bytes, staged_export
from vlfit.models.input_spec_file import input_settings
from vlfit.models.loading import saved_tokenizer

OPEN_CLIP_LAYOUT = "open_clip >= 3.1 (factory.py: local-dir: / hf-hub: folders with open_clip_config.json)"
CONFIG_NAME = "open_clip_config.json"
WEIGHTS_NAME = "open_clip_model.safetensors"
# transformers' config.model_type of the towers open_clip's CLIP is: CLIP and MetaCLIP 2.
MODEL_TYPES = ("clip", "metaclip_2")
# Why each other family cannot be an open_clip folder, by vlfit's family name.
REFUSED = {
    "siglip": "open_clip builds SigLIP's image tower from a named timm architecture, which a vlfit run's weights do "
    "not map onto",
    "siglip2": "open_clip builds SigLIP 2's image tower from a named timm architecture, which a vlfit run's weights "
    "do not map onto",
    "bridgetower": "open_clip has no architecture for BridgeTower's cross-modal tower",
    "two-tower": "its towers are transformers models of any kind, which open_clip's CLIP towers cannot hold",
}
# transformers' hidden_act -> open_clip's quick_gelu (one activation for both towers; nn.GELU is the exact GELU).
ACTIVATIONS = {"quick_gelu": True, "gelu": False}
OPEN_CLIP_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which open_clip's towers use unless norm_kwargs say
# transformers' CLIP names -> open_clip's (within a tower, and per encoder layer).
TOWER_NAMES = {
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.": "ln_final.",
    "text_model.encoder.layers.": "transformer.resblocks.",
    "vision_model.embeddings.class_embedding": "visual.class_embedding",
    "vision_model.embeddings.patch_embedding.weight": "visual.conv1.weight",
    "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
    "vision_model.pre_layrnorm.": "visual.ln_pre.",
    "vision_model.post_layernorm.": "visual.ln_post.",
    "vision_model.encoder.layers.": "visual.transformer.resblocks.",
    "logit_scale": "logit_scale",
}
LAYER_NAMES = {
    "self_attn.out_proj.": "attn.out_proj.",
    "layer_norm1.": "ln_1.",
    "layer_norm2.": "ln_2.",
    "mlp.fc1.": "mlp.c_fc.",
    "mlp.fc2.": "mlp.c_proj.",
}
PROJECTIONS = {"text_projection.weight": "text_projection", "visual_projection.weight": "visual.proj"}
QKV = re.compile(r"^(?P<layer>.*\.)self_attn\.(?P<part>[qkv])_proj\.(?P<kind>weight|bias)$")


def open_clip_refusal(loaded: TorchEncoder) -> str | None:
    """Why open_clip cannot load ``loaded`` as its own CLIP (one line), or None when it can."""
    family, config = loaded.loaded.family.name, loaded.loaded.model.config
    if config.model_type not in MODEL_TYPES:
        reason = REFUSED.get(family, f"open_clip loads CLIP towers, not {config.model_type}")
        return f"{loaded.model_path} is a {family} model: {reason}; export it with --format onnx"
    text, vision = config.text_config, config.vision_config
    acts = {text.hidden_act, vision.hidden_act}
    if len(acts) > 1 or not acts <= ACTIVATIONS.keys():
        return (
            f"{loaded.model_path}: its towers' activations ({text.hidden_act}, {vision.hidden_act}) are not one of "
            f"{', '.join(ACTIVATIONS)}, the only ones open_clip's CLIP runs; export it with --format onnx"
        )
    settings = input_settings(loaded.spec)
    if immich_resize(settings) is None:
        how = f"{settings['resize']}/{settings['crop']}/{settings['resample']}"
        return f"{loaded.model_path} resizes images as {how}, which open_clip's preprocess_cfg cannot say"
    if loaded.spec.tokenizer.pad_token is None:
        return f"{loaded.model_path}: its tokenizer has no pad token, which open_clip pads every caption with"
    return None


def _pooling(config: Any) -> dict[str, Any]:
    """open_clip's text pooling where transformers' pools: the first ``eos_token_id``, or the highest id for a CLIP
    config with the legacy ``eos_token_id`` 2 (MetaCLIP 2 has no legacy rule)."""
    eos = int(config.text_config.eos_token_id)
    if config.model_type == "clip" and eos == 2:
        return {"pool_type": "argmax"}
    return {"pool_type": "eos", "eos_id": eos}


def _layer_norm(tower: Any) -> dict[str, Any]:
    eps = float(tower.layer_norm_eps)
    return {} if eps == OPEN_CLIP_LAYER_NORM_EPS else {"norm_kwargs": {"eps": eps}}


def model_config(loaded: TorchEncoder, tokenizer_name: str) -> dict[str, Any]:
    """open_clip's ``model_cfg`` of ``loaded`` (its ``CLIP(**model_cfg)``), the text tower at the run's caption length
    with the tokenizer at ``tokenizer_name``."""
    config, spec = loaded.loaded.model.config, loaded.spec
    text, vision = config.text_config, config.vision_config
    return {
        "embed_dim": int(config.projection_dim),
        "quick_gelu": ACTIVATIONS[vision.hidden_act],
        "vision_cfg": {
            "image_size": int(spec.image_size),
            "patch_size": int(vision.patch_size),
            "width": int(vision.hidden_size),
            "layers": int(vision.num_hidden_layers),
            "head_width": int(vision.hidden_size) // int(vision.num_attention_heads),
            "mlp_ratio": vision.intermediate_size / vision.hidden_size,
            **_layer_norm(vision),
        },
        "text_cfg": {
            "context_length": int(spec.max_seq_length),
            "vocab_size": int(text.vocab_size),
            "hf_tokenizer_name": tokenizer_name,
            "width": int(text.hidden_size),
            "heads": int(text.num_attention_heads),
            "layers": int(text.num_hidden_layers),
            "mlp_ratio": text.intermediate_size / text.hidden_size,
            **_pooling(config),
            **_layer_norm(text),
        },
    }


def _open_clip_name(name: str) -> str | None:
    for prefix, renamed in TOWER_NAMES.items():
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            for old, new in LAYER_NAMES.items():
                rest = rest.replace(old, new, 1)
            return renamed + rest
    return None


def open_clip_state_dict(model: torch.nn.Module, context_length: int) -> dict[str, torch.Tensor]:
    """``model``'s (a transformers ``CLIPModel`` or ``MetaClip2Model``) weights in open_clip's ``CLIP`` naming.

    Raises:
        ConfigError: naming the weights open_clip's CLIP has no place for.
    """
    source = {name: tensor.detach().float() for name, tensor in model.state_dict().items()
              if not name.endswith("position_ids")}  # fmt: skip
    converted: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    left = []
    for name, tensor in source.items():
        if name in PROJECTIONS:  # nn.Linear [out, in] -> open_clip's x @ proj, [in, out]
            converted[PROJECTIONS[name]] = tensor.t()
        elif (match := QKV.match(name)) is not None:
            qkv.setdefault((match["layer"], match["kind"]), {})[match["part"]] = tensor
        elif (renamed := _open_clip_name(name)) is not None:
            converted[renamed] = tensor
        else:
            left.append(name)
    for (layer, kind), parts in qkv.items():  # nn.MultiheadAttention's in_proj: q, k and v stacked
        converted[f"{_open_clip_name(layer)}attn.in_proj_{kind}"] = torch.cat([parts[p] for p in "qkv"])
    if left:
        raise ConfigError(f"--format open_clip: open_clip's CLIP has no place for the weights {', '.join(left[:5])}"
                          f"{' ...' if len(left) > 5 else ''}; export it with --format onnx")  # fmt: skip
    converted["positional_embedding"] = converted["positional_embedding"][:context_length]  # the run's captions
    return {name: tensor.contiguous() for name, tensor in converted.items()}


def _parity(staging: str, loaded: TorchEncoder, samples: Samples) -> dict[str, dict[str, float]]:
    """Cosines of the embeddings of the staged folder, as open_clip loads it (its model and its tokenizer), to
    PyTorch's: the samples' pixels (vlfit's pipeline, normalized as open_clip's transform normalizes) and captions."""
    import open_clip

    model, _, _ = open_clip.create_model_and_transforms("local-dir:" + staging)
    tokenizer = open_clip.get_tokenizer("local-dir:" + staging)
    mean, std = (torch.tensor(stat, dtype=torch.float32) for stat in (loaded.spec.image_mean, loaded.spec.image_std))
    with torch.inference_mode():
        images = torch.cat([model.encode_image(normalize_uint8(samples.pixels[i : i + 8], mean, std), normalize=True)
                            for i in range(0, len(samples), 8)])  # fmt: skip
        texts = torch.cat([model.encode_text(tokenizer(samples.captions[i : i + 8]), normalize=True)
                           for i in range(0, len(samples), 8)])  # fmt: skip
    reference_images = torch.cat([loaded.encode_images(samples.pixels[i : i + 8]) for i in range(0, len(samples), 8)])
    reference_texts = torch.cat([loaded.encode_texts(samples.captions[i : i + 8]) for i in range(0, len(samples), 8)])
    return {"image": cosine_figures(reference_images, images), "text": cosine_figures(reference_texts, texts)}


def export_open_clip(
    loaded: TorchEncoder, output_dir: str, *, parity_samples: Samples, parity_threshold: float
) -> dict[str, Any]:
    """Write the open_clip folder of ``loaded`` into ``output_dir`` (see the module).

    Returns:
        The record written (``vlfit_export.json``): identity, inputs, the config, parity.

    Raises:
        MissingExtraError: without open_clip (the open_clip extra).
        ConfigError: for a model open_clip cannot load as its CLIP (``open_clip_refusal``).
        ExportParityError: when open_clip's embeddings' cosine to PyTorch's is below ``parity_threshold``; nothing is
            written.
        WriteFailedError: when a write fails while staged; nothing in ``output_dir`` is replaced.
    """
    from safetensors.torch import save_file

    require_extra("open_clip", "--format open_clip")
    check_output_dir(loaded.model_path, output_dir)
    refusal = open_clip_refusal(loaded)
    if refusal is not None:
        raise ConfigError(f"--format open_clip: {refusal}")
    spec = loaded.spec
    # hf-hub: reads the tokenizer from this name (local-dir: from the folder): the folder where it is written; after
    # an upload, the repository's id (docs/export-retrieval.md).
    config = {
        "model_cfg": model_config(loaded, os.path.abspath(output_dir)),
        "preprocess_cfg": preprocess_config(loaded),
    }
    with staged_export(output_dir, RECORD_NAME, expected_bytes=fp32_bytes(loaded.model)) as staging:
        started = time.perf_counter()
        save_file(open_clip_state_dict(loaded.model, spec.max_seq_length), os.path.join(staging, WEIGHTS_NAME),
                  metadata={"format": "pt"})  # fmt: skip
        saved_tokenizer(loaded.loaded.spec).save_pretrained(staging)
        write_text_atomically(os.path.join(staging, CONFIG_NAME), json.dumps(config, indent=2) + "\n")
        return write_layout_record(
            staging,
            loaded,
            fmt="open_clip",
            layout=OPEN_CLIP_LAYOUT,
            details={"open_clip_config": config},
            parity=_parity(staging, loaded, parity_samples),
            parity_samples=parity_samples,
            parity_threshold=parity_threshold,
            seconds=round(time.perf_counter() - started, 1),
            libraries={"open_clip_torch": importlib.metadata.version("open_clip_torch")},
        )
