"""A checkpoint folder loaded for inference: the model in eval mode, its two towers, its input spec and identity."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vlfit.errors import MissingFileError
from vlfit.inference.exported import TOKENIZER_FILES
from vlfit.inference.identity import ModelIdentity, RefusedModelError, checkpoint_fingerprint
from vlfit.inference.towers import ImageTower, TextTower
from vlfit.models.family import InputSpec
from vlfit.models.loading import ModelBundle, load_model_bundle

# The caption length vlfit train truncates to by default (--max_seq_length).
DEFAULT_MAX_SEQ_LENGTH = 128


@dataclass
class LoadedCheckpoint:
    """Attributes:
    path: The checkpoint folder.
    bundle: The model with its family, tokenizer and image processor.
    image_tower: uint8 pixels -> embeddings.
    text_tower: Token ids and mask -> embeddings.
    identity: Family, embedding size and weights fingerprint.
    """

    path: str
    bundle: ModelBundle
    image_tower: ImageTower
    text_tower: TextTower
    identity: ModelIdentity

    @property
    def spec(self) -> InputSpec:
        return self.bundle.inputs


def load_checkpoint(
    path: str, max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH, *, flag: str = "--model_name_or_path"
) -> LoadedCheckpoint:
    """Load a local checkpoint folder for inference (fp32, eval mode, the sdpa attention path).

    Args:
        path: The checkpoint folder.
        max_seq_length: Longest tokenized caption.
        flag: The option that named the folder, for error messages.

    Raises:
        MissingFileError: naming ``flag``, when the folder or its weights do not exist.
        RefusedModelError: when the folder has no tokenizer.
    """
    if not os.path.isdir(path):
        raise MissingFileError(f"{flag} {path}: no such checkpoint folder ({os.path.abspath(path)} does not exist)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise RefusedModelError(
            f"{path}: the checkpoint has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save one beside the weights "
            "(vlfit train does)"
        )
    bundle = load_model_bundle(model_name_or_path=path, max_seq_length=max_seq_length)
    return loaded_bundle(path, bundle, checkpoint_fingerprint(path))


def loaded_bundle(path: str, bundle: ModelBundle, fingerprint: str) -> LoadedCheckpoint:
    """A model bundle made ready for inference (fp32, eval mode, its two towers, its identity).

    Args:
        path: What the model is called (its folder, or ``preset:NAME`` for a preset's random weights).
        bundle: The model with its family, tokenizer and image processor.
        fingerprint: What identifies its weights (``checkpoint_fingerprint`` of a folder).
    """
    model = bundle.model.eval().float()
    image_tower = ImageTower(bundle.family, model, bundle.inputs).eval()
    text_tower = TextTower(bundle.family, model).eval()
    with torch.inference_mode():
        probe = text_tower(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
    identity = ModelIdentity(bundle.family.name, int(probe.shape[-1]), fingerprint)
    return LoadedCheckpoint(path, bundle, image_tower, text_tower, identity)
