from collections.abc import Iterator

import datasets
import pytest


@pytest.fixture(autouse=True, scope="module")
def _quiet_datasets() -> Iterator[None]:
    """Silence datasets' progress bars while a data test module runs, then restore the previous setting."""
    were_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    yield
    if not were_disabled:
        datasets.enable_progress_bars()
