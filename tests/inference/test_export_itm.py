"""The matching graph (BridgeTower's fused tower and ITM head) in vlfit export: fp32 log-odds equal PyTorch's on
calls unlike the trace example, the INT8 graph's agreement is recorded, the ONNX Runtime pair scorer equals the
PyTorch one, a graph that does not match is refused, and a model without a matching head gets no graph and no
scorer, in one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.inference.openvino_checks import run_openvino_check
from vlfit.cli import main
from vlfit.data.device_stage import normalize_uint8
from vlfit.data.sources.synthetic import synthetic_source
from vlfit.errors import ConfigError
from vlfit.inference import export as export_module
from vlfit.inference import export_itm
from vlfit.inference.export import ExportSettings, export_model
from vlfit.inference.export_itm import agreement_figures, parity_calls
from vlfit.inference.export_samples import load_samples
from vlfit.inference.exported import ExportParityError
from vlfit.inference.identity import RefusedModelError
from vlfit.inference.pair_scorer import (
    ExportedPairScorer,
    NoMatchingHeadError,
    TorchPairScorer,
    pair_scorer_for,
)
from vlfit.inference.runtime import RUNTIME_KINDS, ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.models.itm import pair_scores
from vlfit.models.reference import parse_model_reference

CAPTIONS = ["red", "two blue squares on the left and one green circle at the top of the picture, and more words"]


@pytest.fixture(scope="module")
def itm_export(weighted_itm_checkpoint, synthetic_dataset_dir, tmp_path_factory) -> Path:
    """``vlfit export --quantize int8`` of the checkpoint with a matching head whose run saved a re-ranking weight
    (``itm_checkpoint``'s weights: the tests hold the export against either)."""
    out = tmp_path_factory.mktemp("itm-export") / "onnx"
    assert main(["export", "--model_name_or_path", str(weighted_itm_checkpoint), "--output_dir", str(out), "--quantize",
                 "int8", "--calibration_dataset", synthetic_dataset_dir, "--parity_samples", "13",
                 "--calibration_samples", "16"]) == 0  # fmt: skip
    return out


def _pixels(scorer_or_encoder, n: int, seed: int = 5) -> torch.Tensor:
    return load_samples(synthetic_source(n, seed=seed), scorer_or_encoder.spec).pixels


def _runtime(folder: Path, encoder_first: bool = False, **settings) -> ModelRuntime:
    """The runtime of ``folder`` on ``settings``; ``encoder_first``: its encoder built before anything else is
    asked of it (as serve does; retrieve query asks for the pair scorer first)."""
    runtime = ModelRuntime(parse_model_reference(str(folder), kinds=RUNTIME_KINDS), RuntimeSettings(**settings))
    if encoder_first:
        assert runtime.encoder is not None
    return runtime


# ------------------------------------------------------------------------------------------ fast: PyTorch


def test_torch_scorer_is_pair_scores_and_pairs_by_rows_or_by_position(itm_checkpoint):
    encoder = ModelRuntime.open(str(itm_checkpoint)).encoder
    scorer = pair_scorer_for(encoder)
    assert isinstance(scorer, TorchPairScorer) and (scorer.backend, scorer.precision) == ("torch", "fp32")
    pixels = _pixels(scorer, 3)
    tokens = scorer.spec.tokenize(CAPTIONS)
    text_rows, image_rows = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 1, 0])
    scores = scorer.score_pairs(CAPTIONS, pixels, text_rows, image_rows)
    mean, std = torch.tensor(scorer.spec.image_mean), torch.tensor(scorer.spec.image_std)
    with torch.no_grad():
        expected = pair_scores(encoder.model, (tokens["input_ids"], tokens["attention_mask"]),
                               normalize_uint8(pixels, mean, std, torch.float32), text_rows, image_rows)  # fmt: skip
    assert scores.dtype == torch.float32 and scores.shape == (5,)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert scores.unique().numel() == 5  # the head tells the pairs apart
    # Tokens in place of strings, and pairs by position without rows: the same scores.
    torch.testing.assert_close(scorer.score_pairs(tokens, pixels[:2]), scores[[0, 3]], atol=1e-5, rtol=0)
    torch.testing.assert_close(scorer.score_pairs(CAPTIONS[:1], pixels[:1]), scores[:1], atol=1e-5, rtol=0)
    assert scorer.score_pairs(CAPTIONS, pixels, [], []).shape == (0,)


