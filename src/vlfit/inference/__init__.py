"""Inference: a fine-tuned model run on CPU runtimes.

``towers`` (the two towers of any family as modules), ``export`` (ONNX / OpenVINO graphs checked against PyTorch)
and ``quantize`` (INT8), ``exported`` (an export folder and its manifest), ``backends`` (PyTorch, ONNX Runtime,
OpenVINO encoders), ``export_samples`` (the decoded samples export checks parity and calibrates on),
``topk`` and ``recall`` (chunked top-k and the recall figures over embeddings). The embedding index is ``vlfit.index``.
"""
