"""The merged folder is written whole or not at all: staged and moved into place with ``merge.json`` last; a run
whose weights file is cut short, a full disk, an ``--output_dir`` holding other files or naming a file are each one
line, and none leaves a folder that a later command takes for a model."""

from __future__ import annotations

import builtins
import json
import os
import shutil

import pytest

from tests.merge.runs import changed_run
from tests.test_disk_full import SmallDisk
from vlfit.atomic_files import FOLDER_RECORD, STAGING_NAME
from vlfit.cli import main
from vlfit.errors import ConfigError, DiskFullError, ModelLoadError
from vlfit.merging.folder import MERGE_JSON
from vlfit.merging.runs import merge_runs


def test_a_run_whose_weights_file_is_cut_short_is_named_before_anything_loads(tiny_checkpoint, tmp_path) -> None:
    cut = changed_run(tiny_checkpoint, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: os.path.getsize(weights) // 2])
    with pytest.raises(ModelLoadError) as refused:
        merge_runs([str(tiny_checkpoint), str(cut)], method="uniform", output_dir=str(tmp_path / "soup"))
    message = str(refused.value)
    assert message.startswith(f"--runs {cut}: the weights file {weights} is incomplete (safetensors: ")
    assert message.endswith("copy or save the run again") and "\n" not in message
    assert not (tmp_path / "soup").exists()  # refused before the folder was made


def test_the_cli_answers_a_cut_weights_file_in_one_line(tiny_checkpoint, tmp_path, capsys) -> None:
    cut = changed_run(tiny_checkpoint, tmp_path / "cut")
    (cut / "model.safetensors").write_bytes(b"\x08\x00")
    argv = ["merge", "--method", "uniform", "--runs", str(tiny_checkpoint), str(cut), "--output_dir",
            str(tmp_path / "soup")]  # fmt: skip
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"vlfit merge: error: --runs {cut}: the weights file {cut / 'model.safetensors'} is ")


def test_a_full_disk_is_one_line_and_leaves_no_folder(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    """The disk fills as the merged config is written (the Python writes of the folder share 200 bytes): one line
    naming the folder and that nothing was replaced; the new folder is left empty, so nothing takes it for a model."""
    twin = changed_run(tiny_checkpoint, tmp_path / "twin")
    out = tmp_path / "soup"
    monkeypatch.setattr(builtins, "open", SmallDisk(tmp_path / "soup", free=200).open)
    with pytest.raises(DiskFullError) as full:
        merge_runs([str(tiny_checkpoint), str(twin)], method="uniform", output_dir=str(out))
    monkeypatch.undo()
    message = str(full.value)
    assert message.startswith(f"no space left on the device of {out} (")
    assert f"nothing in {out} was replaced (the merged model is staged in {STAGING_NAME}" in message
    assert message.endswith("free space there or write elsewhere (--output_dir)")
    assert os.listdir(out) == []


def test_safetensors_full_disk_error_is_recognised_as_one(tmp_path) -> None:
    """safetensors writes in Rust: a full disk is its SafetensorError quoting the OS error, not an OSError."""
    from safetensors import SafetensorError

    from vlfit.errors import failed_write_error

    error = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    line = failed_write_error(error, str(tmp_path), needed=4_000_000)
    assert isinstance(line, DiskFullError)
    assert str(line).startswith(f"no space left on the device of {tmp_path} (") and "about 4 MB needed" in str(line)


def test_a_merge_stopped_while_staged_leaves_the_earlier_merge_and_a_rerun_replaces_it(
    tiny_checkpoint, tmp_path, monkeypatch
) -> None:
    twin = changed_run(tiny_checkpoint, tmp_path / "twin")
    out = tmp_path / "soup"
    merge_runs([str(tiny_checkpoint), str(twin)], method="uniform", output_dir=str(out))
    earlier = {name: (out / name).read_bytes() for name in os.listdir(out) if (out / name).is_file()}
    assert MERGE_JSON in earlier and json.loads(earlier[FOLDER_RECORD])["written_by"] == "vlfit merge"

    import vlfit.merging.folder as folder

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill while the card is written: the weights and config are staged

    monkeypatch.setattr(folder, "write_model_card", killed)
    with pytest.raises(KeyboardInterrupt):
        merge_runs([str(tiny_checkpoint), str(twin)], method="uniform", output_dir=str(out))
    monkeypatch.undo()
    assert {name: (out / name).read_bytes() for name in earlier} == earlier and not (out / STAGING_NAME).exists()
    (out / "eval_results.json").write_text("{}")  # as an earlier merge with held-out data left
    record = json.loads((out / FOLDER_RECORD).read_text())
    (out / FOLDER_RECORD).write_text(json.dumps({**record, "entries": [*record["entries"], "eval_results.json"]}))
    merge_runs([str(tiny_checkpoint), str(twin)], method="uniform", output_dir=str(out))
    assert not (out / "eval_results.json").exists()  # what the earlier merge wrote is replaced, not left beside


def test_a_folder_merge_did_not_write_is_refused_before_anything_loads(tiny_checkpoint, tmp_path) -> None:
    twin = changed_run(tiny_checkpoint, tmp_path / "twin")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=f"^--output_dir {out} is not empty \\(notes.txt\\) and vlfit merge did not "):
        merge_runs([str(tiny_checkpoint), str(twin)], method="uniform", output_dir=str(out))
    assert sorted(os.listdir(out)) == ["notes.txt"]
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        merge_runs([str(tiny_checkpoint), str(twin)], method="uniform", output_dir=str(out / "notes.txt"))


def test_a_merge_killed_early_leaves_nothing_a_later_merge_refuses(tiny_checkpoint, tmp_path) -> None:
    """What a kill leaves (the staging folder alone) is nobody's: the next merge replaces it."""
    twin = changed_run(tiny_checkpoint, tmp_path / "twin")
    out = tmp_path / "soup"
    shutil.copytree(tiny_checkpoint, out / STAGING_NAME)  # as a merge killed while it saved
    merge_runs([str(tiny_checkpoint), str(twin)], method="uniform", output_dir=str(out))
    assert (out / MERGE_JSON).is_file() and not (out / STAGING_NAME).exists()
