"""The data flags' own checks (``vlfit.arguments.data``): each refused in one line naming the flag."""

from __future__ import annotations

import pytest

from vlfit.arguments import DataArguments
from vlfit.errors import ConfigError


@pytest.mark.parametrize("size", [0, -5])
def test_an_eval_pool_of_no_images_is_refused(tmp_path, size: int) -> None:
    with pytest.raises(ConfigError, match=rf"^--eval_pool_size must be at least 1 .*got {size}; leave it out"):
        DataArguments(dataset_name=str(tmp_path), eval_pool_size=size)
    assert DataArguments(dataset_name=str(tmp_path), eval_pool_size=1).eval_pool_size == 1
