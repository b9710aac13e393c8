"""``vlfit export``'s matching graph: BridgeTower's fused tower and ITM head as ``itm.onnx`` (or, with ``--format
openvino``, that graph converted to ``itm.xml``), checked against PyTorch.

Where the graph is cut. Re-ranking has, for each query, the query (a caption or an image) and its K candidates, as
tokens and uint8 pixels. The cross-modal layers read the unimodal encoders' states at every bridged depth
(``vlfit.models.itm.UnimodalStates``: C x T x H floats per caption, C x P x H per image, about 6 MB per image for
bridgetower-base), which neither the index nor the exported towers hold: caching them for every indexed image would
dwarf the index, and exposing them from the tower graphs would change what every encoder runs. So the graph takes
raw inputs, as the towers do, but pairs them by rows, as ``vlfit.models.itm.pair_scores`` does::

    input_ids, attention_mask  int64 [texts, sequence]    the captions (padded to the longest)
    pixels                     uint8 [images, 3, S, S]    the images (normalized inside, as the image tower does)
    text_rows, image_rows      int64 [pairs]              pair i = (caption text_rows[i], image image_rows[i])
    -> match_log_odds          float32 [pairs]            match - no-match logit of the ITM head

Each caption and image runs its unimodal encoder once per call however many pairs it is in, and the cross-modal
layers once per pair: re-ranking K images for one caption runs the text encoder once, not K times (and K captions
for one image, the vision encoder once). All four axes are dynamic.

Checks, in the export's staging folder: on the parity samples, each caption is a query against K candidate images
(its own and the next ones), scored in calls whose caption, image and pair counts differ from the trace example's.
The fp32 graph is refused (``ExportParityError``) when any log-odds differs from PyTorch's ``pair_scores`` by more
than the tolerance, or when it orders two of a query's candidates otherwise than PyTorch does while PyTorch's
log-odds of the two differ by more than ``TIE_TOLERANCE``. The INT8 graph (dynamic quantization, as the text
tower's) is measured, not refused: its largest difference, Spearman correlation per query and top-1 agreement go
into the manifest.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vlfit.data.device_stage import normalize_uint8
from vlfit.inference.backends import TorchEncoder
from vlfit.inference.export_samples import Samples
from vlfit.inference.exported import ExportFolder, ExportParityError, graph_name
from vlfit.inference.itm_graph import PairScoringGraph
from vlfit.inference.pair_scorer import ITM_GRAPH, ITM_INPUTS, ITM_OUTPUT, exported_pair_scorer
from vlfit.inference.quantize import compress_openvino_weights, convert_to_openvino, quantize_onnx_dynamic
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.inference.towers import IMAGE_INPUT, TEXT_INPUTS
from vlfit.models.itm import pair_scores

logger = logging.getLogger(__name__)

# Two candidates whose PyTorch log-odds are this close are a tie: the graph may order them either way.
TIE_TOLERANCE = 1e-4
# Candidate images per caption in the parity check.
ITM_CANDIDATES = 8
# Captions per call in the parity check: one, then several (the trace example has 2 captions, 3 images, 5 pairs).
QUERY_BATCH_SIZES = (1, 3)
EXAMPLE_TEXTS, EXAMPLE_IMAGES, EXAMPLE_TOKENS = 2, 3, 9
EXAMPLE_TEXT_ROWS, EXAMPLE_IMAGE_ROWS = (0, 0, 1, 1, 0), (0, 1, 2, 0, 2)
QUANTIZATION_METHODS = {"onnx": "onnxruntime dynamic (MatMul)", "openvino": "nncf compress_weights (int8_asym)"}


# ----------------------------------------------------------------------------------------------- tracing


def export_onnx_itm(graph: PairScoringGraph, path: str, image_size: int, vocabulary: int, max_seq_length: int,
                    opset: int) -> None:  # fmt: skip
    """Trace ``graph`` into ``path`` with the texts, images, sequence and pairs axes dynamic."""
    texts, images = torch.export.Dim("texts"), torch.export.Dim("images")
    sequence, pairs = torch.export.Dim("sequence", max=max_seq_length), torch.export.Dim("pairs")
    input_ids = torch.randint(0, vocabulary, (EXAMPLE_TEXTS, EXAMPLE_TOKENS))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, EXAMPLE_TOKENS // 2 :] = 0
    pixels = torch.randint(0, 256, (EXAMPLE_IMAGES, 3, image_size, image_size), dtype=torch.uint8)
    text_rows, image_rows = torch.tensor(EXAMPLE_TEXT_ROWS), torch.tensor(EXAMPLE_IMAGE_ROWS)
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="# The axis name: .* will not be used", category=UserWarning)
        program = torch.onnx.export(
            graph,
            (input_ids, attention_mask, pixels, text_rows, image_rows),
            input_names=list(ITM_INPUTS),
            output_names=[ITM_OUTPUT],
            dynamic_shapes=(
                {0: texts, 1: sequence},
                {0: texts, 1: sequence},
                {0: images},
                {0: pairs},
                {0: pairs},
            ),
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )
        program.save(path)


def itm_manifest_entries(image_size: int) -> dict[str, Any]:
    """The graph's inputs and output as the manifest lists them."""
    text_shape = ["texts", "sequence"]
    return {
        "inputs": [
            *({"name": name, "dtype": "int64", "shape": text_shape} for name in TEXT_INPUTS),
            {"name": IMAGE_INPUT, "dtype": "uint8", "shape": ["images", 3, image_size, image_size]},
            *({"name": name, "dtype": "int64", "shape": ["pairs"]} for name in ITM_INPUTS[3:]),
        ],
        "output": {"name": ITM_OUTPUT, "dtype": "float32", "shape": ["pairs"]},
    }


