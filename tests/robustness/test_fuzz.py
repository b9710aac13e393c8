"""Fuzzing the decoders with mutated JPEGs, in a child process (see ``fuzz_decoders.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.robustness.fuzz_decoders import BASES, mutate

REPO = Path(__file__).resolve().parents[2]
MAX_EXAMPLES = 200


def test_mutate_applies_each_kind_of_mutation() -> None:
    base = BASES[0]
    assert mutate(base, [("flip", 5, 0)])[5] == base[5] ^ 1
    assert mutate(base, [("truncate", 100)]) == base[:100]
    assert mutate(base, [("insert", 10, b"\x00\xff")]) == base[:10] + b"\x00\xff" + base[10:]
    assert mutate(base, [("delete", 10, 3)]) == base[:10] + base[13:]
    assert mutate(base, [("overwrite", len(base) + 1, b"zz")]) == b"zz" + base[2:]  # positions wrap around


@pytest.mark.slow
def test_mutated_jpegs_never_crash_hang_or_raise_anything_but_decode_error() -> None:
    # A segfault in native code kills only the child (faulthandler prints where); the timeout catches hangs.
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "tests.robustness.fuzz_decoders",
            "--max-examples",
            str(MAX_EXAMPLES),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout[-6000:] + done.stderr[-6000:]
    assert done.returncode == 0, output
    ran = re.search(r"fuzz examples run: (\d+)", done.stdout)
    assert ran is not None and int(ran.group(1)) >= MAX_EXAMPLES, output