def test_bad_pair_requests_are_one_line_each(itm_checkpoint):
    scorer = ModelRuntime.open(str(itm_checkpoint)).require_pair_scorer()
    pixels = _pixels(scorer, 2)
    with pytest.raises(ConfigError, match=r"^pair scoring got 2 captions and 1 images; without text_rows"):
        scorer.score_pairs(CAPTIONS, pixels[:1])
    with pytest.raises(ConfigError, match=r"^pair scoring takes text_rows and image_rows together"):
        scorer.score_pairs(CAPTIONS, pixels, [0, 1])
    with pytest.raises(ConfigError, match=r"^text_rows has 2 pairs but image_rows 1"):
        scorer.score_pairs(CAPTIONS, pixels, [0, 1], [0])
    with pytest.raises(ConfigError, match=r"^image_rows must lie in \[0, 2\).*got 0\.\.2$"):
        scorer.score_pairs(CAPTIONS, pixels, [0, 1], [0, 2])
    with pytest.raises(ConfigError, match=r"^pair scoring takes uint8 pixels \[N, 3, 64, 64\], got torch.float32"):
        scorer.score_pairs(CAPTIONS, pixels.float())
    with pytest.raises(ConfigError, match=r"^unknown --backend 'tensorrt'; choose one of"):
        ModelRuntime.open(str(itm_checkpoint), RuntimeSettings(backend="tensorrt")).require_pair_scorer()
    with pytest.raises(ConfigError, match=r"openvino"):  # a checkpoint runs on torch; exports run on openvino
        ModelRuntime.open(str(itm_checkpoint), RuntimeSettings(backend="openvino")).require_pair_scorer()


def test_a_checkpoint_without_a_matching_head_has_no_scorer(tiny_checkpoint):
    assert pair_scorer_for(ModelRuntime.open(str(tiny_checkpoint)).encoder) is None
    with pytest.raises(
        NoMatchingHeadError,
        match=r"has no image-text matching head; re-ranking needs a model with "
        r"an image-text matching head: train one with vlfit train --objective contrastive\+itm",
    ):
        ModelRuntime.open(str(tiny_checkpoint)).require_pair_scorer()  # fmt: skip


def test_pytorch_parts_run_on_the_runtimes_threads_and_leave_the_process_its_own(itm_checkpoint):
    before = torch.get_num_threads()
    runtime = _runtime(itm_checkpoint, num_threads=before + 1)
    scorer = runtime.require_pair_scorer()
    assert torch.get_num_threads() == before  # opening the model sets nothing for the process
    seen: list[tuple[str, int]] = []
    for name, module in (("text", runtime.encoder.text_tower), ("pairs", scorer.graph)):
        module.register_forward_pre_hook(lambda _, args, name=name: seen.append((name, torch.get_num_threads())))
    runtime.embed_texts(CAPTIONS)
    scorer.score_pairs(CAPTIONS[:1], _pixels(scorer, 1))
    assert seen == [("text", before + 1), ("pairs", before + 1)] and torch.get_num_threads() == before


def test_agreement_counts_swapped_candidates_beyond_ties_only():
    reference = torch.tensor([[3.0, 2.0, 1.0, 0.0], [1.0, 1.00001, 0.0, -1.0]])
    figures = agreement_figures(reference, torch.tensor([[3.0, 1.0, 2.0, 0.0], [1.00001, 1.0, 0.0, -1.0]]), 1e-4)
    assert figures["discordant_pairs"] == 1  # row 0's middle pair; row 1's swap is a tie
    assert figures["same_order"] == 0.0 and figures["top1_agreement"] == 0.5
    assert figures["max_abs_diff"] == pytest.approx(1.0)
    assert agreement_figures(reference, reference + 0.5)["discordant_pairs"] == 0
    assert agreement_figures(reference, reference + 0.5)["spearman"] == pytest.approx(1.0)


