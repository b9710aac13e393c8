"""``vlfit train`` on dirty data: bad samples are replaced, counted in logs, metrics and ``bad_samples.jsonl``,
left out of evaluation, bounded by ``--max_bad_fraction``, or stop the run under ``--bad_sample_policy raise``."""

from __future__ import annotations

import json
import multiprocessing
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import datasets
import pytest
from transformers import TrainingArguments

from tests.robustness.bad_corpus import ListSource, bad_images, valid_images
from tests.training.train_runs import run_torchrun, single_torch_thread
from vlfit.cli import main
from vlfit.data.bad_samples import BadSampleError
from vlfit.data.pipeline import InputPipeline, PipelineOptions
from vlfit.data.records import Record
from vlfit.models.loading import load_model
from vlfit.training.bad_sample_ledger import TooManyBadSamplesError
from vlfit.training.trainer import VlfitTrainer

pytestmark = pytest.mark.slow

TRAIN_ROWS = 60
BAD_TRAIN = {7: ("image", "zero_bytes"), 23: ("caption", "   "), 41: ("image", "jpeg_truncated")}
BAD_EVAL = {2: ("image", "random_bytes"), 5: ("caption", None)}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def _split(rows: int, bad: dict, prefix: str) -> datasets.Dataset:
    valid = [image.data for image in valid_images() if image.name.startswith("jpeg_b")] * rows
    broken = {image.name: image.data for image in bad_images()}
    images, captions = [], []
    for i in range(rows):
        kind, what = bad.get(i, (None, None))
        images.append({"bytes": broken[what] if kind == "image" else valid[i], "path": None})
        captions.append(what if kind == "caption" else f"a picture number {i} of a red thing")
    return datasets.Dataset.from_dict(
        {"image": images, "caption": captions, "id": [f"{prefix}-{i}" for i in range(rows)]},
        features=datasets.Features(
            {"image": datasets.Image(), "caption": datasets.Value("string"), "id": datasets.Value("string")}
        ),
    )


@pytest.fixture(scope="module")
def dirty_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("dirty") / "data"
    splits = {"train": _split(TRAIN_ROWS, BAD_TRAIN, "t"), "validation": _split(12, BAD_EVAL, "v")}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return str(path)


def _argv(data: str, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--model_preset", "tiny", "--dataset_name", data, "--caption_column", "caption",
        "--output_dir", str(out), "--report_to", "none", "--per_device_train_batch_size", "8",
        "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "2", *extra,
    ]  # fmt: skip


def test_bad_samples_are_replaced_counted_reported_and_left_out_of_eval(tmp_path: Path, dirty_dataset: str) -> None:
    out = tmp_path / "run"
    # One epoch: 60 samples plus the 3 bad ones read (4.8%, judged once the split was read: under 0.1).
    assert main([*_argv(dirty_dataset, out, "--num_train_epochs", "1", "--do_eval", "--max_bad_fraction", "0.1")]) == 0
    bad_ids = {f"t-{i}" for i in BAD_TRAIN}
    records = [json.loads(line) for line in (out / "bad_samples.jsonl").read_text().splitlines()]
    assert {r["id"] for r in records} == bad_ids  # every bad sample's own index is read once per epoch
    reasons = {r["id"]: r["reason"] for r in records}
    # Empty bytes in an Image column read as "no image at all" to the source, before any decoder sees them.
    assert (
        reasons["t-7"] == "image value has neither bytes nor path" and reasons["t-23"] == "caption is whitespace only"
    )
    assert "Premature end" in reasons["t-41"]
    assert all(r["stage"] == "worker" and 1 <= r["step"] <= 8 for r in records)

    metrics = json.loads((out / "train_results.json").read_text())
    assert metrics["train_bad_samples"] == len(records)
    assert metrics["train_bad_sample_fraction"] == pytest.approx(len(records) / (TRAIN_ROWS + len(records)))
    state = json.loads((out / "trainer_state.json").read_text())
    counts = [entry["bad_samples"] for entry in state["log_history"] if "loss" in entry]
    assert counts == sorted(counts) and counts[-1] <= len(records)  # cumulative in every logged step

    evaluated = json.loads((out / "eval_results.json").read_text())
    assert evaluated["eval_bad_samples"] == len(BAD_EVAL)
    assert evaluated["eval_num_samples"] == 12 - len(BAD_EVAL)  # left out, not replaced by duplicates
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the preemption handlers were removed


def test_the_matching_objective_replaces_and_counts_bad_samples_as_the_contrastive_one(
    tmp_path: Path, dirty_dataset: str
) -> None:
    out = tmp_path / "run"
    argv = _argv(dirty_dataset, out, "--num_train_epochs", "1", "--max_bad_fraction", "0.1", "--objective",
                 "contrastive+itm")  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "bad_samples.jsonl").read_text().splitlines()]
    assert {r["id"] for r in records} == {f"t-{i}" for i in BAD_TRAIN}
    assert json.loads((out / "train_results.json").read_text())["train_bad_samples"] == len(records)
    state = json.loads((out / "trainer_state.json").read_text())
    itm = [entry["loss_itm"] for entry in state["log_history"] if "loss_itm" in entry]
    assert itm and all(0 < loss < 5 for loss in itm)  # a substitute duplicating a row is never its negative