# ---------------------------------------------------------------------------------------------- measuring

ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def parity_calls(num_samples: int, candidates: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The parity check's calls: (captions, images, image rows of each caption's candidates ``[q, K]``).

    Caption ``i`` is a query against images ``i, i+1, ... i+K-1`` (mod N); each call holds the captions of one
    ``QUERY_BATCH_SIZES`` batch and the union of their candidates, once each.
    """
    start, call = 0, 0
    while start < num_samples:
        size = QUERY_BATCH_SIZES[min(call, len(QUERY_BATCH_SIZES) - 1)]
        queries = torch.arange(start, min(start + size, num_samples))
        wanted = (queries[:, None] + torch.arange(candidates)[None, :]) % num_samples
        images, rows = torch.unique(wanted, return_inverse=True)
        yield queries, images, rows
        start, call = start + size, call + 1


def score_parity_pairs(samples: Samples, tokenize: Callable[[list[str]], dict[str, torch.Tensor]], score: ScoreFn,
                       candidates: int) -> torch.Tensor:  # fmt: skip
    """Log-odds ``[N, K]`` of each sample's caption against its ``K`` candidate images (``parity_calls``)."""
    scores = []
    for queries, images, rows in parity_calls(len(samples), candidates):
        tokens = tokenize([samples.captions[int(q)] for q in queries])
        text_rows = torch.arange(len(queries)).repeat_interleave(rows.shape[1])
        pixels = samples.pixels[images].contiguous()
        out = score(tokens["input_ids"], tokens["attention_mask"], pixels, text_rows, rows.reshape(-1))
        scores.append(out.float().reshape(rows.shape))
    return torch.cat(scores)


def torch_reference_scores(loaded: TorchEncoder, samples: Samples, candidates: int) -> torch.Tensor:
    """PyTorch's log-odds of the parity pairs, by ``vlfit.models.itm.pair_scores`` on the loaded model."""
    spec = loaded.spec
    mean, std = torch.tensor(spec.image_mean), torch.tensor(spec.image_std)

    @torch.inference_mode()
    def score(input_ids, attention_mask, pixels, text_rows, image_rows):  # type: ignore[no-untyped-def]
        normalized = normalize_uint8(pixels, mean, std, torch.float32)
        return pair_scores(loaded.model, (input_ids, attention_mask), normalized, text_rows, image_rows)

    return score_parity_pairs(samples, loaded.tokenize, score, candidates)


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    return scores.argsort(dim=1).argsort(dim=1).double()


def agreement_figures(reference: torch.Tensor, other: torch.Tensor, tie_tolerance: float = TIE_TOLERANCE
                      ) -> dict[str, float]:  # fmt: skip
    """How ``other``'s log-odds ``[Q, K]`` agree with ``reference``'s, per query row.

    Returns:
        ``max_abs_diff``, ``mean_abs_diff``; ``discordant_pairs``: pairs of one query's candidates ordered the other
        way round although the reference's log-odds differ by more than ``tie_tolerance``; ``same_order``: share of
        queries whose candidates are in the same order; ``top1_agreement``: share with the same best candidate;
        ``spearman``: mean rank correlation per query; ``reference_std``: the reference log-odds' spread, the scale
        the differences compare with.
    """
    reference, other = reference.double(), other.double()
    diff = (other - reference).abs()
    gap = reference[:, :, None] - reference[:, None, :]
    flipped = (gap * (other[:, :, None] - other[:, None, :])) < 0
    discordant = int((flipped & (gap.abs() > tie_tolerance)).sum()) // 2
    ranks, other_ranks = _ranks(reference), _ranks(other)
    centred, other_centred = ranks - ranks.mean(1, keepdim=True), other_ranks - other_ranks.mean(1, keepdim=True)
    spearman = (centred * other_centred).sum(1) / (centred.norm(dim=1) * other_centred.norm(dim=1)).clamp_min(1e-12)
    return {
        "max_abs_diff": round(float(diff.max()), 7),
        "mean_abs_diff": round(float(diff.mean()), 7),
        "discordant_pairs": discordant,
        "same_order": round(float((ranks == other_ranks).all(dim=1).double().mean()), 4),
        "top1_agreement": round(float((reference.argmax(1) == other.argmax(1)).double().mean()), 4),
        "spearman": round(float(spearman.mean()), 6),
        "reference_std": round(float(reference.std()), 6),
    }


