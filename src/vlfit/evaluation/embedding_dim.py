"""Evaluation at a chosen embedding size (``vlfit eval --embedding_dim d``): the run's family, its encoders' embeddings
cut to their first ``d`` dimensions and L2-normalized again by ``vlfit.inference.embedding_dim`` (the cut and the
check every runtime door uses), so recall, matching and zero-shot accuracy are scored at ``d``.

The cut sits where embeddings leave the family (``encode_text``, ``encode_image``), as the runtime's encoder cuts
what it returns: every score evaluation computes from embeddings sees the same size. A size the run was not trained
for (its ``input_spec.json``'s ``matryoshka_dims``) is evaluated with the runtime doors' one-line note; one above the
embedding's is refused, naming ``--embedding_dim``, at the first batch (the size is the model's output's).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vlfit.errors import ConfigError
from vlfit.inference.embedding_dim import checked_size, cut
from vlfit.models.family import ModelFamily

if TYPE_CHECKING:
    from vlfit.models.loading import ModelSpec


class EmbeddingsCut:
    """``family`` whose ``encode_text`` and ``encode_image`` return their first ``size`` dimensions, L2-normalized
    again (float32, as the runtime's encoders return them); everything else is the family's own.

    Args:
        family: The model's family.
        size: The size asked for (checked against the embeddings' at the first call: ``checked_size``).
        trained: The prefix sizes the run was trained for.
        model: What the note and the refusal call the model.
    """

    def __init__(self, family: ModelFamily, size: int, trained: tuple[int, ...], model: str) -> None:
        self.family, self.asked, self.trained, self.model = family, size, trained, model
        self.size: int | None = None
        self.checked = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy and pickle probe an instance before its family is set
            raise AttributeError(name)
        return getattr(self.family, name)

    def encode_text(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self._cut(self.family.encode_text(model, input_ids, attention_mask))

    def encode_image(self, model: nn.Module, *args: Any, **inputs: Any) -> torch.Tensor:
        return self._cut(self.family.encode_image(model, *args, **inputs))

    def _cut(self, embeddings: torch.Tensor) -> torch.Tensor:
        if not self.checked:  # once: the note (or the refusal) is one line per evaluation
            self.size = checked_size(self.asked, int(embeddings.shape[-1]), self.trained, self.model)
            self.checked = True
        return cut(embeddings.float(), self.size)


def at_embedding_dim(spec: ModelSpec, size: int | None, task: str) -> ModelSpec:
    """``spec`` evaluated at ``size`` dimensions (``None``: as it is).

    Raises:
        ConfigError: for a size asked of a VQA model, whose evaluation scores answers, not embeddings.
    """
    if size is None:
        return spec
    if task == "vqa":
        raise ConfigError("--embedding_dim cuts the embeddings retrieval is scored with; a VQA model's evaluation "
                          "scores its answers: drop --embedding_dim")  # fmt: skip
    family = EmbeddingsCut(spec.family, size, tuple(spec.inputs.matryoshka_dims), spec.description)
    return dataclasses.replace(spec, family=family)  # type: ignore[arg-type]


__all__ = ["EmbeddingsCut", "at_embedding_dim"]
