"""The OpenVINO pair scorer of an export folder against PyTorch's, in a process of its own (OpenVINO's runtime kept
out of the test process, where its threads outlived the test and later crashed an unrelated one).

Run as ``python tests/inference/openvino_pair_check.py EXPORT CHECKPOINT``; prints one JSON object.
"""

from __future__ import annotations

import json
import sys

import torch

from vlfit.data.sources.synthetic import synthetic_source
from vlfit.errors import ConfigError
from vlfit.inference.backends import open_encoder
from vlfit.inference.export_samples import load_samples
from vlfit.inference.pair_scorer import OpenVinoPairScorer, open_pair_scorer, pair_scorer_for

CAPTIONS = ["red", "two blue squares on the left and one green circle at the top of the picture, and more words"]


def main(export: str, checkpoint: str) -> dict:
    fp32 = open_pair_scorer(export, precision="fp32")
    pixels = load_samples(synthetic_source(5, seed=7), fp32.spec).pixels
    rows = (torch.arange(2).repeat_interleave(5), torch.arange(5).repeat(2))
    expected = open_pair_scorer(checkpoint).score_pairs(CAPTIONS, pixels, *rows)
    int8 = pair_scorer_for(open_encoder(export))  # beside the folder's INT8 encoder
    try:
        open_pair_scorer(export, backend="onnxruntime")
        refusal = ""
    except ConfigError as error:
        refusal = str(error)
    return {
        "fp32": [type(fp32) is OpenVinoPairScorer, fp32.backend, fp32.precision],
        "fp32_max_diff": float((fp32.score_pairs(CAPTIONS, pixels, *rows) - expected).abs().max()),
        "int8": [type(int8) is OpenVinoPairScorer, int8.precision if int8 is not None else None],
        "int8_max_diff": float((int8.score_pairs(CAPTIONS, pixels, *rows) - expected).abs().max()),
        "refusal": refusal,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
