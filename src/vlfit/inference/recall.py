"""Retrieval metrics on similarity matrices and on embeddings. Pure tensor math, tested on hand-built matrices.

Several captions may describe one image (COCO and Flickr30k have five): the protocol is the one papers and
CLIP_benchmark use. Text->image recall@k ranks each caption's image among the unique images; image->text
recall@k counts an image as found when any of its captions is within the top k of all captions. With one caption
per image both are the familiar diagonal ranks.

On embeddings, the similarity is walked in chunks (``vlfit.inference.topk``): a whole split is scored without
building its texts x images matrix.

They sit in the inference layer, below evaluation, because both use them: ``vlfit eval`` scores a split, and
``vlfit export`` checks an exported graph's recall against the torch model's.
"""

from __future__ import annotations

import torch

from vlfit.inference.topk import DEFAULT_CHUNK_ELEMENTS, best_owned_ranks, target_ranks

RECALL_KS = (1, 5, 10)


def recall_at_k(
    similarity: torch.Tensor, ks: tuple[int, ...] = RECALL_KS, image_of_text: torch.Tensor | None = None
) -> dict[str, float]:
    """Recall@k in both directions from a full similarity matrix (the reference the chunked functions match).

    ``similarity[i, j]`` scores text ``i`` against image ``j``. Text->image recall@k is the share of texts whose
    image ranks within the top k of its row; image->text recall@k the share of images with one of their texts
    within the top k of their column. Ties count against the right answer (a constant matrix scores chance or
    below, never a perfect recall).

    Args:
        similarity: ``[texts, images]``.
        ks: The cut-offs.
        image_of_text: int64 ``[texts]``, each text's image (every image has at least one text); ``None``: the
            matrix is square and text ``i`` describes image ``i``.

    Returns:
        ``{"t2i_recall@k": ..., "i2t_recall@k": ...}`` for each k.
    """
    if similarity.ndim != 2 or (image_of_text is None and similarity.shape[0] != similarity.shape[1]):
        raise ValueError(f"similarity must be square without image_of_text, got shape {tuple(similarity.shape)}")
    if image_of_text is None:
        image_of_text = torch.arange(similarity.shape[0])
    texts = torch.arange(similarity.shape[0])
    true = similarity[texts, image_of_text].unsqueeze(1)
    t2i = (similarity >= true).sum(dim=1) - 1
    owned = image_of_text.unsqueeze(0) == torch.arange(similarity.shape[1]).unsqueeze(1)  # [images, texts]
    columns = similarity.t()
    best = columns.masked_fill(~owned, float("-inf")).amax(dim=1, keepdim=True)
    i2t = ((columns >= best) & ~owned).sum(dim=1)
    return {**_recall_from_ranks("t2i", t2i, ks), **_recall_from_ranks("i2t", i2t, ks)}


def _recall_from_ranks(name: str, rank: torch.Tensor, ks: tuple[int, ...]) -> dict[str, float]:
    return {f"{name}_recall@{k}": (rank < k).float().mean().item() for k in ks}


def retrieval_ranks(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    image_of_text: torch.Tensor | None = None,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each text's image rank (``[texts]``) and each image's best-text rank (``[images]``), as ``recall_at_k``
    counts them, a chunk of queries at a time (memory stays at ``chunk_elements`` scores)."""
    if text_embeds.shape[0] == 0:
        raise ValueError("no samples to evaluate")
    if image_of_text is None:
        image_of_text = torch.arange(text_embeds.shape[0])
    t2i = target_ranks(text_embeds, image_embeds, image_of_text, chunk_elements=chunk_elements)
    i2t = best_owned_ranks(image_embeds, text_embeds, image_of_text, chunk_elements=chunk_elements)
    return t2i, i2t


def pooled_recall_at_k(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    pool_size: int | None = None,
    ks: tuple[int, ...] = RECALL_KS,
    image_of_text: torch.Tensor | None = None,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> dict[str, float]:
    """Recall@k over consecutive pools of ``pool_size`` images and their captions (the whole set when ``None``).

    Each text and each image counts once: text->image recall is the mean over every text of the split,
    image->text over every image. ``chance_recall@1`` is the expected text->image recall@1 of a random ranking
    (1 / images in the text's pool), the number to compare recall@1 against.

    Args:
        text_embeds: ``[texts, D]``.
        image_embeds: ``[images, D]``, the unique images.
        pool_size: Images per pool (``None`` or < 1: all).
        ks: The cut-offs.
        image_of_text: int64 ``[texts]``, each text's image; ``None``: one text per image, in the same order.
        chunk_elements: Largest number of scores held at once.

    Returns:
        ``t2i_recall@k``, ``i2t_recall@k``, ``chance_recall@1``, ``pool_size`` (images), ``num_texts``,
        ``num_images`` and ``num_samples`` (the texts: one row of the split each).
    """
    num_texts, num_images = text_embeds.shape[0], image_embeds.shape[0]
    if num_texts == 0:
        raise ValueError("no samples to evaluate")
    if image_of_text is None:
        if num_texts != num_images:
            raise ValueError(f"{num_texts} texts and {num_images} images need image_of_text")
        image_of_text = torch.arange(num_texts)
    pool_size = num_images if pool_size is None or pool_size <= 0 else min(pool_size, num_images)
    t2i_ranks, i2t_ranks = [], []
    chance = 0.0
    for start in range(0, num_images, pool_size):
        stop = min(start + pool_size, num_images)
        texts = ((image_of_text >= start) & (image_of_text < stop)).nonzero().squeeze(1)
        t2i, i2t = retrieval_ranks(text_embeds[texts], image_embeds[start:stop], image_of_text[texts] - start,
                                   chunk_elements=chunk_elements)  # fmt: skip
        t2i_ranks.append(t2i)
        i2t_ranks.append(i2t)
        chance += len(texts) / (stop - start)
    metrics = {
        **_recall_from_ranks("t2i", torch.cat(t2i_ranks), ks),
        **_recall_from_ranks("i2t", torch.cat(i2t_ranks), ks),
    }
    metrics["chance_recall@1"] = chance / num_texts
    metrics["pool_size"] = float(pool_size)
    metrics["num_samples"] = metrics["num_texts"] = float(num_texts)
    metrics["num_images"] = float(num_images)
    return metrics


def matching_accuracy(image_embeds: torch.Tensor, choice_embeds: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of images whose highest-scoring caption choice is the labelled one.

    Args:
        image_embeds: ``[N, D]``.
        choice_embeds: ``[N, C, D]`` embeddings of each sample's C caption choices.
        labels: ``[N]`` index of the right choice.
    """
    scores = torch.einsum("nd,ncd->nc", image_embeds.float(), choice_embeds.float())
    return (scores.argmax(dim=1) == labels).float().mean().item()