# ------------------------------------------------------------------------------------------------ the export


def export_itm_graph(
    loaded: TorchEncoder,
    staging: str,
    manifest: dict[str, Any],
    *,
    opset: int,
    quantize: bool,
    samples: Samples,
    tolerance: float,
    fmt: str = "onnx",
    onnx_dir: str | None = None,
) -> None:
    """Trace the matching graph of ``loaded`` (a model with an ITM head) into ``staging``, check its fp32 parity
    and, with ``quantize``, write and measure its INT8 graph; the manifest gets its graphs, inputs and figures.

    Args:
        loaded: The checkpoint on PyTorch.
        staging: The export's staging folder (its tokenizer saved already).
        manifest: The export's manifest, completed here.
        opset: ONNX opset.
        quantize: Also write ``itm.int8.onnx``.
        samples: The parity samples.
        tolerance: Largest fp32 log-odds difference to PyTorch accepted (``ExportSettings.itm_tolerance``).
        fmt: ``onnx``, or ``openvino``: the traced graph (in ``onnx_dir``) converted to ``itm.xml``, its INT8 by
            NNCF's INT8 weight compression, as the text tower's.
        onnx_dir: Where the ONNX graph is traced for ``openvino`` (``staging`` when None).

    Raises:
        ExportParityError: when the fp32 graph's log-odds differ from PyTorch's by more than ``tolerance``, or it
            orders a query's candidates otherwise (beyond ties).
    """
    spec = loaded.spec
    started = time.perf_counter()
    traced = os.path.join(onnx_dir or staging, graph_name(ITM_GRAPH, "fp32", "onnx"))
    graph = PairScoringGraph(loaded.model, spec).eval()
    export_onnx_itm(graph, traced, spec.image_size, len(spec.tokenizer), spec.max_seq_length, opset)
    fp32 = os.path.join(staging, graph_name(ITM_GRAPH, "fp32", fmt))
    if fmt == "openvino":
        convert_to_openvino(traced, fp32)
    manifest["graphs"][ITM_GRAPH] = {"fp32": os.path.basename(fp32)}
    entries = itm_manifest_entries(spec.image_size)
    manifest["inputs"][ITM_GRAPH], manifest["itm_output"] = entries["inputs"], entries["output"]
    seconds = time.perf_counter() - started

    candidates = min(ITM_CANDIDATES, len(samples))
    reference = torch_reference_scores(loaded, samples, candidates)
    parity: dict[str, Any] = {
        "queries": len(samples),
        "candidates": candidates,
        "tolerance": tolerance,
        "tie_tolerance": TIE_TOLERANCE,
    }
    scores = _graph_scores(staging, manifest, "fp32", samples, candidates)
    parity["fp32"] = agreement_figures(reference, scores)
    worst, discordant = parity["fp32"]["max_abs_diff"], parity["fp32"]["discordant_pairs"]
    if worst > tolerance or discordant:
        raise ExportParityError(
            f"the exported fp32 {ITM_GRAPH} graph's matching log-odds differ from PyTorch's: largest difference "
            f"{worst:.6f} (at most {tolerance} allowed), {discordant} candidate pairs ordered otherwise, on "
            f"{reference.numel()} pairs of {len(samples)} captions; nothing was written"
        )
    if quantize:
        started = time.perf_counter()
        int8 = os.path.join(staging, graph_name(ITM_GRAPH, "int8", fmt))
        if fmt == "openvino":
            compress_openvino_weights(fp32, int8)
        else:
            quantize_onnx_dynamic(fp32, int8)
        manifest["graphs"][ITM_GRAPH]["int8"] = os.path.basename(int8)
        manifest.setdefault("quantization", {})[ITM_GRAPH] = QUANTIZATION_METHODS[fmt]
        seconds += time.perf_counter() - started
        parity["int8"] = agreement_figures(reference, _graph_scores(staging, manifest, "int8", samples, candidates))
    parity["export_seconds"] = round(seconds, 1)
    manifest.setdefault("parity", {})[ITM_GRAPH] = parity


def _graph_scores(staging: str, manifest: dict[str, Any], precision: str, samples: Samples, candidates: int
                  ) -> torch.Tensor:  # fmt: skip
    scorer = exported_pair_scorer(ExportFolder(staging, manifest), RuntimeSettings(precision=precision))
    return score_parity_pairs(samples, scorer.spec.tokenize, scorer.score_tokens, candidates)
