from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="module")
def _quiet_datasets() -> Iterator[None]:
    """Silence datasets' progress bars while a data test module runs, then restore the previous setting.

    datasets is imported here, not at module level, so the data tests that need no dataset (the CUDA ones that
    ``benchmarks/gpu.sh`` runs on a GPU machine without datasets) still load.
    """
    try:
        import datasets
    except ImportError:
        yield
        return
    were_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    yield
    if not were_disabled:
        datasets.enable_progress_bars()
