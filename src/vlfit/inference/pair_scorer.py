"""Matching log-odds of (caption, image) pairs on PyTorch, ONNX Runtime or OpenVINO, behind one interface: what
re-ranking calls.

A ``PairScorer`` takes what the fast CPU pipeline makes, captions (strings, or token ids with their attention
mask) and uint8 pixels ``[Ni, 3, H, W]``, and returns the float32 log-odds of a match (``match - no match`` logit
of the ITM head, ``vlfit.models.itm.match_log_odds``) of each pair. Pairs are given as rows into the captions and
the images (``text_rows[i]``, ``image_rows[i]``), so each caption and each image runs its unimodal encoder once
however many pairs it is in: re-ranking K images for one caption is ``score_pairs([caption], images,
text_rows=[0] * K, image_rows=range(K))``. Without rows, caption ``i`` pairs with image ``i``.

``vlfit.inference.itm_graph.PairScoringGraph`` is what every backend runs: PyTorch eagerly, ONNX Runtime as the
``itm.onnx`` graph ``vlfit export`` traced from it (``vlfit.inference.export_itm``), OpenVINO as that graph
converted (``itm.xml``). A model's scorer comes from its runtime (``vlfit.inference.runtime.ModelRuntime``:
``pair_scorer``, on the runtime's settings): ``pair_scorer_for`` gives a checkpoint's, sharing its PyTorch encoder's
model and threads; ``exported_scorer_of`` an export folder's, at the settings' precision, threads and caption
length, whether or not the folder's encoder was opened first. A model without a matching head has no scorer: both
return None and ``ModelRuntime.require_pair_scorer`` refuses it in one line (``NoMatchingHeadError``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from vlfit.errors import ConfigError
from vlfit.inference.backends import ExportedPart, ModelPart, TorchEncoder, exported_precision
from vlfit.inference.exported import ExportFolder, graph_name
from vlfit.inference.graph_runtimes import GraphRuntime, graph_runtime
from vlfit.inference.identity import RefusedModelError
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.inference.towers import IMAGE_INPUT, TEXT_INPUTS
from vlfit.threads import on_own_threads

ITM_GRAPH = "itm"  # the graph's key in the export manifest and its file name (itm.onnx, itm.int8.onnx)
ROW_INPUTS = ("text_rows", "image_rows")
ITM_INPUTS = (*TEXT_INPUTS, IMAGE_INPUT, *ROW_INPUTS)
ITM_OUTPUT = "match_log_odds"
NO_HEAD_ADVICE = (
    "re-ranking needs a model with an image-text matching head: train one with vlfit train --objective "
    "contrastive+itm (BridgeTower)"
)


class NoMatchingHeadError(RefusedModelError):
    """A model or export folder without an image-text matching head was asked to score pairs."""


def no_matching_head(model_path: str, exported: ExportFolder | None = None) -> NoMatchingHeadError:
    """The one-line refusal of a checkpoint (or, ``exported``, an export folder) without a matching head."""
    if exported is None:
        return NoMatchingHeadError(f"{model_path} has no image-text matching head; {NO_HEAD_ADVICE}")
    return NoMatchingHeadError(
        f"{model_path} has no image-text matching graph ({graph_name(ITM_GRAPH, 'fp32', exported.format)}): its "
        f"checkpoint has no matching head, or it was exported by an older vlfit; {NO_HEAD_ADVICE}, then export it "
        "again"
    )


class PairScorer(ModelPart, ABC):
    """Scores (caption, image) pairs by the matching head (the attributes of ``ModelPart``)."""

    kind = "pair scorer "

    @abstractmethod
    def score_tokens(self, *inputs: torch.Tensor) -> torch.Tensor:
        """``PairScoringGraph``'s five inputs (token ids and attention mask ``[Nt, T]``, uint8 pixels
        ``[Ni, 3, H, W]``, text rows and image rows ``[P]``), checked -> float32 log-odds ``[P]`` on the CPU."""

    def score_pairs(
        self,
        texts: Sequence[str] | Mapping[str, torch.Tensor],
        images: torch.Tensor | np.ndarray,
        text_rows: Sequence[int] | torch.Tensor | None = None,
        image_rows: Sequence[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Matching log-odds of pairs of ``texts`` and ``images``.

        Args:
            texts: Captions, or their token ids and attention mask (``{"input_ids", "attention_mask"}``,
                ``[Nt, T]`` each, as ``tokenize`` makes them).
            images: uint8 pixels ``[Ni, 3, H, W]`` at the model's image size.
            text_rows, image_rows: Pair ``i`` is (caption ``text_rows[i]``, image ``image_rows[i]``); both None:
                caption ``i`` with image ``i``.

        Returns:
            float32 ``[P]``: the log-odds of a match, higher for a better match.

        Raises:
            ConfigError: for pixels that are not uint8 ``[N, 3, H, W]`` at the model's size, rows given for one side
                only, rows of different lengths or out of range, or captions and images of different counts
                without rows.
        """
        if isinstance(texts, Mapping):
            input_ids, attention_mask = texts["input_ids"], texts["attention_mask"]
        else:
            tokens = self.spec.tokenize(list(texts))
            input_ids, attention_mask = tokens["input_ids"], tokens["attention_mask"]
        pixels = torch.from_numpy(images) if isinstance(images, np.ndarray) else images
        size = self.spec.image_size
        if pixels.dtype != torch.uint8 or pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, size, size):
            raise ConfigError(
                f"pair scoring takes uint8 pixels [N, 3, {size}, {size}], got {pixels.dtype} "
                f"{list(pixels.shape)}; resize and crop the images as the input pipeline does"
            )
        rows = _pair_rows(len(input_ids), len(pixels), text_rows, image_rows)
        if len(rows[0]) == 0:
            return torch.zeros(0, dtype=torch.float32)
        return self.score_tokens(input_ids.long(), attention_mask.long(), pixels.contiguous(), rows[0], rows[1]).float()


