"""``vlfit`` answers ``--help``, a mistyped flag and a missing data file from the recorded flag index, before it
imports torch, transformers or datasets; the index is what the parsers make today."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vlfit import flag_index
from vlfit.commands import cli_reference

RUN = """
import sys
from vlfit.cli import main
try:
    code = main(sys.argv[1:])
finally:
    heavy = sorted(name for name in ("torch", "transformers", "datasets") if name in sys.modules)
    print("IMPORTED", ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


def _vlfit(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_flag_index_is_what_the_parsers_make():
    recorded = json.loads(Path(flag_index.INDEX_FILE).read_text(encoding="utf-8"))
    assert recorded == {"fingerprint": flag_index.source_fingerprint(), "commands": cli_reference.flag_index()}, (
        f"src/vlfit/flag_index.json is stale: a command's flags or help changed; regenerate it with "
        f"`{flag_index.REGENERATE}` (make docs)"
    )
    assert "--learning_rate" in recorded["commands"]["vlfit train"]["flags"]
    assert "--text" in recorded["commands"]["vlfit retrieve query"]["flags"]


def test_an_index_made_from_other_sources_is_not_used(monkeypatch, capsys):
    flag_index._index.cache_clear()
    monkeypatch.setattr(flag_index, "source_fingerprint", lambda: "another")  # a flag was added since
    try:
        assert flag_index.answer_early("train", ["--a_flag_added_since", "1"]) is None  # the parser decides
        assert flag_index.answer_early("train", ["--help"]) is None
    finally:
        monkeypatch.undo()
        flag_index._index.cache_clear()
    assert flag_index.answer_early("train", ["--learning_rat", "1"]) == 2  # the index of these sources answers
    capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "code", "expected"),
    [
        (["train", "--learning_rat", "1e-3"], 2,
         "vlfit train: error: unrecognized arguments: --learning_rat (did you mean --learning_rate?); see vlfit train "
         "--help"),
        (["retrieve", "query", "--index", "x", "--txt=a"], 2,
         "vlfit retrieve query: error: unrecognized arguments: --txt (did you mean --text?)"),
        (["train", "--model_preset", "tiny", "--train_file", "missing.csv", "--output_dir", "out"], 2,
         "vlfit train: error: --train_file missing.csv: file not found: 'missing.csv'"),
        (["train", "--help"], 0, "--learning_rate"),
        (["serve", "--log_level", "warning", "-h"], 0, "--max_upload_mb"),
    ],
)  # fmt: skip
def test_answered_before_the_heavy_imports(argv, code, expected, tmp_path):
    done = _vlfit(*argv, cwd=tmp_path)
    assert done.returncode == code, done.stderr
    assert expected in (done.stdout if code == 0 else done.stderr)
    assert "IMPORTED \n" in done.stderr  # neither torch nor transformers nor datasets
    if code == 0:
        assert done.stdout == flag_index._index()[f"vlfit {argv[0]}"]["help"]


def test_a_flag_the_index_knows_goes_on_to_the_command(tmp_path):
    done = _vlfit("train", "--model_preset", "tiny", "--max_steps", "ten", "--output_dir", "out", cwd=tmp_path)
    assert done.returncode == 2 and "--max_steps" in done.stderr  # the parser's own refusal of the value
    assert "IMPORTED datasets,torch,transformers" in done.stderr  # the command ran
