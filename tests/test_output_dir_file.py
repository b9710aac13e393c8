"""An ``--output_dir`` that names a file, or a path under one, is refused in one line by every command that takes
one, before any work: from the flag index, before torch, transformers or datasets are imported, and by the parsers
(the Python API's keyword arguments, a flags file). ``vlfit train`` trained its tokenizer and loaded its data first,
then ended in a ``FileExistsError`` traceback."""

from __future__ import annotations

import pytest

from tests.test_flag_index import _vlfit
from vlfit.cli import main
from vlfit.errors import ConfigError
from vlfit.training.output_dir import resolve_output_dir

# Every command that takes --output_dir, with the flags it requires.
COMMANDS = [["bench"], ["demo"], ["eval"], ["export", "--model", "m"], ["fewshot", "--model", "m", "--label_column",
            "y"], ["make-data"], ["merge", "--method", "uniform", "--runs", "a"], ["merge-lora", "--model", "m"],
            ["prepare"], ["retrieve", "index", "--model", "m", "--images", "."], ["search"], ["train"],
            ["wise-ft", "--zeroshot_model", "a", "--finetuned_model", "b"]]  # fmt: skip


def test_the_run_folder_of_vlfit_train_is_refused_when_it_is_a_file(tmp_path) -> None:
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(ConfigError, match=f"^--output_dir {tmp_path / 'notes'} is a file, not a folder: "):
        resolve_output_dir(str(tmp_path / "notes"), {}, frozenset(), overwrite=False, resume_from_checkpoint=None)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command[0])
def test_every_command_refuses_a_file_as_its_output_dir_in_one_line(command, tmp_path, capsys) -> None:
    notes = tmp_path / "notes"
    notes.write_text("mine")
    capsys.readouterr()
    assert main([*command, "--output_dir", str(notes / "run")], answer_from_index=False) == 2  # the parsers
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(f": error: --output_dir {notes / 'run'} lies under the file {notes}, not a folder: name a "
                         "folder to write into (a new or empty one)")  # fmt: skip
    assert notes.read_text() == "mine"


@pytest.mark.slow
def test_the_refusal_comes_before_the_heavy_imports(tmp_path) -> None:
    (tmp_path / "notes").write_text("mine")
    done = _vlfit("train", "--model_preset", "tiny", "--output_dir", "notes", cwd=tmp_path)
    assert done.returncode == 2
    assert "vlfit train: error: --output_dir notes is a file, not a folder: " in done.stderr
    assert "IMPORTED \n" in done.stderr  # neither torch nor transformers nor datasets