def test_parity_calls_hold_each_image_once_and_sizes_unlike_the_trace_example():
    calls = list(parity_calls(13, 8))
    assert [len(queries) for queries, _, _ in calls] == [1, 3, 3, 3, 3]
    for queries, images, rows in calls:
        assert images.unique().numel() == images.numel()  # each image once per call
        assert torch.equal(images[rows], (queries[:, None] + torch.arange(8)) % 13)  # each caption's candidates
    assert {(len(q), len(i), r.numel()) for q, i, r in calls}.isdisjoint({(2, 3, 5)})


# ------------------------------------------------------------------------------------------ slow: exports


@pytest.mark.slow
def test_itm_graph_matches_pytorch_and_its_int8_agreement_is_recorded(itm_export, itm_checkpoint):
    manifest = json.loads((itm_export / "export_manifest.json").read_text())
    assert manifest["graphs"]["itm"] == {"fp32": "itm.onnx", "int8": "itm.int8.onnx"}
    assert [i["name"] for i in manifest["inputs"]["itm"]] == ["input_ids", "attention_mask", "pixels", "text_rows",
                                                              "image_rows"]  # fmt: skip
    assert manifest["itm_output"] == {"name": "match_log_odds", "dtype": "float32", "shape": ["pairs"]}
    assert manifest["quantization"]["itm"] == "onnxruntime dynamic (MatMul)"
    parity = manifest["parity"]["itm"]
    assert (parity["queries"], parity["candidates"], parity["tolerance"]) == (13, 8, 1e-3)
    assert parity["fp32"]["max_abs_diff"] <= 1e-5 and parity["fp32"]["discordant_pairs"] == 0  # 3e-07 measured
    assert parity["fp32"]["same_order"] == 1.0 and parity["fp32"]["reference_std"] > 0.01
    int8 = parity["int8"]
    assert set(int8) == set(parity["fp32"])
    assert 0 < int8["max_abs_diff"] < 0.05 and int8["spearman"] > 0.95  # 0.0114 and 0.9945 measured

    # The ONNX Runtime scorer equals the PyTorch one on pairs unlike the parity check's (2 captions x 5 images).
    onnx = ModelRuntime.open(str(itm_export), RuntimeSettings(precision="fp32")).require_pair_scorer()
    torch_scorer = ModelRuntime.open(str(itm_checkpoint)).require_pair_scorer()
    assert isinstance(onnx, ExportedPairScorer) and (onnx.backend, onnx.precision) == ("onnxruntime", "fp32")
    pixels = _pixels(onnx, 5, seed=7)
    rows = (torch.arange(2).repeat_interleave(5), torch.arange(5).repeat(2))
    expected = torch_scorer.score_pairs(CAPTIONS, pixels, *rows)
    torch.testing.assert_close(onnx.score_pairs(CAPTIONS, pixels, *rows), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(onnx.score_pairs(CAPTIONS[:1], pixels[:1]), expected[:1], atol=1e-4, rtol=0)
    int8_scorer = ModelRuntime.open(str(itm_export)).pair_scorer  # precision auto: the itm graph's INT8
    assert isinstance(int8_scorer, ExportedPairScorer) and int8_scorer.precision == "int8"
    assert (int8_scorer.score_pairs(CAPTIONS, pixels, *rows) - expected).abs().max() < 0.05
    refusal = r"holds onnx graphs, which run on onnxruntime, not torch; .* or pass the checkpoint it was exported from"
    with pytest.raises(ConfigError, match=refusal):
        ModelRuntime.open(str(itm_export), RuntimeSettings(backend="torch")).require_pair_scorer()


@pytest.mark.slow
def test_an_openvino_export_scores_pairs_as_pytorch_does(itm_checkpoint, itm_export, tmp_path):
    # Export and scoring in a process of its own: OpenVINO's runtime threads, left in a test process, crashed an
    # unrelated test later in the same process. Its ONNX graphs are itm_export's, not traced again.
    out = tmp_path / "openvino"
    scored = run_openvino_check("pair", str(itm_checkpoint), str(itm_export), str(out))
    manifest = scored["manifest"]
    assert manifest["graphs"]["itm"] == {"fp32": "itm.xml", "int8": "itm.int8.xml"}
    assert manifest["quantization"]["itm"] == "nncf compress_weights (int8_asym)"
    parity = manifest["parity"]["itm"]
    assert parity["fp32"]["max_abs_diff"] <= 1e-4 and parity["fp32"]["discordant_pairs"] == 0
    assert 0 < parity["int8"]["max_abs_diff"] < 0.05 and parity["int8"]["spearman"] > 0.95
    assert not (out / "onnx").exists() and not list(out.glob("*.onnx"))

    assert scored["fp32"] == [True, "openvino", "fp32"] and scored["fp32_max_diff"] < 1e-4
    assert scored["int8"] == [True, "int8"] and scored["int8_max_diff"] < 0.05  # beside the INT8 encoder
    expected = r"holds openvino graphs, which run on openvino, not onnxruntime; .*--format onnx"
    assert re.search(expected, scored["refusal"]), scored["refusal"]


@pytest.mark.slow
def test_a_model_without_a_matching_head_gets_no_itm_graph_and_its_scorer_is_refused(onnx_export):
    manifest = json.loads((onnx_export / "export_manifest.json").read_text())
    assert "itm" not in manifest["graphs"] and "itm" not in manifest["parity"]
    assert not list(onnx_export.glob("itm*"))
    assert ModelRuntime.open(str(onnx_export)).pair_scorer is None
    with pytest.raises(
        NoMatchingHeadError,
        match=r"has no image-text matching graph \(itm.onnx\): its checkpoint "
        r"has no matching head.*re-ranking needs a model with an image-text matching head",
    ):
        ModelRuntime.open(str(onnx_export)).require_pair_scorer()  # fmt: skip


@pytest.mark.slow
def test_an_itm_graph_that_does_not_match_its_checkpoint_is_not_written(itm_checkpoint, itm_export, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    # The graphs are the export's above (their tracing is tested there), copied instead of traced again; the
    # checkpoint they are held against says "match" a little more for every pair: parity must catch it.
    def copy_towers(loaded, folder, opset):
        return {t: shutil.copy(itm_export / f"{t}.onnx", f"{folder}/{t}.onnx") for t in ("image", "text")}

    def copy_itm(graph, path, *args):
        shutil.copy(itm_export / "itm.onnx", path)

    monkeypatch.setattr(export_module, "export_onnx_towers", copy_towers)
    monkeypatch.setattr(export_itm, "export_onnx_itm", copy_itm)
    loaded = ModelRuntime.open(str(itm_checkpoint)).encoder
    with torch.no_grad():
        loaded.model.itm_score.fc.bias[1] += 0.01
    samples = load_samples(synthetic_source(5), loaded.spec)
    out = tmp_path / "refused"
    with pytest.raises(
        ExportParityError,
        match=r"^the exported fp32 itm graph's matching log-odds differ from "
        r"PyTorch's: largest difference 0\.0100\d+ \(at most 0\.001 allowed\), 0 candidate pairs "
        r"ordered otherwise, on 25 pairs of 5 captions; nothing was written$",
    ):
        export_model(loaded, str(out), ExportSettings(), parity_samples=samples)  # fmt: skip
    assert list(out.iterdir()) == []
    # A tolerance the difference is within (vlfit export --itm_tolerance) lets it through.
    export_model(loaded, str(out), ExportSettings(itm_tolerance=0.02), parity_samples=samples)
    assert (out / "itm.onnx").is_file()
    with pytest.raises(ConfigError, match=r"^--itm_tolerance must be above 0 \(a largest log-odds difference\), got 0"):
        ExportSettings(itm_tolerance=0)


@pytest.mark.slow
def test_the_matching_head_runs_on_the_threads_and_spinning_of_its_runtime(itm_export, itm_checkpoint):
    runtime = ModelRuntime.open(str(itm_export), RuntimeSettings(num_threads=1, allow_spinning=False))
    for session in (runtime.pair_scorer.graphs["itm"], runtime.encoder.graphs["text"]):
        options = session.get_session_options()
        assert options.intra_op_num_threads == 1
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    checkpoint = _runtime(itm_checkpoint, num_threads=2)
    assert isinstance(checkpoint.pair_scorer, TorchPairScorer) and checkpoint.pair_scorer.num_threads == 2


@pytest.mark.slow
@pytest.mark.parametrize("encoder_first", [False, True], ids=["scorer-first", "encoder-first"])
def test_an_exports_pair_scorer_has_one_precision_whichever_part_is_asked_first(itm_export, tmp_path,
                                                                                encoder_first):  # fmt: skip
    # A copy of the export whose itm graph has no INT8 (its towers do).
    fp32_itm = tmp_path / "fp32-itm"
    shutil.copytree(itm_export, fp32_itm)
    manifest = json.loads((fp32_itm / "export_manifest.json").read_text())
    del manifest["graphs"]["itm"]["int8"]
    (fp32_itm / "export_manifest.json").write_text(json.dumps(manifest))

    assert _runtime(itm_export, encoder_first).require_pair_scorer().precision == "int8"  # auto: INT8 exported
    assert _runtime(fp32_itm, encoder_first).require_pair_scorer().precision == "fp32"  # auto: the itm graph's
    assert _runtime(fp32_itm, encoder_first, precision="fp32").require_pair_scorer().precision == "fp32"
    with pytest.raises(RefusedModelError, match=r"fp32-itm: no int8 itm graph \(it has: fp32\); export with "
                       r"--quantize int8 first$"):  # fmt: skip
        _runtime(fp32_itm, encoder_first, precision="int8").require_pair_scorer()


@pytest.mark.slow
@pytest.mark.parametrize("encoder_first", [False, True], ids=["scorer-first", "encoder-first"])
def test_the_matching_head_cuts_captions_at_the_runtimes_max_seq_length(itm_export, itm_checkpoint, encoder_first):
    for folder in (itm_checkpoint, itm_export):
        runtime = _runtime(folder, encoder_first, precision="fp32", max_seq_length=4)
        scorer = runtime.require_pair_scorer()
        tokens = scorer.spec.tokenize(CAPTIONS)
        assert tokens["input_ids"].shape[1] == 4
        torch.testing.assert_close(tokens, runtime.encoder.tokenize(CAPTIONS))  # the head's cut is the encoder's
        whole = _runtime(folder, precision="fp32").require_pair_scorer()
        pixels, rows = _pixels(scorer, 2), ([1, 1], [0, 1])
        cut = scorer.score_pairs(CAPTIONS, pixels, *rows)
        torch.testing.assert_close(cut, whole.score_pairs(tokens, pixels, *rows))
        assert not torch.allclose(cut, whole.score_pairs(CAPTIONS, pixels, *rows))  # the cut changes the scores


@pytest.mark.slow
def test_an_export_keeps_the_runs_rerank_weight(itm_export, itm_checkpoint):
    import vlfit

    assert vlfit.load(str(itm_export)).rerank_weight == 4.0  # what re-ranking through the export fuses with by default
    assert ModelRuntime.open(str(itm_export)).rerank_score().weight == 4.0
    assert vlfit.load(str(itm_checkpoint)).rerank_weight is None  # a run that saved none: ITM alone
