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


def test_every_module_that_declares_flags_is_in_the_fingerprint():
    root = Path(flag_index.__file__).parent
    covered = {path for pattern in flag_index.FLAG_SOURCES for path in root.glob(pattern)}
    declaring = {path for path in root.rglob("*.py") if "= flag(" in path.read_text(encoding="utf-8")}
    assert declaring and declaring <= covered, sorted(str(p.relative_to(root)) for p in declaring - covered)


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
        (["train", "--learning_rate", "abc"], 2,
         "vlfit train: error: argument --learning_rate/--learning-rate: invalid float value: 'abc'; see vlfit train "
         "--help"),
        (["retrieve", "query", "--index", "x", "--text", "a", "--k", "two"], 2,
         "vlfit retrieve query: error: argument --k/-k: invalid int value: 'two'"),
        (["train", "--streaming", "maybe"], 2,
         "vlfit train: error: argument --streaming: Truthy value expected: got maybe but expected one of yes/no"),
        (["train", "--lr_scheduler_type", "foo"], 2,
         "vlfit train: error: argument --lr_scheduler_type/--lr-scheduler-type: invalid choice: 'foo' (choose from "
         "'linear', 'cosine'"),
        (["train", "--model_preset", "tiny", "--train_sampling_strategy", "group_by_length", "--caption_sampling",
          "one_per_image", "--output_dir", "out"], 2,
         "vlfit train: error: --train_sampling_strategy group_by_length with --caption_sampling one_per_image: "
         "one_per_image sets the order itself"),
        (["train", "--model_preset", "tiny", "--wise_ft_alpha", "0.5", "--output_dir", "out"], 2,
         "vlfit train: error: --wise_ft_alpha mixes the trained weights with the starting ones, and --model_preset "
         "tiny starts from random weights"),
        (["retrieve", "query", "--index", "missing", "--text", "a"], 2,
         "vlfit retrieve: error: --index missing: no such folder ("),
        (["serve", "--index", "missing"], 2, "vlfit serve: error: --index missing: no such folder ("),
        (["train", "--model_preset", "siglip2-tiny", "--max_num_patches", "100000", "--output_dir", "out"], 2,
         "vlfit train: error: --max_num_patches 100000 is out of range: give 1 to 4096 (patches per image"),
        (["retrieve", "query", "--index", "x", "--text", "a", "--k", "0"], 2,
         "vlfit retrieve: error: --k 0 is out of range: give at least 1 (results per query)"),
        (["eval", "--model_preset", "tiny", "--task", "vqa", "--rerank_top_k", "5"], 2,
         "vlfit eval: error: --rerank_top_k is a retrieval run's flag"),
        (["merge", "--method", "uniform", "--runs", "/no/such/run", "/no/such/other", "--output_dir", "out"], 2,
         "vlfit merge: error: --runs /no/such/run: no such folder ("),
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


@pytest.mark.slow
def test_a_value_the_index_cannot_judge_goes_on_to_the_command(tmp_path):
    done = _vlfit(
        "train", "--model_preset", "tiny", "--freeze", "vision", "--unfreeze_after_steps", "0", "--output_dir", "out",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2 and "--unfreeze_after_steps must be at least 1" in done.stderr  # the arguments' own
    assert "IMPORTED datasets,torch,transformers" in done.stderr  # the command ran


def test_what_a_folder_is_is_answered_before_the_heavy_imports(tmp_path):
    from PIL import Image

    photos, mine = tmp_path / "photos", tmp_path / "mine"
    photos.mkdir()
    mine.mkdir()
    Image.new("RGB", (8, 8)).save(photos / "a.png")
    (mine / "notes.csv").write_text("image,caption\n")
    model = _vlfit("train", "--model_name_or_path", "photos", "--output_dir", "out", cwd=tmp_path)
    written = _vlfit("make-data", "--output_dir", "mine", cwd=tmp_path)
    assert (
        model.returncode == 2
        and "--model_name_or_path photos: a folder of images (it holds a.png), not a model" in (model.stderr)
    )
    assert written.returncode == 2 and "--output_dir mine is not empty (notes.csv) and vlfit make-data did not " in (
        written.stderr
    )
    assert "IMPORTED \n" in model.stderr and "IMPORTED \n" in written.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["notes.csv"]  # nothing written beside the user's file


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--learning_rate", "abc"],
        ["retrieve", "query", "--index", "x", "--text", "a", "--k", "two"],
        ["train", "--lr_scheduler_type", "foo"],
        ["train", "--model_preset", "tiny", "--wise_ft_alpha", "0.5", "--output_dir", "out"],
        ["retrieve", "verify", "--index", "missing"],
        ["train", "--model_preset", "siglip2-tiny", "--max_num_patches", "100000", "--output_dir", "out"],
        ["eval", "--model_preset", "tiny", "--task", "vqa", "--rerank_top_k", "5"],
    ],
)
def test_the_early_refusal_is_the_parsers_own(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from vlfit.cli import main

    codes, lines = [], []
    for answer_from_index in (True, False):  # a value refused exits argparse's way on both paths, in the same words
        try:
            code = main(argv, answer_from_index=answer_from_index)
        except SystemExit as stop:
            code = ("exit", stop.code)
        codes.append(code)
        lines.append(capsys.readouterr().err.strip().splitlines()[-1])
    assert codes[0] == codes[1] and codes[0] in (2, ("exit", 2))
    assert lines[0] == lines[1]


def test_auto_loader_workers_are_left_to_the_command():
    from vlfit import flag_index

    for flags in (["--dataloader_num_workers", "auto"], ["--dataloader_num_workers=auto"]):
        assert flag_index.answer_early("train", [*flags, "--learning_rate", "1e-4"]) is None  # vlfit train probes


def test_an_index_folder_of_another_kind_is_named_before_the_heavy_imports(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"")
    done = _vlfit("retrieve", "verify", "--index", "photos", cwd=tmp_path)
    assert done.returncode == 2
    assert "vlfit retrieve: error: --index photos: a folder of images (it holds a.jpg), not an index" in done.stderr
    assert "IMPORTED \n" in done.stderr


def test_the_rules_wait_for_a_folder_that_may_set_the_task(tmp_path):
    from vlfit.errors import ConfigError

    entry = flag_index._index()["vlfit train"]
    given = {"model_name_or_path": str(tmp_path), "answer_vocabulary": "answers.json"}  # a VQA run's folder?
    flag_index.check_flag_rules("vlfit train", entry, given)  # no refusal yet
    with pytest.raises(ConfigError, match="--answer_vocabulary is a flag of --task vqa"):
        flag_index.check_flag_rules("vlfit train", entry, {**given, "task": "retrieval"})
