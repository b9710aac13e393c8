"""vlfit export: graphs that match PyTorch on batches and caption lengths unlike the export example's, INT8 graphs
that load and run, a manifest that says what was exported, and refusal of graphs that do not match."""

import json
import re
import shutil

import pytest
import torch

from tests.inference.openvino_checks import min_cosine_against_torch, run_openvino_check
from vlfit.cli import main
from vlfit.data.sources.synthetic import synthetic_source
from vlfit.efficiency.cpu import cpu_info
from vlfit.inference import export as export_module
from vlfit.inference.export_samples import load_samples
from vlfit.inference.identity import RefusedModelError, checkpoint_fingerprint
from vlfit.inference.runtime import ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings

pytestmark = pytest.mark.slow


def error_lines(stderr: str) -> list[str]:
    """The error lines of stderr (``vlfit <command>: error: ...``), without the log lines and progress bars before
    them (one left without its newline when the error stopped it ends on the error's line)."""
    return re.findall(r"vlfit [\w-]+: error: [^\r\n]*", stderr)


def _check_against_torch(encoder, reference, pixels: torch.Tensor, min_cosine: float) -> None:
    assert min_cosine_against_torch(encoder, reference, pixels) >= min_cosine


def test_onnx_export_matches_pytorch_and_its_int8_graphs_run(onnx_export, tiny_checkpoint):
    manifest = json.loads((onnx_export / "export_manifest.json").read_text())
    assert manifest["identity"] == {"family": "bridgetower", "embedding_size": 64,
                                    "checkpoint_sha256": checkpoint_fingerprint(str(tiny_checkpoint))}  # fmt: skip
    assert manifest["inputs"]["image"] == [{"name": "pixels", "dtype": "uint8", "shape": ["batch", 3, 64, 64]}]
    assert [i["name"] for i in manifest["inputs"]["text"]] == ["input_ids", "attention_mask"]
    assert manifest["opset"] == 18 and manifest["libraries"]["onnxruntime"] != "missing"
    assert manifest["parity"]["samples"] == 13 and manifest["parity"]["int8"]["calibration_samples"] == 16
    for tower in ("image", "text"):
        assert manifest["parity"]["fp32"][tower]["min_cosine"] >= 0.9999
        assert manifest["parity"]["int8"][tower]["min_cosine"] >= 0.999  # 0.9997 and 0.9999 measured
    assert set(manifest["accuracy"]["int8_change"]) == {"t2i_recall@1", "t2i_recall@5"}

    reference = ModelRuntime.open(str(tiny_checkpoint)).encoder
    pixels = load_samples(synthetic_source(6, seed=5), reference.spec).pixels
    _check_against_torch(
        ModelRuntime.open(str(onnx_export), RuntimeSettings(precision="fp32")).encoder, reference, pixels, 0.9999
    )
    int8 = ModelRuntime.open(str(onnx_export)).encoder
    with pytest.raises(RefusedModelError, match=r"holds onnx graphs, which run on onnxruntime, not openvino; .*"
                       r"or export with --format openvino$"):  # fmt: skip
        _ = ModelRuntime.open(str(onnx_export), RuntimeSettings(backend="openvino")).encoder
    assert (int8.backend, int8.precision) == ("onnxruntime", "int8")
    _check_against_torch(int8, reference, pixels, 0.999)

    # A server's sessions do not spin-wait between calls; by default they do, as ONNX Runtime's own default.
    entry = "session.intra_op.allow_spinning"
    quiet = ModelRuntime.open(str(onnx_export), RuntimeSettings(allow_spinning=False)).encoder
    assert {s.get_session_options().get_session_config_entry(entry) for s in quiet.graphs.values()} == {"0"}
    with pytest.raises(RuntimeError, match="allow_spinning"):  # never set: ONNX Runtime's default, spinning
        int8.graphs["text"].get_session_options().get_session_config_entry(entry)


def _copy_graphs(export_dir):
    def export_onnx_towers(loaded, folder, opset):
        return {t: shutil.copy(export_dir / f"{t}.onnx", f"{folder}/{t}.onnx") for t in ("image", "text")}

    return export_onnx_towers


