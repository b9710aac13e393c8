"""A query through ``vlfit retrieve query`` or the server opens each file of its index and each file vlfit reads of
its model once in the process (``count_opens.py`` says how opens are counted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_index(tiny_checkpoint, synthetic_dataset_dir, tmp_path_factory) -> Path:
    import vlfit

    path = tmp_path_factory.mktemp("opens") / "index"
    vlfit.Index.build(str(tiny_checkpoint), str(path), dataset_name=synthetic_dataset_dir, split="validation")
    return path


@pytest.mark.parametrize("door", ["query", "serve"])
def test_a_query_opens_each_index_and_model_file_once(door, small_index, tiny_checkpoint):
    script = Path(__file__).with_name("count_opens.py")
    done = subprocess.run([sys.executable, str(script), door, str(small_index), str(tiny_checkpoint)],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    index_files = {path: n for path, n in counts["all"].items() if path.startswith(str(small_index.resolve()))}
    assert {"index_manifest.json", "ann.json"} <= {Path(path).name for path in index_files}
    assert all(n == 1 for n in index_files.values()), {Path(p).name: n for p, n in index_files.items()}
    assert counts["vlfit"] and all(n == 1 for n in counts["vlfit"].values()), counts["vlfit"]
