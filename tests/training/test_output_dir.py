"""What vlfit train does with an --output_dir that holds something: resume the same run, refuse another."""

import os

import pytest

from vlfit.errors import ConfigError
from vlfit.training.output_dir import RUN_FLAGS_FILE, resolve_output_dir, write_run_flags

FLAGS = {"learning_rate": 5e-4, "max_steps": 10, "seed": 42, "dataloader_num_workers": 0, "output_dir": "x"}
GIVEN = frozenset({"learning_rate", "max_steps", "output_dir"})


def _resolve(folder, flags=FLAGS, given=GIVEN, overwrite=False, resume=None):
    return resolve_output_dir(str(folder), flags, given, overwrite=overwrite, resume_from_checkpoint=resume)


def _run_with_checkpoint(folder, step=4):
    write_run_flags(str(folder), FLAGS, GIVEN)
    checkpoint = folder / f"checkpoint-{step}"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    return checkpoint


def test_a_new_or_empty_folder_is_a_fresh_run(tmp_path):
    assert _resolve(tmp_path / "new") is None
    assert _resolve(tmp_path) is None


def test_the_same_flags_resume_from_the_last_checkpoint(tmp_path):
    checkpoint = _run_with_checkpoint(tmp_path)
    assert _resolve(tmp_path) == str(checkpoint)
    # Flags that change nothing the run computes (workers, logging) may differ.
    assert _resolve(tmp_path, {**FLAGS, "dataloader_num_workers": 2}, GIVEN | {"dataloader_num_workers"}) == str(
        checkpoint
    )


def test_other_flags_are_refused_naming_each_difference(tmp_path):
    _run_with_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=r"--learning_rate 0\.001 \(was 0\.0005\)") as caught:
        _resolve(tmp_path, {**FLAGS, "learning_rate": 1e-3})
    assert "--overwrite_output_dir" in str(caught.value) and "--max_steps" not in str(caught.value)
    # A flag given before and left to its default now differs too.
    with pytest.raises(ConfigError, match=r"--max_steps -1 \(was 10\)"):
        _resolve(tmp_path, {**FLAGS, "max_steps": -1}, GIVEN - {"max_steps"})


def test_a_run_that_stopped_before_its_first_step_is_replaced_by_one_with_other_flags(tmp_path, caplog):
    write_run_flags(str(tmp_path), FLAGS, GIVEN)
    (tmp_path / "bad_samples.jsonl").write_text('{"id": "a"}\n')
    with caplog.at_level("INFO", logger="vlfit.training.output_dir"):
        assert _resolve(tmp_path, {**FLAGS, "learning_rate": 1e-3}) is None
    assert "stopped before its first step" in caplog.text and "--learning_rate 0.001 (was 0.0005)" in caplog.text
    assert not os.listdir(tmp_path)  # its flags and bad-sample report are not taken for the new run's


def test_overwrite_starts_over_and_removes_the_old_checkpoints(tmp_path):
    checkpoint = _run_with_checkpoint(tmp_path)
    other = {**FLAGS, "learning_rate": 1e-3}
    # Another process of the run starts over too, and leaves the removing to the main one.
    assert resolve_output_dir(str(tmp_path), other, GIVEN, overwrite=True, resume_from_checkpoint=None,
                              main_process=False) is None  # fmt: skip
    assert checkpoint.exists()
    assert _resolve(tmp_path, other, overwrite=True) is None
    assert not checkpoint.exists()


def test_an_explicit_checkpoint_is_resumed_whatever_the_flags(tmp_path):
    checkpoint = _run_with_checkpoint(tmp_path)
    assert _resolve(tmp_path, {**FLAGS, "learning_rate": 1e-3}, resume=str(checkpoint)) == str(checkpoint)


def test_a_folder_of_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no vlfit run"):
        _resolve(tmp_path)
    assert os.path.isfile(tmp_path / "notes.txt") and not os.path.exists(tmp_path / RUN_FLAGS_FILE)


@pytest.mark.slow
def test_rerunning_a_finished_run_trains_nothing_and_writes_nothing(synthetic_dataset_dir, tmp_path, caplog):
    from vlfit.cli import main

    out = tmp_path / "run"
    argv = ["train", "--model_preset", "clip-tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir", str(out),
            "--max_steps", "2", "--per_device_train_batch_size", "4", "--save_steps", "1", "--report_to", "none",
            "--disable_tqdm", "true"]  # fmt: skip
    assert main(argv) == 0
    written = {str(p): p.stat().st_mtime_ns for p in out.rglob("*")}
    assert main(argv) == 0
    # Resuming from checkpoint-2 used to train a third step, save checkpoint-3 and rewrite the metrics and the card.
    assert {str(p): p.stat().st_mtime_ns for p in out.rglob("*")} == written
    assert "already complete at step 2" in caplog.text


@pytest.mark.slow
def test_a_run_failed_on_a_bad_column_does_not_block_its_corrected_rerun(synthetic_dataset_dir, tmp_path):
    from vlfit.cli import main

    argv = ["train", "--model_preset", "clip-tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir",
            str(tmp_path / "run"), "--max_steps", "1", "--per_device_train_batch_size", "4", "--report_to", "none",
            "--disable_tqdm", "true"]  # fmt: skip
    assert main([*argv, "--image_column", "image_description"]) == 2  # captions are not image files
    assert main(argv) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()
