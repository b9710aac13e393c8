"""The data flags' own checks (``vlfit.arguments.data``): each refused in one line naming the flag."""

from __future__ import annotations

import pytest

from vlfit.arguments import DataArguments
from vlfit.errors import ConfigError


@pytest.mark.parametrize("size", [0, -5])
def test_an_eval_pool_of_no_images_is_refused(tmp_path, size: int) -> None:
    with pytest.raises(
        ConfigError, match=rf"^--eval_pool_size {size} is out of range: give at least 1 .*left out: the whole"
    ):
        DataArguments(dataset_name=str(tmp_path), eval_pool_size=size)
    assert DataArguments(dataset_name=str(tmp_path), eval_pool_size=1).eval_pool_size == 1


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("max_seq_length", 0, r"at least 1 \(tokens per caption"),
        ("max_num_patches", 0, r"1 to 4096 \(patches per image"),
        ("max_num_patches", 100_000, r"1 to 4096 \(patches per image"),
        ("rerank_top_k", 0, r"at least 1 \(candidates per query"),
        ("max_train_samples", 0, r"at least 1 \(samples; left out: the whole training split\)$"),
        ("max_eval_samples", -1, r"at least 1 \(samples; left out: the whole evaluation split\)$"),
    ],
)
def test_a_size_flag_out_of_its_range_is_refused_with_the_range(tmp_path, flag: str, value: int, allowed: str) -> None:
    with pytest.raises(ConfigError, match=rf"^--{flag} {value} is out of range: give {allowed}"):
        DataArguments(dataset_name=str(tmp_path), **{flag: value})


def test_the_ends_of_the_size_ranges_are_taken(tmp_path) -> None:
    ends = {"max_seq_length": 1, "max_num_patches": 4096, "rerank_top_k": 1, "max_train_samples": 1,
            "max_eval_samples": 1}  # fmt: skip
    args = DataArguments(dataset_name=str(tmp_path), **ends)
    assert {name: getattr(args, name) for name in ends} == ends
