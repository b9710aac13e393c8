"""The layer order of pyproject.toml's [tool.importlinter]: no import points up, no two folders import each other in
a loop (what `make lint` checks, tested here too so that the suite alone catches an upward import)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_import_points_up_the_layers():
    lint_imports = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
