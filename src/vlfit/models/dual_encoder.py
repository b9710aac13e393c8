"""What the dual-encoder families (CLIP, SigLIP) share: normalization of their embeddings.

A dual encoder embeds captions and images separately (``get_text_features`` / ``get_image_features``, whose
``pooler_output`` is the projected embedding) and scores every caption against every image; nothing is fused.
"""

from __future__ import annotations

import torch
from torch import nn


def normalized(embeddings: torch.Tensor) -> torch.Tensor:
    return nn.functional.normalize(embeddings, dim=-1, p=2)
