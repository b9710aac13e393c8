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
``pair_scorer``, on the threads and precision of its encoder): ``pair_scorer_for`` gives the scorer beside an encoder
already open, ``exported_scorer_of`` an export folder's without its encoder. A model without a matching head has no
scorer: both return None and ``ModelRuntime.require_pair_scorer`` refuses it in one line (``NoMatchingHeadError``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from vlfit.errors import ConfigError
from vlfit.extras import require_extra
from vlfit.inference.backends import (
    Encoder,
    OnnxRuntimeEncoder,
    OpenVinoEncoder,
    TorchEncoder,
    onnx_session,
    openvino_model,
)
from vlfit.inference.exported import ExportFolder, graph_name
from vlfit.inference.identity import RefusedModelError
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.inference.towers import IMAGE_INPUT, TEXT_INPUTS
from vlfit.models.family import InputSpec

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


class PairScorer(ABC):
    """Scores (caption, image) pairs by the matching head.

    Attributes:
        backend: ``torch``, ``onnxruntime`` or ``openvino``.
        precision: ``fp32`` or ``int8`` (PyTorch: ``fp32``).
        model_path: The checkpoint or export folder.
        spec: Image size, mean, std, tokenizer and caption length.
    """

    backend: str
    precision: str
    model_path: str
    spec: InputSpec

    @abstractmethod
    def score_tokens(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixels: torch.Tensor,
        text_rows: torch.Tensor,
        image_rows: torch.Tensor,
    ) -> torch.Tensor:
        """``PairScoringGraph``'s inputs, checked -> float32 log-odds ``[P]`` on the CPU."""

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

    @property
    def description(self) -> str:
        return f"pair scorer {self.model_path} on {self.backend} ({self.precision})"


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
    """A loaded model with a matching head on PyTorch (fp32, eval mode).

    Args:
        encoder: The model's ``TorchEncoder`` (its model and spec; the scorer shares the model, not a copy).

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
        self.graph = PairScoringGraph(encoder.model, encoder.spec).eval()

    @torch.inference_mode()
    def score_tokens(self, input_ids, attention_mask, pixels, text_rows, image_rows) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return self.graph(input_ids, attention_mask, pixels, text_rows, image_rows)


class _ExportedPairScorer(PairScorer):
    """The ``itm`` graph of an export folder, of the precision asked (``auto``: INT8 when exported).

    Raises:
        NoMatchingHeadError: when the folder has no ``itm`` graph.
        RefusedModelError: when it has none of ``precision``.
    """

    def __init__(self, exported: ExportFolder, precision: str = "auto") -> None:
        precisions = exported_itm_precisions(exported)
        if not precisions:
            raise no_matching_head(exported.path, exported)
        if precision == "auto":
            precision = "int8" if "int8" in precisions else "fp32"
        self.precision = precision
        self.model_path = exported.path
        self.exported = exported
        self.spec = exported.input_spec()

    def _feeds(self, values: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
        return {name: np.ascontiguousarray(value.numpy()) for name, value in zip(ITM_INPUTS, values, strict=True)}


class OnnxRuntimePairScorer(_ExportedPairScorer):
    """The ``itm`` graph of an exported ONNX folder on ONNX Runtime's CPU provider.

    Args:
        exported: The export folder.
        precision: ``fp32``, ``int8`` or ``auto`` (INT8 when exported).
        num_threads: Intra-op threads (``None``: ONNX Runtime's default).
        allow_spinning: Let idle intra-op threads spin-wait for the next call (see ``OnnxRuntimeEncoder``).
    """

    backend = "onnxruntime"

    def __init__(
        self,
        exported: ExportFolder,
        precision: str = "auto",
        num_threads: int | None = None,
        allow_spinning: bool = True,
    ) -> None:
        require_extra("export", "the onnxruntime backend", ("onnxruntime",))
        super().__init__(exported, precision)
        self.session = onnx_session(exported.graph_path(ITM_GRAPH, self.precision), num_threads, allow_spinning)

    def score_tokens(self, input_ids, attention_mask, pixels, text_rows, image_rows) -> torch.Tensor:  # type: ignore[no-untyped-def]
        (out,) = self.session.run(None, self._feeds((input_ids, attention_mask, pixels, text_rows, image_rows)))
        return torch.from_numpy(out)


class OpenVinoPairScorer(_ExportedPairScorer):
    """The ``itm`` graph of an exported OpenVINO folder on the CPU plugin, computing in f32 (the precision its
    parity was checked in).

    Args:
        exported: The export folder.
        precision: ``fp32``, ``int8`` or ``auto`` (INT8 when exported).
        num_threads: ``INFERENCE_NUM_THREADS`` (``None``: the plugin's default).
    """

    backend = "openvino"

    def __init__(self, exported: ExportFolder, precision: str = "auto", num_threads: int | None = None) -> None:
        require_extra("export", "the openvino backend", ("openvino",))  # before the folder is read
        super().__init__(exported, precision)
        self.compiled = openvino_model(exported.graph_path(ITM_GRAPH, self.precision), "f32", num_threads)

    def score_tokens(self, input_ids, attention_mask, pixels, text_rows, image_rows) -> torch.Tensor:  # type: ignore[no-untyped-def]
        feeds = self._feeds((input_ids, attention_mask, pixels, text_rows, image_rows))
        return torch.from_numpy(np.asarray(self.compiled(feeds)[self.compiled.output(0)], dtype=np.float32))


def exported_pair_scorer(
    exported: ExportFolder, precision: str = "auto", *, num_threads: int | None = None, allow_spinning: bool = True
) -> PairScorer:
    """The scorer of an export folder's ``itm`` graph on the folder's runtime (ONNX Runtime or OpenVINO)."""
    if exported.runtime == "openvino":
        return OpenVinoPairScorer(exported, precision, num_threads=num_threads)
    return OnnxRuntimePairScorer(exported, precision, num_threads=num_threads, allow_spinning=allow_spinning)


def exported_itm_precisions(exported: ExportFolder) -> tuple[str, ...]:
    """The precisions of the folder's ``itm`` graph (none: the folder cannot score pairs)."""
    graphs = exported.manifest.get("graphs", {}).get(ITM_GRAPH, {})
    return tuple(precision for precision in ("fp32", "int8") if graphs.get(precision))


def pair_scorer_for(
    encoder: Encoder, *, num_threads: int | None = None, allow_spinning: bool = True
) -> PairScorer | None:
    """The pair scorer beside an open encoder, on the same backend; None when its model has no matching head
    (``ModelRuntime.pair_scorer`` calls it with the runtime's threads).

    A PyTorch encoder's scorer shares its model; an ONNX Runtime encoder's scorer runs the folder's ``itm`` graph
    of the encoder's precision (fp32 when that precision has none), an OpenVINO encoder's the same on OpenVINO.
    """
    if isinstance(encoder, TorchEncoder):
        from vlfit.models.itm import has_itm_head

        return TorchPairScorer(encoder) if has_itm_head(encoder.model) else None
    if isinstance(encoder, (OnnxRuntimeEncoder, OpenVinoEncoder)):
        precisions = exported_itm_precisions(encoder.exported)
        if not precisions:
            return None
        precision = encoder.precision if encoder.precision in precisions else "fp32"
        return exported_pair_scorer(encoder.exported, precision, num_threads=num_threads, allow_spinning=allow_spinning)
    return None


def exported_scorer_of(folder: str, settings: RuntimeSettings) -> PairScorer | None:
    """The scorer of an export folder's ``itm`` graph on ``settings`` (its backend checked against the folder's
    runtime, its precision ``auto``: INT8 when exported), without opening the folder's encoder; None without the
    graph."""
    exported = ExportFolder.open(folder)
    exported.check_backend(settings.backend)
    if not exported_itm_precisions(exported):
        return None
    return exported_pair_scorer(
        exported, settings.precision, num_threads=settings.num_threads, allow_spinning=settings.allow_spinning
    )
