"""``benchmarks/demo_recipe.py`` takes the demo's flags as ``vlfit demo`` does: ``--quick`` screens at the quick
demo's sizes, and ``--resume_from_checkpoint`` (a screened run is timed whole) is refused in one line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from vlfit.commands.demo import QUICK

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "demo_recipe.py"


def _benchmark() -> ModuleType:
    """The script as a module (registered: its dataclasses look their module up while they are made)."""
    if "demo_recipe" not in sys.modules:
        spec = importlib.util.spec_from_file_location("demo_recipe", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["demo_recipe"] = module
        spec.loader.exec_module(module)
    return sys.modules["demo_recipe"]


def test_quick_screens_at_the_quick_demos_sizes_where_no_flag_set_them() -> None:
    screen, demo = _benchmark().parse_arguments(["--name", "quick-row", "--quick", "--num_samples", "80"])
    assert screen.name == "quick-row"
    assert {name: getattr(demo, name) for name in QUICK} == {**QUICK, "num_samples": 80}


def test_resume_from_checkpoint_is_refused_in_one_line(tmp_path, capsys) -> None:
    argv = ["--name", "a", "--output_dir", str(tmp_path), "--resume_from_checkpoint", str(tmp_path / "checkpoint-3")]
    assert _benchmark().main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("benchmarks/demo_recipe.py: error: --resume_from_checkpoint: ")
    assert "drop the flag" in err
    assert list(tmp_path.iterdir()) == []  # refused before any data is generated