def test_two_processes_count_every_bad_sample_and_evaluate_as_one_process(tmp_path: Path, dirty_dataset: str) -> None:
    """Training: each process reports the bad samples it read, and the run's metrics sum them. Evaluation: two
    processes whose batches lose different numbers of bad samples score the split as one process does.

    12 validation rows, batches of 4 over 2 processes: rank 0 reads rows 0-3 (row 2 bad) and 8-11, rank 1 reads
    4-7 (row 5 bad) and then rows 0-3 again to even out the batches. Each valid row must count once.
    """
    out = tmp_path / "run"
    eval_flags = ["--per_device_eval_batch_size", "4", "--dataloader_num_workers", "0"]
    done = run_torchrun("-m", "vlfit", *_argv(dirty_dataset, out, "--num_train_epochs", "1", "--do_eval", *eval_flags))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [out / "bad_samples.jsonl", out / "bad_samples_1.jsonl"]
    records = [json.loads(line) for report in reports for line in report.read_text().splitlines()]
    # Every bad row is read by one process at least (a process may read one again in the epoch's padded tail).
    assert {r["id"] for r in records} == {f"t-{i}" for i in BAD_TRAIN}
    assert json.loads((out / "train_results.json").read_text())["train_bad_samples"] == len(records)

    eval_argv = ["eval", "--model_name_or_path", str(out), "--dataset_name", dirty_dataset, "--caption_column",
                 "caption", "--report_to", "none", *eval_flags, "--output_dir", str(tmp_path / "one")]  # fmt: skip
    assert main(eval_argv) == 0
    one = json.loads((tmp_path / "one" / "eval_results.json").read_text())
    two = json.loads((out / "eval_results.json").read_text())
    assert two["eval_num_samples"] == one["eval_num_samples"] == 12 - len(BAD_EVAL)
    assert two["eval_bad_samples"] == one["eval_bad_samples"] == len(BAD_EVAL)
    for key in ("eval_t2i_recall@1", "eval_i2t_recall@1", "eval_t2i_recall@5", "eval_i2t_recall@5"):
        assert two[key] == pytest.approx(one[key], abs=1e-6), key


def test_max_bad_fraction_stops_the_run_with_the_ids(tmp_path: Path, dirty_dataset: str, capsys) -> None:
    out = tmp_path / "run"
    argv = _argv(dirty_dataset, out, "--num_train_epochs", "3", "--max_bad_fraction", "0.02")
    assert main(argv) == 2  # the user's data: one error line, not a traceback
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(
        r"vlfit train: error: \d+ of the \d+ samples read so far were bad .* over --max_bad_fraction 0.02", error
    )
    with pytest.raises(TooManyBadSamplesError):
        main([*argv, "--debug"])
    records = [json.loads(line) for line in (out / "bad_samples.jsonl").read_text().splitlines()]
    assert {r["id"] for r in records} <= {f"t-{i}" for i in BAD_TRAIN} and len(records) >= 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_raise_policy_stops_at_the_first_bad_sample_even_through_workers(tmp_path: Path, dirty_dataset: str) -> None:
    # The error a worker raised reaches the command as itself (with --debug; without, it is the CLI's one line).
    argv = _argv(dirty_dataset, tmp_path / "run", "--max_steps", "8", "--bad_sample_policy", "raise")
    with pytest.raises(BadSampleError, match=r"bad sample t-(7|23|41): .*--bad_sample_policy skip") as raised:
        main([*argv, "--dataloader_num_workers", "2", "--debug"])
    # The loader's workers are stopped as the error leaves the run, though its traceback (held here) still holds
    # the loader's iterator: left to garbage collection they took 5 s each to exit, in whatever ran next.
    assert raised.traceback and not multiprocessing.active_children()


def test_flags_are_validated(tmp_path: Path, dirty_dataset: str, capsys) -> None:
    assert main(_argv(dirty_dataset, tmp_path / "run", "--max_bad_fraction", "1.5")) == 2
    error = capsys.readouterr().err.strip()
    assert error == "vlfit train: error: --max_bad_fraction must be between 0 and 1, got 1.5"
    with pytest.raises(SystemExit):  # argparse choices
        main(_argv(dirty_dataset, tmp_path / "run", "--bad_sample_policy", "ignore"))


def test_device_decode_drops_and_counts_what_only_decoding_finds(tmp_path: Path) -> None:
    """Device decode (run on the CPU here): the worker's header check replaces what it can; a JPEG corrupt after
    its header is dropped from its batch at decode time and counted as a device-stage bad sample."""
    jpeg = next(image for image in valid_images() if image.name == "jpeg_baseline").data
    broken = {image.name: image.data for image in bad_images()}
    records = [Record(id=f"ok-{i}", image=jpeg, caption=f"picture {i}") for i in range(12)]
    records[3] = Record(id="late", image=broken["jpeg_truncated"], caption="picture 3")
    records[9] = Record(id="early", image=broken["random_bytes"], caption="picture 9")
    bundle = load_model(model_preset="tiny", captions=lambda: [r.caption for r in records])
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=3, per_device_train_batch_size=4,
        save_strategy="no", dataloader_pin_memory=False,
    )  # fmt: skip
    # Device decode on a CPU device: the bench's CPU seam of the path nvJPEG runs on a GPU.
    pipeline = InputPipeline(bundle.inputs, PipelineOptions(decode_on_device=True), args.device, cpu_device_decode=True)
    trainer = VlfitTrainer(
        model=bundle.model,
        args=args,
        train_dataset=pipeline.dataset(ListSource(records), train=True),  # type: ignore[arg-type]
        pipeline=pipeline,
        family=bundle.family,
    )
    trainer.train()
    stages = {record.id: record.stage for record in trainer.bad_samples.records}
    assert stages == {"early": "worker", "late": "device"}
    assert trainer.bad_samples.samples_read == 12 + 1  # 12 rows delivered + 1 replaced in the worker
