"""Zero-shot classification by prompts: the class embeddings ``vlfit fewshot`` scores zero-shot with, and the
zero-shot sets classified while fine-tuning (``--zeroshot_dataset``, opened as ``vlfit.data.sources.labelled``'s
``ZeroShotSet``s): what the model still knows of other data.

Each class is the normalized mean of its prompts' text embeddings, averaged as CLIP does (the mean of the normalized
embeddings, normalized again; ``class_embeddings``); each image of the labelled split is classified by its highest
cosine. Reported as ``zeroshot_top1`` / ``zeroshot_top5`` (``zeroshot_{name}_*`` when several sets are given),
beside the retrieval metrics, as open_clip's ``--imagenet-val`` does.

Every process embeds the whole labelled split (no collective): the sets are small, and every process computes the
same figures.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from vlfit.data.pipeline import InputPipeline, LoaderSettings
from vlfit.data.sources.labelled import ZeroShotSet, check_templates
from vlfit.errors import ConfigError
from vlfit.models.family import ModelFamily, image_inputs
from vlfit.models.logit_scale import logit_scale_parameter
from vlfit.models.sharding import unsharded

# The softmax temperature's inverse when the model has no logit scale (CLIP's largest).
DEFAULT_SCALE = 100.0


def class_embeddings(
    embed_texts: Callable[[list[str]], torch.Tensor], class_names: Sequence[str], templates: Sequence[str]
) -> torch.Tensor:
    """``float32 [C, D]``: per class, the normalized mean of its prompts' normalized text embeddings.

    Args:
        embed_texts: Texts -> their L2-normalized embeddings (an ``Encoder``'s ``encode_texts``, or a model's).
        class_names: The classes.
        templates: The prompts, ``{}`` the class name.
    """
    check_templates(templates)
    rows = []
    for name in class_names:
        prompts = embed_texts([template.format(name) for template in templates])
        rows.append(nn.functional.normalize(prompts.float().mean(dim=0), dim=-1))
    return torch.stack(rows)


def model_scale(model: nn.Module) -> float:
    """The model's logit scale multiplier (``exp`` of its parameter, at most 100), or ``DEFAULT_SCALE``."""
    parameter = logit_scale_parameter(model)
    if parameter is None:
        return DEFAULT_SCALE
    return min(DEFAULT_SCALE, math.exp(float(parameter.detach().float())))


@torch.no_grad()
def zeroshot_metrics(
    family: ModelFamily,
    model: nn.Module,
    pipeline: InputPipeline,
    zeroshot: ZeroShotSet,
    *,
    dtype: torch.dtype,
    batch_size: int,
    settings: LoaderSettings = LoaderSettings(),
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, float]:
    """Top-1 / top-5 zero-shot accuracy of ``model`` on one labelled split.

    Returns:
        ``{prefix}_top1``, ``{prefix}_top5``, ``{prefix}_chance_top1`` (the majority class's share),
        ``{prefix}_num_images`` (the images classified: rows that show one image are one, as retrieval
        evaluation counts them), ``{prefix}_num_rows`` (the rows of the data they came from) and
        ``{prefix}_bad_samples`` (images that do not decode, left out).
    """
    model = getattr(model, "module", model)
    was_training = model.training
    model.eval()
    split, device = zeroshot.split, pipeline.device

    def embed_texts(texts: list[str]) -> torch.Tensor:
        tokens = pipeline.inputs.tokenize(texts)
        with autocast():
            return family.encode_text(model, tokens["input_ids"].to(device), tokens["attention_mask"].to(device))

    correct1 = correct5 = seen = bad = 0
    with unsharded(model):
        classes = class_embeddings(embed_texts, split.class_names, zeroshot.templates).to(device)
        top = min(5, len(split.class_names))
        loader = pipeline.loader(pipeline.dataset(split.source, train=False), batch_size=batch_size, settings=settings)
        for batch in pipeline.feed(loader, dtype, train=False):
            bad += len(batch.bad_samples)
            if not len(batch):
                continue
            with autocast():
                images = family.encode_image(model, **image_inputs(batch.inputs)).float()
            ranked = (images @ classes.t()).topk(top, dim=1).indices.cpu()
            labels = torch.as_tensor(split.labels[batch.positions])
            correct1 += int((ranked[:, 0] == labels).sum())
            correct5 += int((ranked == labels.unsqueeze(1)).any(dim=1).sum())
            seen += len(batch)
    if was_training:
        model.train()
    if not seen:
        raise ConfigError(f"--zeroshot_dataset: no image of {split.source.name} could be read")
    prefix = zeroshot.prefix
    return {
        f"{prefix}_top1": correct1 / seen,
        f"{prefix}_top5": correct5 / seen,
        f"{prefix}_chance_top1": split.majority_share(),
        f"{prefix}_num_images": float(seen),
        f"{prefix}_num_rows": float(split.num_rows),
        f"{prefix}_bad_samples": float(bad),
    }
