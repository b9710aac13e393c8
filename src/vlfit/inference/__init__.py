"""Inference: a fine-tuned model as a retrieval engine on CPUs.

``towers`` (the two towers of any family as modules), ``export`` (ONNX / OpenVINO graphs checked against PyTorch)
and ``quantize`` (INT8), ``exported`` (an export folder and its manifest), ``backends`` (PyTorch, ONNX Runtime,
OpenVINO encoders), ``collection`` (folders, dataset splits and synthetic scenes through the input pipeline),
``index`` (a resumable embedding index) and ``query`` (chunked top-k over it).
"""