def test_openvino_export_matches_pytorch_and_its_int8_graphs_run(tiny_checkpoint, onnx_export, tmp_path):
    # The export's ONNX graphs are copied from the ONNX export above (tracing is tested there), and OpenVINO runs in
    # a process of its own (tests/inference/openvino_checks.py).
    checked = run_openvino_check("encoder", str(tiny_checkpoint), str(onnx_export), str(tmp_path / "ov"))
    assert sorted(p.name for p in (tmp_path / "ov").glob("*.xml")) == ["image.int8.xml", "image.xml",
                                                                       "text.int8.xml", "text.xml"]  # fmt: skip
    assert not list((tmp_path / "ov").glob("*.onnx"))
    assert checked["default_precision"] in ("f32", "bf16", "f16")
    assert checked["fp32_backend"] == "openvino"
    assert checked["fp32_min_cosine"] >= 0.9999 and checked["int8_min_cosine"] >= 0.98
    assert checked["fp32_hint"] == "f32"  # fp32 asked is fp32 computed, where the plugin's default is bf16 (AMX)
    cpu = cpu_info()
    if cpu.has_amx_bf16 or "avx512_bf16" in cpu.features:  # the CPU's bf16 matrix units: the fp32 graphs in bf16
        assert checked["bf16_hint"] == "bf16" and checked["bf16_min_cosine"] >= 0.99
    else:
        assert "has neither amx_bf16 nor avx512_bf16" in checked["bf16_refusal"]


def test_bf16_is_refused_where_it_does_not_run(tiny_checkpoint, onnx_export):
    with pytest.raises(RefusedModelError, match=r"--precision bf16 runs an OpenVINO export's graphs in bf16; this "):
        _ = ModelRuntime.open(str(onnx_export), RuntimeSettings(precision="bf16")).encoder
    with pytest.raises(RefusedModelError, match=r"bf16 runs on exported graphs only; export with --format openvino$"):
        _ = ModelRuntime.open(str(tiny_checkpoint), RuntimeSettings(precision="bf16")).encoder


def test_a_graph_that_does_not_match_its_checkpoint_is_not_written(
    tiny_checkpoint, other_checkpoint, onnx_export, tmp_path, monkeypatch, capsys
):
    # The tracer is replaced by one that hands back another checkpoint's graphs: parity must catch them.
    monkeypatch.setattr(export_module, "export_onnx_towers", _copy_graphs(onnx_export))
    out = tmp_path / "refused"
    capsys.readouterr()
    assert main(["export", "--model_name_or_path", str(other_checkpoint), "--output_dir", str(out),
                 "--parity_samples", "5"]) == 2  # fmt: skip
    (line,) = error_lines(capsys.readouterr().err)
    expected = (
        r"vlfit export: error: the exported fp32 image graph's embeddings differ from PyTorch's: "
        r"cosine -?0\.\d+ on 5 samples, below the 0\.9999 required; nothing was written"
    )
    assert re.fullmatch(expected, line), line
    assert list(out.iterdir()) == []


def test_unknown_format_or_quantization_is_one_line(tiny_checkpoint, tmp_path, capsys):
    argv = ["export", "--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(tmp_path)]
    capsys.readouterr()
    assert main([*argv, "--quantize", "int4"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "vlfit export: error: unknown --quantize 'int4'; the one choice is int8"
    ]
    assert main(["export", "--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(tiny_checkpoint)]) == 2
    assert "is the checkpoint folder itself" in error_lines(capsys.readouterr().err)[0]
    with pytest.raises(SystemExit) as exit_info:  # argparse's own line for a choice it knows
        main([*argv, "--format", "tflite"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'tflite'" in error_lines(capsys.readouterr().err)[-1]


def test_export_recall_on_three_captions_per_image_is_evals_and_torch_and_onnx_agree(tiny_checkpoint, tmp_path,
                                                                                     capsys):  # fmt: skip
    from .several_captions import write_csv

    csv_file = str(write_csv(tmp_path / "csv"))
    exported = tmp_path / "onnx"
    columns = ["--image_column", "file_name", "--caption_column", "caption", "--image_id_column", "image_id"]
    capsys.readouterr()
    assert main(["export", "--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(exported),
                 "--calibration_dataset", csv_file, "--parity_samples", "24", *columns]) == 0  # fmt: skip
    # Without --json, export prints what it measured and ends with what it wrote.
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"fp32 graphs: lowest cosine to PyTorch's embeddings on 24 samples: image [01]\.\d+, "
                        r"text [01]\.\d+", lines[0])  # fmt: skip
    assert lines[-1] == f"wrote {exported}: onnx graphs image.onnx, text.onnx, the tokenizer and export_manifest.json"
    accuracy = json.loads((exported / "export_manifest.json").read_text())["accuracy"]
    assert accuracy["torch_fp32"] == accuracy["fp32"]
    assert main(["eval", "--model_name_or_path", str(tiny_checkpoint), "--dataset_name", csv_file, "--eval_split",
                 "train", *columns, "--output_dir", str(tmp_path / "eval"), "--report_to", "none"]) == 0  # fmt: skip
    metrics = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert metrics["eval_num_images"] == 8 and metrics["eval_num_texts"] == 24
    for k in (1, 5):
        assert accuracy["torch_fp32"][f"t2i_recall@{k}"] == round(metrics[f"eval_t2i_recall@{k}"], 4)