def _pair_rows(
    num_texts: int, num_images: int, text_rows: Sequence[int] | torch.Tensor | None,
    image_rows: Sequence[int] | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if (text_rows is None) != (image_rows is None):
        raise ConfigError("pair scoring takes text_rows and image_rows together, or neither (caption i, image i)")
    if text_rows is None or image_rows is None:
        if num_texts != num_images:
            raise ConfigError(
                f"pair scoring got {num_texts} captions and {num_images} images; without text_rows and image_rows "
                "caption i pairs with image i, so their counts must be equal"
            )
        rows = torch.arange(num_texts)
        return rows, rows
    texts = torch.as_tensor(text_rows, dtype=torch.long).reshape(-1)
    images = torch.as_tensor(image_rows, dtype=torch.long).reshape(-1)
    if len(texts) != len(images):
        raise ConfigError(f"text_rows has {len(texts)} pairs but image_rows {len(images)}; give one row each per pair")
    for name, values, count in (("text_rows", texts, num_texts), ("image_rows", images, num_images)):
        if len(values) and (int(values.min()) < 0 or int(values.max()) >= count):
            raise ConfigError(f"{name} must lie in [0, {count}) (one per caption or image given), got "
                              f"{int(values.min())}..{int(values.max())}")  # fmt: skip
    return texts, images


class TorchPairScorer(PairScorer):
    """A loaded model with a matching head on PyTorch (fp32, eval mode), on its encoder's threads.

    Args:
        encoder: The model's ``TorchEncoder`` (its model, spec and threads; the scorer shares the model, not a copy).

    Raises:
        NoMatchingHeadError: when the model has no matching head.
    """

    backend = "torch"
    precision = "fp32"

    def __init__(self, encoder: TorchEncoder) -> None:
        from vlfit.inference.itm_graph import PairScoringGraph  # only here: it imports transformers' models
        from vlfit.models.itm import has_itm_head

        if not has_itm_head(encoder.model):
            raise no_matching_head(encoder.model_path)
        self.model_path = encoder.model_path
        self.spec = encoder.spec
        self.num_threads = encoder.num_threads
        self.graph = PairScoringGraph(encoder.model, encoder.spec).eval()

    @on_own_threads
    @torch.inference_mode()
    def score_tokens(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.graph(*inputs)


class ExportedPairScorer(ExportedPart, PairScorer):
    """The ``itm`` graph of an export folder on the runtime of its format (``exported_pair_scorer`` makes one).

    Args:
        exported: The export folder.
        runtime: Where its graph runs (``vlfit.inference.graph_runtimes.graph_runtime``).
        precision: ``fp32``, ``int8`` or ``auto`` (INT8 when the ``itm`` graph was exported in INT8).
        max_seq_length: Caption length (``None``: the export's, which is the run's).

    Raises:
        NoMatchingHeadError: when the folder has no ``itm`` graph.
        RefusedModelError: when it has none of ``precision``.
    """

    def __init__(
        self, exported: ExportFolder, runtime: GraphRuntime, precision: str = "auto", max_seq_length: int | None = None
    ) -> None:
        precisions = exported.graph_precisions(ITM_GRAPH)
        if not precisions:
            raise no_matching_head(exported.path, exported)
        super().__init__(exported, runtime, (ITM_GRAPH,), exported_precision(precision, precisions), max_seq_length)

    def score_tokens(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.run_graph(ITM_GRAPH, dict(zip(ITM_INPUTS, inputs, strict=True)))


def exported_pair_scorer(exported: ExportFolder, settings: RuntimeSettings | None = None) -> ExportedPairScorer:
    """The scorer of an export folder's ``itm`` graph on the folder's runtime (ONNX Runtime, or OpenVINO computing
    in f32: the precision its parity was checked in), at ``settings``' precision, threads and caption length
    (``None``: the defaults).

    Raises:
        NoMatchingHeadError: when the folder has no ``itm`` graph.
        RefusedModelError: when it has none of the precision asked.
    """
    settings = settings or RuntimeSettings()
    runtime = graph_runtime(exported, settings, inference_precision="f32")
    precision = "fp32" if settings.precision == "bf16" else settings.precision  # the encoder's bf16 only
    return ExportedPairScorer(exported, runtime, precision, settings.max_seq_length)


def pair_scorer_for(encoder: TorchEncoder) -> TorchPairScorer | None:
    """The pair scorer sharing a PyTorch encoder's model (and its threads); None when the model has no matching
    head (``ModelRuntime.pair_scorer`` calls it for a checkpoint or a preset)."""
    from vlfit.models.itm import has_itm_head

    return TorchPairScorer(encoder) if has_itm_head(encoder.model) else None


def exported_scorer_of(folder: str, settings: RuntimeSettings) -> PairScorer | None:
    """The scorer of an export folder's ``itm`` graph on ``settings``, whether or not the folder's encoder is open
    (``ModelRuntime.pair_scorer`` calls it for an export folder, so its precision, threads and caption length are
    those of the settings, never of which part was asked for first); None without the graph.

    Raises:
        RefusedModelError: for a backend other than the folder's runtime, a caption length longer than the graphs
            take, or a precision the ``itm`` graph was not exported in.
    """
    exported = ExportFolder.open(folder)
    exported.check_backend(settings.backend)
    exported.check_caption_length(settings.max_seq_length)
    if not exported.graph_precisions(ITM_GRAPH):
        return None
    return exported_pair_scorer(exported, settings)
